"""The cpu backend: the reference every accelerator is checked against."""

from __future__ import annotations

import platform
import resource
import sys

import torch

from hal.base import DeviceBackend


class CpuBackend(DeviceBackend):
    """Plain CPU: gloo collectives, SDPA-per-segment attention, no memory to manage."""

    name = "cpu"
    device_type = "cpu"
    process_group_backend = "gloo"
    visible_devices_env = None
    ray_resource = "CPU"
    ray_noset_env_var = None
    is_accelerator = False

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

    def device_names(self) -> list[str]:
        """One human-readable name for the host processor."""
        return [platform.processor() or platform.machine() or "cpu"]
