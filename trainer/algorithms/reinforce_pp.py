"""REINFORCE++ (Hu 2025): token-level discounted returns, whitened over the batch.

Over one trajectory's generated tokens t = 0..L-1 with token rewards r_t:

    G_t = r_t + gamma * G_{t+1},   G_L = 0          # return-to-go
    A_t = (G_t - mean(G)) / std(G)                  # mean/std over ALL real loss
                                                    # tokens of the batch
No critic and no group baseline: the global whitening is the baseline.

REINFORCE++ with a group baseline (verl's ``reinforce_plus_plus_baseline``) works on outcome
scores instead: for the G trajectories of one prompt with scores s_1..s_G,

    A_i = s_i - mean(s)                             # per trajectory, on each of its tokens
    A_t = (A_t - mean(A)) / std(A)                  # then whitened over ALL real loss tokens
"""

from __future__ import annotations

import numpy as np

from trainer.algorithms.common import (
    group_index,
    group_mean_std,
    reverse_discounted_cumsum,
    whiten,
)


def reinforce_pp_advantages(
    token_rewards, lengths, *, gamma: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """REINFORCE++ advantages and returns for concatenated sequences.

    Args:
        token_rewards: [n] rewards of the loss tokens, sequences concatenated,
            each in generation order.
        lengths: [S] tokens per sequence (sum = n).
        gamma: discount per generated token.

    Returns:
        ``(advantages[n], returns[n])`` float64; returns are G_t before whitening.
    """
    returns = reverse_discounted_cumsum(token_rewards, lengths, gamma)  # G_t
    return whiten(returns), returns


def reinforce_pp_baseline_advantages(scores, group_ids) -> np.ndarray:
    """Group-centred outcome score per trajectory, ``s_i - mean(s)`` over its group (a group
    of one gives 0). The caller puts it on the trajectory's loss tokens and whitens over the
    batch's tokens (``compute_advantages``).

    Args:
        scores: [N] outcome score of each trajectory.
        group_ids: [N] group (prompt ``uid``) of each trajectory.

    Returns:
        [N] float64, one per trajectory.
    """
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    index, num_groups = group_index(group_ids)
    _count, mean, _std = group_mean_std(s, index, num_groups)
    return s - mean[index]
