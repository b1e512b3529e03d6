"""REINFORCE++ (Hu 2025): token-level discounted returns, whitened over the batch.

Over one trajectory's generated tokens t = 0..L-1 with token rewards r_t:

    G_t = r_t + gamma * G_{t+1},   G_L = 0          # return-to-go
    A_t = (G_t - mean(G)) / std(G)                  # mean/std over ALL real loss
                                                    # tokens of the batch
No critic and no group baseline: the global whitening is the baseline.
"""

from __future__ import annotations

import numpy as np

from trainer.algorithms.common import reverse_discounted_cumsum, whiten


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
