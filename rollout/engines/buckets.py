"""Weight buckets in shared memory: many named tensors packed into one flat byte buffer.

The weight sync hands an engine whole buckets instead of tensors: the training rank packs
gathered tensors into a buffer it shares with the engine on the same device (a /dev/shm file
on the CPU, an IPC handle on accelerators; ``hal``'s ``share_buffer`` / ``open_buffer``), and
sends only the specs below; the engine unpacks views of the same memory. Pure torch, no device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

#: Byte alignment of every tensor in a bucket (safe for any dtype's view).
ALIGN_BYTES = 64


class TensorSpec(NamedTuple):
    """Where one tensor lies in a bucket: ``offset`` in bytes, its dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def tensor_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype``."""
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * torch.empty((), dtype=dtype).element_size()


def plan_buckets(
    items: Iterable[tuple[str, Sequence[int]]], dtype: torch.dtype, bucket_bytes: int
) -> tuple[list[list[TensorSpec]], int]:
    """Split named shapes, in order, into buckets of about ``bucket_bytes`` bytes each; a
    tensor larger than that gets a bucket of its own. Returns the buckets' specs and the buffer
    size in bytes that holds the largest bucket."""
    buckets: list[list[TensorSpec]] = [[]]
    used = 0
    for name, shape in items:
        size = _aligned(tensor_nbytes(shape, dtype))
        if buckets[-1] and used + size > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(TensorSpec(name, str(dtype).removeprefix("torch."), tuple(shape), used))
        used += size
    largest = max(
        (s.offset + _aligned(tensor_nbytes(s.shape, dtype)) for b in buckets for s in b[-1:]),
        default=0,
    )
    return [b for b in buckets if b], largest


def tensor_view(flat: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The tensor ``spec`` describes, as a view of the bucket ``flat`` (uint8): no copy."""
    dtype = getattr(torch, spec.dtype)
    nbytes = tensor_nbytes(spec.shape, dtype)
    return flat[spec.offset : spec.offset + nbytes].view(dtype).view(spec.shape)


def pack_tensor(flat: torch.Tensor, spec: TensorSpec, tensor: torch.Tensor) -> None:
    """Copy ``tensor`` (any device or dtype, same shape) into its place in ``flat``."""
    tensor_view(flat, spec).copy_(tensor.reshape(spec.shape))


def unpack_bucket(
    flat: torch.Tensor, specs: Sequence[TensorSpec]
) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views of a bucket's tensors in ``flat`` (a uint8 tensor): no copy."""
    return [(spec.name, tensor_view(flat, spec)) for spec in specs]
