"""Call limits that scale (issue 45 item 8): a checkpoint's and a push's limit follow the
model's bytes over a storage or link throughput (a floor until one is measured), one key
scales every budget (``run.time_limit_scale``), the rollout's counts the decode waves the
engines' KV caches need, validation's its records; a limit a call passed doubles for the
attempts left (the restart itself: tests/test_fault_decisions.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollout.engines.capacity import concurrent_sequences
from trainer.config import load_config
from trainer.loop.plan import call_limits
from trainer.loop.plan.call_limits import CallLimits, Limit

SHORT = ["train.batch_size=4", "train.mini_batch_size=2", "rollout.n=4"]

#: Llama-3-70B's published config.json sizes.
LLAMA_70B = {
    "model_type": "llama",
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}


def _cfg(tmp_path: Path, *overrides: str):
    return load_config(None, [*SHORT, f"run.dir={tmp_path / 'run'}", *overrides])


@pytest.fixture
def model_70b(tmp_path) -> Path:
    folder = tmp_path / "Llama-3-70B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_70B))
    return folder


def _budget(limit: float, limits: CallLimits) -> float:
    return limit - limits.collective_s


def test_a_70b_checkpoint_gets_the_time_its_bytes_need(tmp_path, model_70b):
    """A 70B actor's fp32 weights and AdamW moments are about 840 GB: at the storage floor
    (100 MB/s for all ranks) that is 2.3 hours, where the flat limit gave 30 minutes."""
    big = CallLimits.for_config(_cfg(tmp_path, f"model.path={model_70b}", "model.dtype=bfloat16"))
    assert big.state_bytes == pytest.approx(840e9, rel=0.02)
    assert big.weight_bytes == pytest.approx(140e9, rel=0.02)  # bf16 for the engines
    floor_s = big.state_bytes / call_limits.STORAGE_BYTES_PER_S
    assert _budget(big.checkpoint_save_s, big) >= floor_s > 8000
    assert _budget(big.checkpoint_load_s, big) >= floor_s
    assert _budget(big.push_s, big) >= big.weight_bytes / call_limits.PUSH_BYTES_PER_S
    assert _budget(big.setup_s, big) > call_limits.SETUP_S  # reading 140 GB counts too
    small = CallLimits.for_config(_cfg(tmp_path))  # builtin:tiny
    assert small.checkpoint_save_s < big.checkpoint_save_s and small.push_s < big.push_s
    lora = CallLimits.for_config(
        _cfg(tmp_path, f"model.path={model_70b}", "model.lora.rank=8", "model.dtype=bfloat16")
    )
    assert lora.state_bytes < big.state_bytes / 100  # the adapters alone are checkpointed


def test_one_key_scales_every_budget_never_the_collective_timeout(tmp_path, model_70b):
    keys = [f"model.path={model_70b}", "run.collective_timeout_s=300"]
    base = CallLimits.for_config(_cfg(tmp_path, *keys))
    slow = CallLimits.for_config(_cfg(tmp_path, *keys, "run.time_limit_scale=3"))
    for name in ("rollout_s", "validation_s", "checkpoint_save_s", "checkpoint_load_s", "push_s"):
        one, three = getattr(base, name), getattr(slow, name)
        assert _budget(three, slow) == pytest.approx(3 * _budget(one, base)), name
        assert three.call == one.call  # a Limit names the call it bounds
    assert _budget(slow.update_s(5000), slow) == pytest.approx(
        3 * _budget(base.update_s(5000), base)
    )
    quick = CallLimits.for_config(_cfg(tmp_path, *keys, "run.time_limit_scale=0.01"))
    assert quick.checkpoint_save_s > 300 and quick.rollout_s > 300  # the collective names it first


def test_a_measured_throughput_replaces_the_floor(tmp_path, model_70b):
    limits = CallLimits.for_config(_cfg(tmp_path, f"model.path={model_70b}"))
    floor = limits.checkpoint_save_s
    slow_s = limits.state_bytes / 20e6  # a save at 20 MB/s: slower than the floor
    limits.observe("checkpoint_save", slow_s)
    assert _budget(limits.checkpoint_save_s, limits) >= call_limits.MEASURED_SLACK * slow_s
    assert limits.checkpoint_load_s > floor  # a resume reads from the same storage
    limits.observe("checkpoint_save", slow_s / 100)  # a faster one later: the slowest holds
    assert _budget(limits.checkpoint_save_s, limits) >= call_limits.MEASURED_SLACK * slow_s
    fast = CallLimits.for_config(_cfg(tmp_path, f"model.path={model_70b}"))
    fast.observe("push", fast.weight_bytes / 2e9)  # 2 GB/s measured: a hang shows sooner
    assert fast.push_s < CallLimits.for_config(fast.cfg).push_s


def test_the_rollout_limit_counts_the_decode_waves_the_kv_cache_needs(tmp_path):
    cfg = _cfg(tmp_path, "train.batch_size=8", "rollout.n=8", "rollout.max_new_tokens=256")
    one_wave = CallLimits.for_config(cfg)
    limits = CallLimits.for_config(cfg)
    limits.set_engines([{"kv_sequences": 16}, {"kv_sequences": 20}])  # 64 trajectories, 2 replicas
    assert limits.decode_waves(64) == 2  # 32 a replica, 16 at a time
    decode_s = cfg.rollout.max_turns * 256 * call_limits.DECODE_STEP_S
    extra = cfg.rollout.max_sample_batches * decode_s
    assert limits.rollout_s - one_wave.rollout_s == pytest.approx(extra)
    limits.set_engines([{"kv_sequences": None}, {}])  # the HF engine: all at once
    assert limits.rollout_s == one_wave.rollout_s


def test_the_validation_limit_follows_the_validation_set(tmp_path):
    limits = CallLimits.for_config(_cfg(tmp_path, "rollout.val_n=4"))
    limits.set_validation(10)
    few = limits.validation_s
    limits.set_validation(5000)
    assert limits.validation_s > few and limits.validation_s.call == "validation"


def test_a_limit_a_call_passed_doubles_and_says_so(tmp_path):
    limits = CallLimits.for_config(_cfg(tmp_path))
    before = _budget(limits.checkpoint_save_s, limits)
    line = limits.grow("checkpoint_save")
    assert _budget(limits.checkpoint_save_s, limits) == pytest.approx(2 * before)
    assert "checkpoint_save limit is 2x its budget" in line
    assert f"({float(limits.checkpoint_save_s):.0f} s)" in line
    limits.grow("checkpoint_save")
    assert _budget(limits.checkpoint_save_s, limits) == pytest.approx(4 * before)
    assert limits.rollout_s == CallLimits.for_config(limits.cfg).rollout_s  # only that one
    update = _budget(limits.update_s(1000), limits)
    assert "update limit is 2x" in limits.grow("update")
    assert _budget(limits.update_s(1000), limits) == pytest.approx(2 * update)


def test_a_limit_is_seconds_that_name_their_call():
    import pickle

    limit = Limit(42.0, "push")
    assert limit == 42.0 and limit.call == "push" and min(limit, 50.0) == 42.0
    again = pickle.loads(pickle.dumps(limit))  # as it goes into a worker's call
    assert again == 42.0 and again.call == "push"


def test_what_a_vllm_kv_cache_holds_at_once():
    def vllm(blocks, block_size=16, max_len=2048, max_seqs=256):
        config = SimpleNamespace(
            cache_config=SimpleNamespace(num_gpu_blocks=blocks, block_size=block_size),
            scheduler_config=SimpleNamespace(max_num_seqs=max_seqs),
            model_config=SimpleNamespace(max_model_len=max_len),
        )
        return SimpleNamespace(llm=SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config)))

    assert concurrent_sequences(vllm(1024)) == 8  # 16384 tokens / 2048
    assert concurrent_sequences(vllm(10**6)) == 256  # max_num_seqs caps it
    assert concurrent_sequences(vllm(10)) == 1  # never below one
    assert concurrent_sequences(vllm(None)) is None  # not sized yet
    assert concurrent_sequences(SimpleNamespace(model=object())) is None  # the HF engine
