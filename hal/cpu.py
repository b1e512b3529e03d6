"""The cpu backend: the reference every accelerator is checked against."""

from __future__ import annotations

import platform

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

    def device_names(self) -> list[str]:
        """One human-readable name for the host processor."""
        return [platform.processor() or platform.machine() or "cpu"]
