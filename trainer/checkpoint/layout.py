"""Where everything of a checkpoint lives: the one source of its directory and file names.

Workers, the controller, the commit code and the tests all take names from ``LAYOUT``, so a
test builds exactly the files a run writes. The names are an on-disk contract: resuming an
older run reads them, so change none without a migration.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointLayout:
    """Names under ``<run.dir>/`` (``checkpoints_dir``, ``latest``) and inside one ``step_<N>``
    checkpoint directory. ``role`` is a training worker group (``actor``, ``critic``); ``rank``
    its data-parallel rank."""

    checkpoints_dir: str = "checkpoints"  # under run.dir
    latest: str = "latest"  # under checkpoints_dir: text "step_<N>", the commit point
    manifest: str = "manifest.json"  # size + sha256 per file, written by the commit
    trainer_state: str = "trainer_state.json"  # the controller's step and data position
    controller_rng: str = "controller_rng.pt"  # the controller's RNG state

    def model(self, role: str) -> str:
        """Full (unsharded) model weights of ``role``, written by its rank 0."""
        return f"{role}_model.safetensors"

    def optim(self, role: str) -> str:
        """Full optimizer state of a trainable ``role``, written by its rank 0."""
        return f"{role}_optim.pt"

    def scheduler(self, role: str) -> str:
        """LR scheduler state of a trainable ``role``, written by its rank 0."""
        return f"{role}_scheduler.pt"

    def rng(self, role: str, rank: int) -> str:
        """RNG state of ``role``'s data-parallel rank ``rank`` (one file per rank)."""
        return f"{role}_rng_rank{int(rank)}.pt"


LAYOUT = CheckpointLayout()
