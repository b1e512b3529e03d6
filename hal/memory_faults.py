"""What a backend says about running out of device memory (``DeviceBackend`` mixes this in).

- ``out_of_memory_patterns``: how the device's runtime words an out-of-memory error that does
  not reach Python as ``torch.OutOfMemoryError``: torch_npu raises its allocator's as that
  class (``c10::OutOfMemoryError``, "NPU out of memory. Tried to allocate ..."), but an op
  that fails to get its workspace inside CANN comes back as a plain RuntimeError carrying
  CANN's error code (EL0004, "Failed to allocate memory"); cuBLAS's failed workspace is
  ``CUBLAS_STATUS_ALLOC_FAILED``.

``hal.registry.is_out_of_memory`` asks every backend: the kernel set (``hal.kernels``) re-raises
such an error instead of falling back to the reference, which would need more memory still.
"""

from __future__ import annotations

import re


class MemoryFaults:
    """The out-of-memory half of a ``hal.DeviceBackend`` (see the module docstring)."""

    out_of_memory_patterns: tuple[str, ...] = ()
    """Regular expressions (``re.search`` on the error's text) that mark an error this
    device's runtime raised because device memory ran out."""

    @classmethod
    def is_out_of_memory(cls, err: BaseException) -> bool:
        """Whether ``err`` says device memory ran out: a ``torch.OutOfMemoryError`` (what
        torch's and torch_npu's caching allocators raise), or an error whose text matches
        ``out_of_memory_patterns``."""
        import torch

        if isinstance(err, torch.OutOfMemoryError):
            return True
        text = str(err)
        return any(re.search(pattern, text) for pattern in cls.out_of_memory_patterns)
