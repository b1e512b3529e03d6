"""A run directory has one owner and is never overwritten by accident (issue 18): a second
``crossrl train`` / ``probe`` on a locked directory exits 2 naming the holder, a stale lock of a
dead process is taken over, and ``run.resume=never`` or ``crossrl probe --out`` on a directory
holding a run exits 2 unless ``run.overwrite=true``, leaving every file as it was."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import ray

from trainer.cli import main
from trainer.records.run_dir import LOCK_FILE, RunDirError, RunDirLock, overwrite_problem

GOLDEN_DIR = Path(__file__).parent / "golden"


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _existing_run(root: Path) -> Path:
    """A run directory as a finished run leaves it (config, metrics, a checkpoint)."""
    (root / "checkpoints" / "step_2").mkdir(parents=True)
    (root / "checkpoints" / "step_2" / "actor_model.safetensors").write_bytes(b"\0" * 64)
    (root / "checkpoints" / "latest").write_text("step_2\n")
    (root / "config.yaml").write_text("seed: 1\n")
    (root / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (root / "fingerprint.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    return root


@pytest.fixture
def holder(tmp_path):
    """Another live process that holds the lock on tmp_path / "run"."""
    run_dir = tmp_path / "run"
    code = textwrap.dedent(
        f"""
        import sys, time
        from trainer.records.run_dir import RunDirLock
        with RunDirLock({str(run_dir)!r}, "train"):
            print("locked", flush=True)
            time.sleep(120)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield run_dir, proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_second_train_on_a_locked_run_dir_exits_2_naming_the_holder(holder, capsys):
    run_dir, pid = holder
    before = _snapshot(run_dir)
    assert main(["train", f"run.dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"is in use by crossrl train (pid {pid} on host {socket.gethostname()}" in err
    assert not ray.is_initialized()
    assert _snapshot(run_dir) == before


def test_a_probe_into_a_locked_dir_exits_2(holder, capsys):
    run_dir, pid = holder
    code = main(
        [
            "probe",
            "--config",
            str(GOLDEN_DIR / "tiny_cpu_fp32" / "config.yaml"),
            "--rollouts",
            str(GOLDEN_DIR / "tiny_rollouts"),
            "--steps",
            "1",
            "--out",
            str(run_dir),
        ]
    )
    assert code == 2 and f"pid {pid}" in capsys.readouterr().err


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stale = {"host": socket.gethostname(), "pid": _dead_pid(), "command": "train"}
    (run_dir / LOCK_FILE).write_text(json.dumps(stale))
    with RunDirLock(run_dir, "train") as lock:
        assert lock.took_over["pid"] == stale["pid"]
        mine = json.loads((run_dir / LOCK_FILE).read_text())
        assert mine["pid"] != stale["pid"] and mine["host"] == socket.gethostname()
        with pytest.raises(RunDirError, match="in use by crossrl train"):
            RunDirLock(run_dir, "probe").acquire()  # held: even this process is refused again
    assert not (run_dir / LOCK_FILE).exists(), "the lock outlived its run"


def test_a_lock_from_another_host_is_reported_not_taken(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    other = {"host": "node-17.cluster", "pid": 4242, "command": "train", "since": "today"}
    (run_dir / LOCK_FILE).write_text(json.dumps(other))
    with pytest.raises(RunDirError) as info:
        RunDirLock(run_dir).acquire()
    message = str(info.value)
    assert "pid 4242 on host node-17.cluster" in message and str(run_dir / LOCK_FILE) in message


def test_resume_never_on_a_run_exits_2_and_destroys_nothing(tmp_path, capsys):
    run_dir = _existing_run(tmp_path / "run")
    before = _snapshot(run_dir)
    assert main(["train", f"run.dir={run_dir}", "run.resume=never"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert (
        "already holds a run (config.yaml, metrics.jsonl, fingerprint.jsonl, checkpoints/)" in err
    )
    assert "run.overwrite=true" in err
    assert not ray.is_initialized()
    assert _snapshot(run_dir) == before
    assert not (run_dir / LOCK_FILE).exists()


def test_overwrite_is_the_explicit_key_that_allows_it(tmp_path):
    run_dir = _existing_run(tmp_path / "run")
    assert overwrite_problem(run_dir, resume="never", overwrite=True) is None
    assert overwrite_problem(run_dir, resume="auto", overwrite=False) is None
    assert overwrite_problem(tmp_path / "empty", resume="never", overwrite=False) is None
    assert "already holds a run" in overwrite_problem(run_dir, resume="never", overwrite=False)


def test_probe_out_refuses_a_directory_holding_a_run(tmp_path, capsys):
    run_dir = _existing_run(tmp_path / "run")
    before = _snapshot(run_dir)
    code = main(
        [
            "probe",
            "--config",
            str(GOLDEN_DIR / "tiny_cpu_fp32" / "config.yaml"),
            "--rollouts",
            str(GOLDEN_DIR / "tiny_rollouts"),
            "--steps",
            "1",
            "--out",
            str(run_dir),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert f"--out '{run_dir}' already holds a run" in err and "run.overwrite=true" in err
    assert _snapshot(run_dir) == before
