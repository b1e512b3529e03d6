"""End-to-end runs of the CPU default job, short: the run-directory contract, exact resume,
and a controller that stops with the dead worker's name instead of hanging."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from trainer.config import load_config
from trainer.loop.cluster.group import WorkerFailedError
from trainer.loop.schedule.controller import Trainer
from trainer.loop.start import launch
from trainer.loop.start.run import run_training
from trainer.records.checkpoint import LAYOUT, find_latest, read_model_weights, verify_checkpoint
from trainer.records.jsonl_files import read_jsonl
from trainer.records.metrics import REQUIRED_KEYS

pytestmark = pytest.mark.slow

SHORT = ["train.batch_size=4", "train.mini_batch_size=2", "rollout.n=4"]


def _cfg(run_dir: Path, *overrides: str):
    return load_config(None, [*SHORT, f"run.dir={run_dir}", *overrides])


@pytest.mark.smoke
def test_run_directory_contract(local_ray, tmp_path):
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir, "train.total_steps=3", "run.save_every=2", "run.resume=never")
    assert run_training(cfg) == 0

    # config.yaml is the resolved config and loads back as the same config.
    again = load_config(str(run_dir / "config.yaml"), [])
    assert again.flat() == cfg.flat()
    assert "run.deterministic applied" in (run_dir / "config.yaml").read_text()

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        missing = [k for k in REQUIRED_KEYS if k not in m]
        assert not missing, f"metrics.jsonl lacks {missing}"
        assert 0.0 <= m["reward/mean"] <= 1.0
        assert m["batch/num_padding_rows"] == 0 and m["batch/token_efficiency"] == 1.0
        assert m["batch/num_rows"] >= 4 * 4  # >= one row per trajectory
        # peak RSS of the actor's process on the CPU: its model, optimizer and Python at least
        assert 0.05 < m["memory/actor_peak_gb"] < 64

    # Start-up is timed once, on the first line: the total and its phases, workers' included.
    startup = {k: v for k, v in metrics[0].items() if k.startswith("timing/startup")}
    assert startup["timing/startup_s"] > 0
    assert "timing/startup_actor_build_s" in startup  # one process: no ray_init phase
    assert not any(k.startswith("timing/startup") for m in metrics[1:] for k in m)

    fingerprints = read_jsonl(run_dir / "fingerprint.jsonl")
    assert [f["step"] for f in fingerprints] == [1, 2, 3]
    assert all(len(f["plan_digest"]) == 64 for f in fingerprints)

    latest = find_latest(run_dir)
    assert latest is not None and latest.name == "step_3"
    assert (run_dir / "checkpoints" / "step_2").is_dir()
    verify_checkpoint(latest)
    weights = read_model_weights(latest, "actor")
    assert "model.embed_tokens.weight" in weights
    state = json.loads((latest / "trainer_state.json").read_text())
    assert state["step"] == 3


#: Diagnostics that measure float noise themselves: how far the rollout engine's logprobs are
#: from the trainer's (about 1e-8 here). Once in many CI runs their own last bits differed
#: between two runs while every trained quantity (losses, rewards, grad norms, weights'
#: checksum) was equal, so they are compared to 1e-6 instead of exactly.
NOISE_METRICS = ("rollout/logprob_abs_diff", "rollout/logprob_kl")


def _comparable(record: dict) -> dict:
    """What must repeat exactly: everything but time, throughput, memory use and the noise
    diagnostics (``NOISE_METRICS``)."""
    skip = ("timing/", "throughput/", "memory/", *NOISE_METRICS)
    return {k: v for k, v in record.items() if not k.startswith(skip)}


@pytest.mark.smoke
def test_resume_is_exact(local_ray, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_training(_cfg(straight, "train.total_steps=4", "run.resume=never")) == 0
    assert run_training(_cfg(resumed, "train.total_steps=2", "run.resume=never")) == 0
    assert run_training(_cfg(resumed, "train.total_steps=4", "run.resume=auto")) == 0

    a = read_jsonl(straight / "metrics.jsonl")
    b = read_jsonl(resumed / "metrics.jsonl")
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for step in (3, 4):
        assert _comparable(a[step - 1]) == _comparable(b[step - 1]), f"step {step} differs"
        for key in NOISE_METRICS:
            assert a[step - 1][key] == pytest.approx(b[step - 1][key], abs=1e-6), key
    fa = read_jsonl(straight / "fingerprint.jsonl")
    fb = read_jsonl(resumed / "fingerprint.jsonl")
    assert fa[3] == fb[3]


def test_dead_worker_is_named_not_hung(local_ray, tmp_path):
    cfg = _cfg(tmp_path / "run", "train.dp_size=2", "train.total_steps=1", "run.resume=never")
    trainer = Trainer(cfg, Path(cfg.run.dir))
    try:
        launch.start(trainer)
        # Rank 1 dies between steps; in the next step rank 0 is left waiting inside the
        # first collective (the sharded forward's all-gather).
        ray.kill(trainer.actor.handles[1], no_restart=True)
        # The failure names the dead rank as dead: a hung wait would end in wait_all's own
        # timeout instead ("no answer from ... within N s"), which this match rejects.
        with pytest.raises(WorkerFailedError, match="worker actor rank 1 died"):
            trainer.train_step(1)
    finally:
        trainer.shutdown()


def _crossrl(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("train.mini_batch_size=64", "train.mini_batch_size"),
        ("trian.lr=1e-3", "train.lr"),
        ("rollout.temperature=0", "rollout.temperature"),
        ("device=npu", "device"),
    ],
)
@pytest.mark.smoke
def test_bad_config_exits_2_naming_the_key(override, key, tmp_path):
    proc = _crossrl("train", override, f"run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr
    assert key in proc.stderr
    # Validation comes before anything starts: nothing was written.
    assert not (tmp_path / "run").exists()


def test_sigint_stops_cleanly_and_keeps_latest(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainer.cli",
            "train",
            *SHORT,
            f"run.dir={run_dir}",
            "train.total_steps=500",
            "run.save_every=1",
            "run.resume=never",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        deadline = time.monotonic() + 180
        while find_latest(run_dir) is None:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "interrupted" in err
    latest = find_latest(run_dir)
    verify_checkpoint(latest)
    steps = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl", allow_torn_tail=True)]
    assert steps and steps[-1] < 500


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        (
            ["algorithm.adv_estimator=gae", "critic.enable=true", "algorithm.lam=0.95"],
            ["critic/vf_loss", "critic/grad_norm"],
        ),
        (["algorithm.kl_coef=0.01", "algorithm.use_kl_loss=true"], ["actor/kl"]),
        (["algorithm.adv_estimator=reinforce_pp", "algorithm.kl_coef=0.01"], ["advantage/std"]),
        (
            ["algorithm.adv_estimator=rloo", "algorithm.loss_agg=seq-mean-token-sum-norm"],
            ["advantage/std"],
        ),
    ],
    ids=["gae-critic", "kl-loss-reference", "reinforce_pp-kl-penalty", "rloo"],
)
@pytest.mark.smoke
def test_algorithm_variants_train(local_ray, tmp_path, overrides, keys):
    """Critic, reference model and the other estimators run through the same loop."""
    run_dir = tmp_path / "run"
    assert run_training(_cfg(run_dir, "train.total_steps=2", "run.resume=never", *overrides)) == 0
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        for key in [*keys, "actor/loss", "actor/grad_norm"]:
            assert key in m and m[key] is not None and abs(m[key]) < 1e6, key
    assert any(m["actor/grad_norm"] > 0 for m in metrics)
    if "critic.enable=true" in overrides:
        latest = find_latest(run_dir)
        value_head = read_model_weights(latest, "critic")["lm_head.weight"]
        assert value_head.shape[0] == 1  # the critic's own model: one value per token
        assert (latest / LAYOUT.optim_dir("critic")).is_dir()
