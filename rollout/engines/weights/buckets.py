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


def weight_group(name: str) -> str:
    """The decoder layer a weight belongs to (``model.layers.3``), or the weight's own name:
    a bucket boundary never falls inside a layer, so an engine that rebuilds a layer once
    all its shards arrived (vLLM's layerwise reload: fused q/k/v, gate/up) finishes every
    complete layer within one bucket. A padded parameter (a vocabulary padded to a multiple)
    is never complete before the update's end, so an engine that defers anything copies it
    out of the bucket (``rollout.engines.vllm.worker``): a bucket's memory is rewritten
    once the engine has read it."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2])
    return name


def plan_buckets(
    items: Iterable[tuple[str, Sequence[int]]], dtype: torch.dtype, bucket_bytes: int
) -> tuple[list[list[TensorSpec]], int]:
    """Split named shapes, in order, into buckets of about ``bucket_bytes`` bytes each, never
    splitting a decoder layer (``weight_group``); a layer or tensor larger than that gets a
    bucket of its own. Returns the buckets' specs and the buffer size in bytes that holds the
    largest bucket."""
    runs: list[list[tuple[str, tuple[int, ...], int]]] = []
    for name, shape in items:
        size = _aligned(tensor_nbytes(shape, dtype))
        if not runs or weight_group(runs[-1][-1][0]) != weight_group(name):
            runs.append([])
        runs[-1].append((name, tuple(shape), size))
    buckets: list[list[TensorSpec]] = [[]]
    used = 0
    dtype_name = str(dtype).removeprefix("torch.")
    for run in runs:
        run_bytes = sum(size for _, _, size in run)
        if buckets[-1] and used + run_bytes > bucket_bytes:
            buckets.append([])
            used = 0
        for name, shape, size in run:
            buckets[-1].append(TensorSpec(name, dtype_name, shape, used))
            used += size
    largest = max(
        (s.offset + _aligned(tensor_nbytes(s.shape, dtype)) for b in buckets for s in b[-1:]),
        default=0,
    )
    return [b for b in buckets if b], largest


def stream_buckets(
    model_bytes: int, free_bytes: int, *, engine_bytes: int, reserve_bytes: int, floor_bytes: int
) -> tuple[int, int]:
    """``(bucket_bytes, slots)`` of a streamed weight push on a device with ``free_bytes``
    free (every rank's least, once the ranks have offloaded and the engine sleeps without
    its weights): the whole model (``model_bytes`` in the engine's dtype) in one bucket when
    it fits beside the engine's woken weights (``engine_bytes``) and ``reserve_bytes`` (one
    gathered tensor and the allocator's slack); else two slots of half the room, so the ranks
    fill one while the engine reads the other, never below ``floor_bytes`` (the largest
    layer, which a bucket holds whole)."""
    room = int(free_bytes) - int(engine_bytes) - int(reserve_bytes)
    if room >= model_bytes:
        return int(model_bytes), 1
    return max(room // 2, int(floor_bytes)), 2


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


def piece_specs(
    pieces: Sequence[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> tuple[list[TensorSpec], int]:
    """Where ``pack_pieces`` puts each of ``pieces`` in ``dtype``, and the bucket's bytes;
    reads only the tensors' shapes."""
    specs, used = [], 0
    dtype_name = str(dtype).removeprefix("torch.")
    for name, tensor in pieces:
        specs.append(TensorSpec(name, dtype_name, tuple(tensor.shape), used))
        used += _aligned(tensor_nbytes(tensor.shape, dtype))
    return specs, used


def pack_pieces(
    pieces: Sequence[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, list[TensorSpec]]:
    """One flat uint8 bucket (on ``device``; None: the CPU) holding ``pieces`` (``(name,
    tensor)``, any dtype; converted to ``dtype``) one after another, and their specs: what one
    training rank publishes of a snapshot bucket, its own rows of each tensor
    (``assemble_pieces`` joins the ranks')."""
    specs, used = piece_specs(pieces, dtype)
    flat = torch.empty(used, dtype=torch.uint8, device=device)
    for spec, (_, tensor) in zip(specs, pieces):
        pack_tensor(flat, spec, tensor.detach())
    return flat, specs


def assemble_pieces(
    per_rank: Sequence[Sequence[tuple[str, torch.Tensor]]],
) -> list[tuple[str, torch.Tensor]]:
    """Whole tensors from the ranks' pieces of one bucket (``per_rank[r]``: rank r's
    ``(name, rows)``, in the bucket's order): the pieces of a name joined along dim 0 in rank
    order (FSDP2 shards dim 0, rank r holding the r-th chunk), a name only one rank sent
    taken as it is. Names come out in the order they first appear."""
    order: list[str] = []
    parts: dict[str, list[torch.Tensor]] = {}
    for pieces in per_rank:
        for name, tensor in pieces:
            if name not in parts:
                order.append(name)
                parts[name] = []
            parts[name].append(tensor)
    return [
        (name, parts[name][0] if len(parts[name]) == 1 else torch.cat(parts[name], dim=0))
        for name in order
    ]
