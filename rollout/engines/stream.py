"""A streamed weight push: all of a step's buckets in one engine call.

The training ranks of one tp group and their engine replica share a node. Each rank packs
bucket k into staging slot ``k % slots`` on its own device (``rollout.engines.buckets``),
waits for its device to finish the copies, then rings the doorbell: ``ready[tp rank] = k + 1``.
The engine, in a single call (``receive_weight_stream``), waits until *every* tp rank has
rung for bucket k (so no worker reads a peer's slot that is still being written), loads it,
waits for its own device to finish reading, then marks ``read = k + 1``; a rank reuses a slot
only once the engine has read what it held. The doorbell is a few int64 counters in host
shared memory: waiting on it costs no Ray round trip and no collective, so a push is one call
however many buckets it has.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from rollout.engines.buckets import TensorSpec

#: How long a side waits for the other before it gives up, in seconds.
STREAM_TIMEOUT_S = 600.0


class Doorbell:
    """``ready`` counters, one per tp rank, and one ``read`` counter, in host shared memory
    (a /dev/shm file that every process of the tp group and its engine maps)."""

    def __init__(self, flat: torch.Tensor, tp: int) -> None:
        self.tp = int(tp)
        self.counts = flat[: 8 * (self.tp + 1)].view(torch.int64)

    @classmethod
    def create(cls, tp: int) -> tuple[Doorbell, tuple]:
        """A new doorbell for a tp group of ``tp`` ranks, all counters 0, and its handle."""
        import hal

        flat, handle = hal.get_backend("cpu").shared_buffer(8 * (tp + 1))
        bell = cls(flat, tp)
        bell.counts.zero_()
        return bell, (*handle, int(tp))

    @classmethod
    def open(cls, handle: tuple) -> Doorbell:
        """Map the doorbell ``create`` made (in any process on the node)."""
        import hal

        *buffer, tp = handle
        return cls(hal.open_shared_buffer(tuple(buffer)), tp)

    @staticmethod
    def release(handle: tuple) -> None:
        """Drop the doorbell's file name once every process has mapped it."""
        import hal

        hal.get_backend("cpu").release_shared_buffer(tuple(handle[:-1]))

    def ring(self, tp_rank: int, buckets: int) -> None:
        """Tp rank ``tp_rank`` has written its first ``buckets`` buckets."""
        self.counts[tp_rank] = int(buckets)

    def ready(self) -> int:
        """Buckets every tp rank has written."""
        return int(self.counts[: self.tp].min())

    def mark_read(self, buckets: int) -> None:
        """The engine has loaded the first ``buckets`` buckets."""
        self.counts[self.tp] = int(buckets)

    def read(self) -> int:
        """Buckets the engine has loaded."""
        return int(self.counts[self.tp])

    def wait(self, count: Callable[[], int], target: int, what: str, timeout_s: float) -> None:
        """Wait until ``count() >= target``; raise ``TimeoutError`` naming ``what`` after
        ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        pause = 1e-5
        while count() < target:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"weight push: waited {timeout_s:g} s for {what} (bucket {target}); the "
                    "other side of the push has stopped or died (see its error above)"
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


def receive_weight_stream(
    engine,
    open_bucket: Callable[[tuple], torch.Tensor],
    slots: Sequence[Sequence[tuple]],
    doorbell: tuple,
    buckets: Sequence[Sequence[TensorSpec]],
    *,
    timeout_s: float = STREAM_TIMEOUT_S,
) -> int:
    """The engine's side of a streamed push: load ``buckets`` in order from the staging
    ``slots`` (per slot, every tp rank's buffer handle in tp rank order), each once every tp
    rank has rung for it, and finish the update before the last ``read`` mark (no view of a
    staging buffer outlives the call). ``engine`` is an ``Engine`` whose weights are awake.
    Returns the number of tensors loaded."""
    bell = Doorbell.open(doorbell)
    loaded = 0
    for k, specs in enumerate(buckets):
        bell.wait(bell.ready, k + 1, "every tp rank to write its bucket", timeout_s)
        specs = [TensorSpec(*s) for s in specs]
        engine.load_shared_bucket(open_bucket, slots[k % len(slots)], specs)
        loaded += len(specs)
        if k == len(buckets) - 1:
            engine.finish_weight_update()
        bell.mark_read(k + 1)
    return loaded
