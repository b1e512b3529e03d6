"""The memory budget (trainer/loop/plan/memory_budget.py): parameter counts of the shapes it knows,
the shipped 7B jobs fitting their devices after issue 24's fixes (and the 30.5 GB of whole fp32
gradients before them), each component moving with its key, `crossrl layout` printing the
table for every shipped GPU and NPU config, and `crossrl train` refusing a job that cannot fit
before anything starts (exit 2, one line naming the key)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray

from trainer.cli import main
from trainer.config import load_config
from trainer.loop.plan.memory_budget import (
    COMPONENTS,
    DEFAULT_DEVICE_MEMORY_BYTES,
    GB,
    budget_for,
    estimate_memory,
)
from trainer.loop.plan.memory_report import format_budget, memory_problem
from trainer.loop.plan.model_shape import PUBLISHED_SHAPES, ModelShape, model_shape
from trainer.loop.plan.rank_memory import micro_batch_tokens

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(
    str(p.relative_to(ROOT / "configs"))
    for device in ("gpu", "npu")
    for p in (ROOT / "configs" / device).glob("*.yaml")
)


def _cfg(name: str, *overrides: str):
    return load_config(str(ROOT / "configs" / name), list(overrides), check_environment=False)


def _budget(name: str, *overrides: str, before_fixes: bool = False):
    cfg = _cfg(name, *overrides)
    memory = DEFAULT_DEVICE_MEMORY_BYTES[cfg.device]
    return cfg, budget_for(cfg, cfg.device, memory, "default", before_fixes=before_fixes)


# ----------------------------------------------------------------------------- shapes


def test_parameter_counts_of_the_published_shapes():
    counts = {
        name: ModelShape.from_config(config, "table").num_params
        for name, config in PUBLISHED_SHAPES.items()
    }
    # The published totals (tied embeddings at 0.5B and 1.5B count once).
    assert counts == {
        "Qwen2.5-0.5B": 494_032_768,
        "Qwen2.5-1.5B": 1_543_714_304,
        "Qwen2.5-7B": 7_615_616_512,
        "Qwen3-235B-A22B": 235_093_634_560,
        "Qwen3-30B-A3B": 30_532_122_624,
    }
    assert [round(c / 1e9, 2) for c in counts.values()] == [0.49, 1.54, 7.62, 235.09, 30.53]


@pytest.mark.parametrize("name", ["Qwen2.5-0.5B", "Qwen2.5-7B", "Qwen3-30B-A3B", "Qwen3-235B-A22B"])
def test_parameter_count_matches_the_transformers_model(name):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(PUBLISHED_SHAPES[name])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_config(PUBLISHED_SHAPES[name], "table")
    assert sum(p.numel() for p in model.parameters()) == shape.num_params
    largest = max(p.numel() for p in model.parameters())
    assert shape.largest_tensor_params == largest


def test_shape_comes_from_config_json_builtin_or_the_table(tmp_path):
    tiny = model_shape("builtin:tiny")
    assert tiny is not None and tiny.num_params == 105_408 and "builtin:tiny" in tiny.source
    local = tmp_path / "Qwen2.5-7B-Instruct"  # its config.json wins over the name
    local.mkdir()
    (local / "config.json").write_text(json.dumps({**PUBLISHED_SHAPES["Qwen2.5-0.5B"]}))
    shape = model_shape(str(local))
    assert shape.num_params == 494_032_768 and str(local / "config.json") in shape.source
    table = model_shape("/models/Qwen2.5-1.5B-Instruct")
    assert table.num_params == 1_543_714_304 and "table of published shapes" in table.source
    assert model_shape("/models/Qwen2.5-72B-Instruct") is None
    assert model_shape("/models/some-llm") is None


# ----------------------------------------------------------------------------- the 7B jobs


@pytest.mark.parametrize("name", ["gpu/qwen2.5-7b-grpo.yaml", "npu/qwen2.5-7b-grpo.yaml"])
def test_7b_jobs_fit_after_the_fixes_and_held_whole_fp32_grads_before(name):
    cfg, after = _budget(name)
    _, before = _budget(name, before_fixes=True)
    assert after.over == [] and memory_problem(after, cfg) is None
    n = after.shape.num_params
    head_grad = after.shape.embedding_params * 2  # the LM head's whole bf16 gradient, both
    whole = before.phase("update").parts["grads"] - head_grad
    assert whole == pytest.approx(4 * n) and round(whole / GB, 1) == 30.5
    sharded = after.phase("update").parts["grads"] - head_grad
    assert sharded == pytest.approx(4 * n / cfg.train.dp_size)
    # after: the gradients are freed with the step and the ranks offload before the push
    assert after.phase("rollout").parts["grads"] == 0
    assert before.phase("rollout").parts["grads"] == pytest.approx(4 * n / cfg.train.dp_size)
    assert after.phase("update").total < before.phase("update").total - 25 * GB


def test_7b_ppo_before_the_fixes_did_not_fit_and_names_a_key():
    # actor and critic update at once on every device: two models' whole fp32 gradients
    cfg, before = _budget("gpu/qwen2.5-7b-ppo.yaml", before_fixes=True)
    assert [p.name for p in before.over] == ["update"]
    assert "train.dp_size" in memory_problem(before, cfg)
    _, after = _budget("gpu/qwen2.5-7b-ppo.yaml")
    assert after.over == []


# ----------------------------------------------------------------------------- scaling


def test_twice_the_ranks_halve_the_sharded_state():
    _, one = _budget("gpu/qwen2.5-7b-grpo.yaml")
    _, two = _budget("gpu/qwen2.5-7b-grpo.yaml", "train.dp_size=16")
    for part in ("params", "optim"):
        assert two.phase("rollout").parts[part] == pytest.approx(
            one.phase("rollout").parts[part] / 2
        )
    # what is not sharded stays: the engine, the gathered layers, the activations
    for phase, part in [("rollout", "engine"), ("update", "gather"), ("update", "activ")]:
        assert two.phase(phase).parts[part] == one.phase(phase).parts[part]


def test_checkpointing_and_a_smaller_micro_batch_lower_the_activations():
    off = _budget("gpu/qwen2.5-7b-grpo.yaml", "train.activation_checkpointing=false")[1]
    on = _budget("gpu/qwen2.5-7b-grpo.yaml")[1]
    half = _budget("gpu/qwen2.5-7b-grpo.yaml", "train.max_tokens_per_micro_batch=8192")[1]
    activ = [b.phase("update").parts["activ"] for b in (off, on, half)]
    assert activ[0] > 5 * activ[1] and activ[2] == pytest.approx(activ[1] / 2)


def test_optimizer_offload_takes_the_optimizer_state_out_of_rollout_and_push():
    _, kept = _budget("gpu/qwen2.5-7b-grpo.yaml")
    _, offloaded = _budget("gpu/qwen2.5-7b-grpo.yaml", "train.optimizer_offload=true")
    n, dp = kept.shape.num_params, 8
    assert kept.phase("rollout").parts["optim"] == pytest.approx(8 * n / dp)
    assert offloaded.phase("rollout").parts["optim"] == 0
    assert offloaded.phase("weight push").parts["optim"] == 0
    # 4 optimizer steps per step: back on the device from the first one to the step's end
    assert offloaded.phase("update").parts["optim"] == kept.phase("update").parts["optim"]


def test_full_logits_without_the_lean_path_and_no_micro_batch_budget():
    cfg, lean = _budget("gpu/qwen2.5-7b-grpo.yaml")
    _, plain = _budget("gpu/qwen2.5-7b-grpo.yaml", "train.lean_logprobs=false")
    vocab = lean.shape.vocab_size
    assert plain.phase("update").parts["logits"] > 16384 * vocab * 2  # [T, V] bf16 kept
    whole = _cfg("gpu/qwen2.5-7b-grpo.yaml", "train.max_tokens_per_micro_batch=null")
    # 16 prompts x 8 samples x 4 turns of up to 5,120 tokens, over 8 ranks
    assert micro_batch_tokens(whole) == 64 * 5120


# ----------------------------------------------------------------------------- printing


@pytest.mark.parametrize("name", SHIPPED)
def test_crossrl_layout_prints_the_budget_of_every_shipped_config(name, capsys):
    # the device each config is written for, whatever this machine has
    memory_gb = {"gpu": "80", "npu": "64"}[name.split("/")[0]]
    config = ROOT / "configs" / name
    assert main(["layout", "--config", str(config), "--device-memory-gb", memory_gb]) == 0
    out = capsys.readouterr().out
    table = out[out.index("memory per ") :].splitlines()
    header = next(line for line in table if line.strip().startswith("phase"))
    assert header.split()[1:] == [*COMPONENTS, "total"]
    rows = {line.split()[0]: line for line in table if line.startswith("  ")}
    assert {"rollout", "update", "weight"} <= set(rows)
    model = Path(_cfg(name).model.path)
    here = (model / "config.json").is_file()
    assert ("table of published shapes" in out) != here, out
    assert "fits" in table[-1] and "NOT" not in out
    assert all(len(line) <= 100 for line in table)


def test_layout_with_less_device_memory_says_which_key_to_change(capsys):
    config = str(ROOT / "configs/gpu/qwen2.5-7b-grpo.yaml")
    assert main(["layout", "--config", config, "--device-memory-gb", "40"]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "rollout.memory_fraction" in out
    assert main(["layout", "--config", config, "--device-memory-gb", "0"]) == 2
    assert "--device-memory-gb=0.0: must be > 0" in capsys.readouterr().err


def test_an_unknown_shape_gives_no_estimate_and_refuses_nothing(tmp_path):
    from trainer.loop.start.preflight import _check_memory

    cfg = _cfg("gpu/qwen2.5-7b-grpo.yaml", f"model.path={tmp_path / 'my-llm'}")
    assert budget_for(cfg, "cuda", 1e9) is None
    assert "no estimate" in format_budget(None, cfg)
    _check_memory(cfg)  # no raise


# ----------------------------------------------------------------------------- refusal


def test_train_refuses_a_7b_job_on_one_gpu_before_start_up(tmp_path, capsys):
    from trainer.loop.start.run import run_training

    cfg = _cfg(
        "gpu/qwen2.5-7b-grpo.yaml",
        "train.dp_size=1",
        "rollout.tensor_parallel_size=1",
        f"run.dir={tmp_path / 'run'}",
    )
    assert run_training(cfg) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "phase needs about" in line and "GB per cuda device" in line
    assert "raise train.dp_size (now 1)" in line
    assert not ray.is_initialized() and not (tmp_path / "run").exists()


def test_a_probe_is_checked_on_its_update_only(tmp_path):
    from trainer.loop.start.preflight import PreflightError, _check_memory

    # a probe replays recorded rollouts: no engine, so its memory_fraction takes nothing
    cfg = _cfg("gpu/qwen2.5-7b-grpo.yaml", "rollout.memory_fraction=0.95")
    with pytest.raises(PreflightError, match="the rollout phase .* rollout.memory_fraction"):
        _check_memory(cfg)
    _check_memory(cfg, replay=True)
    one_gpu = _cfg("gpu/qwen2.5-7b-grpo.yaml", "train.dp_size=1", "rollout.tensor_parallel_size=1")
    with pytest.raises(PreflightError, match="the update phase"):
        _check_memory(one_gpu, replay=True)


def test_on_the_cpu_only_a_phase_beyond_the_hosts_ram_refuses():
    cfg = load_config(None, [], check_environment=False)
    shape = model_shape(cfg.model.path)
    ram = estimate_memory(cfg, shape, 16e9, device="cpu", memory_source="RAM")
    assert memory_problem(ram, cfg) is None
    tiny_host = estimate_memory(cfg, shape, 1e6, device="cpu", memory_source="RAM")
    assert "on the host, more than its 0.0 GB" in memory_problem(tiny_host, cfg)


def test_lean_chunk_size_is_the_workers_own():
    from trainer.loop.plan.rank_memory import LEAN_CHUNK_BYTES
    from trainer.loop.ranks.forward import LEAN_CHUNK_BYTES as WORKERS

    assert LEAN_CHUNK_BYTES == WORKERS


def test_engines_of_their_own_leave_the_ranks_devices_to_training():
    cfg, colocated = _budget("gpu/qwen2.5-7b-grpo.yaml", "train.dp_size=4")
    _, separate = _budget(
        "gpu/qwen2.5-7b-grpo.yaml",
        "train.dp_size=4",
        "rollout.engine_devices=4",
        "train.rollout_lag=1",
        "algorithm.rollout_correction=token",
    )
    assert [p.name for p in separate.phases] == ["update", "weight push", "engines"]
    # No engine on a rank's device, awake or asleep; the engine's own device holds its share.
    assert separate.phase("update").parts.get("engine", 0.0) == 0.0
    engines = separate.phase("engines").parts["engine"]
    assert engines == pytest.approx(cfg.rollout.memory_fraction * separate.device_memory_bytes)
    # The update itself is the colocated one, less the engine process's device context.
    assert separate.phase("update").total < colocated.phase("update").total
    text = format_budget(separate, cfg)
    assert "engines" in text and "fits" in text


def test_each_process_counts_what_it_holds_beyond_its_tensors_on_its_device_type():
    """cuda counts the 1.85 GB per process measured on an H100 (docs/gpu.md, tier 1), the npu
    its 0.5 GB context plus HCCL's buffers: four processes share a colocated 7B PPO device."""
    import hal

    gpu = _budget("gpu/qwen2.5-7b-ppo.yaml")[1].phase("update").parts["ctx"]
    assert gpu == pytest.approx(4 * hal.process_bytes("cuda")) and hal.process_bytes("cuda") > 1e9
    npu = _budget("npu/qwen2.5-7b-ppo.yaml")[1].phase("update").parts["ctx"]
    # HCCL's buffers: one communicator per training process (3) and the tp-2 engine's
    assert npu == pytest.approx(
        4 * hal.process_bytes("npu") + 4 * hal.communicator_buffer_bytes("npu")
    )


@pytest.mark.parametrize("device", ["cuda", "npu", "cpu"])
def test_the_fused_heads_accumulator_is_counted_where_the_kernel_set_runs_it(device):
    """The fused LM head (``hal.fused_head``) sums the head's weight gradient in a float32
    ``[V, H]`` tensor through its backward: counted in the update's ``kernel`` column on the
    devices whose kernel set offers it, not on the CPU (the reference), nor where the config
    keeps the reference head, nor under LoRA (the head does not train)."""
    import hal
    from hal.device_memory import FUSED_HEAD_DEVICES
    from hal.kernels import FUSED_HEAD

    offered = hal.backend_class(device).kernel_providers.get("lm_head") is FUSED_HEAD
    assert (device in FUSED_HEAD_DEVICES) == offered
    cfg = _cfg("gpu/qwen2.5-1.5b-grpo.yaml")
    shape = model_shape(cfg.model.path)
    accumulator = 4 * shape.vocab_size * shape.hidden_size  # 0.93 GB at 1.5B

    def kernel(*overrides: str) -> float:
        c = _cfg("gpu/qwen2.5-1.5b-grpo.yaml", *overrides)
        budget = estimate_memory(c, shape, 80e9, device=device)
        return budget.phase("update").parts["kernel"]

    assert kernel() == (accumulator if offered else 0.0)
    assert kernel("train.kernels=reference") == 0.0
    assert kernel("train.reference_kernels=[lm_head]") == 0.0
    assert kernel("train.lean_logprobs=false") == 0.0
    assert kernel("model.lora.rank=8") == 0.0
