"""RLOO: REINFORCE with a leave-one-out baseline (Ahmadian et al. 2024).

For the G trajectories of one prompt with outcome scores s_1..s_G, each one is
compared with the mean of the OTHER G-1:

    A_i = s_i - (sum_j s_j - s_i) / (G - 1)  =  G / (G - 1) * (s_i - mean(s))

A group of one has no other sample to be the baseline: its advantage is 0.
"""

from __future__ import annotations

import numpy as np

from trainer.algorithms.common import group_index


def rloo_advantages(scores, group_ids) -> np.ndarray:
    """Leave-one-out outcome advantage per trajectory.

    Args:
        scores: [N] outcome score of each trajectory.
        group_ids: [N] group (prompt ``uid``) of each trajectory.

    Returns:
        [N] float64 advantages, one per trajectory.
    """
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    index, num_groups = group_index(group_ids)
    count = np.bincount(index, minlength=num_groups).astype(np.float64)[index]  # G
    total = np.bincount(index, weights=s, minlength=num_groups)[index]  # sum_j s_j
    baseline = (total - s) / np.maximum(count - 1.0, 1.0)  # mean of the others
    return np.where(count > 1, s - baseline, 0.0)
