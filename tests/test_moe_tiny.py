"""``builtin:tiny-moe``: a Qwen3-MoE of the tiny model's size (8 experts, top-2, layer 0 dense),
built offline, trained by the default job on the CPU and exported (issue 58's first step: the HF engine and
the trainer run transformers' own MoE modules, experts fused per layer)."""

from __future__ import annotations

import pytest
import torch

from rollout.models import builtin_config_dir, load_model


def test_the_tiny_moe_is_a_qwen3_moe_with_fused_experts_and_one_dense_layer():
    model = load_model("builtin:tiny-moe", seed=0)
    config = model.config
    assert config.model_type == "qwen3_moe"
    assert (config.num_experts, config.num_experts_per_tok, config.mlp_only_layers) == (8, 2, [0])
    assert (builtin_config_dir("builtin:tiny-moe") / "config.json").is_file()
    names = dict(model.named_parameters())
    gate_up = names["model.layers.1.mlp.experts.gate_up_proj"]
    down = names["model.layers.1.mlp.experts.down_proj"]
    inter, hidden = config.moe_intermediate_size, config.hidden_size
    assert tuple(gate_up.shape) == (8, 2 * inter, hidden)
    assert tuple(down.shape) == (8, hidden, inter)
    assert tuple(names["model.layers.1.mlp.gate.weight"].shape) == (8, hidden)
    assert "model.layers.0.mlp.gate_proj.weight" in names  # the dense layer
    # the same seed gives the same weights, another seed others
    again = load_model("builtin:tiny-moe", seed=0).state_dict()
    other = load_model("builtin:tiny-moe", seed=1).state_dict()
    key = "model.layers.1.mlp.experts.gate_up_proj"
    assert torch.equal(again[key], gate_up.detach())
    assert not torch.equal(other[key], gate_up.detach())


def test_the_default_job_trains_the_tiny_moe_and_its_experts_learn(tmp_path):
    """Two steps of the default job on ``builtin:tiny-moe``: the HF engine samples what the
        trainer scores (the pushed experts served), the steps move the experts and the router, and
    the export loads back in transformers with those weights."""
    from trainer.config import load_config
    from trainer.loop.start.run import run_training
    from trainer.records.jsonl_files import read_jsonl

    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "model.path=builtin:tiny-moe",
            "train.total_steps=2",
            "run.resume=never",
            f"run.dir={run_dir}",
        ],
    )
    assert run_training(cfg) == 0
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["actor/grad_norm"] > 0
        assert m["rollout/logprob_abs_diff"] < 1e-4
    # exported as transformers reads it back (the fused experts under their own names)
    from transformers import AutoModelForCausalLM

    from trainer.commands.export import export_run

    out = export_run(run_dir, tmp_path / "export")
    # one tensor per expert, as published checkpoints are: what vLLM 0.24's and 0.26's
    # loaders map (they skip transformers 5's fused names)
    from rollout.models import CheckpointTensors

    names = CheckpointTensors(out).files
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)
    trained = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    initial = load_model("builtin:tiny-moe", seed=cfg.seed).state_dict()
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.gate.weight"):
        assert not torch.equal(trained[name].float(), initial[name].float()), name


def _run(tmp_path, name: str, *overrides: str) -> list[dict]:
    from trainer.config import load_config
    from trainer.loop.start.run import run_training
    from trainer.records.jsonl_files import read_jsonl

    run_dir = tmp_path / name
    cfg = load_config(
        None,
        [
            "model.path=builtin:tiny-moe",
            "train.total_steps=2",
            "run.resume=never",
            f"run.dir={run_dir}",
            *overrides,
        ],
    )
    assert run_training(cfg) == 0
    return read_jsonl(run_dir / "metrics.jsonl")


KEYS = ("actor/loss", "actor/grad_norm", "actor/entropy", "rollout/score_mean")


def test_replaying_the_engines_routing_changes_nothing_where_engine_and_trainer_agree(tmp_path):
    """fp32 on both sides and one update per step (every forward on the weights that
    sampled): the engine's routing is the trainer's own, so a replayed run, its layers
    checkpointed (the recompute reuses the forward's routing), trains as the plain one; the
    flip rate says 0."""
    one_update = "train.mini_batch_size=16"
    plain = _run(tmp_path, "plain", one_update)
    replayed = _run(
        tmp_path,
        "replayed",
        one_update,
        "algorithm.routing_replay=rollout",
        "train.activation_checkpointing=true",
    )
    for a, b in zip(plain, replayed, strict=True):
        assert "actor/routing_flip_rate" not in a
        assert b["actor/routing_flip_rate"] == 0.0
        for key in KEYS:
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), key


def test_the_flip_rate_measures_a_bf16_trainer_against_an_fp32_engine(tmp_path):
    """A bf16 trainer routes some tokens otherwise than the fp32 engine that sampled them:
    ``measure`` reports it and trains as a run without replay; ``rollout`` measures the same
    rate on the same first step (before any update), then trains on the engine's routing."""
    bf16 = "train.param_dtype=bfloat16"
    plain = _run(tmp_path, "plain", bf16)
    measured = _run(tmp_path, "measured", bf16, "algorithm.routing_replay=measure")
    replayed = _run(tmp_path, "replayed", bf16, "algorithm.routing_replay=rollout")
    assert measured[0]["actor/routing_flip_rate"] > 0
    assert replayed[0]["actor/routing_flip_rate"] == measured[0]["actor/routing_flip_rate"]
    for a, b in zip(plain, measured, strict=True):
        for key in KEYS:
            assert a[key] == b[key], key
    assert replayed[0]["actor/loss"] != measured[0]["actor/loss"]  # later updates replay


def test_the_load_balancing_loss_trains_through_checkpointed_layers_and_replay(tmp_path):
    """``algorithm.router_aux_loss_coef`` with routing replay, layers checkpointed or not: the
    same run (the recompute neither routes anew nor counts loads twice), the loss logged near
    its coefficient at step 1 (the tiny MoE's router starts near uniform: E * sum f P is 1
    there), and a run without it trains otherwise."""
    aux = ["algorithm.router_aux_loss_coef=0.01", "algorithm.routing_replay=rollout"]
    kept = _run(tmp_path, "kept", *aux)
    recomputed = _run(tmp_path, "recomputed", *aux, "train.activation_checkpointing=true")
    without = _run(tmp_path, "without", "algorithm.routing_replay=rollout")
    assert kept[0]["actor/router_aux_loss"] == pytest.approx(0.01, rel=0.1)
    for a, b, c in zip(kept, recomputed, without, strict=True):
        assert a["actor/router_aux_loss"] > 0
        assert "actor/router_aux_loss" not in c
        for key in (*KEYS, "actor/router_aux_loss"):
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), key
    assert kept[0]["actor/loss"] != without[0]["actor/loss"]
