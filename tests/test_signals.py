"""Stopping a real run (issue 18): SIGTERM, what schedulers send, behaves like SIGINT (the
step in flight finishes, its checkpoint is written when due, exit 128 + signal) although
``ray.init`` installs its own SIGTERM handler; an unreachable ``ray.address`` fails within
``ray.connect_timeout_s`` naming the address instead of hanging."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from trainer.records.checkpoint import find_latest, verify_checkpoint
from trainer.records.jsonl_files import read_jsonl

SHORT = ["train.batch_size=4", "train.mini_batch_size=2", "rollout.n=4"]


def _first_step_logged(run_dir) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.is_file() and bool(read_jsonl(path, allow_torn_tail=True))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_finishes_the_step_checkpoints_and_exits_128_plus_signal(tmp_path, sig):
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
        deadline = time.monotonic() + 240
        while not _first_step_logged(run_dir):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "no step logged within 240 s"
            time.sleep(0.2)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, err
    assert f"signal {int(sig)}: stopping after this step" in err
    assert "interrupted; the last whole checkpoint stays `latest`" in err
    assert "Traceback" not in err
    steps = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 500
    # The step in flight finished and, save_every being 1, was checkpointed.
    latest = find_latest(run_dir)
    assert latest is not None and latest.name == f"step_{steps[-1]}"
    verify_checkpoint(latest)
    assert not (run_dir / "crossrl.lock").exists()


def test_an_unreachable_ray_address_fails_within_the_timeout(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.cli",
            "train",
            f"run.dir={tmp_path / 'run'}",
            "ray.address=127.0.0.1:1",
            "ray.connect_timeout_s=5",
        ],
        capture_output=True,
        text=True,
        timeout=120,  # it used to run past 9 minutes
    )
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert "ray.address=127.0.0.1:1: no Ray cluster answered (" in err
    assert "waited at most 5 s" in err
    assert "ray.connect_timeout_s" in err and "ray.address=null" in err
