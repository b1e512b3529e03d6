"""Shared-memory files: a flat buffer that processes on one host map without a copy.

The CPU backend's shared buffers (``CpuBackend.shared_buffer``) and their readers
(``hal.open_shared_buffer``) both use it; it sits below both, so neither imports the other.
"""

from __future__ import annotations

import os
import tempfile

import torch

#: Shared-memory files this process has mapped, by path: a reader maps each buffer once.
_MAPPED: dict[str, torch.Tensor] = {}


def shm_dir() -> str:
    """Where shared buffers live: /dev/shm (memory, not disk) when there is one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def open_shm_file(path: str, nbytes: int) -> torch.Tensor:
    """The flat uint8 tensor mapped onto shared-memory file ``path`` (``nbytes`` bytes),
    mapped once per process and kept: later buckets reuse the mapping."""
    mapped = _MAPPED.get(path)
    if mapped is None or mapped.numel() < nbytes:
        mapped = torch.from_file(path, shared=True, size=int(nbytes), dtype=torch.uint8)
        _MAPPED[path] = mapped
    return mapped[:nbytes]
