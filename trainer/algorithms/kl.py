"""KL(pi || pi_ref) per token from sampled-token log-probs (Schulman, "Approximating KL
Divergence"), and the per-token reward penalty built on it (``algorithm.use_kl_loss`` false); the KL loss
term of ``trainer.algorithms.losses`` takes the same estimate.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
"""Values allowed for a KL estimator (Schulman, "Approximating KL Divergence").
k3 is verl's ``low_var_kl``."""

# exp() of a log-ratio beyond +-20 overflows float16/bfloat16 ranges and carries no
# useful signal; clamping it (as verl does) keeps one bad token from making NaNs.
LOG_RATIO_CLAMP = 20.0
# k3 is unbounded above when the policy puts far less mass than the reference on a
# token; verl clamps the estimate to [-10, 10] and so do we, for comparable runs.
_K3_CLAMP = 10.0


def kl_divergence(logprobs, ref_logprobs, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token logprobs.

    With ``log_r = ref_logprobs - logprobs`` (tokens sampled from pi):
        k1 = -log_r                       unbiased, high variance, can be < 0
        k2 = 0.5 * log_r ** 2             biased, always >= 0
        k3 = exp(log_r) - log_r - 1       unbiased, >= 0, low variance; clamped to [-10, 10]

    Args:
        logprobs, ref_logprobs: [T] log-probabilities (nats) of the sampled tokens.
        estimator: one of ``KL_ESTIMATORS``.

    Returns:
        [T] KL estimate per token, in nats.
    """
    if estimator not in KL_ESTIMATORS:
        hint = " (verl's 'low_var_kl' is 'k3')" if estimator == "low_var_kl" else ""
        raise ValueError(
            f"KL estimator {estimator!r} is not supported{hint}; use one of "
            f"{', '.join(KL_ESTIMATORS)}"
        )
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    log_r = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(log_r) - log_r - 1.0).clamp(-_K3_CLAMP, _K3_CLAMP)


def kl_reward_penalty(
    logprobs, ref_logprobs, kl_coef: float, estimator: str, *, loss_mask
) -> torch.Tensor:
    """The KL-in-reward penalty per token, ``-kl_coef * KL_t`` where ``loss_mask`` is 1 and 0
    elsewhere (detached). ``compute_advantages(token_penalty=...)`` adds it to the token
    rewards (gae, reinforce_pp) or sums it into each trajectory's score (grpo, rloo,
    reinforce_pp_baseline), as verl does with its penalised token rewards."""
    if not kl_coef >= 0:
        raise ValueError(f"algorithm.kl_coef={kl_coef!r} must be >= 0")
    kl = kl_divergence(logprobs, ref_logprobs, estimator).detach()
    kl = torch.where(loss_mask > 0, kl, torch.zeros_like(kl))
    return -kl_coef * kl


def apply_kl_penalty(
    token_rewards, logprobs, ref_logprobs, kl_coef: float, estimator: str, *, loss_mask=None
) -> torch.Tensor:
    """Token rewards with a KL-to-reference penalty: ``r_t - kl_coef * KL_t``.

    This is the "KL in reward" variant (InstructGPT); the token estimators
    (GAE, REINFORCE++) then discount the penalty like any reward. The outcome
    estimators read the trajectory ``score``, so the trainer hands them
    ``kl_reward_penalty`` through ``compute_advantages(token_penalty=...)`` instead.

    Args:
        token_rewards: [T] rewards per token.
        logprobs, ref_logprobs: [T] sampled-token logprobs (nats) of the policy
            that generated the rollout and of the reference policy.
        kl_coef: penalty weight (reward units per nat), >= 0.
        estimator: one of ``KL_ESTIMATORS``.
        loss_mask: optional [T] 0/1; the penalty is applied only where it is 1.

    Returns:
        [T] penalised rewards (a new tensor; the arguments are left unchanged).
    """
    mask = torch.ones_like(logprobs) if loss_mask is None else loss_mask
    penalty = kl_reward_penalty(logprobs, ref_logprobs, kl_coef, estimator, loss_mask=mask)
    return token_rewards + penalty.to(token_rewards.dtype)
