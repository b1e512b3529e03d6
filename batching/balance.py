"""Token balancing: which mini-batch each unit goes to, and which rank each row goes to.

Stages 2 and 3 of the planner (see `batching.planner`): units are dealt to mini-batches
largest first, each round's largest unit to the lightest mini-batch (`assign_units`); rows
are dealt to the ranks of their mini-batch by longest-processing-time-first, then refined by
moves/swaps between the heaviest and lightest rank (`assign_ranks`). Integer arithmetic and
sorts on unique keys only, so the result is the same on every machine.
"""

from __future__ import annotations

import numpy as np

from batching.groupwise import LockstepWalk, order_by

__all__ = ["assign_ranks", "assign_units"]

#: Rows of a mini-batch placed one at a time (exact LPT) before rounds of `dp_size` rows.
_EXACT_LPT_ROWS = 8192
#: Refine a mini-batch's rank assignment when (max - mean) / mean exceeds 1 / this.
_REFINE_THRESHOLD_INV = 1000
#: Unit-to-mini-batch rounds handled one by one; later rounds use one frozen snake order.
_MAX_ADAPTIVE_ROUNDS = 1024


# ---------------------------------------------------------------------------- stage 2


def assign_units(unit_tokens: np.ndarray, num_mb: int) -> np.ndarray:
    """Mini-batch of every unit: rounds of `num_mb` units, largest to lightest mini-batch."""
    num_units = unit_tokens.size
    unit_mb = np.empty(num_units, dtype=np.int64)
    if num_mb == 1:
        unit_mb[:] = 0
        return unit_mb
    order = np.lexsort((np.arange(num_units), -unit_tokens))  # tokens desc, id asc
    loads = np.zeros(num_mb, dtype=np.int64)
    mb_index = np.arange(num_mb)
    num_rounds = -(-num_units // num_mb)
    adaptive = min(num_rounds, _MAX_ADAPTIVE_ROUNDS)
    for r in range(adaptive):
        units = order[r * num_mb : (r + 1) * num_mb]
        lightest = np.lexsort((mb_index, loads))[: units.size]
        unit_mb[units] = lightest
        loads[lightest] += unit_tokens[units]
    if num_rounds > adaptive:
        # Many small units left: a snake over the current load order keeps totals within the
        # largest remaining unit without a Python loop per round.
        rest = order[adaptive * num_mb :]
        base = np.lexsort((mb_index, loads))
        pos = np.arange(rest.size)
        rnd, col = pos // num_mb, pos % num_mb
        col = np.where(rnd % 2 == 0, col, num_mb - 1 - col)
        unit_mb[rest] = base[col]
    return unit_mb


# ---------------------------------------------------------------------------- stage 3


def assign_ranks(
    row_mb: np.ndarray, seq_lens: np.ndarray, num_mb: int, dp: int
) -> tuple[np.ndarray, np.ndarray]:
    """Rank of every row (LPT per mini-batch, vectorised across mini-batches) and the
    resulting per-(mini-batch, rank) real token loads `[num_mb, dp]`."""
    n = row_mb.size
    row_rank = np.zeros(n, dtype=np.int64)
    loads = np.zeros((num_mb, dp), dtype=np.int64)
    if dp == 1 or n == 0:
        loads[:, 0] = np.bincount(row_mb, weights=seq_lens, minlength=num_mb).astype(np.int64)
        return row_rank, loads
    max_len = int(seq_lens.max())
    by_mb = order_by(row_mb, max_len - seq_lens, np.arange(n, dtype=np.int64))
    walk = LockstepWalk(row_mb[by_mb], num_mb)
    exact = min(walk.max_count, _EXACT_LPT_ROWS)
    for k in range(exact):
        mbs, at = walk.step(k)
        rows = by_mb[at]
        ranks = np.argmin(loads[mbs], axis=1)
        row_rank[rows] = ranks
        loads[mbs, ranks] += seq_lens[rows]
    for k in range(exact, walk.max_count, dp):
        # Rounds of dp rows per mini-batch: the i-th largest row to the i-th lightest rank.
        mbs, at = walk.step(k)
        lightest = np.argsort(loads[mbs], axis=1, kind="stable")
        for j in range(min(dp, walk.max_count - k)):
            keep = walk.counts[mbs] > k + j
            m_j, at_j = mbs[keep], at[keep] + j
            rows = by_mb[at_j]
            ranks = lightest[keep, j]
            row_rank[rows] = ranks
            loads[m_j, ranks] += seq_lens[rows]
    _refine_ranks(row_mb, row_rank, seq_lens, loads)
    return row_rank, loads


def _refine_ranks(
    row_mb: np.ndarray, row_rank: np.ndarray, seq_lens: np.ndarray, loads: np.ndarray
) -> None:
    """Move or swap rows between the heaviest and the lightest rank while that lowers their
    maximum, in mini-batches whose imbalance exceeds 1/_REFINE_THRESHOLD_INV. In place."""
    num_mb, dp = loads.shape
    totals = loads.sum(axis=1)
    excess = (loads.max(axis=1) * dp - totals) * _REFINE_THRESHOLD_INV > totals
    todo = np.flatnonzero(excess)
    if todo.size == 0:
        return
    order = np.argsort(row_mb, kind="stable")
    starts = np.searchsorted(row_mb[order], np.arange(num_mb + 1))
    for m in todo.tolist():
        members = order[starts[m] : starts[m + 1]]
        for _ in range(4 * dp):
            lm = loads[m]
            h, lo = int(np.argmax(lm)), int(np.argmin(lm))
            gap = int(lm[h] - lm[lo])
            if gap <= 1:
                break
            on_h = members[row_rank[members] == h]
            on_l = members[row_rank[members] == lo]
            # Best single move: the row from h closest to gap / 2 (must be < gap to help).
            best_gain, best = 0, None
            xs = seq_lens[on_h]
            ok = xs < gap
            if ok.any():
                cand = np.flatnonzero(ok)
                i = cand[np.argmin(np.abs(gap - 2 * xs[cand]))]
                gain = gap - abs(gap - 2 * int(xs[i]))
                if gain > best_gain:
                    best_gain, best = gain, (int(on_h[i]), None)
            # Best swap: x from h, y from lo with 0 < x - y < gap, x - y closest to gap / 2.
            if on_l.size and on_h.size:
                ly = np.argsort(seq_lens[on_l], kind="stable")
                ys = seq_lens[on_l][ly]
                want = xs - gap // 2
                j = np.clip(np.searchsorted(ys, want), 0, ys.size - 1)
                for jj in (j, np.clip(j - 1, 0, ys.size - 1)):
                    d = xs - ys[jj]
                    valid = (d > 0) & (d < gap)
                    if valid.any():
                        cand = np.flatnonzero(valid)
                        i = cand[np.argmin(np.abs(gap - 2 * d[cand]))]
                        gain = gap - abs(gap - 2 * int(d[i]))
                        if gain > best_gain:
                            best_gain, best = gain, (int(on_h[i]), int(on_l[ly[jj[i]]]))
            if best is None:
                break
            x, y = best
            dx = int(seq_lens[x]) - (int(seq_lens[y]) if y is not None else 0)
            row_rank[x] = lo
            if y is not None:
                row_rank[y] = h
            loads[m, h] -= dx
            loads[m, lo] += dx
