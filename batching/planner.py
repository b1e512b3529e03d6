"""Trajectory-aware mini-batch planning: which rows go into which mini-batch, rank and micro-batch.

A *unit* is what `mini_batch_size` counts and what is never split across mini-batches: a group
(`group_ids` given, e.g. a GRPO prompt group) or else a trajectory. Rows of one unit may go to
different ranks of the same mini-batch: a row is the smallest thing the planner moves.

Pipeline (numpy integer arithmetic; every sort is on a unique key, ties broken by index, so
its result is the same everywhere; no floats, no `hash()`):

1. Dense ids: trajectory (and group) ids are numbered by first appearance in the input, so the
   plan never depends on `PYTHONHASHSEED` or on the type of the ids.
2. Mini-batches: `ceil(units / mini_batch_size)` of them. Units, largest first, are dealt in
   rounds of one unit per mini-batch, the largest unit of a round to the mini-batch with the
   fewest tokens so far. Every mini-batch gets `floor` or `ceil` of `units / mini_batches`
   units (so at most `mini_batch_size`); token totals differ by at most the largest unit
   (twice that when there are more than 1024 rounds, whose tail uses a snake order).
   The assignment does not depend on `dp_size` or the token budget, so runs with different
   device counts train on the same mini-batches (see `Plan.digest`).
3. Ranks: longest-processing-time-first over rows (largest first, each onto the lightest
   rank; past the 8192nd row of a mini-batch, rounds of `dp_size` rows, the i-th largest to
   the i-th lightest rank, to bound the Python loop), vectorised across mini-batches. Then,
   where the imbalance still exceeds 0.1 %, moves/swaps between the heaviest and lightest
   rank. Either way max - min rank tokens <= the longest row (promise 5).
4. Micro-batches: first-fit-decreasing under `max_tokens_per_micro_batch` per rank, then every
   rank of a mini-batch is brought to the same micro-batch count by splitting its largest
   multi-row micro-batches; a rank with fewer rows than that count gets one padding row (-1)
   per otherwise-empty micro-batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["MiniBatchPlan", "Plan", "plan_minibatches"]

#: Rows of a mini-batch placed one at a time (exact LPT) before rounds of `dp_size` rows.
_EXACT_LPT_ROWS = 8192
#: Refine a mini-batch's rank assignment when (max - mean) / mean exceeds 1 / this.
_REFINE_THRESHOLD_INV = 1000
#: Unit-to-mini-batch rounds handled one by one; later rounds use one frozen snake order.
_MAX_ADAPTIVE_ROUNDS = 1024


@dataclass
class MiniBatchPlan:
    """One mini-batch: `micro_batches[rank][k]` is a list of row indices, -1 = a padding row.

    Every rank has `num_micro_batches` non-empty micro-batches. `rows` holds the real row
    indices of the mini-batch in ascending order. `rank_tokens[r]` counts the tokens rank r
    computes (real rows + 2 per padding row); `rank_real_tokens[r]` only real rows' tokens.
    """

    index: int
    micro_batches: list[list[list[int]]]
    rows: np.ndarray
    num_units: int
    num_trajectories: int
    rank_tokens: np.ndarray
    rank_real_tokens: np.ndarray
    num_padding_rows: int

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank (the same on every rank)."""
        return len(self.micro_batches[0]) if self.micro_batches else 0

    @property
    def num_rows(self) -> int:
        """Real rows in this mini-batch."""
        return int(self.rows.size)

    @property
    def num_tokens(self) -> int:
        """Real tokens in this mini-batch."""
        return int(self.rank_real_tokens.sum())

    def rank_rows(self, rank: int) -> list[int]:
        """All row indices of `rank`, micro-batch after micro-batch (-1 = padding row)."""
        return [i for mb in self.micro_batches[rank] for i in mb]


@dataclass
class Plan:
    """The output of `plan_minibatches`. Per real row: `row_mini_batch`, `row_rank`,
    `row_micro_batch` (int64 `[R]`) say where the row went."""

    mini_batches: list[MiniBatchPlan]
    dp_size: int
    mini_batch_size: int
    max_tokens_per_micro_batch: int | None
    grouped: bool
    seq_lens: np.ndarray
    row_mini_batch: np.ndarray
    row_rank: np.ndarray
    row_micro_batch: np.ndarray
    _digest: str | None = field(default=None, repr=False)

    @property
    def num_mini_batches(self) -> int:
        return len(self.mini_batches)

    @property
    def num_padding_rows(self) -> int:
        return sum(mb.num_padding_rows for mb in self.mini_batches)

    def digest(self) -> str:
        """sha256 hex of which rows form each mini-batch, in mini-batch order.

        Independent of `dp_size` and the micro-batch budget on purpose: a run on 8 devices and one on 16
        run of the same job train on the same mini-batches and so share this digest. Use
        `layout_digest` to compare rank and micro-batch placement as well.
        """
        if self._digest is None:
            h = hashlib.sha256(b"crossrl-plan-v1")
            for mb in self.mini_batches:
                _hash_ints(h, mb.rows)
            self._digest = h.hexdigest()
        return self._digest

    def layout_digest(self) -> str:
        """sha256 hex of the whole layout: mini-batches, ranks, micro-batches, padding rows."""
        h = hashlib.sha256(b"crossrl-layout-v1")
        _hash_ints(h, np.array([self.dp_size], dtype=np.int64))
        for mb in self.mini_batches:
            for rank in mb.micro_batches:
                for micro in rank:
                    _hash_ints(h, np.asarray(micro, dtype=np.int64))
        return h.hexdigest()


def _hash_ints(h: Any, values: np.ndarray) -> None:
    """Feed a length-prefixed little-endian int64 array into a hash (same bytes everywhere)."""
    values = np.ascontiguousarray(values, dtype="<i8")
    h.update(np.array([values.size], dtype="<i8").tobytes())
    h.update(values.tobytes())


# ---------------------------------------------------------------------------- validation


def _check_positive_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name} = {value!r}; it must be an integer >= {minimum}")
    return int(value)


def _as_seq_lens(seq_lens: Any) -> np.ndarray:
    arr = np.asarray(seq_lens)
    if arr.ndim != 1:
        raise ValueError(f"seq_lens must be 1-D (one token count per row), got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind not in "bf":
            raise ValueError(f"seq_lens must hold integer token counts, got dtype {arr.dtype}")
        values = arr.tolist()
        bad = [i for i, v in enumerate(values) if not float(v).is_integer()]
        if bad:
            raise ValueError(
                f"seq_lens[{bad[0]}] = {values[bad[0]]!r}; seq_lens must be whole token counts"
            )
    arr = arr.astype(np.int64)
    if arr.min() < 1:
        bad = int(np.flatnonzero(arr < 1)[0])
        raise ValueError(
            f"seq_lens[{bad}] = {int(arr[bad])}; every row needs at least 1 token "
            "(drop empty rows before planning)"
        )
    return arr


def _dense_ids(values: Any, name: str) -> tuple[np.ndarray, list[Any]]:
    """Number the distinct values 0, 1, ... by first appearance. Returns (dense ids, the
    representative value of each dense id). Independent of hash() order by construction."""
    n = len(values)
    if n == 0:
        return np.zeros(0, dtype=np.int64), []
    arr = None
    if isinstance(values, np.ndarray):
        arr = values
    elif not isinstance(values[0], str | bytes | tuple):
        try:
            arr = np.asarray(values)
        except (ValueError, TypeError):
            arr = None
    if arr is not None and arr.ndim == 1 and arr.dtype.kind in "iub":
        uniq, first, inv = np.unique(arr, return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")
        rank = np.empty(order.size, dtype=np.int64)
        rank[order] = np.arange(order.size, dtype=np.int64)
        return rank[inv.reshape(-1)], uniq[order].tolist()
    seen: dict[Any, int] = {}
    try:
        dense = np.fromiter(
            (seen.setdefault(v, len(seen)) for v in values), dtype=np.int64, count=n
        )
    except TypeError as err:
        raise ValueError(f"{name} must hold hashable ids (ints or strings): {err}") from None
    return dense, list(seen)


# ---------------------------------------------------------------------------- stage 2


def _assign_units(unit_tokens: np.ndarray, num_mb: int) -> np.ndarray:
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


# ---------------------------------------------------------------------------- helpers


def _order(*keys: np.ndarray) -> np.ndarray:
    """Indices sorting by `keys` (major first; each non-negative int64; the last key must make
    the whole key unique, e.g. the row index). A unique key has exactly one sorted order, so
    the fast unstable sort is as deterministic as a stable one."""
    bound = 1
    for k in keys:
        bound *= int(k.max()) + 1 if k.size else 1
    if bound >= 2**62:
        return np.lexsort(keys[::-1])
    combined = keys[0].astype(np.int64)
    for k in keys[1:]:
        combined = combined * (int(k.max()) + 1) + k
    return np.argsort(combined)


def _position_in_group(group_sorted: np.ndarray) -> np.ndarray:
    """For a sorted array of group keys, the 0-based position of each element in its group."""
    n = group_sorted.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, group_sorted[1:] != group_sorted[:-1]])
    return np.arange(n, dtype=np.int64) - np.repeat(starts, np.diff(np.r_[starts, n]))


class _Walk:
    """Visit the members of many groups in lock step: step k yields the k-th member of every
    group that has more than k members, so one numpy operation serves all groups at once.
    `group_sorted` is the group of each member, in an order where each group's members are
    contiguous and in processing order."""

    def __init__(self, group_sorted: np.ndarray, num_groups: int) -> None:
        self.counts = np.bincount(group_sorted, minlength=num_groups)
        self.starts = np.zeros(num_groups, dtype=np.int64)
        np.cumsum(self.counts[:-1], out=self.starts[1:])
        # Groups by member count, largest first: the groups active at step k are a prefix.
        self.groups = np.argsort(-self.counts, kind="stable")
        sorted_counts = self.counts[self.groups]
        self.max_count = int(sorted_counts[0]) if num_groups else 0
        # active[k] = number of groups with more than k members
        self.active = np.searchsorted(-sorted_counts, -np.arange(self.max_count), side="left")

    def step(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(groups, positions into the grouped order) of the k-th members."""
        groups = self.groups[: self.active[k]]
        return groups, self.starts[groups] + k


# ---------------------------------------------------------------------------- stage 3


def _assign_ranks(
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
    by_mb = _order(row_mb, max_len - seq_lens, np.arange(n, dtype=np.int64))
    walk = _Walk(row_mb[by_mb], num_mb)
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


# ---------------------------------------------------------------------------- stage 4


def _first_fit_decreasing(
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
    by_grp = _order(grp, max_len - seq_lens, np.arange(n, dtype=np.int64))
    walk = _Walk(grp[by_grp], num_groups)
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


def _layout(
    grp: np.ndarray, row_bin: np.ndarray, lens: np.ndarray, num_mb: int, dp: int
) -> tuple[list[list[list[list[int]]]], np.ndarray]:
    """Turn per-row (group, bin) into `[mini_batch][rank][k] -> rows` with equal micro-batch
    counts per rank, largest micro-batch first, rows ascending inside one. Returns the
    layout and each row's micro-batch index k."""
    n = grp.size
    num_groups = num_mb * dp
    rows = np.arange(n, dtype=np.int64)
    order = _order(grp, row_bin, rows) if n else rows
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
    ranked = _order(bin_grp, max_tok - bin_tok, bin_first) if n else rows
    k_of_bin = np.empty(ranked.size, dtype=np.int64)
    k_of_bin[ranked] = _position_in_group(bin_grp[ranked])
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


# ---------------------------------------------------------------------------- entry point


def plan_minibatches(
    trajectory_ids: Sequence[Any],
    seq_lens: Sequence[int],
    *,
    mini_batch_size: int,
    dp_size: int,
    max_tokens_per_micro_batch: int | None = None,
    group_ids: Sequence[Any] | None = None,
) -> Plan:
    """Plan mini-batches, data-parallel ranks and micro-batches for one training step.

    Args:
        trajectory_ids: one hashable per row (ints, strings, ...).
        seq_lens: tokens of each row, integers >= 1.
        mini_batch_size: units per mini-batch; a unit is a group when `group_ids` is given,
            else a trajectory.
        dp_size: data-parallel ranks.
        max_tokens_per_micro_batch: token budget of one micro-batch (>= 2, the size of a
            padding row); None means one micro-batch per rank.
        group_ids: optional, one hashable per row; all rows of a trajectory must share it.

    Returns:
        A `Plan`; `plan.mini_batches[m].micro_batches[rank][k]` lists row indices, -1 being a
        padding row. See DESIGN.md ("The planner") for the seven promises it keeps.
    """
    mini_batch_size = _check_positive_int("mini_batch_size", mini_batch_size, 1)
    dp = _check_positive_int("dp_size", dp_size, 1)
    budget = None
    if max_tokens_per_micro_batch is not None:
        budget = _check_positive_int("max_tokens_per_micro_batch", max_tokens_per_micro_batch, 2)
    lens = _as_seq_lens(seq_lens)
    n = lens.size
    if len(trajectory_ids) != n:
        raise ValueError(
            f"trajectory_ids has {len(trajectory_ids)} entries but seq_lens has {n}; "
            "give one trajectory id and one length per row"
        )
    traj, traj_values = _dense_ids(trajectory_ids, "trajectory_ids")
    if group_ids is not None:
        if len(group_ids) != n:
            raise ValueError(
                f"group_ids has {len(group_ids)} entries but seq_lens has {n}; "
                "give one group id per row or None"
            )
        unit, group_values = _dense_ids(group_ids, "group_ids")
        group_of_traj = np.full(len(traj_values), -1, dtype=np.int64)
        group_of_traj[traj] = unit
        clash = np.flatnonzero(group_of_traj[traj] != unit)
        if clash.size:
            r = int(clash[0])
            raise ValueError(
                f"trajectory {traj_values[traj[r]]!r} has rows in group "
                f"{group_values[unit[r]]!r} and group {group_values[group_of_traj[traj[r]]]!r}; "
                "all rows of a trajectory must share one group id"
            )
        num_units = len(group_values)
    else:
        unit = traj
        num_units = len(traj_values)

    num_mb = -(-num_units // mini_batch_size)
    unit_tokens = np.bincount(unit, weights=lens, minlength=num_units).astype(np.int64)
    unit_mb = _assign_units(unit_tokens, num_mb) if num_units else unit_tokens
    row_mb = unit_mb[unit] if n else np.zeros(0, dtype=np.int64)

    row_rank, real_loads = _assign_ranks(row_mb, lens, num_mb, dp)

    grp = row_mb * dp + row_rank
    if budget is None:
        row_bin = np.zeros(n, dtype=np.int64)
    else:
        row_bin = _first_fit_decreasing(grp, lens, num_mb * dp, budget)
    layouts, row_micro = _layout(grp, row_bin, lens, num_mb, dp)

    rows_idx = np.arange(n, dtype=np.int64)
    by_mb = _order(row_mb, rows_idx) if n else rows_idx
    mb_starts = np.zeros(num_mb + 1, dtype=np.int64)
    np.cumsum(np.bincount(row_mb, minlength=num_mb), out=mb_starts[1:])
    # Trajectories never straddle mini-batches: each trajectory's rows share one row_mb value.
    traj_mb = np.zeros(len(traj_values), dtype=np.int64)
    traj_mb[traj] = row_mb
    num_traj_per_mb = np.bincount(traj_mb, minlength=num_mb)
    units_per_mb = np.bincount(unit_mb, minlength=num_mb)

    mini_batches = []
    for m, ranks in enumerate(layouts):
        pad_rows = np.array([sum(b[0] < 0 for b in g) for g in ranks], dtype=np.int64)
        mini_batches.append(
            MiniBatchPlan(
                index=m,
                micro_batches=ranks,
                rows=by_mb[mb_starts[m] : mb_starts[m + 1]],
                num_units=int(units_per_mb[m]),
                num_trajectories=int(num_traj_per_mb[m]),
                rank_tokens=real_loads[m] + 2 * pad_rows,
                rank_real_tokens=real_loads[m].copy(),
                num_padding_rows=int(pad_rows.sum()),
            )
        )
    return Plan(
        mini_batches=mini_batches,
        dp_size=dp,
        mini_batch_size=mini_batch_size,
        max_tokens_per_micro_batch=budget,
        grouped=group_ids is not None,
        seq_lens=lens,
        row_mini_batch=row_mb,
        row_rank=row_rank,
        row_micro_batch=row_micro,
    )
