"""Recorded rollout batches: save a step's rows once, replay them anywhere.

Sampling makes two runs differ, so a parity check replays the same recorded rows through the
training path on both machines (DESIGN.md, "Cross-device parity"). With
``run.record_rollouts: true`` the rollout host saves each step's ``StepBatch.to_numpy()`` as
``RUN_DIR/rollouts/step_<N>.npz``; ``crossrl probe`` reads them back (its replay host stands
in for the rollout engine).
"""

from __future__ import annotations

import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from rollout.files import atomic_path


def record_rollout(record_dir: str | Path, step: int, arrays: Mapping[str, np.ndarray]) -> Path:
    """Save one step's rollout batch (``StepBatch.to_numpy()``) as ``step_<N>.npz``, atomically.

    Compressed npz of plain arrays (no pickle), so any machine can replay it; a tiny-job step
    is about 5 KB.
    """
    path = Path(record_dir) / f"step_{step}.npz"
    # A reader (or a crash) sees the old file or the whole new one, never half a recording.
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        np.savez_compressed(handle, **arrays)
    return path


class RecordingError(ValueError):
    """A recorded rollout file that cannot be read; the message names the file and the fix."""


def load_rollout(path: str | Path) -> dict[str, np.ndarray]:
    """Arrays of a recorded rollout batch, read without pickle. A file that is not a whole
    npz archive of plain arrays (truncated, random bytes, pickled objects, a directory)
    raises ``RecordingError`` naming it."""
    path = Path(path)
    fix = "record it again with run.record_rollouts=true"
    if not path.is_file():
        raise RecordingError(f"{path}: not a file; {fix}")
    if not zipfile.is_zipfile(path):
        raise RecordingError(f"{path}: not an npz archive (truncated or not a recording); {fix}")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {key: data[key] for key in data.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise RecordingError(f"{path}: damaged recording ({reason}); {fix}") from None


def recorded_steps(rollouts_dir: str | Path) -> list[int]:
    """The step numbers N of the ``step_<N>.npz`` files in ``rollouts_dir``, ascending."""
    steps = []
    for path in Path(rollouts_dir).glob("step_*.npz"):
        suffix = path.stem[len("step_") :]
        if suffix.isdigit():
            steps.append(int(suffix))
    return sorted(steps)
