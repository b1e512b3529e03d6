"""In-run restarts: a run that loses a worker process starts its workers again and resumes.

When a training rank, the rollout host or a whole node is lost, or a rank hangs inside a
collective (``WorkerFailedError.restartable``), ``trainer.loop.run`` tears every worker down,
starts them again on what the cluster still has (the layout is planned anew: too little left
stops the run naming what is missing) and resumes from the last checkpoint this run committed,
or from where the run started when it committed none, at most ``run.max_restarts`` times.
An error a worker's own code raised is not restarted: it would only repeat.

Each restart is recorded: on the first metrics line written after it (``restart/*`` keys) and
in the end-of-run summary. A deterministic run resumes exactly (``tests/test_trainer_e2e.py``'s
resume test), so its fingerprints equal an uninterrupted run's.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainer.config import Config
from trainer.loop.workers.group import WorkerFailedError


@dataclass
class Restart:
    """One restart: the step that was running (``failed_step``), the error's line, the step
    resumed from (``resumed_step``, 0 for the run's start), and the seconds from the failure
    to the first step after it starting (``down_s``: tear-down, start-up, resume)."""

    number: int
    failed_step: int
    error: str
    resumed_step: int = 0
    down_s: float = 0.0

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
            f"restart {self.number}: at step {self.failed_step} ({self.error}); resumed from "
            f"{start}, {self.down_s:.1f} s down, {self.steps_redone} step(s) redone"
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
        restart = Restart(len(self.done) + 1, self.current_step, what)
        self.done.append(restart)
        return restart

    def refused(self, err: WorkerFailedError) -> str:
        """Why ``err`` stops the run instead of restarting it (one line, naming the key)."""
        if not err.restartable:
            return f"{err} (the worker's own error: a restart would repeat it)"
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
