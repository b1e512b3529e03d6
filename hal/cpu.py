"""The cpu backend: the reference every accelerator is checked against."""

from __future__ import annotations

import os
import platform
import resource
import sys
import uuid

import torch

from hal import RAY_RESOURCES
from hal.base import DeviceBackend
from hal.kernels import CPU as CPU_KERNELS
from hal.shm import close_shm_file, open_shm_file, shm_dir


class CpuBackend(DeviceBackend):
    """Plain CPU: gloo collectives, SDPA-per-segment attention, no memory to manage."""

    name = "cpu"
    device_type = "cpu"
    process_group_backend = "gloo"
    visible_devices_env = None
    ray_resource = RAY_RESOURCES["cpu"]
    ray_noset_env_var = None
    is_accelerator = False
    # gloo words a broken collective as a plain RuntimeError from its transport: past the
    # group's timeout ("[.../gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting
    # 20000ms for send ..."), or a peer gone ("[.../gloo/transport/tcp/pair.cc:537] Read
    # error [127.0.0.1]:44466: Connection reset by peer").
    collective_error_patterns = (
        r"gloo/transport/\S+\] (Timed out|Read error|Write error|Connection)",
    )
    # the eager reference for every op (the golden); per-block compilation when asked for
    kernel_providers = CPU_KERNELS

    def device(self, local_rank: int = 0) -> torch.device:
        """Always `cpu`: every rank shares the host; local_rank is accepted and ignored."""
        return torch.device("cpu")

    def device_count(self) -> int:
        """1: the host counts as one device."""
        return 1

    def set_device(self, local_rank: int) -> None:
        """No-op: there is one cpu device."""

    def synchronize(self) -> None:
        """No-op: cpu kernels run synchronously."""

    def empty_cache(self) -> None:
        """No-op: the cpu allocator has no cache to release."""

    def memory_stats(self) -> dict[str, int]:
        """Zeros: torch does not track cpu allocations per device."""
        return {"allocated": 0, "reserved": 0, "max_allocated": 0}

    def peak_memory_bytes(self) -> int:
        """Peak resident set size of this process over its whole life (bytes): the host is
        the device; the kernel keeps no resettable peak."""
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux counts KiB

    def reset_peak_memory(self) -> None:
        """No-op: a process's peak RSS cannot be reset."""

    def shared_buffer(self, nbytes: int, local_index: int = 0) -> tuple[torch.Tensor, tuple]:
        """A buffer in a shared-memory file (``shm_dir()``) that an engine process on this
        host maps without a copy; the handle is ``("file", path, nbytes)``."""
        path = os.path.join(shm_dir(), f"crossrl-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        return open_shm_file(path, nbytes, create=True), ("file", path, int(nbytes))

    def release_shared_buffer(self, handle: tuple) -> None:
        """Unlink the file: the name goes, so a crash later leaves nothing in /dev/shm, and
        this process forgets its own mapping of it (the memory stays while a tensor views it,
        in this process or a reader's; a reader closes its own, ``hal.close_shared_buffer``)."""
        try:
            os.unlink(handle[1])
        except FileNotFoundError:
            pass
        close_shm_file(handle[1])

    def device_names(self) -> list[str]:
        """One human-readable name for the host processor."""
        return [platform.processor() or platform.machine() or "cpu"]
