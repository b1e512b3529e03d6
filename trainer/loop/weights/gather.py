"""Whole tensors out of FSDP2 shards for the push through the engines' transfer API
(``trainer.loop.weights.weight_group``): every rank takes part, bucket by bucket.

A tensor sharded on dim 0 (FSDP2's ``Shard(0)``: ``torch.chunk`` rows, the last ranks fewer or
none) is cast to the engine's dtype on each rank first (a cast is elementwise: the same bits as
gathering then casting, half the bytes for bf16), then the shards of a bucket of such tensors
travel in ONE all-gather of a flat buffer, each rank's rows of each tensor padded to the
chunk size: a model of hundreds of tensors takes a few collectives, not one per tensor (each a
round trip, the push's cost on a CPU). Any other placement is gathered by DTensor itself
(``full_tensor``); a plain tensor is itself.

The gather runs on the rank's device (``device``) whatever holds the shards: with
``train.param_offload`` FSDP2 keeps them in host memory, which the device's collective library
cannot gather, so each bucket's rows are copied to the device first.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch


def _sharded_rows(tensor) -> bool:
    from torch.distributed.tensor import DTensor, Shard

    return isinstance(tensor, DTensor) and tuple(tensor.placements) == (Shard(0),)


def _chunk(rows: int, ranks: int) -> int:
    return -(-rows // ranks)


def _gather_bucket(
    bucket: list[tuple[str, object]], dtype: torch.dtype, device: torch.device | None = None
) -> list[tuple[str, torch.Tensor]]:
    """The whole tensors of a bucket of ``Shard(0)`` DTensors (one mesh), in one all-gather
    on ``device`` (None: where the shards are)."""
    import torch.distributed as dist

    from hal.collectives import all_gather_flat

    group = bucket[0][1].device_mesh.get_group()
    ranks = dist.get_world_size(group)
    local = [t.to_local() for _, t in bucket]
    device = local[0].device if device is None else device
    widths = [_row(t) for _, t in bucket]  # elements per dim-0 row
    chunks = [_chunk(t.shape[0], ranks) for _, t in bucket]
    sizes = [c * w for c, w in zip(chunks, widths)]
    flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
    offset = 0
    for part, size in zip(local, sizes):
        count = part.numel()
        flat[offset : offset + count].copy_(part.reshape(-1))
        offset += size
    out = torch.empty(ranks * flat.numel(), dtype=dtype, device=device)
    all_gather_flat(out, flat, group=group)
    per_rank = out.view(ranks, -1)
    whole = []
    offset = 0
    for (name, tensor), chunk, width, size in zip(bucket, chunks, widths, sizes):
        rows = tensor.shape[0]
        pieces = []
        for rank in range(ranks):
            held = max(0, min(chunk, rows - rank * chunk))
            if held:
                pieces.append(per_rank[rank, offset : offset + held * width])
        whole.append((name, torch.cat(pieces).view(tuple(tensor.shape))))
        offset += size
    return whole


def _row(tensor) -> int:
    """Elements per dim-0 row of ``tensor``."""
    count = 1
    for dim in tensor.shape[1:]:
        count *= int(dim)
    return count


def whole_tensors(
    state: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    bucket_bytes: int,
    device: torch.device | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, whole tensor in dtype)`` of every entry of ``state`` in order, on every rank
    (each rank must iterate it whole: the gathers are collectives); ``Shard(0)`` tensors in
    buckets of about ``bucket_bytes`` bytes of ``dtype``, one all-gather each, on ``device``
    (the rank's; None: where the shards are). A plain tensor is a copy (the next update
    changes it in place)."""
    bucket: list[tuple[str, object]] = []
    size = 0
    for name, tensor in state.items():
        if _sharded_rows(tensor):
            cast = tensor.detach().to(dtype)
            bucket.append((name, cast))
            size += cast.numel() * dtype.itemsize
            if size >= bucket_bytes:
                yield from _gather_bucket(bucket, dtype, device)
                bucket, size = [], 0
            continue
        if bucket:  # the order of the state is kept
            yield from _gather_bucket(bucket, dtype, device)
            bucket, size = [], 0
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        yield name, full.detach().to(dtype=dtype, copy=True)
    if bucket:
        yield from _gather_bucket(bucket, dtype, device)
