"""Shared-memory files: a flat buffer that processes on one host map without a copy, and a
few counters they read and write in order.

The CPU backend's shared buffers (``CpuBackend.shared_buffer``) and their readers
(``hal.open_shared_buffer``) both use it; it sits below both, so neither imports the other.
"""

from __future__ import annotations

import fcntl
import os
import struct
import tempfile
import uuid
import weakref
from collections import OrderedDict

import torch

#: Most shared-memory files one process keeps mapped; the least recently opened goes first.
#: A push closes its own mappings when it ends (``close_shm_file``); the bound caps what a
#: failed push or a caller that never closes leaves behind.
MAX_MAPPINGS = 32

#: Shared-memory files this process has mapped, by path, least recently opened first: a
#: reader maps each buffer once for all the buckets of a push, not once per bucket.
_MAPPED: OrderedDict[str, torch.Tensor] = OrderedDict()


def shm_dir() -> str:
    """Where shared buffers live: /dev/shm (memory, not disk) when there is one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def open_shm_file(path: str, nbytes: int, *, create: bool = False) -> torch.Tensor:
    """The flat uint8 tensor mapped onto shared-memory file ``path`` (``nbytes`` bytes),
    mapped once per process and kept until ``close_shm_file`` (or until ``MAX_MAPPINGS``
    newer ones push it out): later buckets reuse the mapping. ``create``: make the file
    (its writer); a reader's file must exist, else a reader whose writer has already let go
    would map a fresh file of zeros."""
    mapped = _MAPPED.get(path)
    if mapped is None or mapped.numel() < nbytes:
        if not create and not os.path.exists(path):
            raise FileNotFoundError(
                f"shared buffer {path} is gone: its writer released it before this process "
                "mapped it (the writer stopped or failed; see its error)"
            )
        mapped = torch.from_file(path, shared=True, size=int(nbytes), dtype=torch.uint8)
        _MAPPED[path] = mapped
    _MAPPED.move_to_end(path)
    while len(_MAPPED) > MAX_MAPPINGS:
        _MAPPED.popitem(last=False)
    return mapped[:nbytes]


def close_shm_file(path: str) -> None:
    """This process is done with ``path``: drop its mapping, which the kernel unmaps once no
    tensor views it any more (the file's memory goes when every process has let go and the
    name is gone). Closing a file this process never mapped does nothing."""
    _MAPPED.pop(path, None)


class SharedCounters:
    """``n`` int64 counters in a small file that the processes of one host share (a
    doorbell: ``rollout.engines.weights.stream``); every read and write holds ``flock`` on the file.

    Why a lock rather than plain stores into a mapping: x86 makes one core's stores visible
    to the others in program order, but aarch64 (the hosts of Ascend A3 nodes) may show a
    store to a counter before the stores that preceded it (a bucket's bytes), and neither
    Python nor torch offers an atomic store or a fence. The kernel takes and drops a flock
    with acquire / release ordering on every architecture it runs on, so whatever a process
    wrote before it set a counter is visible to any process that reads that value after it,
    and no read sees half a write. The counters move through ``pwrite`` / ``pread`` under
    the lock, never through a mapping. A set or a read costs a few microseconds (three
    system calls)."""

    def __init__(self, path: str, n: int, fd: int) -> None:
        self.path, self.n, self._fd = path, int(n), fd
        self._close = weakref.finalize(self, os.close, fd)

    @classmethod
    def create(cls, n: int) -> SharedCounters:
        """``n`` new counters, all 0, in a fresh file under ``shm_dir()``."""
        path = os.path.join(shm_dir(), f"crossrl-counters-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, 8 * int(n))  # zeros
        return cls(path, n, fd)

    @classmethod
    def open(cls, path: str, n: int) -> SharedCounters:
        """The ``n`` counters another process made at ``path``."""
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"shared counters {path} are gone: their maker released them before this "
                "process opened them (it stopped or failed; see its error)"
            ) from None
        return cls(path, n, fd)

    def set(self, index: int, value: int) -> None:
        """Counter ``index`` becomes ``value``."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            os.pwrite(self._fd, struct.pack("=q", int(value)), 8 * int(index))
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def values(self) -> list[int]:
        """Every counter, read at one moment."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            data = os.pread(self._fd, 8 * self.n, 0)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        return list(struct.unpack(f"={self.n}q", data))

    def close(self) -> None:
        """Let go of the file (its name stays until ``unlink``)."""
        self._close()

    def unlink(self) -> None:
        """Drop the file's name once every process has opened it (open ones keep working)."""
        unlink_counters(self.path)


def unlink_counters(path: str) -> None:
    """Drop the name of the counters file at ``path`` (``SharedCounters.unlink``), if any."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
