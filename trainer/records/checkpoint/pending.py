"""The rollouts a lagged run had already sampled when it saved (``train.rollout_lag`` > 0).

A checkpoint of step t holds the weights after step t, but the batches of steps t+1 .. t+k
were sampled by older weights (``trainer.loop.schedule.pipeline``), which the checkpoint does not
hold. So they are saved with it, and a resumed run trains on exactly the batches the uninterrupted
run would have: ``pending/step_<s>.npz`` (the batch's arrays, ``rollout.replay``'s format)
and ``pending/step_<s>.json`` (what the controller knew of it besides the rows: metrics,
prompt position, the weights that sampled it, environment faults).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from trainer.records.checkpoint.pieces import save_json

#: The folder of a checkpoint that holds its pending rollouts.
PENDING_DIR = "pending"
#: Metadata fields kept beside the arrays (the rest is rebuilt from the arrays).
KEPT = ("metrics", "prompts_consumed", "policy_version", "env_faults")


def write_pending_rollouts(staging: Path, pending: dict[int, tuple[dict[str, Any], dict]]) -> None:
    """Write ``pending`` (step -> (metadata, the batch's numpy arrays)) into the checkpoint
    being staged at ``staging``; nothing when it is empty."""
    from rollout.replay import record_rollout

    for step, (meta, arrays) in sorted(pending.items()):
        record_rollout(staging / PENDING_DIR, step, arrays)
        kept = {key: meta[key] for key in KEPT if key in meta}
        kept["env_faults"] = [list(f) for f in kept.get("env_faults", [])]
        save_json(kept, staging / PENDING_DIR / f"step_{step}.json")


def read_pending_steps(ckpt: Path) -> list[int]:
    """The steps whose rollouts the checkpoint at ``ckpt`` keeps, in order (none read)."""
    from rollout.replay import recorded_steps

    folder = Path(ckpt) / PENDING_DIR
    return list(recorded_steps(folder)) if folder.is_dir() else []


def read_pending_rollouts(ckpt: Path) -> dict[int, tuple[dict[str, Any], dict[str, np.ndarray]]]:
    """The pending rollouts of the checkpoint at ``ckpt``, by step: (the kept metadata, the
    batch's arrays); empty when it has none (a run without a lag saved it)."""
    from rollout.replay import load_rollout, recorded_steps

    folder = Path(ckpt) / PENDING_DIR
    if not folder.is_dir():
        return {}
    out = {}
    for step in recorded_steps(folder):
        meta = json.loads((folder / f"step_{step}.json").read_text())
        meta["env_faults"] = [tuple(f) for f in meta.get("env_faults", [])]
        out[step] = (meta, load_rollout(folder / f"step_{step}.npz"))
    return out
