"""In-run restarts: a run that loses a worker process starts its workers again and resumes.

What happened decides (``trainer.loop.cluster.faults``), at any call the controller makes
(a rollout, the batch's fetch, an update, a weight push, a checkpoint, a validation): a
process of the job gone (a training rank, the rollout host, an engine replica the push
needed, a whole node), an object lost with it (the batch the ranks were fetching), a
collective broken (torch.distributed's errors, or NCCL's, HCCL's and gloo's words, which the
HAL's backends know), or a call past its time limit (``trainer.loop.plan.call_limits``; that limit
doubles for the attempts left). Then ``trainer.loop.start.run`` tears every worker down, starts them
again on what the cluster still has (the layout is planned anew: too little left stops the
run naming what is missing) and resumes from the last checkpoint this run committed, or from
where the run started when it committed none, at most ``run.max_restarts`` times. An error a
worker's own code raised while every process of the job is alive is not restarted: it would
only repeat; the run stops with its one line.

Each restart is recorded: on the first metrics line written after it (``restart/*`` keys) and
in the end-of-run summary. A deterministic run resumes exactly (``tests/test_trainer_e2e.py``'s
resume test), so its fingerprints equal an uninterrupted run's.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.config import Config
from trainer.loop.cluster.faults import WHAT_HAPPENED, dead_workers, fault_kind
from trainer.loop.cluster.group import WorkerFailedError


@dataclass
class Restart:
    """One restart: the step that was running (``failed_step``), the error's line, the step
    resumed from (``resumed_step``, 0 for the run's start), the seconds from the failure to
    the first step after it starting (``down_s``: tear-down, start-up, resume), and what
    happened, in words (``cause``: ``faults.WHAT_HAPPENED``)."""

    number: int
    failed_step: int
    error: str
    resumed_step: int = 0
    down_s: float = 0.0
    cause: str = "a process died"

    @property
    def steps_redone(self) -> int:
        """Steps finished before the failure that run again after it."""
        return max(0, self.failed_step - 1 - self.resumed_step)

    def metrics(self) -> dict[str, float]:
        """The ``restart/*`` keys of the first metrics line after this restart."""
        return {
            "restart/count": float(self.number),
            "restart/failed_step": float(self.failed_step),
            "restart/steps_redone": float(self.steps_redone),
            "restart/down_s": self.down_s,
        }

    def summary(self) -> str:
        """One line for the end-of-run summary."""
        start = f"step {self.resumed_step}" if self.resumed_step else "the run's start"
        return (
            f"restart {self.number}: at step {self.failed_step} ({self.cause}: {self.error}); "
            f"resumed from {start}, {self.down_s:.1f} s down, {self.steps_redone} step(s) redone"
        )


@dataclass
class Restarts:
    """The restarts of one run, at most ``limit`` (``run.max_restarts``)."""

    limit: int
    run_dir: Path
    done: list[Restart] = field(default_factory=list)
    current_step: int = 0  # the step being run (set by the training loop)
    _latest_at_start: tuple | None = None
    _failed_at: float = 0.0

    def __post_init__(self) -> None:
        self._latest_at_start = self._latest()

    def _latest(self) -> tuple | None:
        """The committed checkpoint ``latest`` names, and when its manifest was written (a
        step this run saved again has the name of an older run's)."""
        from trainer.records.checkpoint import LAYOUT, find_latest

        latest = find_latest(self.run_dir)
        if latest is None:
            return None
        return latest, (latest / LAYOUT.manifest).stat().st_mtime_ns

    def take(self, err: WorkerFailedError) -> Restart | None:
        """The restart ``err`` earns, or None when the run must stop: the error is not one a
        restart gets past, or ``limit`` restarts were spent."""
        if not err.restartable or len(self.done) >= self.limit:
            return None
        self._failed_at = time.monotonic()
        # the call and the worker; Ray's explanation after them stays in the error's own line
        what = re.split(r" \(|: \[", str(err).splitlines()[0], maxsplit=1)[0]
        restart = Restart(
            len(self.done) + 1, self.current_step, what, cause=WHAT_HAPPENED[err.kind]
        )
        self.done.append(restart)
        return restart

    def refused(self, err: WorkerFailedError, in_process: bool = False) -> str:
        """Why ``err`` stops the run instead of restarting it (one line, naming the key);
        ``in_process``: the workers ran in the driver's process (``ray.in_process``)."""
        if not err.restartable:
            return f"{err} (the worker's own error: a restart would repeat it)"
        if in_process:
            return (
                f"{err}; workers in the driver's own process (ray.in_process) are not "
                "restarted: `run.resume=auto` continues the run from its last checkpoint"
            )
        return (
            f"{err}; run.max_restarts={self.limit} restart(s) already spent, so the run "
            "stops: `run.resume=auto` continues it from its last checkpoint"
        )

    def config(self, cfg: Config) -> Config:
        """The config a restart starts with: resuming from the last checkpoint this run
        committed, or, when it committed none, from where the run started (``cfg``'s own
        ``run.resume``)."""
        latest = self._latest()
        if latest is None or latest == self._latest_at_start:
            return cfg
        run = cfg.run.model_copy(update={"resume": str(latest[0])})
        return cfg.model_copy(update={"run": run})

    def resumed(self, step: int) -> Restart | None:
        """Note that the restarted run resumed at ``step`` and is about to run its next one;
        returns the restart that led here (None when this is not a restart)."""
        if not self.done or self.done[-1].down_s:
            return None
        last = self.done[-1]
        last.resumed_step = step
        last.down_s = max(time.monotonic() - self._failed_at, 1e-6)
        return last


def as_worker_failure(err: BaseException, trainer: Any) -> WorkerFailedError | None:
    """``err``, raised while ``trainer`` (a ``trainer.loop.schedule.controller.Trainer``) ran, as
    the ``WorkerFailedError`` the restart decision reads, or None when it is no worker's fault
    (crossrl's own error). A Ray error that reached the driver outside ``wait_all`` is
    classified the same way. An error a worker raised while another of the job's processes
    is found dead (``faults.dead_workers``) is that loss's consequence: ``died``."""
    ray = sys.modules.get("ray")
    if not isinstance(err, WorkerFailedError):
        if ray is None or not isinstance(err, ray.exceptions.RayError):
            return None
        lines = str(err).strip().splitlines() or [type(err).__name__]
        err = WorkerFailedError(f"a Ray call failed: {lines[-1]}", kind=fault_kind(err))
    if err.kind != "raised" or trainer.in_process or ray is None or not ray.is_initialized():
        return err
    dead = dead_workers(_handles(trainer))
    if not dead:
        return err
    return WorkerFailedError(f"{err}; and {', '.join(dead)} died", kind="died")


def _handles(trainer: Any) -> dict[str, Any]:
    """Every worker of ``trainer`` by its name: the training roles' ranks, the engines."""
    handles = {n: h for g in trainer.all_groups() for n, h in zip(g.names, g.handles)}
    for i, handle in enumerate(trainer.replicas):
        if handle is not None:
            handles[f"engine replica {i}"] = handle
    return handles
