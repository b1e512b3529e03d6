"""Restarts decide by what happened, at every remote call the controller makes (issue 45 item
7): a process gone, an object lost with it, a collective broken (in the words of the device's
library, which the HAL's backends know), a time limit passed; and a worker's own error stops
the run in one line.

First the decision itself, on Ray's and torch's real errors (fast); then faults injected into
a real dp-2 run (Ray, deterministic, 4 steps, a checkpoint at step 2) at the weight push, the
batch's fetch, the checkpoint and the validation: a process killed (SIGKILL) or an error
raised inside the worker's own process, once, on the run's first start."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from bench.faults import FAULT_JOB, _pid  # _pid: importable where the workers run
from trainer.config import load_config
from trainer.loop.cluster.faults import describe, fault_kind
from trainer.loop.cluster.group import WorkerFailedError, worker_failure
from trainer.loop.plan import call_limits
from trainer.loop.start.restarts import Restarts, as_worker_failure

SHORT = ["train.batch_size=4", "train.mini_batch_size=2", "rollout.n=4"]
FAULT_RUN = [*FAULT_JOB, "train.total_steps=4", "run.save_every=2"]
#: What a rank's checkpoint write (``save_pieces``) writes its shards with.
SAVE_SHARDS = "trainer.records.checkpoint:save_sharded"

#: What torch_npu raises when HCCL reports a timed-out operator (HCCL_CHECK_ERROR's words):
#: a plain RuntimeError, no torch.distributed class.
HCCL_TIMEOUT = (
    "save_pieces:build/CMakeFiles/torch_npu.dir/compiler_depend.ts:2060 HCCL function error: "
    "HcclAllGather(inputPtr, outputPtr, numel, dataType, comm, stream), error code is 9\n"
    "[ERROR] 2026-11-28-00:00:00 (PID:4242, Device:1, RankID:1) ERR02200 DIST call hccl api "
    "failed.\nEI0002: The wait execution of the Notify register times out."
)


def _task_error(cause: BaseException, function: str = "load_batch"):
    """What ``ray.get`` raises on the driver when a worker's task raised ``cause``."""
    import ray

    return ray.exceptions.RayTaskError(function, "Traceback ...", cause).as_instanceof_cause()


# ---- the decision -----------------------------------------------------------------------


def test_what_happened_decides_not_the_class_name():
    import ray
    from torch.distributed import DistBackendError, DistNetworkError

    owner_gone = ray.exceptions.OwnerDiedError("ab" * 14, None, "")
    assert fault_kind(_task_error(owner_gone)) == "lost"  # a node lost during the batch's fetch
    assert fault_kind(ray.exceptions.ActorDiedError()) == "died"
    assert fault_kind(_task_error(ray.exceptions.ActorDiedError(), "push_weights")) == "died"
    assert fault_kind(ray.exceptions.NodeDiedError("node gone")) == "died"
    assert fault_kind(_task_error(ray.exceptions.GetTimeoutError("get timed out"))) == "hung"
    assert fault_kind(_task_error(DistNetworkError("recv failed"))) == "collective"
    assert fault_kind(_task_error(RuntimeError(HCCL_TIMEOUT))) == "collective"
    nccl = "NCCL error in: ProcessGroupNCCL.cpp:2044, remote process exited or there was a network error"
    assert fault_kind(RuntimeError(nccl)) == "collective"
    # the same words, wrapped by the worker's own code: the chain is read
    try:
        try:
            raise DistBackendError("peer gone")
        except DistBackendError as inner:
            raise RuntimeError("update failed") from inner
    except RuntimeError as outer:
        assert fault_kind(outer) == "collective"
    # misuse repeats on a restart: HCCL's bad argument (code 1), a worker's own bug
    misuse = HCCL_TIMEOUT.replace("error code is 9", "error code is 1").replace("EI0002", "")
    assert fault_kind(RuntimeError(misuse)) == "raised"
    assert fault_kind(_task_error(ValueError("reward function returned a str"))) == "raised"


def test_the_line_says_what_happened():
    import ray

    lost = worker_failure(
        "actor.load_batch",
        "actor rank 1",
        _task_error(ray.exceptions.OwnerDiedError("ab" * 14, None, "")),
    )
    assert lost.kind == "lost" and lost.restartable
    assert str(lost) == (
        "actor.load_batch: worker actor rank 1 lost an object it read (OwnerDiedError: the "
        "process or node that held it is gone)"
    )
    called = _task_error(ray.exceptions.ActorDiedError(), "push_weights")
    line = describe("actor.push_weights", "actor rank 1", called, "died")
    assert line.startswith("actor.push_weights: worker actor rank 1 lost a process it called")
    hccl = worker_failure(
        "actor.save_pieces", "actor rank 0", _task_error(RuntimeError(HCCL_TIMEOUT))
    )
    assert hccl.kind == "collective" and "\n" not in str(hccl)
    assert not worker_failure("rollout", "rollout host", _task_error(KeyError("x"))).restartable


def test_a_ray_error_outside_a_wait_is_a_worker_s_fault_and_crossrl_s_own_is_not(tmp_path):
    import ray

    class Job:  # a run in the driver's process: no probe of the others
        in_process = True

    err = as_worker_failure(ray.exceptions.OwnerDiedError("ab" * 14, None, ""), Job())
    assert isinstance(err, WorkerFailedError) and err.kind == "lost"
    assert as_worker_failure(KeyError("a bug of crossrl's"), Job()) is None
    restart = Restarts(2, tmp_path).take(err)
    assert restart is not None and restart.cause == "an object was lost with its process or node"


# ---- faults injected at each remote call of a real run (dp 2) ------------------------------


def _cfg(run_dir: Path, *overrides: str):
    return load_config(None, [*SHORT, f"run.dir={run_dir}", *overrides])


def _fingerprints(run_dir: Path) -> list[dict]:
    from trainer.records.jsonl_files import read_jsonl

    return read_jsonl(run_dir / "fingerprint.jsonl")


@pytest.fixture(scope="module")
def straight(local_ray, tmp_path_factory):
    """The uninterrupted run the restarted ones must equal."""
    from trainer.loop.start.run import run_training

    run_dir = tmp_path_factory.mktemp("straight") / "run"
    assert run_training(_cfg(run_dir, *FAULT_RUN)) == 0
    return run_dir


def _raise_in(function: str, text: str, error: type = RuntimeError):
    """A function for ``__ray_call__`` that makes ``function`` (``module:name``, looked up
    where the worker calls it) raise ``error(text)`` in the worker it runs in, from then on
    (that process only: a restart starts fresh ones). Ray binds an actor's own methods when
    it starts, so the fault goes into what they call."""

    def patch(worker) -> None:  # noqa: ARG001 - Ray passes the actor itself
        import importlib

        module, name = function.split(":")

        def failing(*args, **kwargs):
            raise error(text)

        setattr(importlib.import_module(module), name, failing)

    return patch


class CallFault:
    """Before the controller's ``call`` (a ``Trainer`` method) runs for the ``nth`` time on the
    run's first start, kill worker ``kill``'s process, or make worker ``name``'s ``method``
    raise (``raise_in``: (name, ``module:function``, text[, error class])); then call ``then`` with the
    call's arguments."""

    def __init__(
        self, monkeypatch, call: str, nth: int, *, kill=None, raise_in=None, then=None
    ) -> None:
        from trainer.loop.schedule.controller import Trainer
        from trainer.loop.start import launch

        self.fired = False
        self.starts = 0
        original_start, original_call = launch.start, getattr(Trainer, call)
        fault, calls = self, []

        def start(trainer) -> None:
            original_start(trainer)
            fault.starts += 1

        def faulty(trainer, *args, **kwargs):
            calls.append(call)
            if fault.starts == 1 and len(calls) == nth and not fault.fired:
                fault.fired = True
                workers = _workers(trainer)
                if kill is not None:
                    _kill(workers[kill])
                if then is not None:  # e.g. until Ray finds what the victim owned lost
                    then(*args)
                if raise_in is not None:
                    import ray

                    name, method, *why = raise_in
                    ray.get(workers[name].__ray_call__.remote(_raise_in(method, *why)))
            return original_call(trainer, *args, **kwargs)

        monkeypatch.setattr(launch, "start", start)
        monkeypatch.setattr(Trainer, call, faulty)


def _kill(handle, wait_s: float = 30.0) -> None:
    """SIGKILL the actor's process, then wait until Ray knows it is dead (its processes and
    the objects it owns: a fetch right after the kill may still find them)."""
    import ray

    os.kill(ray.get(handle.__ray_call__.remote(_pid)), signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=1.0)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.1)


def _until_lost(plan, batch_refs, wait_s: float = 30.0) -> None:  # noqa: ARG001
    """Wait until reading the step's batch fails as its owner's death makes it fail."""
    import ray

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            ray.get(batch_refs[0], timeout=1.0)
        except ray.exceptions.ObjectLostError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.2)
    raise AssertionError("the batch stayed readable after its owner was killed")


def _workers(trainer) -> dict:
    workers = {n: h for g in trainer.all_groups() for n, h in zip(g.names, g.handles)}
    workers.update({f"engine replica {i}": h for i, h in enumerate(trainer.replicas)})
    workers["rollout host"] = trainer.rollout
    return workers


def _restarted(capsys, cause: str) -> str:
    """The run's stderr, once it says it restarted for ``cause`` (a regular expression)."""
    err = capsys.readouterr().err
    assert "restarting the workers (1 of run.max_restarts=2)" in err, err
    assert re.search(rf"restart 1: at step \d \(({cause}): ", err), err
    assert "Traceback" not in err
    return err


@pytest.mark.slow
def test_an_engine_lost_during_the_weight_push_restarts(straight, monkeypatch, tmp_path, capsys):
    from trainer.loop.start.run import run_training

    fault = CallFault(monkeypatch, "sync_weights", 3, kill="engine replica 1")
    run_dir = tmp_path / "run"
    assert run_training(_cfg(run_dir, *FAULT_RUN)) == 0
    assert fault.fired and fault.starts == 2
    _restarted(capsys, "a process died")
    assert _fingerprints(run_dir) == _fingerprints(straight)


@pytest.mark.slow
def test_the_batch_lost_while_the_ranks_fetch_it_restarts(straight, monkeypatch, tmp_path, capsys):
    """The rollout host owns the step's batch in the object store; it dies as the ranks start
    to read it: their ``load_batch`` raises Ray's ``OwnerDiedError`` (the worker's own error
    before, and the run stopped)."""
    from trainer.loop.start.run import run_training

    fault = CallFault(monkeypatch, "_prepare", 3, kill="rollout host", then=_until_lost)
    run_dir = tmp_path / "run"
    assert run_training(_cfg(run_dir, *FAULT_RUN)) == 0
    assert fault.fired and fault.starts == 2
    err = _restarted(capsys, "an object was lost with its process or node")
    assert "actor.load_batch" in err  # the ranks' fetch is where it broke
    assert _fingerprints(run_dir) == _fingerprints(straight)


@pytest.mark.slow
def test_an_hccl_error_while_checkpointing_restarts(straight, monkeypatch, tmp_path, capsys):
    """HCCL's timeout reaches Python as a plain RuntimeError (torch_npu's words, read by the
    npu backend); raised here by rank 0's checkpoint write on the CPU."""
    from trainer.loop.start.run import run_training

    fault = CallFault(
        monkeypatch, "save_checkpoint", 1, raise_in=("actor rank 0", SAVE_SHARDS, HCCL_TIMEOUT)
    )
    run_dir = tmp_path / "run"
    assert run_training(_cfg(run_dir, *FAULT_RUN)) == 0
    assert fault.fired and fault.starts == 2
    err = _restarted(capsys, "a collective broke")
    assert "HCCL function error" in err
    assert _fingerprints(run_dir) == _fingerprints(straight)


@pytest.mark.slow
def test_a_worker_s_own_error_while_checkpointing_stops_in_one_line(
    local_ray, monkeypatch, tmp_path, capsys
):
    from trainer.loop.start.run import run_training

    why = "disk quota of /scratch exceeded"
    CallFault(
        monkeypatch, "save_checkpoint", 1, raise_in=("actor rank 1", SAVE_SHARDS, why, OSError)
    )
    assert run_training(_cfg(tmp_path / "run", *FAULT_RUN)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "restarting" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("crossrl train: actor.save_pieces: worker actor rank 1 raised")
    assert why in last and "the worker's own error: a restart would repeat it" in last


@pytest.mark.slow
def test_the_rollout_host_lost_during_validation_restarts(local_ray, monkeypatch, tmp_path, capsys):
    from trainer.loop.start.run import run_training
    from trainer.records.jsonl_files import read_jsonl

    val = tmp_path / "val.jsonl"
    val.write_text("".join(f'{{"prompt": "say {i}", "answer": "{i}"}}\n' for i in range(3)))
    fault = CallFault(monkeypatch, "validate", 1, kill="rollout host")
    run_dir = tmp_path / "run"
    job = [*FAULT_RUN, f"data.val_source={val}", "run.val_every=2"]
    assert run_training(_cfg(run_dir, *job)) == 0
    assert fault.fired and fault.starts == 2
    _restarted(capsys, "a process died")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all("val/reward_mean" in m for m in metrics if m["step"] in (2, 4))


# ---- a time limit a call passed is not passed again (issue 45 item 8) ---------------------

#: Seconds every rank's checkpoint write waits before it writes, in every attempt: past the
#: first attempt's limit (``run.collective_timeout_s`` 20 + the move base, 20 here), within
#: the doubled one (20 + 40).
SLOW_SAVE_S = 45.0


def _slow_save(wait_s: float):
    """A function for ``__ray_call__`` that makes the first shard write of the process it
    runs in wait ``wait_s`` seconds (every rank alike, so no rank waits for another inside a
    collective). A closure: Ray's workers cannot import this test module."""

    def patch(worker) -> None:  # noqa: ARG001 - Ray passes the actor itself
        import importlib
        import time

        checkpoint = importlib.import_module("trainer.records.checkpoint")
        original, waited = checkpoint.save_sharded, []

        def slow(*args, **kwargs):
            if not waited:
                waited.append(True)
                time.sleep(wait_s)
            return original(*args, **kwargs)

        checkpoint.save_sharded = slow

    return patch


@pytest.mark.slow
def test_a_checkpoint_past_its_limit_restarts_with_the_limit_doubled(
    straight, monkeypatch, tmp_path, capsys
):
    import ray

    from trainer.loop.start import launch
    from trainer.loop.start.run import run_training
    from trainer.records.jsonl_files import read_jsonl

    monkeypatch.setattr(call_limits, "MOVE_BASE_S", 20.0)
    original_start, starts = launch.start, []

    def start(trainer) -> None:
        original_start(trainer)
        starts.append(trainer)
        ray.get([h.__ray_call__.remote(_slow_save(SLOW_SAVE_S)) for h in trainer.actor.handles])

    monkeypatch.setattr(launch, "start", start)
    run_dir = tmp_path / "run"
    job = [*FAULT_JOB, "train.total_steps=2", "run.save_every=2", "run.collective_timeout_s=20"]
    assert run_training(_cfg(run_dir, *job)) == 0
    assert len(starts) == 2
    err = _restarted(capsys, "a call passed its time limit")
    assert "actor.save_pieces: no answer from actor rank 0, actor rank 1 within 40 s" in err
    assert "the checkpoint_save limit is 2x its budget (60 s) for the attempts left" in err
    assert (run_dir / "checkpoints" / "step_2").is_dir()
    assert read_jsonl(run_dir / "fingerprint.jsonl") == _fingerprints(straight)[:2]
