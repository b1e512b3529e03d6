"""The memory budget of mixture-of-experts models (issue 45 item 15): the experts, routers and
shared experts of every counted model type are in the parameter count (equal to transformers'
own model built from the same published config.json on the meta device), so in the weights,
gradients and AdamW state; the activations follow the experts a token goes through (held
against torch's FSDPMemTracker); FSDP2's padding of 60 experts over 8 ranks is counted; a
weight snapshot carries every expert; and a model type whose experts the budget cannot count
is refused before start-up with one line naming it (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray

from trainer.cli import main
from trainer.config import load_config
from trainer.loop.plan.memory_budget import DEFAULT_DEVICE_MEMORY_BYTES, budget_for
from trainer.loop.plan.model_shape import ModelShapeError, model_shape
from trainer.loop.plan.moe_layout import COUNTED
from trainer.loop.plan.rank_memory import recompute_bytes
from trainer.loop.plan.snapshot_budget import snapshot_bytes
from trainer.loop.ranks.memory_tracker import measured_update, track_step

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "moe"
GPU_7B = str(ROOT / "configs" / "gpu" / "qwen2.5-7b-grpo.yaml")
#: Published totals, 1e9 parameters (the models' cards; GLM-4.5-Air's 106e9 includes its
#: next-token-prediction layer, which transformers does not build).
PUBLISHED = {
    "Qwen3-30B-A3B": 30.5,
    "Mixtral-8x7B": 46.7,
    "Qwen1.5-MoE-A2.7B": 14.3,
    "OLMoE-1B-7B": 6.9,
    "GLM-4.5-Air": 106.9,
}


def _config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def _cfg(name: str, *overrides: str):
    path = f"model.path={FIXTURES / name}"
    return load_config(GPU_7B, [path, *overrides], check_environment=False)


def _meta_model(config: dict, **changes):
    """transformers' own causal LM of ``config`` on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in {**config, **changes}.items() if k != "model_type"}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            AutoConfig.for_model(config["model_type"], **fields)
        )


# ----------------------------------------------------------------------------- counting


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_expert_is_counted_as_transformers_builds_it(name):
    shape = model_shape(str(FIXTURES / name))
    model = _meta_model(_config(name))
    params = list(model.parameters())
    assert shape.num_params == sum(p.numel() for p in params)
    assert round(shape.num_params / 1e9, 1) == PUBLISHED[name]
    assert shape.largest_tensor_params == max(p.numel() for p in params)
    assert shape.experts is not None and shape.config["model_type"] in COUNTED
    # a weight snapshot (model.dtype bf16) carries every weight, every expert (none is tied)
    assert snapshot_bytes(shape, "bfloat16") == 2 * shape.num_params


def test_dense_layers_and_shared_experts_follow_the_model_types_rules():
    # qwen2_moe: mlp_only_layers and decoder_sparse_step pick the dense layers
    config = {**_config("Qwen1.5-MoE-A2.7B"), "mlp_only_layers": [0, 5], "decoder_sparse_step": 2}
    shape = _shape(config)
    assert shape.experts.sparse_layers == 11  # odd indices 1..23, less 5
    assert shape.num_params == sum(p.numel() for p in _meta_model(config).parameters())
    # glm4_moe: the first first_k_dense_replace layers are dense, with a shared expert
    config = {**_config("GLM-4.5-Air"), "first_k_dense_replace": 3, "num_hidden_layers": 6}
    shape = _shape(config)
    assert shape.experts.sparse_layers == 3 and shape.experts.shared_intermediate_size == 1408
    assert shape.num_params == sum(p.numel() for p in _meta_model(config).parameters())
    # a dense qwen3 has the same per-head query and key norms and no experts
    config = {**_config("Qwen3-30B-A3B"), "model_type": "qwen3", "num_hidden_layers": 2}
    config = {k: v for k, v in config.items() if "expert" not in k}
    shape = _shape(config)
    assert shape.experts is None and shape.qk_norm == (128, 128)
    assert shape.num_params == sum(p.numel() for p in _meta_model(config).parameters())


def _shape(config: dict):
    from trainer.loop.plan.model_shape import ModelShape

    return ModelShape.from_config(config, "a test config")


# ----------------------------------------------------------------------------- the budget


def test_layout_counts_the_experts_state_and_no_longer_fits_qwen3_30b_a3b(capsys):
    assert main(["layout", "--config", GPU_7B, f"model.path={FIXTURES / 'Qwen3-30B-A3B'}"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("memory per ") :]
    # before: "model: 3.34e9 parameters" (a dense MLP) and "fits, 75 %"
    assert "model: 30.53e9 parameters" in table
    assert "experts: 128 x width 768 in 48/48 layers" in table and "8 active a token" in table
    assert "does NOT fit" in table and "raise train.dp_size" in table
    # the prose wraps at 100 columns; a path is printed whole, however deep the checkout
    assert all(len(line.replace(str(FIXTURES), "")) <= 100 for line in table.splitlines())
    cfg = _cfg("Qwen3-30B-A3B")
    budget = budget_for(cfg, "cuda", DEFAULT_DEVICE_MEMORY_BYTES["cuda"])
    n, dp = budget.shape.num_params, cfg.train.dp_size
    # the experts' fp32 weights (actor and reference), gradients and AdamW moments, sharded
    assert budget.phase("rollout").parts["params"] == pytest.approx(2 * 4 * n / dp)
    assert budget.phase("rollout").parts["optim"] == pytest.approx(8 * n / dp)
    # the update's peak is its backward (the fused head's fp32 accumulator counted, issue
    # 56): the sharded fp32 gradients and the LM head's whole bf16 gradient
    head = budget.shape.embedding_params * 2
    assert budget.phase("update").parts["grads"] == pytest.approx(4 * n / dp + head)


def test_the_activations_follow_the_experts_a_token_goes_through():
    shape = model_shape(str(FIXTURES / "Qwen3-30B-A3B"))
    tokens = 16384
    eight = recompute_bytes(shape, tokens, 2)
    more = _shape({**_config("Qwen3-30B-A3B"), "num_experts_per_tok": 16})
    # each routed copy of a token holds 4 m + 6 h elements early in the layer's backward
    routed = tokens * 8 * (4 * 768 + 6 * 2048) * 2
    assert recompute_bytes(more, tokens, 2) - eight == pytest.approx(routed)
    # without checkpointing every layer saves its routed copies' 2 h + 4 m
    on = _cfg("Qwen3-30B-A3B", "train.dp_size=16")
    off = _cfg("Qwen3-30B-A3B", "train.dp_size=16", "train.activation_checkpointing=false")
    memory = DEFAULT_DEVICE_MEMORY_BYTES["cuda"]
    activ = [budget_for(c, "cuda", memory).phase("update") for c in (on, off)]
    assert activ[1].parts["activ"] > 48 * tokens * 8 * (2 * 2048 + 4 * 768) * 2


def test_sixty_experts_over_eight_ranks_shard_as_sixty_four():
    cfg = _cfg("Qwen1.5-MoE-A2.7B")
    budget = budget_for(cfg, "cuda", DEFAULT_DEVICE_MEMORY_BYTES["cuda"])
    shape = budget.shape
    padded = shape.padded_params(8)
    # per layer: 4 more experts' weights and router rows, and the shared expert's one-row gate
    # held as 8 rows
    h, m = 2048, 1408
    assert padded - shape.num_params == 24 * (4 * (3 * h * m + h) + 7 * h)
    assert budget.phase("rollout").parts["optim"] == pytest.approx(8 * padded / 8)
    # 60 experts over 4 ranks: 15 each, only the gate pads (to 4 rows)
    assert shape.padded_params(4) - shape.num_params == 24 * 3 * h


# ----------------------------------------------------------------------------- the tracker

TRACKED = 4  # decoder layers, as tests/test_memory_tracker.py


def _check_against_the_tracker(name: str):
    cfg = _cfg(name)
    step = track_step(cfg, layers=TRACKED)
    _, estimate, tracked = measured_update(cfg, step)
    assert 0.97 <= estimate / tracked <= 1.10, (estimate / 1e9, tracked / 1e9)
    assert step.shape.experts is not None  # the tracker built the model with its experts
    actor = step.roles["actor"]
    shape, dp = step.shape, cfg.train.dp_size
    assert actor["Sharded Param"] == pytest.approx(4 * shape.padded_params(dp) / dp, rel=1e-3)
    # the recomputed layer's backward: what the tracker sees beyond the kept layer inputs and
    # the LM head's whole bf16 gradient
    tokens, h = step.micro_batch_tokens, shape.hidden_size
    seen = actor["Activation"] + actor["Temp"] - shape.embedding_params * 2
    seen -= (TRACKED + 1) * tokens * h * 2
    assert recompute_bytes(shape, tokens, 2) == pytest.approx(seen, rel=0.05)


def test_budget_matches_the_tracker_on_qwen3_30b_a3b():
    _check_against_the_tracker("Qwen3-30B-A3B")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["Mixtral-8x7B", "Qwen1.5-MoE-A2.7B", "OLMoE-1B-7B"])
def test_budget_matches_the_tracker_on_the_other_moe_shapes(name):
    _check_against_the_tracker(name)


def test_crossrl_layout_measure_builds_the_experts(capsys):
    model = f"model.path={FIXTURES / 'Qwen3-30B-A3B'}"
    assert main(["layout", "--config", GPU_7B, model, "--measure", "2"]) == 0
    table = capsys.readouterr().out.split("FSDPMemTracker", 1)[1]
    two = _shape({**_config("Qwen3-30B-A3B"), "num_hidden_layers": 2})
    assert f"2 layers, hidden 2048, {two.num_params / 1e9:.2f}e9 parameters" in table
    assert two.num_params > 3 * two.embedding_params  # its 2 x 128 experts
    ratio = float(table.rsplit("estimate / tracker", 1)[1])
    assert 0.97 <= ratio <= 1.10


# ----------------------------------------------------------------------------- refusal


def test_a_moe_the_budget_cannot_count_is_refused_naming_its_type(tmp_path, capsys):
    deepseek = f"model.path={FIXTURES / 'DeepSeek-V3'}"
    assert main(["layout", "--config", GPU_7B, deepseek]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("crossrl layout: model.path: ")
    assert "model_type deepseek_v3 is a mixture of experts (n_routed_experts=256)" in err[0]
    assert "qwen3_moe" in err[0]  # what it counts
    # crossrl train: before anything starts
    from trainer.loop.start.run import run_training

    cfg = _cfg("DeepSeek-V3", f"run.dir={tmp_path / 'run'}")
    assert run_training(cfg) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "deepseek_v3" in lines[0], lines
    assert not ray.is_initialized() and not (tmp_path / "run").exists()


def test_experts_inside_a_nested_config_or_with_a_bad_count_are_refused(tmp_path):
    nested = tmp_path / "vl"
    nested.mkdir()
    text = {k: v for k, v in _config("Qwen3-30B-A3B").items() if k != "model_type"}
    (nested / "config.json").write_text(
        json.dumps({"model_type": "qwen3_vl_moe", "text_config": text})
    )
    with pytest.raises(ModelShapeError, match=r"qwen3_vl_moe .*\(text_config.num_experts=128\)"):
        model_shape(str(nested))
    bad = tmp_path / "bad"
    bad.mkdir()
    broken = {**_config("Mixtral-8x7B"), "num_experts_per_tok": "two"}
    (bad / "config.json").write_text(json.dumps(broken))
    with pytest.raises(ModelShapeError, match="num_experts_per_tok='two'"):
        model_shape(str(bad))


def test_expert_parallelism_gathers_a_layers_share_of_the_experts(capsys):
    """``train.expert_parallel_size``: a rank gathers only its ep group's experts of a layer
    (FSDP2 shards them by their dim 1 over the rest, so no expert rows are padded); the rest of
    the state is sharded over every rank as before. ``crossrl layout`` says so."""
    plain = budget_for(_cfg("Qwen3-30B-A3B"), "cuda", DEFAULT_DEVICE_MEMORY_BYTES["cuda"])
    shape = plain.shape
    e = shape.experts
    experts = e.count * 3 * e.intermediate_size * shape.hidden_size  # gate, up, down
    for ep in (2, 4, 8):
        saved = shape.padded_layer_params(8) - shape.padded_layer_params(8, ep)
        assert saved == experts - experts // ep
    split = budget_for(
        _cfg("Qwen3-30B-A3B", "train.expert_parallel_size=8"),
        "cuda",
        DEFAULT_DEVICE_MEMORY_BYTES["cuda"],
    )
    for part in ("params", "optim"):  # the state: sharded over every rank either way
        assert split.phase("rollout").parts[part] == plain.phase("rollout").parts[part]
    # the update's backward holds less (its peak may become the optimizer step's)
    assert split.phase("update").total < plain.phase("update").total
    config = f"model.path={FIXTURES / 'Qwen3-30B-A3B'}"
    assert main(["layout", "--config", GPU_7B, config, "train.expert_parallel_size=8"]) == 0
    assert "expert parallel: 16 experts a rank of 8" in capsys.readouterr().out
