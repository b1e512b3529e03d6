"""`crossrl probe` on the CPU: the committed recording replayed through the real trainer
(Ray workers, FSDP2 over gloo) matches the golden fingerprints, agrees with itself across dp
sizes 1, 2 and 4 (the 8-GPU vs 16-NPU layout difference in miniature), and a planted
learning-rate change is caught at the step and field where it first acts."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from trainer.cli import main as cli_main
from trainer.commands.parity import DEFAULT_TOLERANCES, compare_runs, read_run
from trainer.commands.probe import probe_config, run_probe
from trainer.config import load_config
from trainer.loop.cluster.group import WorkerFailedError, agree_on_settings, start_ray
from trainer.records.jsonl_files import read_jsonl

GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN = GOLDEN_DIR / "tiny_cpu_fp32"
ROLLOUTS = GOLDEN_DIR / "tiny_rollouts"
CONFIG = str(GOLDEN / "config.yaml")  # the config the golden probe ran with
STEPS = 3

#: What a learning-rate change cannot touch at step 1: the plan, the recorded rows, and the
#: logprobs before the first optimizer step.
LR_INDEPENDENT = (
    "plan_digest",
    "mini_batch_rows",
    "mini_batch_tokens",
    "mini_batch_loss_tokens",
    "reward_mean",
    "old_logprob_mean",
)


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """Probe runs of the golden recording, one Ray for all of them."""
    started = start_ray(None, num_cpus=8)
    root = tmp_path_factory.mktemp("probes")
    layouts = {
        "dp1": [],
        "dp2": ["train.dp_size=2"],
        "dp4": ["train.dp_size=4", "train.max_tokens_per_micro_batch=512"],
        "lr": ["train.lr=4.0e-3"],  # planted: one digit of the golden lr 3.0e-3
        # old log-probs of the first mini-batch from a separate pass instead of its update
        "old_pass": ["train.old_logprobs_from_update=false"],
        "epochs2": ["train.ppo_epochs=2"],
        "epochs2_old_pass": ["train.ppo_epochs=2", "train.old_logprobs_from_update=false"],
    }
    out = {}
    try:
        for name, overrides in layouts.items():
            cfg = probe_config(CONFIG, overrides, rollouts=ROLLOUTS, steps=STEPS, out=root / name)
            assert run_probe(cfg, ROLLOUTS) == 0, f"probe {name} failed"
            out[name] = root / name
        yield out
    finally:
        if started:
            ray.shutdown()


@pytest.mark.slow
def test_cpu_probe_matches_golden(probes):
    report = compare_runs(GOLDEN, probes["dp1"])
    assert report.tolerance == DEFAULT_TOLERANCES["float32"]
    assert report.agree, [c for c in report.comparisons if not c.ok]
    assert {c.step for c in report.comparisons} == set(range(1, STEPS + 1))
    # Every step carried a checksum (run.fingerprint_every=1) and it was compared.
    assert {c.step for c in report.comparisons if c.field.startswith("param_checksum")} == {1, 2, 3}


@pytest.mark.slow
def test_probe_run_directory(probes):
    run = probes["dp1"]
    assert (run / "metrics.jsonl").is_file() and (run / "config.yaml").is_file()
    assert not (run / "checkpoints").exists()  # a probe is for fingerprints only
    cfg = load_config(str(run / "config.yaml"), [])
    assert cfg.train.total_steps == STEPS and cfg.run.resume == "never"


@pytest.mark.slow
def test_dp_sizes_agree(probes):
    runs = {name: read_run(probes[name]) for name in ("dp1", "dp2", "dp4")}
    assert [r.setting("train.dp_size") for r in runs.values()] == [1, 2, 4]
    for a, b in (("dp1", "dp2"), ("dp1", "dp4"), ("dp2", "dp4")):
        report = compare_runs(runs[a], runs[b])
        assert report.agree, (a, b, [c for c in report.comparisons if not c.ok])
        assert not report.notes  # dp size and micro-batch budget are layout, not the job
        digests = [c for c in report.comparisons if c.field == "plan_digest"]
        assert len(digests) == STEPS and all(c.a == c.b for c in digests)


def _lines(run: Path, name: str) -> list[str]:
    return (run / name).read_text().splitlines()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("update", "separate"), [("dp1", "old_pass"), ("epochs2", "epochs2_old_pass")]
)
def test_old_logprobs_from_the_update_are_those_of_a_separate_pass(probes, update, separate):
    """The first update runs on the weights that sampled its rows, so its forward's log-probs
    are the old log-probs a separate pass computes: the same fingerprints to the last bit
    (old log-probs, losses, gradient norms, parameter checksums), also when later epochs
    read the stored ones, and the same engine-vs-trainer metrics."""
    assert _lines(probes[update], "fingerprint.jsonl") == _lines(
        probes[separate], "fingerprint.jsonl"
    )
    for a, b in zip(
        read_jsonl(probes[update] / "metrics.jsonl"), read_jsonl(probes[separate] / "metrics.jsonl")
    ):
        for key in ("rollout/logprob_abs_diff", "rollout/logprob_kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-15), key


@pytest.mark.slow
def test_planted_lr_change_is_caught_where_it_first_acts(probes, capsys):
    report = compare_runs(probes["dp1"], probes["lr"])
    assert not report.agree
    first = report.first_divergence
    # Step 1's second mini-batch is the first computation that sees lr: it runs on weights the
    # first optimizer step moved. Everything computed before it must still agree.
    assert (first.step, first.field) == (1, "new_logprob_mean")
    step1 = {c.field: c for c in report.comparisons if c.step == 1}
    for name in LR_INDEPENDENT:
        assert step1[name].ok, name
    # The update itself (loss, KL to the old policy) is off by far more than the tolerance.
    for name in ("actor_loss", "actor_approx_kl", "actor_grad_norm"):
        assert step1[name].diff > 30 * step1[name].allowed, name
    # The report also points at the config key that makes these two different jobs.
    assert any("train.lr" in note for note in report.notes)
    assert cli_main(["parity", str(probes["dp1"]), str(probes["lr"])]) == 1
    assert "first divergence at step 1, field new_logprob_mean" in capsys.readouterr().out


@pytest.mark.slow
def test_deterministic_settings_recorded(probes):
    text = (probes["dp2"] / "config.yaml").read_text()
    assert "# run.deterministic applied on every worker:" in text
    assert "#   torch.use_deterministic_algorithms=True" in text
    # and what each role's ops ran (hal.kernels): the CPU's reference set
    assert "# kernels (train.kernels), per role, as its ranks chose them:" in text
    assert (
        "#   actor: rms_norm=reference, swiglu=reference, rope=reference, "
        "moe_experts=reference, lm_head=reference, optimizer=reference, compile=reference "
        "(train.compile_blocks=false)" in text
    )
    assert load_config(str(probes["dp2"] / "config.yaml"), []).run.deterministic is True


def test_deterministic_check_names_the_odd_process():
    same = {"seed": "1", "torch.use_deterministic_algorithms": "True"}
    assert agree_on_settings([("actor rank 0", same), ("actor rank 1", same)]) == same
    with pytest.raises(WorkerFailedError, match="actor rank 1"):
        agree_on_settings([("actor rank 0", same), ("actor rank 1", {})])
    # the rollout engine's process is held to the same settings
    with pytest.raises(WorkerFailedError, match="rollout host"):
        agree_on_settings([("actor rank 0", same), ("rollout host", {})])


# --------------------------------------------------------------------------- bad input: exit 2


def _probe_cli(tmp_path, *args: str) -> int:
    return cli_main(["probe", "--config", CONFIG, "--out", str(tmp_path / "out"), *args])


def test_probe_missing_rollouts_dir(tmp_path, capsys):
    assert _probe_cli(tmp_path, "--rollouts", str(tmp_path / "none"), "--steps", "1") == 2
    assert "--rollouts" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_probe_too_few_recorded_steps(tmp_path, capsys):
    assert _probe_cli(tmp_path, "--rollouts", str(ROLLOUTS), "--steps", "5") == 2
    err = capsys.readouterr().err
    assert "step_4.npz" in err and "steps 1..3" in err


def test_probe_bad_config(tmp_path, capsys):
    assert _probe_cli(tmp_path, "--rollouts", str(ROLLOUTS), "--steps", "1", "trian.lr=1") == 2
    assert "train.lr" in capsys.readouterr().err  # the config layer suggests the right key


def test_probe_recording_of_another_job(tmp_path, capsys):
    assert (
        _probe_cli(
            tmp_path,
            "--rollouts",
            str(ROLLOUTS),
            "--steps",
            "1",
            "train.batch_size=8",
            "train.mini_batch_size=2",
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "train.batch_size=8" in err and "4 prompt groups" in err
