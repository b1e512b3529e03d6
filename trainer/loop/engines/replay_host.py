"""The rollout host of a replay (``crossrl probe``): recorded batches instead of sampling."""

from __future__ import annotations

from typing import Any

import numpy as np

from batching import StepBatch
from trainer.loop.cluster.local import put
from trainer.loop.engines.rollout_meta import batch_metadata


class ReplayHost:
    """Stands in for ``RolloutHost`` when replaying recorded rollouts (``crossrl probe``):
    step N's batch is ``<rollouts_dir>/step_<N>.npz``; there is no engine, so weight
    updates are accepted and dropped. Sampling is gone, so two devices train on the same rows.
    """

    def __init__(self, rollouts_dir: str) -> None:
        self.rollouts_dir = rollouts_dir

    def setup(self) -> dict[str, Any]:
        """Check the recording exists."""
        from pathlib import Path

        if not sorted(Path(self.rollouts_dir).glob("step_*.npz")):
            raise ValueError(
                f"--rollouts {self.rollouts_dir!r}: no step_<N>.npz files; record some with "
                f"run.record_rollouts=true (they land in RUN_DIR/rollouts)"
            )
        return {"engine": "replay"}

    def rollout(
        self, step: int, record_dir: str | None = None, weights: list | None = None
    ) -> tuple[dict[str, Any], list]:
        """The recorded batch of ``step`` and its metadata."""
        from pathlib import Path

        from rollout.replay import load_rollout

        path = Path(self.rollouts_dir) / f"step_{step}.npz"
        if not path.is_file():
            raise ValueError(
                f"--rollouts: {path} is missing; record at least as many steps as --steps asks for"
            )
        arrays = load_rollout(path)
        batch = StepBatch.from_numpy(arrays)
        return batch_metadata(batch, {}), [put(arrays)]

    def update_weights(self, bucket: dict[str, np.ndarray]) -> int:
        """No engine to update."""
        return len(bucket)

    def get_prompts_consumed(self) -> int:
        """A replay samples no prompts."""
        return 0

    def set_prompts_consumed(self, count: int) -> None:
        """A replay samples no prompts."""

    def sleep(self, discard_weights: bool = False) -> None:
        """No engine to put to sleep."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """No engine to wake."""

    def awake_tags(self) -> list[str]:
        """No engine: nothing awake."""
        return []

    def shutdown(self) -> None:
        """Nothing to release."""
