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


class _LastPlan:
    """The plan of the last key seen: every layer of a forward asks with the same one."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value = None

    def get(self, key: tuple, make):
        """``make()``'s result for ``key``, made again only when the key changes."""
        if key != self._key:
            self._key, self._value = key, make()
        return self._value


_LAST_GROUPS = _LastPlan()


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
    plan = _LAST_GROUPS.get((tuple(offsets), q.device), lambda: segment_groups(offsets, q.device))
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


#: Segments are bucketed by their lengths rounded up to this many tokens (prefix and own
#: length each), and padded to the bucket's: few SDPA calls also when prompt and response
#: lengths vary, at most this many padding keys and queries per segment.
PREFIX_BUCKET_TOKENS = 16


@dataclass(frozen=True)
class PrefixBucket:
    """``count`` segments padded to ``length`` tokens, each continuing a prefix padded to
    ``prefix_len`` tokens (0: none). ``q_index`` ``[count * length]`` and ``kv_index``
    ``[count * (prefix_len + length)]``: the tokens of the padded queries and keys (padding
    points at token 0); ``mask`` ``[count, 1, length, prefix_len + length]``: which keys each
    query sees (None: plain causal, no padding inside); ``real``: the real queries' places in
    ``q_index``."""

    q_index: torch.Tensor
    kv_index: torch.Tensor
    mask: torch.Tensor | None
    real: torch.Tensor
    count: int
    prefix_len: int
    length: int


@dataclass(frozen=True)
class PrefixGroups:
    """The buckets of a packed row's segments; ``inverse`` puts the concatenation of every
    bucket's real outputs back in token order."""

    buckets: tuple[PrefixBucket, ...]
    inverse: torch.Tensor


def _round_up(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum


def prefix_groups(
    offsets: list[int],
    parents: list[int],
    device: torch.device,
    *,
    quantum: int | None = None,
) -> PrefixGroups:
    """Bucket the segments of ``offsets`` (R+1 token boundaries) by (prefix length, length),
    each rounded up to ``quantum`` tokens; ``parents[s]``: the segment that segment ``s``
    continues, or -1. A parent continues nothing itself (one level of sharing). ``quantum``
    None: ``PREFIX_BUCKET_TOKENS``."""
    quantum = PREFIX_BUCKET_TOKENS if quantum is None else quantum
    by_shape: dict[tuple[int, int], list[int]] = {}
    for s, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        if end > start:
            p = parents[s]
            prefix = 0 if p < 0 else _round_up(offsets[p + 1] - offsets[p], quantum)
            by_shape.setdefault((prefix, _round_up(end - start, quantum)), []).append(s)
    buckets, order = [], []
    for (prefix, length), segments in sorted(by_shape.items()):
        q_index, kv_index, real, visible = [], [], [], []
        for j, s in enumerate(segments):
            own = list(range(offsets[s], offsets[s + 1]))
            p = parents[s]
            mine = [] if p < 0 else list(range(offsets[p], offsets[p + 1]))
            q_index.extend(own + [0] * (length - len(own)))
            kv_index.extend(mine + [0] * (prefix - len(mine)) + own + [0] * (length - len(own)))
            real.extend(range(j * length, j * length + len(own)))
            order.extend(own)
            visible.append(len(mine))
        mask = None
        if prefix:  # query i sees its prefix's real keys, then its own keys up to itself
            keys = torch.arange(prefix + length)
            own_part = keys[None, :] >= prefix
            causal = keys[None, :] <= prefix + torch.arange(length)[:, None]
            seen = torch.tensor(visible)[:, None, None]
            mask = ((keys[None, None, :] < seen) | (own_part & causal)[None])[:, None]
            mask = mask.to(device)
        buckets.append(
            PrefixBucket(
                q_index=torch.tensor(q_index, dtype=torch.long, device=device),
                kv_index=torch.tensor(kv_index, dtype=torch.long, device=device),
                mask=mask,
                real=torch.tensor(real, dtype=torch.long, device=device),
                count=len(segments),
                prefix_len=prefix,
                length=length,
            )
        )
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return PrefixGroups(tuple(buckets), inverse.to(device))


_LAST_PREFIX_GROUPS = _LastPlan()


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
    Segments share one batched SDPA call per bucket of lengths (``prefix_groups``), padded to
    the bucket's lengths; a continuation's queries see its keys through a mask (its prefix's
    real keys, then its own causally). The padding moves the last bits, never a value.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    plan = _LAST_PREFIX_GROUPS.get(
        (tuple(offsets), tuple(parents), q.device, PREFIX_BUCKET_TOKENS),
        lambda: prefix_groups(offsets, parents, q.device),
    )
    if not plan.buckets:
        return q.new_zeros(q.shape[0], num_heads, v.shape[-1])
    outputs = []
    for b in plan.buckets:
        span = b.prefix_len + b.length
        qs = q.index_select(0, b.q_index).view(b.count, b.length, num_heads, -1).transpose(1, 2)
        ks, vs = (
            x.index_select(0, b.kv_index).view(b.count, span, num_kv_heads, -1).transpose(1, 2)
            for x in (k, v)
        )
        out = F.scaled_dot_product_attention(
            qs,
            ks,
            vs,
            attn_mask=b.mask,
            dropout_p=dropout,
            is_causal=b.mask is None,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out = out.transpose(1, 2).reshape(b.count * b.length, num_heads, v.shape[-1])
        outputs.append(out.index_select(0, b.real))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
    return out.index_select(0, plan.inverse)
