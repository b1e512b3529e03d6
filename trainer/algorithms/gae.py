"""GAE: generalised advantage estimation with a learned critic (Schulman et al. 2016).

Over one trajectory's generated tokens t = 0..L-1 with token rewards r_t and
critic values V_t (the value of the state in which token t is generated):

    delta_t = r_t + gamma * V_{t+1} - V_t,   V_L = 0     # TD error
    A_t     = delta_t + gamma * lam * A_{t+1}, A_L = 0
    R_t     = A_t + V_t                                  # critic target (returns)

As in verl and the PPO reference code, the advantages (not the returns) are
then whitened over all real loss tokens of the batch.
"""

from __future__ import annotations

import numpy as np

from trainer.algorithms.common import reverse_discounted_cumsum, whiten


def gae_advantages(
    token_rewards,
    values,
    lengths,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten_advantages: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """GAE advantages and returns for concatenated sequences.

    Args:
        token_rewards: [n] rewards of the loss tokens, sequences concatenated,
            each in generation order.
        values: [n] critic values V_t, same layout.
        lengths: [S] tokens per sequence (sum = n).
        gamma: discount per generated token.
        lam: GAE lambda (1 = Monte-Carlo return minus V, 0 = one-step TD).
        whiten_advantages: whiten A over all n tokens (returns are never whitened).

    Returns:
        ``(advantages[n], returns[n])`` float64.
    """
    r = np.asarray(token_rewards, dtype=np.float64).reshape(-1)
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    lengths = np.asarray(lengths, dtype=np.int64)
    if r.shape != v.shape:
        raise ValueError(f"values has {v.size} tokens but token_rewards has {r.size}")
    # V_{t+1}: the next token's value within the same sequence, 0 after its end.
    next_v = np.zeros_like(v)
    if v.size:
        next_v[:-1] = v[1:]
        next_v[np.cumsum(lengths)[lengths > 0] - 1] = 0.0
    delta = r + gamma * next_v - v  # delta_t
    adv = reverse_discounted_cumsum(delta, lengths, gamma * lam)  # A_t
    returns = adv + v  # R_t
    return (whiten(adv) if whiten_advantages else adv), returns
