"""What a step leaves to finish while later steps train: its metrics line, held until its
validation has run, and its checkpoint, committed once the rollouts it keeps are sampled.

Only a lagged run (``trainer.loop.schedule.pipeline``) leaves anything: its validations queue behind
rollouts already running and its checkpoints keep rollouts still being sampled, and waiting
for them in the step would drain the pipeline. Lines are written and checkpoints committed in
step order, a checkpoint never before its own step's line (a run resumed from it truncates
``metrics.jsonl`` to that step). A run that stops early keeps its last committed checkpoint.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.loop.cluster.group import Later, is_done
from trainer.records.checkpoint.save import StagedStep


@dataclass
class PendingCheckpoint:
    """A staged checkpoint and the rollouts it keeps (``RolloutPipeline.ahead``: step -> a
    reference; empty for a run without a lag, which commits at once)."""

    staged: StagedStep
    ahead: dict[int, Any]

    def ready(self) -> bool:
        """Whether every rollout it keeps has been sampled (never waits)."""
        return all(is_done(ref) for ref in self.ahead.values())

    def commit(self) -> Path:
        """Read the rollouts it keeps (waiting for them) and commit it."""
        from trainer.loop.schedule.pipeline import read_ahead

        return self.staged.commit(read_ahead(self.ahead) if self.ahead else None)


class Backlog:
    """The metrics lines and checkpoints of finished steps not yet written, in step order;
    ``log``: the run's ``MetricsLogger``."""

    def __init__(self, log) -> None:
        self.log = log
        self.lines: deque[tuple[int, dict[str, Any], Later | dict | None]] = deque()
        self.checkpoints: deque[PendingCheckpoint] = deque()

    def __enter__(self) -> Backlog:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """The loop ended: wait for everything held, or, when it raised, ``abandon``."""
        if exc_type is None:
            self.settle(wait=True)
        else:
            self.abandon()

    def add_line(self, step: int, metrics: dict[str, Any], validation=None) -> None:
        """Step ``step``'s metrics line, with its ``val/*`` metrics: a dict, a ``Later`` of
        them (a lagged run's validation), or None (no validation this step); written at
        once when nothing before it is held and its validation has run."""
        self.lines.append((step, metrics, validation))
        self.settle(wait=False)

    def add_checkpoint(self, checkpoint: PendingCheckpoint) -> None:
        """A staged checkpoint, committed after its step's line once its rollouts are in
        (at once for a run without a lag)."""
        self.checkpoints.append(checkpoint)
        self.settle(wait=False)

    def settle(self, *, wait: bool) -> None:
        """Write the lines whose validation has run and commit the checkpoints whose
        rollouts are sampled, in step order; ``wait``: wait for all of them (the run's end)."""
        while self.lines and (wait or _done(self.lines[0][2])):
            step, metrics, validation = self.lines.popleft()
            if isinstance(validation, Later):
                validation = validation.result()
            self.log.log(step, {**metrics, **(validation or {})})
        while self.checkpoints:
            first = self.checkpoints[0]
            written = not any(step <= first.staged.step for step, _, _ in self.lines)
            if not written or not (wait or first.ready()):
                break
            self.checkpoints.popleft().commit()

    def abandon(self) -> None:
        """The run stops early: write the held lines now, each with its validation only if
        that has finished well, and commit nothing (the last committed checkpoint stays
        ``latest``; a run resumed from it writes the later lines again)."""
        while self.lines:
            step, metrics, validation = self.lines.popleft()
            if isinstance(validation, Later):
                try:
                    validation = validation.result(timeout_s=0.0) if validation.done() else None
                except Exception:  # noqa: BLE001 - the run is stopping for another reason
                    validation = None
            self.log.log(step, {**metrics, **(validation or {})})
        self.checkpoints.clear()


def _done(validation) -> bool:
    return not isinstance(validation, Later) or validation.done()
