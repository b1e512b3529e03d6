"""The accelerator benchmark's code path, run on a CPU with a tiny model: it times the shipped
``PolicyWorker`` update (activation checkpointing on and off) and the rollout host's engine.

No timing is asserted here (speed lives in bench/ output, see docs/benchmarks.md).
"""

from __future__ import annotations

import math

import pytest

import hal
from bench import gpu, train

#: A Qwen2 config small enough for a 2-core CPU: 2 layers, hidden 64, vocab 512.
TINY_SHAPE = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "pad_token_id": 3,
    "eos_token_id": 2,
}
TINY_SIZES = gpu.GpuSizes(
    matmul_n=64,
    matmul_iters=2,
    rows=12,
    median_row_tokens=24,
    max_row_tokens=64,
    budget_tokens=256,
    update_repeats=1,
    rollout_prompts=2,
    prompt_tokens=5,
    new_tokens=4,
)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return gpu.measure(
        hal.get_backend("cpu"),
        TINY_SIZES,
        shape=TINY_SHAPE,
        model_dir=tmp_path_factory.mktemp("bench-gpu") / "model",
        profile=True,
    )


def test_both_activation_checkpointing_settings_train_the_whole_batch(result):
    rows = train.make_rows(
        TINY_SIZES.rows,
        vocab_size=TINY_SHAPE["vocab_size"],
        seed=0,
        median_tokens=TINY_SIZES.median_row_tokens,
        max_tokens=TINY_SIZES.max_row_tokens,
    )
    tokens = sum(int(r["input_ids"].numel()) for r in rows)
    assert set(result["update"]) == {"ac_on", "ac_off", "ac_on_reference"}
    for key, on, kernels in gpu.UPDATES:
        u = result["update"][key]
        assert u["activation_checkpointing"] is on and u["kernels"] == kernels
        # the CPU has no fused set; it compiles blocks only when asked (train.compile_blocks)
        assert {v.split(" (")[0] for v in u["kernel_report"].values()} == {"reference"}
        assert u["rows"] == TINY_SIZES.rows and u["tokens"] == tokens  # one mini-batch: all rows
        assert u["micro_batches"] >= math.ceil(tokens / TINY_SIZES.budget_tokens)
        assert len(u["seconds"]) == TINY_SIZES.update_repeats
        assert u["mfu"] > 0 and math.isfinite(u["mfu"])
        assert u["peak_memory_gb"] > 0
        assert math.isfinite(u["grad_norm"]) and u["grad_norm"] > 0  # a real update ran
    # Same model and rows: the model FLOPs do not depend on recomputation.
    on, off = result["update"]["ac_on"], result["update"]["ac_off"]
    assert on["model_tflops_per_update"] == off["model_tflops_per_update"]


def test_rollout_generates_every_requested_token(result):
    r = result["rollout"]
    # No stop token: every request runs out its new tokens.
    assert r["generated_tokens"] == TINY_SIZES.rollout_prompts * TINY_SIZES.new_tokens
    assert r["tokens_per_s"] > 0
    assert result["peak"]["tflops"] > 0


def test_table_shows_both_updates_and_the_rollout(result):
    table = gpu.format_table(result)
    assert "activation checkpointing on" in table and "activation checkpointing off" in table
    assert table.count("MFU") == 3 and table.count("peak memory") == 4
    assert "kernels reference (rms_norm reference" in table
    assert "HF engine rollout" in table


def test_the_shipped_settings_update_is_profiled_once(result):
    """``--profile``: the activation-checkpointing updates (the shipped setting, with each
    kernel set) get torch's profiler table, with the operators the update runs; the other
    setting is not profiled."""
    for key in ("ac_on", "ac_on_reference"):
        table = result["update"][key]["profile_table"]
        assert "aten::" in table and "Self CPU" in table
        assert table in gpu.format_table(result)
    assert result["update"]["ac_off"]["profile_table"] is None


@pytest.mark.slow
def test_the_compiled_update_runs_compiled_blocks(monkeypatch, tmp_path):
    """``--compile``: one more update, checkpointing off, every decoder layer through
    ``torch.compile`` (inductor's C++ backend on this CPU); it ran compiled, nothing fell back."""
    monkeypatch.setattr(gpu, "UPDATES", ())  # the compiled update alone, to keep this short
    result = gpu.measure(
        hal.get_backend("cpu"),
        TINY_SIZES,
        shape=TINY_SHAPE,
        model_dir=tmp_path / "model",
        compile_blocks=True,
    )
    u = result["update"]["ac_off_compiled"]
    assert u["activation_checkpointing"] is False and u["kernels"] == "auto"
    assert u["kernel_report"]["compile"] == "torch.compile"
    assert math.isfinite(u["grad_norm"]) and u["grad_norm"] > 0
