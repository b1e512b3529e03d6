"""Reference varlen causal attention: torch SDPA over the segments of a packed row.

Runs on any device torch runs on; the cpu backend uses it, the others fall back to it. It computes
exactly what separate per-sequence calls would, which is why it is the reference the fused kernels
are checked against.

Segments of equal length go through ONE batched SDPA call (``[B, H, L, D]``): SDPA computes every
batch element on its own with the same tiling, so the numbers are bit for bit those of one call
per segment, forward and backward (``tests/test_hal_sdpa.py``), with far fewer calls: a GRPO
group's samples share a prompt, so a micro-batch of 64 short rows holds only a dozen lengths.
Padding segments to a common length would be fewer calls still, but it moves the last bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SegmentGroups:
    """Segments of a packed row grouped by length, in tokens.

    ``order``: token indices that lay every group out contiguously (None when the row already
    is: lengths non-decreasing along it); ``inverse`` undoes it. ``groups``: per group
    ``(first, count, length)``: its first token in the reordered row, its number of segments and
    their common length.
    """

    order: torch.Tensor | None
    inverse: torch.Tensor | None
    groups: tuple[tuple[int, int, int], ...]


def segment_groups(offsets: list[int], device: torch.device) -> SegmentGroups:
    """Group the non-empty segments of ``offsets`` (R+1 token boundaries) by length."""
    by_length: dict[int, list[int]] = {}
    for start, end in zip(offsets[:-1], offsets[1:]):
        if end > start:
            by_length.setdefault(end - start, []).append(start)
    lengths = sorted(by_length)
    groups, first, starts = [], 0, []
    for length in lengths:
        group = by_length[length]
        groups.append((first, len(group), length))
        first += len(group) * length
        starts.extend((s, length) for s in group)
    if all(a[0] < b[0] for a, b in zip(starts, starts[1:])):
        return SegmentGroups(None, None, tuple(groups))
    order = torch.cat([torch.arange(s, s + n) for s, n in starts]) if starts else torch.zeros(0)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return SegmentGroups(order.to(device), inverse.to(device), tuple(groups))


class _LastGroups:
    """The grouping of the last offsets seen: every layer of a forward has the same ones."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: SegmentGroups | None = None

    def get(self, offsets: list[int], device: torch.device) -> SegmentGroups:
        key = (tuple(offsets), device)
        if key != self._key:
            self._key, self._value = key, segment_groups(offsets, device)
        return self._value


_LAST_GROUPS = _LastGroups()


def segmented_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: list[int],
    *,
    scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention per segment of a packed row, TND layout.

    q: [T, H, D]; k, v: [T, Hkv, D] (Hkv divides H: grouped-query attention); offsets: the R+1
    segment boundaries in tokens, from 0 to T (empty segments allowed). Returns [T, H, D].
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    plan = _LAST_GROUPS.get(offsets, q.device)
    if not plan.groups:
        return q.new_zeros(q.shape[0], num_heads, v.shape[-1])
    if plan.order is not None:
        q, k, v = (x.index_select(0, plan.order) for x in (q, k, v))
    outputs = []
    for first, count, length in plan.groups:
        end = first + count * length
        # [B*L, H, D] -> [B, H, L, D], the layout SDPA wants
        qs, ks, vs = (
            x[first:end].view(count, length, x.shape[1], x.shape[2]).transpose(1, 2)
            for x in (q, k, v)
        )
        out = F.scaled_dot_product_attention(
            qs,
            ks,
            vs,
            dropout_p=dropout,
            is_causal=True,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        outputs.append(out.transpose(1, 2).reshape(count * length, num_heads, v.shape[-1]))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
    return out if plan.order is None else out.index_select(0, plan.inverse)
