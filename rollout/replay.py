"""Recorded rollout batches: save a step's rows once, replay them anywhere.

Sampling makes two runs differ, so a parity check replays the same recorded rows through the
training path on both machines (DESIGN.md, "Cross-device parity"). With
``run.record_rollouts: true`` the rollout host saves each step's ``StepBatch.to_numpy()`` as
``RUN_DIR/rollouts/step_<N>.npz``; ``crossrl probe`` reads them back (its replay host stands
in for the rollout engine).

Rollout sits below the trainer, so the atomic write here is its own few lines rather than
``trainer.checkpoint.atomic_path``.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Mapping
from pathlib import Path

import numpy as np


def record_rollout(record_dir: str | Path, step: int, arrays: Mapping[str, np.ndarray]) -> Path:
    """Save one step's rollout batch (``StepBatch.to_numpy()``) as ``step_<N>.npz``, atomically.

    Compressed npz of plain arrays (no pickle), so any machine can replay it; a tiny-job step
    is about 5 KB.
    """
    path = Path(record_dir) / f"step_{step}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    # Temp file beside the target, fsync, rename, fsync the folder: a reader (or a crash) sees
    # the old file or the whole new one, never half a recording.
    tmp = path.with_name(f".{path.name}.tmp.{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as handle:
            np.savez_compressed(handle, **arrays)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (a no-op where folders cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_rollout(path: str | Path) -> dict[str, np.ndarray]:
    """Arrays of a recorded rollout batch, read without pickle."""
    with np.load(path, allow_pickle=False) as data:
        return {key: data[key] for key in data.files}


def recorded_steps(rollouts_dir: str | Path) -> list[int]:
    """The step numbers N of the ``step_<N>.npz`` files in ``rollouts_dir``, ascending."""
    steps = []
    for path in Path(rollouts_dir).glob("step_*.npz"):
        suffix = path.stem[len("step_") :]
        if suffix.isdigit():
            steps.append(int(suffix))
    return sorted(steps)
