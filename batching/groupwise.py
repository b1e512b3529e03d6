"""Vectorised helpers for working on many groups (mini-batches, ranks) at once.

The planner's stages run one numpy operation across all mini-batches instead of a Python loop
per mini-batch. These helpers give them a deterministic sort on a unique composite key
(`order_by`), each element's position within its group (`position_in_group`), and a walk
that visits the k-th member of every group in lock step (`LockstepWalk`).
"""

from __future__ import annotations

import numpy as np

__all__ = ["LockstepWalk", "order_by", "position_in_group"]


def order_by(*keys: np.ndarray) -> np.ndarray:
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


def position_in_group(group_sorted: np.ndarray) -> np.ndarray:
    """For a sorted array of group keys, the 0-based position of each element in its group."""
    n = group_sorted.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, group_sorted[1:] != group_sorted[:-1]])
    return np.arange(n, dtype=np.int64) - np.repeat(starts, np.diff(np.r_[starts, n]))


class LockstepWalk:
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
