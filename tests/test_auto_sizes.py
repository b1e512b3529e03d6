"""``train.max_tokens_per_micro_batch: auto`` and ``train.activation_checkpointing: auto``: the
memory budget chooses them before start-up (``trainer.loop.plan.auto_sizes``), against the
same budget ``crossrl layout`` prints and the preflight checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainer.cli import main
from trainer.config import load_config
from trainer.loop.plan.auto_sizes import (
    EFFICIENT_TOKENS,
    FILL,
    STEP_TOKENS,
    AutoSizes,
    resolve_auto_sizes,
)
from trainer.loop.plan.memory_budget import budget_for
from trainer.loop.plan.memory_report import memory_problem

ROOT = Path(__file__).resolve().parents[1]
AUTO = ["train.max_tokens_per_micro_batch=auto", "train.activation_checkpointing=auto"]


def _config(name: str, *overrides: str):
    return load_config(str(ROOT / "configs" / name), list(overrides), check_environment=False)


def _on(device_gb: float):
    """The budget of a plain config on one CUDA device of ``device_gb`` GB."""
    return lambda cfg: budget_for(cfg, "cuda", device_gb * 1e9, f"{device_gb} GB")


def _update(cfg, device_gb: float) -> float:
    """The update's bytes as the device's allocator reserves them (``MemoryBudget.reserved``)."""
    return _on(device_gb)(cfg).reserved("update")


def _with(cfg, tokens, checkpointing: bool):
    return AutoSizes(tokens, checkpointing, "").apply(cfg)


def test_a_roomy_device_takes_the_largest_micro_batch_without_checkpointing():
    """1.5B on 80 GB: checkpointing off, the largest micro-batch whose update, as reserved,
    fits FILL of the device, and one STEP_TOKENS more would not."""
    cfg = _config("gpu/qwen2.5-1.5b-grpo.yaml", *AUTO)
    sized, note = resolve_auto_sizes(cfg, _on(80))
    tokens = sized.train.max_tokens_per_micro_batch
    assert sized.train.activation_checkpointing is False and tokens >= EFFICIENT_TOKENS
    assert tokens % STEP_TOKENS == 0
    assert _update(sized, 80) <= FILL * 80e9 < _update(_with(cfg, tokens + STEP_TOKENS, False), 80)
    assert note == (
        f"auto sizes from the memory budget: train.max_tokens_per_micro_batch={tokens}, "
        "train.activation_checkpointing=false; the update within 90% of 80.0 GB (80 GB) as "
        "reserved (tensors x 1.20)"
    )
    assert memory_problem(_on(80)(sized), sized) is None  # the preflight takes it


def test_a_tight_device_turns_checkpointing_on_for_an_efficient_micro_batch():
    """7B PPO (actor and critic) on 80 GB: without checkpointing no micro-batch of
    EFFICIENT_TOKENS fits, so it goes on, with the largest micro-batch that fits with it."""
    cfg = _config("gpu/qwen2.5-7b-ppo.yaml", *AUTO)
    sized, _ = resolve_auto_sizes(cfg, _on(80))
    tokens = sized.train.max_tokens_per_micro_batch
    assert sized.train.activation_checkpointing is True
    assert _update(_with(cfg, EFFICIENT_TOKENS, False), 80) > FILL * 80e9
    assert _update(sized, 80) <= FILL * 80e9 < _update(_with(cfg, tokens + STEP_TOKENS, True), 80)


def test_the_whole_mini_batch_when_it_fits():
    """The default job's tiny model: a rank's whole mini-batch (null), no checkpointing."""
    cfg = load_config(None, AUTO, check_environment=False)
    sized, note = resolve_auto_sizes(cfg, _on(80))
    assert sized.train.max_tokens_per_micro_batch is None
    assert sized.train.activation_checkpointing is False
    assert "train.max_tokens_per_micro_batch=null (a rank's whole mini-batch)" in note


def test_a_set_key_keeps_its_value():
    cfg = _config("gpu/qwen2.5-7b-ppo.yaml", "train.activation_checkpointing=auto")
    assert cfg.train.max_tokens_per_micro_batch == 16384  # the config's own
    sized, note = resolve_auto_sizes(cfg, _on(80))
    assert sized.train.max_tokens_per_micro_batch == 16384
    assert sized.train.activation_checkpointing is True
    assert "max_tokens_per_micro_batch" not in note
    plain = _config("gpu/qwen2.5-7b-ppo.yaml")
    assert resolve_auto_sizes(plain, _on(80)) == (plain, None)


def test_nothing_fits_the_smallest_with_checkpointing_and_the_preflight_says_so():
    cfg = _config("gpu/qwen2.5-7b-ppo.yaml", *AUTO)
    sized, _ = resolve_auto_sizes(cfg, _on(20))
    row = cfg.rollout.max_input_len + cfg.rollout.max_new_tokens
    assert (sized.train.max_tokens_per_micro_batch, sized.train.activation_checkpointing) == (
        row,
        True,
    )
    problem = memory_problem(_on(20)(sized), sized)
    assert problem is not None and problem.startswith("memory: the ")


@pytest.mark.parametrize(
    "value, said",
    [
        ("train.max_tokens_per_micro_batch=big", "input should be a valid integer, or input "),
        ("train.activation_checkpointing=maybe", "input should be a valid boolean, or input "),
    ],
)
def test_a_bad_value_is_one_problem_naming_auto(value, said, capsys):
    assert main(["layout", value]) == 2
    err = capsys.readouterr().err
    assert said + "should be 'auto'" in err and "more problem" not in err


def test_crossrl_layout_prints_the_choice(capsys):
    args = ["--config", str(ROOT / "configs/gpu/qwen2.5-1.5b-grpo.yaml"), *AUTO]
    assert main(["layout", "--device-memory-gb", "80", *args]) == 0
    out = capsys.readouterr().out
    assert "auto sizes from the memory budget: train.max_tokens_per_micro_batch=" in out
    assert "train.activation_checkpointing=false; the update within 90% of 80.0 GB" in out


def test_a_run_resolves_them_before_start_up_and_records_the_values(tmp_path, capsys):
    run_dir = tmp_path / "run"
    short = ["train.batch_size=4", "train.mini_batch_size=2", "rollout.n=4", "train.total_steps=1"]
    assert main(["train", *short, *AUTO, f"run.dir={run_dir}"]) == 0
    assert "crossrl train: auto sizes from the memory budget:" in capsys.readouterr().err
    train = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]
    assert train["max_tokens_per_micro_batch"] is None  # the host's RAM holds it all
    assert train["activation_checkpointing"] is False


def test_compiled_blocks_refuse_checkpointing_chosen_by_auto(capsys):
    """7B PPO on 80 GB: ``auto`` turns checkpointing on; beside ``train.compile_blocks`` that
    is refused before start-up in one line naming both keys, as the explicit pair is
    (``tests/test_config_errors.py``); with checkpointing set off the job sizes itself."""
    from trainer.config import ConfigError

    compiled = ["train.compile_blocks=true", "run.deterministic=false"]
    cfg = _config("gpu/qwen2.5-7b-ppo.yaml", *AUTO, *compiled)
    with pytest.raises(ConfigError) as info:
        resolve_auto_sizes(cfg, _on(80))
    assert info.value.key == "train.compile_blocks"
    assert "train.activation_checkpointing=auto, which the memory budget chose true" in str(
        info.value
    )
    args = ["--config", str(ROOT / "configs/gpu/qwen2.5-7b-ppo.yaml"), *AUTO, *compiled]
    assert main(["layout", "--device-memory-gb", "80", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.compile_blocks" in err[0], err
    off = _config(
        "gpu/qwen2.5-7b-ppo.yaml", AUTO[0], *compiled, "train.activation_checkpointing=false"
    )
    sized, _ = resolve_auto_sizes(off, _on(80))
    assert sized.train.activation_checkpointing is False


def test_the_reserve_sizes_the_micro_batch_below_the_allocated_rule_and_it_fits():
    """The H100 tier measured 1.20 bytes reserved per byte allocated: against reserved bytes
    (and the fused head's accumulator) the 1.5B job's auto micro-batch is smaller than the
    rule before issue 56 (85 % of the allocated estimate, about 102 % of the device as
    reserved), and the chosen size's update times the reserve fits the device."""
    from dataclasses import replace

    from hal.device_memory import allocator_reserve
    from trainer.loop.plan import auto_sizes

    cfg = _config("gpu/qwen2.5-1.5b-grpo.yaml", *AUTO)
    sized, _ = resolve_auto_sizes(cfg, _on(80))
    budget = _on(80)(sized)
    assert budget.allocator_reserve == allocator_reserve("cuda") == 1.20
    update = budget.phase("update")
    assert update.parts["kernel"] > 0  # the fused head's fp32 accumulator, counted
    assert budget.allocator_reserve * update.total <= 80e9
    before = auto_sizes.choose_sizes(
        cfg.model_copy(deep=True),
        lambda trial: replace(
            _on(80)(trial),
            allocator_reserve=auto_sizes.FILL / 0.85,  # 0.85 of the allocated estimate
            phases=tuple(
                replace(p, parts={**p.parts, "kernel": 0.0}) for p in _on(80)(trial).phases
            ),
        ),
    )
    assert sized.train.max_tokens_per_micro_batch < before.tokens
    assert (
        1.20 * _on(80)(AutoSizes(before.tokens, False, "").apply(cfg)).phase("update").total > 80e9
    )  # what the allocated rule chose overfills the device as reserved
