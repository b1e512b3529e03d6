"""A streamed weight push: all of a step's buckets in one engine call.

The training ranks of one tp group and their engine replica share a node. Each rank packs
bucket k into staging slot ``k % slots`` on its own device (``rollout.engines.weights.buckets``),
waits for its device to finish the copies, then rings the doorbell: ``ready[tp rank] = k + 1``.
The engine, in a single call (``receive_weight_stream``), waits until *every* tp rank has
rung for bucket k (so no worker reads a peer's slot that is still being written), loads it,
waits for its own device to finish reading, then marks ``read = k + 1``; a rank reuses a slot
only once the engine has read what it held. The doorbell is a few int64 counters in a host
file, each access under a file lock (``hal.shm.SharedCounters``): waiting on it costs no Ray
round trip and no collective, so a push is one call however many buckets it has. A side that
fails rings ``abort``, so the other side stops at once instead of at the stream timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from rollout.engines.weights.buckets import TensorSpec

#: How long a side waits for the other before it gives up, in seconds.
STREAM_TIMEOUT_S = 600.0

#: Who stopped a push (the doorbell's ``abort`` counter): the engine, or a training rank.
ENGINE, RANK = 1, 2
_WHO = {ENGINE: "the engine", RANK: "a training rank"}

#: How often a waiter asks whether the other side's call has ended (``Doorbell.wait``'s
#: ``check``), in seconds: often enough to fail at once, rarely enough to cost nothing.
CHECK_EVERY_S = 0.01


class PushAborted(RuntimeError):
    """The other side of a streamed push has failed (it rang ``Doorbell.abort``); its own
    error is raised in its process."""


class Doorbell:
    """``ready`` counters, one per tp rank, a ``read`` counter and an ``abort`` counter, shared
    by every process of the tp group and its engine (``hal.shm.SharedCounters``: each access
    holds a file lock, which orders it after whatever its process wrote before, on aarch64
    hosts as on x86)."""

    def __init__(self, counters, tp: int) -> None:
        self.tp = int(tp)
        self.counters = counters

    @classmethod
    def create(cls, tp: int) -> tuple[Doorbell, tuple]:
        """A new doorbell for a tp group of ``tp`` ranks, all counters 0, and its handle."""
        from hal.shm import SharedCounters

        counters = SharedCounters.create(int(tp) + 2)
        return cls(counters, tp), (counters.path, int(tp))

    @classmethod
    def open(cls, handle: tuple) -> Doorbell:
        """Open the doorbell ``create`` made (in any process on the node)."""
        from hal.shm import SharedCounters

        path, tp = handle
        return cls(SharedCounters.open(path, int(tp) + 2), tp)

    @staticmethod
    def release(handle: tuple) -> None:
        """Drop the doorbell's file name once every process has opened it."""
        from hal.shm import unlink_counters

        unlink_counters(handle[0])

    def close(self) -> None:
        """This process is done with the doorbell."""
        self.counters.close()

    def ring(self, tp_rank: int, buckets: int) -> None:
        """Tp rank ``tp_rank`` has written its first ``buckets`` buckets."""
        self.counters.set(tp_rank, buckets)

    def ready(self) -> int:
        """Buckets every tp rank has written."""
        return min(self.counters.values()[: self.tp])

    def mark_read(self, buckets: int) -> None:
        """The engine has loaded the first ``buckets`` buckets."""
        self.counters.set(self.tp, buckets)

    def read(self) -> int:
        """Buckets the engine has loaded."""
        return self.counters.values()[self.tp]

    def abort(self, who: int) -> None:
        """``who`` (``ENGINE`` or ``RANK``) has failed: every waiter on this push stops now.
        The first side to abort is the one named."""
        if not self.counters.values()[self.tp + 1]:
            self.counters.set(self.tp + 1, who)

    def aborted(self) -> str | None:
        """Who stopped the push (``abort``), or None."""
        who = self.counters.values()[self.tp + 1]
        return _WHO.get(who, f"side {who}") if who else None

    def wait(
        self,
        count: Callable[[], int],
        target: int,
        what: str,
        timeout_s: float,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Wait until ``count() >= target``. Raise ``PushAborted`` at once when the other side
        has aborted the push, and ``TimeoutError`` naming ``what`` after ``timeout_s`` seconds.
        ``check``: called every ``CHECK_EVERY_S`` seconds while waiting, to raise the other
        side's own error as soon as its call has ended (e.g. a Ray reply's)."""
        deadline = time.monotonic() + timeout_s
        next_check = time.monotonic() + CHECK_EVERY_S
        pause = 1e-5
        while count() < target:
            who = self.aborted()
            if who is not None:
                raise PushAborted(
                    f"weight push: {who} failed while this side waited for {what} (bucket "
                    f"{target}); its error is in its own log"
                )
            now = time.monotonic()
            if check is not None and now >= next_check:
                check()
                next_check = now + CHECK_EVERY_S
            if now > deadline:
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
    close_bucket: Callable[[tuple], None] | None = None,
) -> int:
    """The engine's side of a streamed push: load ``buckets`` in order from the staging
    ``slots`` (per slot, every tp rank's buffer handle in tp rank order), each once every tp
    rank has rung for it, and finish the update before the last ``read`` mark (no view of a
    staging buffer outlives the call). ``engine`` is an ``Engine`` whose weights are awake.
    An error here stops the ranks' waits at once (``Doorbell.abort``), and a rank's failure
    stops this one. This process's mappings of the slots are closed at the end
    (``close_bucket``, default ``hal.close_shared_buffer``). Returns the number of tensors
    loaded."""
    if close_bucket is None:
        from hal.handoff import close_shared_buffer as close_bucket
    bell = Doorbell.open(doorbell)
    loaded = 0
    try:
        for k, specs in enumerate(buckets):
            bell.wait(bell.ready, k + 1, "every tp rank to write its bucket", timeout_s)
            specs = [TensorSpec(*s) for s in specs]
            engine.load_shared_bucket(open_bucket, slots[k % len(slots)], specs)
            loaded += len(specs)
            if k == len(buckets) - 1:
                engine.finish_weight_update()
            bell.mark_read(k + 1)
    except BaseException:
        bell.abort(ENGINE)
        raise
    finally:
        bell.close()
        for handles in slots:
            for handle in handles:
                close_bucket(tuple(handle))
    return loaded
