"""`crossrl parity`: comparing two runs' fingerprints (no training here; see
test_parity_probe.py for real probes)."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rollout.replay import load_rollout, record_rollout, recorded_steps
from trainer.cli import main as cli_main
from trainer.commands.parity import (
    DEFAULT_TOLERANCES,
    ParityInputError,
    compare_runs,
    format_report,
    read_run,
    tolerance_used_by_field,
)
from trainer.records.fingerprint import (
    combine_param_stats,
    local_param_stats,
    tracked_parameter_names,
)

GOLDEN = Path(__file__).parent / "golden" / "tiny_cpu_fp32"


def _write_run(path: Path, records: list[dict], dtype: str = "float32", dp: int = 1) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "fingerprint.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (path / "config.yaml").write_text(
        f"device: cpu\ntrain:\n  param_dtype: {dtype}\n  dp_size: {dp}\n"
        f"run:\n  deterministic: true\n# run.deterministic applied on every worker:\n#   seed=1\n"
    )
    return path


def _golden_records() -> list[dict]:
    return [json.loads(line) for line in (GOLDEN / "fingerprint.jsonl").read_text().splitlines()]


def _copy_with(tmp_path: Path, name: str, edit=None, dtype: str = "float32", dp: int = 1) -> Path:
    records = copy.deepcopy(_golden_records())
    if edit is not None:
        edit(records)
    return _write_run(tmp_path / name, records, dtype=dtype, dp=dp)


def test_identical_runs_agree_and_report_counts(tmp_path):
    a = _copy_with(tmp_path, "a")
    b = _copy_with(tmp_path, "b", dp=8)  # another dp size: same fingerprints expected
    report = compare_runs(a, b)
    assert report.agree and report.first_divergence is None
    steps = {c.step for c in report.comparisons}
    assert steps == {r["step"] for r in _golden_records()}
    fields = {c.field for c in report.comparisons}
    assert {
        "plan_digest",
        "mini_batch_loss_tokens",
        "old_logprob_mean",
        "actor_grad_norm",
        "param_checksum.__all__.sq",
    } <= fields
    assert not report.notes  # dp size is a layout key: still the same job
    text = format_report(report)
    assert "AGREE" in text and "train.dp_size=8" in text


def test_small_float_noise_is_within_fp32_tolerance(tmp_path):
    def nudge(records):
        for r in records:
            r["actor_grad_norm"] *= 1 + 3e-6
            r["param_checksum"]["__all__"]["sq"] *= 1 - 2e-6

    report = compare_runs(_copy_with(tmp_path, "a"), _copy_with(tmp_path, "b", nudge))
    assert report.agree


def test_first_divergence_names_step_and_field(tmp_path):
    def plant(records):
        records[1]["new_logprob_mean"] += 1e-2  # step 2
        records[2]["actor_loss"] += 1.0  # step 3, later

    report = compare_runs(_copy_with(tmp_path, "a"), _copy_with(tmp_path, "b", plant))
    assert not report.agree
    first = report.first_divergence
    assert (first.step, first.field) == (2, "new_logprob_mean")
    assert first.diff == pytest.approx(1e-2, rel=1e-6)
    assert first.diff > first.allowed
    text = format_report(report, only_failures=True)
    assert "first divergence at step 2, field new_logprob_mean" in text
    assert "actor_loss" in text  # the later failure is listed too
    assert "old_logprob_mean" not in text  # agreeing rows are left out with only_failures


def test_plan_digest_must_match_exactly(tmp_path):
    def other_plan(records):
        records[0]["plan_digest"] = "0" * 64

    report = compare_runs(
        _copy_with(tmp_path, "a"), _copy_with(tmp_path, "b", other_plan), rtol=1.0, atol=1.0
    )  # no tolerance excuses a different plan
    assert (report.first_divergence.step, report.first_divergence.field) == (1, "plan_digest")


def test_loss_token_counts_must_match_exactly(tmp_path):
    def one_token_more(records):
        records[2]["mini_batch_loss_tokens"][1] += 1

    report = compare_runs(
        _copy_with(tmp_path, "a"), _copy_with(tmp_path, "b", one_token_more), rtol=1.0, atol=1.0
    )
    assert (report.first_divergence.step, report.first_divergence.field) == (
        3,
        "mini_batch_loss_tokens",
    )


def test_checksum_sum_is_judged_at_the_scale_of_magnitudes(tmp_path):
    """A sum near 0 of values whose magnitudes add to ~100 may move by rtol * 100."""
    name = "model.layers.0.self_attn.q_proj.weight"

    def shift(delta):
        def edit(records):
            entry = records[0]["param_checksum"][name]
            entry["sum"] = 0.05 + delta
            entry["abs"] = 100.0

        return edit

    a = _copy_with(tmp_path, "a", shift(0.0))
    within = _copy_with(tmp_path, "b", shift(0.5 * 1e-4 * 100.0))
    beyond = _copy_with(tmp_path, "c", shift(3 * 1e-4 * 100.0))
    assert compare_runs(a, within).agree
    report = compare_runs(a, beyond)
    assert report.first_divergence.field == f"param_checksum.{name}.sum"


def test_bf16_run_gets_the_looser_tolerance(tmp_path):
    def bf16_noise(records):
        for r in records:
            r["actor_grad_norm"] *= 1.01  # 1 %: bf16-sized, far beyond fp32

    a = _copy_with(tmp_path, "a")
    b32 = _copy_with(tmp_path, "b32", bf16_noise)
    b16 = _copy_with(tmp_path, "b16", bf16_noise, dtype="bfloat16")
    assert not compare_runs(a, b32).agree
    report = compare_runs(a, b16)
    assert report.agree
    assert report.tolerance == DEFAULT_TOLERANCES["bfloat16"]
    assert "float32 vs bfloat16" in report.tolerance_source
    assert any("train.param_dtype" in note for note in report.notes)
    # An explicit tolerance overrides the dtype default.
    assert not compare_runs(a, b16, rtol=1e-6, atol=0).agree
    assert compare_runs(a, b32, rtol=0.02).agree


def test_missing_and_extra_steps(tmp_path):
    a = _copy_with(tmp_path, "a")
    short = _copy_with(tmp_path, "short", lambda records: records.pop())
    report = compare_runs(a, short)
    assert not report.agree
    assert report.first_divergence.step == 3
    assert any("no fingerprint" in note for note in report.notes)
    # Restricting to the common steps makes them agree; asking for more is bad input.
    assert compare_runs(a, short, steps=2).agree
    with pytest.raises(ParityInputError, match="lower --steps"):
        compare_runs(a, short, steps=3)


def test_checksum_cadence_may_differ(tmp_path):
    def drop_checksums(records):
        for r in records[:2]:
            del r["param_checksum"]

    report = compare_runs(_copy_with(tmp_path, "a"), _copy_with(tmp_path, "b", drop_checksums))
    assert report.agree
    assert any(c.field.startswith("param_checksum") and c.step == 3 for c in report.comparisons)
    assert not any(c.field.startswith("param_checksum") and c.step == 1 for c in report.comparisons)


def test_non_finite_values(tmp_path):
    def nan_loss(records):
        records[0]["actor_loss"] = None

    a = _copy_with(tmp_path, "a", nan_loss)
    assert compare_runs(a, _copy_with(tmp_path, "b", nan_loss)).agree
    report = compare_runs(a, _copy_with(tmp_path, "c"))
    assert report.first_divergence.field == "actor_loss"


@pytest.mark.parametrize("breakage", ["no_dir", "no_file", "torn", "no_config", "bad_dtype"])
def test_unreadable_input_raises(tmp_path, breakage):
    good = _copy_with(tmp_path, "good")
    bad = _copy_with(tmp_path, "bad")
    if breakage == "no_dir":
        shutil.rmtree(bad)
    elif breakage == "no_file":
        (bad / "fingerprint.jsonl").unlink()
    elif breakage == "torn":
        with open(bad / "fingerprint.jsonl", "a") as fh:
            fh.write('{"step": 4, "plan_dig')
    elif breakage == "no_config":
        (bad / "config.yaml").unlink()
    else:
        (bad / "config.yaml").write_text("train:\n  param_dtype: float8\n")
    with pytest.raises(ParityInputError, match=str(bad.name)):
        compare_runs(good, bad)
    if breakage in ("no_config", "bad_dtype"):  # explicit tolerances need no config
        assert compare_runs(good, bad, rtol=1e-4, atol=1e-6).agree


def test_cli_exit_codes(tmp_path, capsys):
    a = _copy_with(tmp_path, "a")
    b = _copy_with(tmp_path, "b", lambda records: records[1].update(actor_loss=5.0))
    assert cli_main(["parity", str(a), str(a)]) == 0
    assert "AGREE" in capsys.readouterr().out
    assert cli_main(["parity", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "first divergence at step 2, field actor_loss" in out
    assert cli_main(["parity", str(a), str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err
    assert cli_main(["parity", str(a), str(b), "--rtol", "-1"]) == 2
    assert cli_main(["parity", str(a), str(b), "--atol", "10"]) == 0


def test_cli_runs_as_a_program(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "parity", str(GOLDEN), str(GOLDEN)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "AGREE" in proc.stdout


def test_read_run_rejects_repeated_steps(tmp_path):
    records = _golden_records()
    bad = _write_run(tmp_path / "bad", [records[0], records[0]])
    with pytest.raises(ParityInputError, match="repeated"):
        read_run(bad)


# --------------------------------------------------------------------------- checksums


def test_checksum_shares_add_up_to_the_whole_model():
    """Sharded sums (what dp ranks report) add up to the unsharded model's sums."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    named = list(model.named_parameters())
    whole = combine_param_stats([local_param_stats(named)])
    # Split every parameter into 3 uneven row shards, as FSDP2 does over 3 ranks.
    shards = [[], [], []]
    for name, p in named:
        for rank, piece in enumerate(torch.tensor_split(p.detach(), 3, dim=0)):
            shards[rank].append((name, piece))
    split = combine_param_stats([local_param_stats(s) for s in shards])
    assert whole.keys() == split.keys()
    for name in whole:
        for key, value in whole[name].items():
            assert split[name][key] == pytest.approx(value, rel=1e-12, abs=1e-12)
    flat = torch.cat([p.detach().double().reshape(-1) for _, p in named])
    assert whole["__all__"]["sum"] == pytest.approx(float(flat.sum()), rel=1e-12)
    # Squares are taken in float32 (1 ulp each), the sums in float64.
    assert whole["__all__"]["sq"] == pytest.approx(float(flat.square().sum()), rel=1e-6)
    assert whole["__all__"]["abs"] == pytest.approx(float(flat.abs().sum()), rel=1e-12)


def test_tracked_parameters_skip_biases_and_span_the_model():
    names = [
        f"model.layers.{i}.{part}"
        for i in range(12)
        for part in ("attn.k_proj.bias", "attn.k_proj.weight", "mlp.weight")
    ]
    names += ["model.embed_tokens.weight", "lm_head.weight"]
    tracked = tracked_parameter_names(names, max_tracked=8)
    assert len(tracked) == 8 and not any(n.endswith("bias") for n in tracked)
    weights = sorted(n for n in names if n.endswith("weight"))
    assert tracked[0] == weights[0] and tracked[-1] == weights[-1]
    assert tracked == sorted(tracked)


# --------------------------------------------------------------------------- recordings


def test_recorded_rollouts_round_trip_without_pickle(tmp_path):
    arrays = {
        "token/input_ids": np.arange(50, dtype=np.int64),
        "row/is_padding": np.zeros(3, dtype=bool),
        "token/loss_mask": np.ones(50, dtype=np.float32),
    }
    path = record_rollout(tmp_path / "rollouts", 7, arrays)
    assert path.name == "step_7.npz"
    record_rollout(tmp_path / "rollouts", 10, arrays)
    (tmp_path / "rollouts" / "step_x.npz").write_bytes(b"")
    assert recorded_steps(tmp_path / "rollouts") == [7, 10]
    back = load_rollout(path)
    assert back.keys() == arrays.keys()
    for key, value in arrays.items():
        assert back[key].dtype == value.dtype and np.array_equal(back[key], value)


def test_report_shows_share_of_tolerance_used(tmp_path):
    def nudge(records):
        records[0]["actor_loss"] += 1e-6  # well inside the float32 tolerance

    report = compare_runs(_copy_with(tmp_path, "a"), _copy_with(tmp_path, "b", nudge))
    assert report.agree
    used = tolerance_used_by_field(report.comparisons)
    loss = next(c for c in report.comparisons if c.field == "actor_loss" and c.step == 1)
    assert used["actor_loss"] == pytest.approx(loss.diff / loss.allowed)
    assert 0 < used["actor_loss"] < 1
    assert used["old_logprob_mean"] == 0.0
    assert "largest share of the tolerance used, per field:" in format_report(report)


def test_key_missing_from_an_older_config_counts_as_its_default(tmp_path):
    """A run recorded before a config key existed is still the same job as one that writes
    the key's default; a non-default value is still reported."""
    a = _copy_with(tmp_path, "a")  # config.yaml without train.activation_checkpointing
    b = _copy_with(tmp_path, "b")
    config = (b / "config.yaml").read_text()
    (b / "config.yaml").write_text(
        config.replace("train:\n", "train:\n  activation_checkpointing: false\n")
        + "rollout:\n  stop_strings: []\n"
    )
    assert compare_runs(a, b).notes == []
    (b / "config.yaml").write_text(
        config.replace("train:\n", "train:\n  activation_checkpointing: true\n")
    )
    notes = compare_runs(a, b).notes
    assert len(notes) == 1 and "train.activation_checkpointing" in notes[0]
