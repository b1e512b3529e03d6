"""Rollout correction: truncated importance sampling between the engine and the trainer.

The rollout engine samples with its own kernels (and, with vLLM, its own numerics), so the
log-probs it reports for the sampled tokens (``rollout_logprobs``) differ from the trainer's
old log-probs (``old_logprobs``) of the same weights. The PPO ratio is taken against the
trainer's ``pi_old``; the samples came from ``pi_rollout``. Truncated importance sampling
(TIS, Yao et al. 2025) reweights each token's policy-gradient loss by

    w_t = min(pi_old(a_t) / pi_rollout(a_t), cap)              # level "token"
    w_i = min(prod_t pi_old / pi_rollout over sequence i, cap)  # level "sequence", on each token

a constant (no gradient) computed once per step. The mismatch itself is measured whatever the
level: ``rollout/logprob_abs_diff`` (mean |old - rollout| per loss token) and
``rollout/logprob_kl`` (k3 estimate of KL(pi_rollout || pi_old) per loss token, nats).
"""

from __future__ import annotations

import torch

ROLLOUT_CORRECTION_LEVELS = ("none", "token", "sequence")


def mismatch_sums(old_logprobs, rollout_logprobs, loss_mask) -> dict[str, float]:
    """What ``mismatch_metrics`` averages, as sums over loss tokens (float64) and their
    count, so that pieces of a batch (ranks' rows) add up: ``mismatch_from_sums``."""
    on = loss_mask > 0
    d = (old_logprobs - rollout_logprobs)[on].double()
    k3 = torch.exp(d.clamp(-20, 20)) - 1.0 - d
    return {"abs_diff": float(d.abs().sum()), "kl": float(k3.sum()), "tokens": float(on.sum())}


def mismatch_from_sums(pieces: list[dict[str, float]]) -> dict[str, float]:
    """``mismatch_metrics`` from ``mismatch_sums`` of pieces that cover the batch once."""
    tokens = sum(p["tokens"] for p in pieces)
    if not tokens:
        return {"rollout/logprob_abs_diff": 0.0, "rollout/logprob_kl": 0.0}
    return {
        "rollout/logprob_abs_diff": sum(p["abs_diff"] for p in pieces) / tokens,
        "rollout/logprob_kl": sum(p["kl"] for p in pieces) / tokens,
    }


def mismatch_metrics(old_logprobs, rollout_logprobs, loss_mask) -> dict[str, float]:
    """``rollout/logprob_abs_diff`` and ``rollout/logprob_kl`` over loss tokens."""
    on = loss_mask > 0
    if not bool(on.any()):
        return {"rollout/logprob_abs_diff": 0.0, "rollout/logprob_kl": 0.0}
    d = (old_logprobs - rollout_logprobs)[on].double()  # log(pi_old / pi_rollout)
    k3 = torch.exp(d.clamp(-20, 20)) - 1.0 - d  # KL(pi_rollout || pi_old), tokens ~ pi_rollout
    return {
        "rollout/logprob_abs_diff": float(d.abs().mean()),
        "rollout/logprob_kl": float(k3.mean()),
    }


def rollout_correction_weights(
    old_logprobs, rollout_logprobs, loss_mask, cu_seqlens, *, level: str, cap: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights ([T] float32, 1 off the loss mask) and their metrics.

    Args:
        old_logprobs, rollout_logprobs: [T] log-probs (nats) of the sampled tokens under the
            trainer's pre-update policy and as the engine reported them.
        loss_mask: [T] 0/1.
        cu_seqlens: [R+1] row offsets; a row is a sequence for ``level="sequence"``.
        level: ``token`` or ``sequence`` (``algorithm.rollout_correction``).
        cap: upper bound of a weight (``algorithm.rollout_correction_cap``), >= 1.

    Returns:
        ``(weights, metrics)``; metrics ``rollout_correction/weight_mean`` and
        ``rollout_correction/capped_frac`` over loss tokens.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"algorithm.rollout_correction={level!r}: use token or sequence")
    if not cap >= 1.0:
        raise ValueError(f"algorithm.rollout_correction_cap={cap!r} must be >= 1")
    from trainer.algorithms.losses import row_of_token

    on = loss_mask > 0
    log_w = torch.where(on, (old_logprobs - rollout_logprobs).double(), 0.0)
    if level == "sequence":
        row = row_of_token(cu_seqlens)
        seq = torch.zeros(len(cu_seqlens) - 1, dtype=torch.float64).index_add(0, row, log_w)
        log_w = seq[row]
    log_cap = torch.log(torch.tensor(cap, dtype=torch.float64))
    capped = on & (log_w > log_cap)
    weights = torch.where(on, torch.exp(torch.minimum(log_w, log_cap)), 1.0)
    n = max(int(on.sum()), 1)
    metrics = {
        "rollout_correction/weight_mean": float(weights[on].sum()) / n,
        "rollout_correction/capped_frac": float(capped.sum()) / n,
    }
    return weights.float(), metrics
