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

This module holds the public entry point `plan_minibatches`, its result types (`Plan`,
`MiniBatchPlan`) and the input checks and dense ids of stage 1. Stages 2 and 3 live in
`batching.balance`, stage 4 in `batching.packing`, the digest bytes in `batching.digest`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batching.balance import assign_ranks, assign_units
from batching.digest import hash_layout, hash_mini_batch_rows
from batching.groupwise import order_by
from batching.packing import first_fit_decreasing, layout_micro_batches

__all__ = ["MiniBatchPlan", "Plan", "plan_minibatches"]


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
            self._digest = hash_mini_batch_rows(mb.rows for mb in self.mini_batches)
        return self._digest

    def layout_digest(self) -> str:
        """sha256 hex of the whole layout: mini-batches, ranks, micro-batches, padding rows."""
        return hash_layout(self.dp_size, (mb.micro_batches for mb in self.mini_batches))


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
    unit_mb = assign_units(unit_tokens, num_mb) if num_units else unit_tokens
    row_mb = unit_mb[unit] if n else np.zeros(0, dtype=np.int64)

    row_rank, real_loads = assign_ranks(row_mb, lens, num_mb, dp)

    grp = row_mb * dp + row_rank
    if budget is None:
        row_bin = np.zeros(n, dtype=np.int64)
    else:
        row_bin = first_fit_decreasing(grp, lens, num_mb * dp, budget)
    layouts, row_micro = layout_micro_batches(grp, row_bin, lens, num_mb, dp)

    rows_idx = np.arange(n, dtype=np.int64)
    by_mb = order_by(row_mb, rows_idx) if n else rows_idx
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
