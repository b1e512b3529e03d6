"""GRPO: group-relative outcome advantage (Shao et al. 2024, DeepSeekMath).

For the G trajectories sampled from one prompt (one ``uid``) with outcome
scores s_1..s_G:

    A_i = (s_i - mean(s)) / (std(s) + eps)      # GRPO
    A_i =  s_i - mean(s)                        # Dr. GRPO (Liu et al. 2025), norm_adv_by_std=False

std is the unbiased (n-1) sample std, as in verl and TRL, so a run ported from
either sees the same advantages. A group of one has no baseline to compare with
(mean(s) = s_i): its advantage is 0.
"""

from __future__ import annotations

import numpy as np

from trainer.algorithms.common import group_index, group_mean_std


def grpo_advantages(
    scores, group_ids, *, norm_adv_by_std: bool = True, eps: float = 1e-6
) -> np.ndarray:
    """Outcome advantage per trajectory.

    Args:
        scores: [N] outcome score of each trajectory (one entry per trajectory,
            not per row or token).
        group_ids: [N] group (prompt ``uid``) of each trajectory.
        norm_adv_by_std: divide by the group std (GRPO); False gives Dr. GRPO.
        eps: added to the std so a group with equal scores gives 0, not NaN.

    Returns:
        [N] float64 advantages, one per trajectory.
    """
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    index, num_groups = group_index(group_ids)
    count, mean, std = group_mean_std(s, index, num_groups)
    adv = s - mean[index]  # s_i - mean(s)
    # A singleton group already gives s - s = 0; keep it 0 (not 0/0) even when eps = 0.
    multi = count[index] > 1
    if norm_adv_by_std:
        adv = adv / np.where(multi, std[index] + eps, 1.0)
    return np.where(multi, adv, 0.0)
