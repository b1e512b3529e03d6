"""A run that outlives its workers: a training rank or the rollout host killed (kill -9) at a
seeded moment, or a rank hung so its peer waits inside a collective, and the run restarts its
workers, resumes from its last checkpoint and finishes with the fingerprints of an
uninterrupted run; the bounds (``run.max_restarts``) and the call limits that turn hangs into
faults."""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from pathlib import Path

import pytest

import hal
from trainer.config import load_config
from trainer.loop import call_limits
from trainer.loop.call_limits import CallLimits
from trainer.loop.restarts import Restart, Restarts
from trainer.loop.run import closing_summary
from trainer.loop.workers.group import WorkerFailedError, raised_kind

SHORT = ["train.batch_size=4", "train.mini_batch_size=2", "rollout.n=4"]


def _cfg(run_dir: Path, *overrides: str):
    return load_config(None, [*SHORT, f"run.dir={run_dir}", *overrides])


# ---- what restarts, and how often -----------------------------------------------------------


class DistBackendError(RuntimeError):
    """Stands for torch.distributed's error of that name (matched by class name)."""


class Wrapped(RuntimeError):
    """Stands for Ray's RayTaskError, which keeps the worker's error as ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def test_kinds_of_worker_failure_and_which_restart():
    assert raised_kind(ValueError("bad reward")) == "raised"
    assert raised_kind(Wrapped(DistBackendError("gloo timed out"))) == "collective"
    gloo = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out "
    assert raised_kind(Wrapped(RuntimeError(gloo + "waiting 20000ms for send"))) == "collective"
    assert raised_kind(RuntimeError("Timed out waiting for my env")) == "raised"
    assert WorkerFailedError("x", kind="died").restartable
    assert WorkerFailedError("x", kind="hung").restartable
    assert WorkerFailedError("x", kind="collective").restartable
    assert not WorkerFailedError("x").restartable  # a worker's own error would repeat


def test_restarts_are_bounded_and_the_refusal_names_the_key(tmp_path):
    restarts = Restarts(1, tmp_path)
    restarts.current_step = 3
    died = WorkerFailedError("actor.train_mini_batch: worker actor rank 1 died", kind="died")
    first = restarts.take(died)
    assert first is not None and first.number == 1 and first.failed_step == 3
    assert restarts.take(died) is None
    assert "run.max_restarts=1" in restarts.refused(died)
    assert "repeat" in restarts.refused(WorkerFailedError("raised ValueError"))
    assert Restarts(0, tmp_path).take(died) is None  # 0: today's stop


def test_a_restart_resumes_from_the_checkpoint_this_run_committed(tmp_path):
    from trainer.records.checkpoint.store import _write_latest

    cfg = _cfg(tmp_path, "run.resume=never")
    restarts = Restarts(2, tmp_path)
    assert restarts.config(cfg) is cfg  # nothing committed yet: start where the run started
    step = tmp_path / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    _write_latest(tmp_path / "checkpoints", "step_2")
    again = restarts.config(cfg)
    assert again.run.resume == str(step) and again.train == cfg.train
    assert cfg.run.resume == "never"  # the run's own config is unchanged


def test_a_restart_is_recorded_on_the_next_line_and_in_the_summary(tmp_path):
    restart = Restart(1, failed_step=5, error="worker actor rank 1 died", resumed_step=2)
    assert restart.steps_redone == 2
    restart.down_s = 12.5
    assert restart.metrics()["restart/steps_redone"] == 2.0
    text = closing_summary(
        "train",
        tmp_path,
        first_step=3,
        total_steps=6,
        rewards=[0.1, 0.2, 0.3, 0.4],
        wall_s=9.0,
        restarts=[restart.summary()],
    )
    assert "restart 1: at step 5 (worker actor rank 1 died); resumed from step 2" in text
    assert "2 step(s) redone" in text


# ---- hangs become faults --------------------------------------------------------------------


def test_call_limits_follow_the_budgets(tmp_path):
    base = CallLimits.for_config(_cfg(tmp_path))
    longer = CallLimits.for_config(_cfg(tmp_path, "rollout.max_turns=6"))
    slow_env = CallLimits.for_config(_cfg(tmp_path, "rollout.env_timeout_s=600"))
    assert longer.rollout_s > base.rollout_s and slow_env.rollout_s > base.rollout_s
    assert base.update_s(100_000) > base.update_s(1_000)
    quick = CallLimits.for_config(_cfg(tmp_path, "run.collective_timeout_s=30"))
    # every limit sits above the collective timeout: a collective names the hang first
    assert quick.update_s(1) > 30 and quick.rollout_s > 30 and quick.setup_s > 30
    assert quick.update_s(1) < call_limits.SETUP_S  # a small update is not given half an hour


def test_collective_timeout_reaches_each_device_librarys_watchdog():
    assert hal.backend_class("cpu")().collective_timeout_env(90) == {}
    cuda = hal.backend_class("cuda")().collective_timeout_env(90, environ={})
    assert cuda == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    npu = hal.backend_class("npu")()
    assert npu.collective_timeout_env(90.5, environ={})["HCCL_EXEC_TIMEOUT"] == "91"
    mine = {"HCCL_EXEC_TIMEOUT": "0"}  # the user's own value wins
    assert "HCCL_EXEC_TIMEOUT" not in npu.collective_timeout_env(90, environ=mine)


# ---- faults in a real run (dp 2, deterministic) ---------------------------------------------

FAULT_RUN = [
    "train.dp_size=2",
    "train.total_steps=4",
    "run.save_every=2",
    "run.deterministic=true",
    "run.resume=never",
]


@pytest.fixture(scope="module")
def local_ray():
    import ray

    from trainer.loop.workers.group import start_ray

    started = start_ray(None, num_cpus=8)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def straight(local_ray, tmp_path_factory):
    """The uninterrupted run the faulted ones must equal."""
    from trainer.loop.run import run_training

    run_dir = tmp_path_factory.mktemp("straight") / "run"
    started = time.monotonic()
    assert run_training(_cfg(run_dir, *FAULT_RUN)) == 0
    return run_dir, time.monotonic() - started


class Fault:
    """Kills (SIGKILL) a worker process of the first trainer at a seeded random moment of
    ``phase`` (``_rollout`` or ``_update``) of step ``step``, or, with ``hang``, makes
    training rank 1 sleep before that step so rank 0 waits for it inside a collective."""

    def __init__(self, monkeypatch, *, step: int, phase: str, target: str, seed: int) -> None:
        from trainer.loop.controller import Trainer

        self.step, self.target = step, target
        self.delay_s = random.Random(seed).uniform(0.0, 0.5)
        self.fired = threading.Event()
        self.pids: dict[str, int] = {}
        fault = self
        original_start, original_phase = Trainer.start, getattr(Trainer, phase)
        original_step = Trainer.train_step

        def start(trainer) -> None:
            original_start(trainer)
            if not fault.pids:  # the first trainer only: its processes' ids
                fault.pids = fault._pids(trainer)

        def train_step(trainer, step: int):
            if target == "hang" and step == fault.step and not fault.fired.is_set():
                fault.fired.set()
                trainer.actor.handles[1].__ray_call__.remote(lambda self: time.sleep(3600))
            return original_step(trainer, step)

        def in_phase(trainer, *args, **kwargs):
            step = args[-1] if phase == "_update" else args[0]
            if step == fault.step and not fault.fired.is_set() and target != "hang":
                fault.fired.set()
                threading.Thread(target=fault._kill, daemon=True).start()
            return original_phase(trainer, *args, **kwargs)

        monkeypatch.setattr(Trainer, "start", start)
        monkeypatch.setattr(Trainer, "train_step", train_step)
        monkeypatch.setattr(Trainer, phase, in_phase)

    @staticmethod
    def _pids(trainer) -> dict[str, int]:
        import ray

        def pid(self) -> int:
            return os.getpid()

        handles = {"actor rank 1": trainer.actor.handles[1], "rollout host": trainer.rollout}
        return {name: ray.get(h.__ray_call__.remote(pid)) for name, h in handles.items()}

    def _kill(self) -> None:
        time.sleep(self.delay_s)
        os.kill(self.pids[self.target], signal.SIGKILL)


def _fingerprints(run_dir: Path) -> list[dict]:
    from trainer.records.metrics import read_jsonl

    return read_jsonl(run_dir / "fingerprint.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("target", "phase", "step", "extra"),
    [
        ("actor rank 1", "_update", 3, []),  # (b) a training rank mid-update
        ("rollout host", "_rollout", 3, []),  # (c) the rollout host mid-rollout
        ("hang", "_update", 3, ["run.collective_timeout_s=20"]),  # a rank hung
    ],
    ids=["rank-killed", "rollout-host-killed", "rank-hung"],
)
def test_a_lost_or_hung_worker_is_restarted_and_the_run_is_exact(
    straight, monkeypatch, tmp_path, capsys, target, phase, step, extra
):
    from trainer.loop.run import run_training
    from trainer.records.metrics import read_jsonl

    fault = Fault(monkeypatch, step=step, phase=phase, target=target, seed=step)
    run_dir = tmp_path / "run"
    started = time.monotonic()
    assert run_training(_cfg(run_dir, *FAULT_RUN, *extra)) == 0
    wall_s = time.monotonic() - started
    assert fault.fired.is_set()
    err = capsys.readouterr().err
    assert "restarting the workers (1 of run.max_restarts=2)" in err
    # the seeded moment may fall in step 3 or, the steps being short, in step 4
    assert re.search(r"restart 1: at step [34] \(.*\); resumed from step 2", err), err
    if target == "hang":
        assert "collective" in err.lower() or "timed out" in err.lower(), err
    assert _fingerprints(run_dir) == _fingerprints(straight[0])
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[2]["restart/count"] == 1 and metrics[2]["restart/steps_redone"] in (0, 1)
    print(f"{target}: {wall_s - straight[1]:.1f} s lost ({metrics[2]['restart/down_s']:.1f} s down)")


@pytest.mark.slow
def test_max_restarts_0_stops_at_the_first_lost_worker(local_ray, monkeypatch, tmp_path, capsys):
    from trainer.loop.run import run_training

    Fault(monkeypatch, step=1, phase="_update", target="actor rank 1", seed=0)
    cfg = _cfg(tmp_path / "run", *FAULT_RUN, "run.max_restarts=0")
    assert run_training(cfg) == 1
    err = capsys.readouterr().err
    assert "worker actor rank 1 died" in err and "run.max_restarts=0" in err
