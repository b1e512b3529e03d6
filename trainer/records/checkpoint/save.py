"""Writing one step's checkpoint: every training worker writes its pieces into a staging
directory, the controller adds its own state, then the whole is committed atomically.

A lagged run (``train.rollout_lag``) stages the checkpoint when its step ends and commits it
once the rollouts it keeps (``trainer.records.checkpoint.pending``) are sampled, while later
steps train; until then the previous checkpoint stays ``latest``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.records.checkpoint import (
    LAYOUT,
    begin_checkpoint,
    commit_checkpoint,
    rng_state,
    save_json,
    save_torch,
)


@dataclass
class StagedStep:
    """A checkpoint of step ``step`` whose pieces are in ``staging``, not yet committed;
    ``expected``: the files the workers said they wrote (the commit checks them)."""

    run_dir: Path
    step: int
    staging: Path
    expected: list[str]

    def commit(self, pending: dict | None = None) -> Path:
        """Add ``pending`` (a lagged run's rollouts of later steps, already sampled: step ->
        (metadata, the batch's numpy arrays)) and commit; returns the step directory."""
        from trainer.records.checkpoint.pending import write_pending_rollouts

        write_pending_rollouts(self.staging, pending or {})
        return commit_checkpoint(self.run_dir, self.step, self.staging, expect_files=self.expected)


def stage_step(
    run_dir: Path,
    step: int,
    groups: list,
    prompts_consumed: int,
    state: dict[str, Any] | None = None,
    *,
    timeout_s: float | None = None,
) -> StagedStep:
    """Stage the checkpoint of step ``step`` under ``run_dir``: ``groups`` (the training roles'
    worker groups: ``group.call("save_pieces", dir)`` answers, per rank, the files it wrote)
    write their pieces, each role within ``timeout_s`` seconds (default: the group's);
    ``prompts_consumed``: prompts the run has taken from its stream, up to step ``step``'s
    rollout; ``state``: more of the controller's state for ``trainer_state.json`` (e.g.
    ``rollout_lag``, which a resume checks)."""
    staging = begin_checkpoint(run_dir, step)
    expected: set[str] = set()  # what the workers say they wrote; the commit checks it
    limit = {} if timeout_s is None else {"timeout_s": timeout_s}
    for group in groups:
        for names in group.call("save_pieces", str(staging), **limit):
            expected.update(names)
    save_json(
        {**(state or {}), "step": step, "prompts_consumed": int(prompts_consumed)},
        staging / LAYOUT.trainer_state,
    )
    save_torch(rng_state(), staging / LAYOUT.controller_rng)
    return StagedStep(Path(run_dir), step, staging, sorted(expected))


def save_step(
    run_dir: Path, step: int, groups: list, prompts_consumed: int, pending: dict | None = None
) -> Path:
    """``stage_step`` and commit at once, with ``pending`` (``StagedStep.commit``). Returns the
    committed step directory."""
    return stage_step(run_dir, step, groups, prompts_consumed).commit(pending)
