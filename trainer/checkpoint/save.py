"""Writing one step's checkpoint: every training worker writes its pieces into a staging
directory, the controller adds its own state, then the whole is committed atomically."""

from __future__ import annotations

from pathlib import Path

from trainer.checkpoint import (
    LAYOUT,
    begin_checkpoint,
    commit_checkpoint,
    rng_state,
    save_json,
    save_torch,
)
from trainer.workers.group import CALL_TIMEOUT_S, wait_all


def save_step(run_dir: Path, step: int, groups: list, rollout) -> Path:
    """Checkpoint of step ``step`` under ``run_dir``: ``groups`` (the training roles'
    ``WorkerGroup``s) write their pieces, ``rollout`` (the rollout host's handle) says how many
    prompts the run consumed; the commit checks every piece the workers said they wrote.
    Returns the committed step directory."""
    staging = begin_checkpoint(run_dir, step)
    expected: set[str] = set()  # what the workers say they wrote; the commit checks it
    for group in groups:
        for names in group.call("save_pieces", str(staging)):
            expected.update(names)
    (consumed,) = wait_all(
        [rollout.get_prompts_consumed.remote()],
        ["rollout host"],
        timeout_s=CALL_TIMEOUT_S,
        what="rollout.get_prompts_consumed",
    )
    save_json({"step": step, "prompts_consumed": consumed}, staging / LAYOUT.trainer_state)
    save_torch(rng_state(), staging / LAYOUT.controller_rng)
    return commit_checkpoint(run_dir, step, staging, expect_files=sorted(expected))
