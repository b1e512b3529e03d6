"""Where everything of a checkpoint lives: the one source of its directory and file names.

Workers, the controller, the commit code and the tests all take names from ``LAYOUT``, so a
test builds exactly the files a run writes. The names are an on-disk contract: resuming an
older run reads them, so change none without a migration.

Two model/optimizer layouts exist. Today's is sharded: ``<role>_model/`` and ``<role>_optim/``
are torch.distributed.checkpoint directories (``.metadata`` plus one ``__<rank>_0.distcp`` per
rank), readable at any dp size. Checkpoints written before it hold the single-file layout
(``legacy_model``/``legacy_optim``: the whole state gathered on rank 0); they still load.
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

    def model_dir(self, role: str) -> str:
        """Sharded model weights of ``role``: a torch.distributed.checkpoint directory every
        rank writes its own shard into, keyed by the model's parameter names."""
        return f"{role}_model"

    def optim_dir(self, role: str) -> str:
        """Sharded optimizer state of a trainable ``role`` (torch.distributed.checkpoint
        directory, keyed by parameter names, so it loads at another dp size)."""
        return f"{role}_optim"

    def scheduler(self, role: str) -> str:
        """LR scheduler state of a trainable ``role``, written by its rank 0."""
        return f"{role}_scheduler.pt"

    def rng(self, role: str, rank: int) -> str:
        """RNG state of ``role``'s data-parallel rank ``rank`` (one file per rank)."""
        return f"{role}_rng_rank{int(rank)}.pt"

    def legacy_model(self, role: str) -> str:
        """Single-file layout (older checkpoints): full model weights, written by rank 0."""
        return f"{role}_model.safetensors"

    def legacy_optim(self, role: str) -> str:
        """Single-file layout (older checkpoints): full optimizer state, written by rank 0."""
        return f"{role}_optim.pt"


LAYOUT = CheckpointLayout()
