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


# ----------------------------------------------------------------------------- shared prefixes


@dataclass(frozen=True)
class PrefixGroups:
    """Segments of a packed row whose queries and keys are gathered alike, grouped by shape.

    ``groups``: per group ``(q_index, kv_index, count, prefix_len, length)``: the group's
    ``count`` segments of ``length`` tokens each continue a segment of ``prefix_len`` tokens
    (0: none); ``q_index`` ``[count * length]`` are their tokens, ``kv_index``
    ``[count * (prefix_len + length)]`` the tokens they attend to (the prefix, then their own).
    ``inverse``: undoes the concatenation of every group's ``q_index``.
    """

    groups: tuple[tuple[torch.Tensor, torch.Tensor, int, int, int], ...]
    inverse: torch.Tensor


def prefix_groups(offsets: list[int], parents: list[int], device: torch.device) -> PrefixGroups:
    """Group the segments of ``offsets`` (R+1 token boundaries) by (prefix length, length);
    ``parents[s]``: the segment that segment ``s`` continues, or -1. A parent continues
    nothing itself (one level of sharing)."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    for s, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        if end > start:
            p = parents[s]
            prefix = 0 if p < 0 else offsets[p + 1] - offsets[p]
            by_shape.setdefault((prefix, end - start), []).append(s)
    groups, order = [], []
    for (prefix, length), segments in sorted(by_shape.items()):
        q_index, kv_index = [], []
        for s in segments:
            own = list(range(offsets[s], offsets[s + 1]))
            p = parents[s]
            kv_index.extend(([] if p < 0 else list(range(offsets[p], offsets[p + 1]))) + own)
            q_index.extend(own)
        order.extend(q_index)
        q_t = torch.tensor(q_index, dtype=torch.long, device=device)
        kv_t = torch.tensor(kv_index, dtype=torch.long, device=device)
        groups.append((q_t, kv_t, len(segments), prefix, length))
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return PrefixGroups(tuple(groups), inverse.to(device))


class _LastPrefixGroups:
    """The grouping of the last (offsets, parents) seen: every layer of a forward has the same."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: PrefixGroups | None = None

    def get(self, offsets: list[int], parents: list[int], device: torch.device) -> PrefixGroups:
        key = (tuple(offsets), tuple(parents), device)
        if key != self._key:
            self._key, self._value = key, prefix_groups(offsets, parents, device)
        return self._value


_LAST_PREFIX_GROUPS = _LastPrefixGroups()


def prefix_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: list[int],
    parents: list[int],
    *,
    scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention per segment of a packed row where a segment may continue another.

    A segment ``s`` with ``parents[s] = p >= 0`` is the rest of a sequence whose first tokens
    are segment ``p`` (a prompt several samples share): its tokens attend to all of ``p``'s
    tokens, then causally to its own, exactly as if the sequence ``p + s`` were a segment of
    its own. Segments with ``parents[s] = -1`` are ordinary causal segments. q: [T, H, D];
    k, v: [T, Hkv, D]; offsets: R+1 segment boundaries in tokens. Returns [T, H, D].
    Segments of one shape share one batched SDPA call; a continuation's queries see its keys
    through a bottom-right causal mask.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    plan = _LAST_PREFIX_GROUPS.get(offsets, parents, q.device)
    if not plan.groups:
        return q.new_zeros(q.shape[0], num_heads, v.shape[-1])
    outputs = []
    for q_index, kv_index, count, prefix, length in plan.groups:
        span = prefix + length
        qs = q.index_select(0, q_index).view(count, length, num_heads, q.shape[2]).transpose(1, 2)
        ks, vs = (
            x.index_select(0, kv_index).view(count, span, num_kv_heads, x.shape[2]).transpose(1, 2)
            for x in (k, v)
        )
        if prefix == 0:
            mask, causal = None, True
        else:  # query i (at position prefix + i of its sequence) sees keys 0 .. prefix + i
            rows = torch.arange(prefix, span, device=q.device)[:, None]
            mask, causal = torch.arange(span, device=q.device)[None, :] <= rows, False
        out = F.scaled_dot_product_attention(
            qs,
            ks,
            vs,
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=causal,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        outputs.append(out.transpose(1, 2).reshape(count * length, num_heads, v.shape[-1]))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
    return out.index_select(0, plan.inverse)
