"""The vLLM engine serving LoRA adapters (``model.lora``, ``rollout.engines.vllm.lora``), on the
CPU lane's vLLM (``@pytest.mark.vllm``, skipped unless vllm imports)::

    .venv-vllm/bin/python -m pytest tests/test_rollout_vllm_lora.py -m vllm -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout.engines.base import SamplingParams
from tests.test_rollout_vllm import (
    LOGPROB_ATOL,
    _hf_model,
    _max_logprob_error,
    _requests,
    _save_tiny_qwen2,
    _tiny_engine,
    needs_vllm,
)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """The tiny Qwen2 of ``tests/test_rollout_vllm.py`` (seed 1), as its own fixture makes it."""
    return (_save_tiny_qwen2(tmp_path_factory.mktemp("vllm_lora_models") / "seed1", 1),)


def _save_tiny_llama(directory: Path, seed: int) -> Path:
    """``_save_tiny_qwen2``'s sizes as a Llama with its own LM head: vLLM's Llama lists its
    embedding and LM head among the modules LoRA may wrap, and the head is a layer of its own."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    qwen = AutoConfig.from_pretrained(str(_save_tiny_qwen2(directory, seed)))
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    keys += ("num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
    config = LlamaConfig(
        **{k: getattr(qwen, k) for k in keys},
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=qwen.eos_token_id,
        pad_token_id=qwen.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(directory))
    return directory


@needs_vllm
@pytest.mark.parametrize("arch", ["qwen2-tied", "llama-untied"])
def test_vllm_serves_lora_adapters_beside_embeddings_loaded_whole(model_dirs, tmp_path, arch):
    """model.lora.train_embeddings: each update's adapters are served through vLLM's LoRA and
    the embedding and LM head (tied or not), trained whole, are loaded whole into the base
    (``crossrl_load_whole``), never folded into whole weights: the engine samples with the
    logprobs of the base with those adapters and that embedding, update after update."""
    from rollout import lora

    directory = model_dirs[0] if arch == "qwen2-tied" else _save_tiny_llama(tmp_path, 1)
    settings = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    engine = _tiny_engine(directory, lora=settings)
    try:
        reqs = _requests()
        sp = SamplingParams(max_new_tokens=8, temperature=1.0)
        for seed in (0, 1):  # the second update replaces both in place
            policy = _hf_model(directory)
            lora.inject(policy, 4, 8.0, 0.0, settings["target_modules"], embeddings=True)
            generator = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for name, param in policy.named_parameters():
                    noise = torch.randn(param.shape, generator=generator)
                    if lora.is_adapter(name):
                        param.copy_(0.3 * noise)
                    elif param.requires_grad:  # the embedding and tied LM head
                        param.add_(0.1 * noise)
            trained = lora.trained_names(policy)
            update = [(n, t.clone()) for n, t in policy.state_dict().items() if n in trained]
            assert any(not lora.is_adapter(n) for n, _ in update)
            engine.update_weights(update)
            engine.finish_weight_update()
            served = engine.generate(reqs, sp)
            assert _max_logprob_error(policy.eval(), reqs, served, 1.0) < LOGPROB_ATOL
            assert _max_logprob_error(_hf_model(directory), reqs, served, 1.0) > 0.05
    finally:
        engine.shutdown()


@needs_vllm
def test_vllm_serves_lora_adapters_loaded_in_place_and_an_exported_adapter(model_dirs, tmp_path):
    """A LoRA engine (``lora=``) serves the adapters each update carries, loaded in place
    (``rollout.engines.vllm.lora``), and an adapter directory as ``crossrl export`` writes it;
    both sample with the logprobs of the base with those adapters (peft, transformers)."""
    from peft import PeftModel
    from vllm.lora.request import LoRARequest

    from rollout import lora
    from trainer.commands.export import _write_adapter
    from trainer.config import load_config

    settings = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    base = _hf_model(model_dirs[0])
    lora.inject(base, 4, 8.0, 0.0, settings["target_modules"])
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in base.named_parameters():
            if lora.is_adapter(name):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    adapters = {n: t.clone() for n, t in base.state_dict().items() if lora.is_adapter(n)}
    engine = _tiny_engine(model_dirs[0], lora=settings)
    try:
        reqs = _requests()
        sp = SamplingParams(max_new_tokens=8, temperature=1.0)
        before = engine.generate(reqs, sp)  # the base: no adapter served yet
        assert _max_logprob_error(_hf_model(model_dirs[0]), reqs, before, 1.0) < LOGPROB_ATOL
        engine.update_weights(adapters.items())
        engine.finish_weight_update()
        served = engine.generate(reqs, sp)
        assert _max_logprob_error(base, reqs, served, 1.0) < LOGPROB_ATOL
        # the export's adapter directory, served by a request of its own
        cfg = load_config(None, ["model.lora.rank=4", "model.lora.alpha=8"])
        cfg.model.lora.target_modules = settings["target_modules"]
        _write_adapter(cfg, adapters, tmp_path, torch.float32)
        peft_model = PeftModel.from_pretrained(_hf_model(model_dirs[0]), str(tmp_path)).eval()
        engine._lora_request = LoRARequest("exported", 2, str(tmp_path))
        exported = engine.generate(reqs, sp)
        assert _max_logprob_error(peft_model, reqs, exported, 1.0) < LOGPROB_ATOL
    finally:
        engine.shutdown()
