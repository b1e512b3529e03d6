"""Micro-batch packing: how each rank's rows are cut into micro-batches under the token budget.

Stage 4 of the planner (see `batching.planner`): first-fit-decreasing per (mini-batch, rank)
under `max_tokens_per_micro_batch` (`first_fit_decreasing`), then every rank of a mini-batch
is brought to the same micro-batch count by splitting its largest multi-row micro-batches and,
where a rank has too few rows, by one padding row (-1) per otherwise-empty micro-batch
(`layout_micro_batches`).
"""

from __future__ import annotations

import numpy as np

from batching.groupwise import LockstepWalk, order_by, position_in_group

__all__ = ["first_fit_decreasing", "layout_micro_batches"]


def first_fit_decreasing(
    grp: np.ndarray, seq_lens: np.ndarray, num_groups: int, budget: int
) -> np.ndarray:
    """Bin (micro-batch) index of every row within its group (mini-batch, rank): first-fit
    decreasing under `budget` tokens, vectorised across groups. A row longer than the budget
    gets a bin of its own."""
    n = grp.size
    row_bin = np.zeros(n, dtype=np.int64)
    if n == 0:
        return row_bin
    max_len = int(seq_lens.max())
    by_grp = order_by(grp, max_len - seq_lens, np.arange(n, dtype=np.int64))
    walk = LockstepWalk(grp[by_grp], num_groups)
    group_tokens = np.bincount(grp, weights=seq_lens, minlength=num_groups).astype(np.int64)
    # First fit leaves at most one bin half empty, so bins <= 2 * tokens / budget + 1.
    max_bins = int(np.minimum(walk.counts, 2 * group_tokens // budget + 2).max())
    loads = np.zeros((num_groups, max_bins), dtype=np.int64)
    used = np.zeros(num_groups, dtype=np.int64)
    for k in range(walk.max_count):
        g, at = walk.step(k)
        rows = by_grp[at]
        s = seq_lens[rows]
        fits = loads[g] + s[:, None] <= budget
        first = np.argmax(fits, axis=1)
        none = ~fits[np.arange(g.size), first]
        b = np.where(none, used[g], first)  # oversized row: a fresh bin
        row_bin[rows] = b
        loads[g, b] += s
        used[g] = np.maximum(used[g], b + 1)
    return row_bin


def _split_bin(members: list[int], seq_lens: np.ndarray) -> tuple[list[int], list[int]]:
    """Split a micro-batch in two with near-equal tokens (largest rows first, to the lighter)."""
    ordered = sorted(members, key=lambda r: (-int(seq_lens[r]), r))
    a: list[int] = []
    b: list[int] = []
    ta = tb = 0
    for r in ordered:
        if ta <= tb:
            a.append(r)
            ta += int(seq_lens[r])
        else:
            b.append(r)
            tb += int(seq_lens[r])
    return sorted(a), sorted(b)


def _equalise(bins: list[list[int]], target: int, seq_lens: np.ndarray) -> list[list[int]]:
    """Bring one rank to `target` micro-batches: split its largest multi-row micro-batches,
    then add one padding row per micro-batch that would still be empty. The result is ordered
    like every rank: most tokens first, ties by smallest row, padding last."""
    bins = [list(b) for b in bins]
    tokens = [int(seq_lens[b].sum()) for b in bins]
    while len(bins) < target:
        splittable = [i for i, b in enumerate(bins) if len(b) > 1]
        if not splittable:
            break
        best = max(splittable, key=lambda i: (tokens[i], -min(bins[i])))
        a, b = _split_bin(bins[best], seq_lens)
        bins[best], tokens[best] = a, int(seq_lens[a].sum())
        bins.append(b)
        tokens.append(int(seq_lens[b].sum()))
    order = sorted(range(len(bins)), key=lambda i: (-tokens[i], bins[i][0]))
    return [bins[i] for i in order] + [[-1] for _ in range(target - len(bins))]


def layout_micro_batches(
    grp: np.ndarray, row_bin: np.ndarray, lens: np.ndarray, num_mb: int, dp: int
) -> tuple[list[list[list[list[int]]]], np.ndarray]:
    """Turn per-row (group, bin) into `[mini_batch][rank][k] -> rows` with equal micro-batch
    counts per rank, largest micro-batch first, rows ascending inside one. Returns the
    layout and each row's micro-batch index k."""
    n = grp.size
    num_groups = num_mb * dp
    rows = np.arange(n, dtype=np.int64)
    order = order_by(grp, row_bin, rows) if n else rows
    gs, bs = grp[order], row_bin[order]
    starts = np.flatnonzero(np.r_[True, (gs[1:] != gs[:-1]) | (bs[1:] != bs[:-1])]) if n else rows
    ends = np.r_[starts[1:], n].astype(np.int64)
    bin_grp = gs[starts]
    bin_tok = np.add.reduceat(lens[order], starts) if n else rows
    bin_first = order[starts]  # smallest row of the bin: a unique tie-break
    bins_per_group = np.bincount(bin_grp, minlength=num_groups)
    target = np.maximum(1, bins_per_group.reshape(num_mb, dp).max(axis=1))
    # Within a rank: most tokens first, then the bin holding the smaller row index.
    max_tok = int(bin_tok.max()) if n else 0
    ranked = order_by(bin_grp, max_tok - bin_tok, bin_first) if n else rows
    k_of_bin = np.empty(ranked.size, dtype=np.int64)
    k_of_bin[ranked] = position_in_group(bin_grp[ranked])
    row_micro = np.empty(n, dtype=np.int64)
    row_micro[order] = np.repeat(k_of_bin, ends - starts)

    flat = order.tolist()
    st, en = starts.tolist(), ends.tolist()
    pieces = [flat[st[i] : en[i]] for i in ranked.tolist()]
    first_bin = np.zeros(num_groups + 1, dtype=np.int64)
    np.cumsum(bins_per_group, out=first_bin[1:])
    fb = first_bin.tolist()
    layouts = []
    for m in range(num_mb):
        ranks = []
        for g in range(m * dp, (m + 1) * dp):
            bins = pieces[fb[g] : fb[g + 1]]
            if len(bins) < target[m]:
                bins = _equalise(bins, int(target[m]), lens)
                for k, b in enumerate(bins):
                    if b[0] >= 0:
                        row_micro[b] = k
            ranks.append(bins)
        layouts.append(ranks)
    return layouts, row_micro
