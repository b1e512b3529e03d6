"""Writing one step's checkpoint: every training worker writes its pieces into a staging
directory, the controller adds its own state, then the whole is committed atomically."""

from __future__ import annotations

from pathlib import Path

from trainer.records.checkpoint import (
    LAYOUT,
    begin_checkpoint,
    commit_checkpoint,
    rng_state,
    save_json,
    save_torch,
)


def save_step(
    run_dir: Path, step: int, groups: list, prompts_consumed: int, pending: dict | None = None
) -> Path:
    """Checkpoint of step ``step`` under ``run_dir``: ``groups`` (the training roles' worker
    groups: ``group.call("save_pieces", dir)`` answers, per rank, the files it wrote) write
    their pieces; ``prompts_consumed``: prompts the run has taken from its stream, up to step
    ``step``'s rollout; ``pending``: a lagged run's rollouts of later steps, already sampled
    (``trainer.records.checkpoint.pending``). The commit checks every piece the workers said
    they wrote. Returns the committed step directory."""
    from trainer.records.checkpoint.pending import write_pending_rollouts

    staging = begin_checkpoint(run_dir, step)
    write_pending_rollouts(staging, pending or {})
    expected: set[str] = set()  # what the workers say they wrote; the commit checks it
    for group in groups:
        for names in group.call("save_pieces", str(staging)):
            expected.update(names)
    save_json(
        {"step": step, "prompts_consumed": int(prompts_consumed)}, staging / LAYOUT.trainer_state
    )
    save_torch(rng_state(), staging / LAYOUT.controller_rng)
    return commit_checkpoint(run_dir, step, staging, expect_files=sorted(expected))
