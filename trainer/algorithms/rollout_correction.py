"""Rollout correction: truncated importance sampling between the engine and the trainer.

The rollout engine samples with its own kernels (and, with vLLM, its own numerics), so the
log-probs it reports for the sampled tokens (``rollout_logprobs``) differ from the trainer's
old log-probs (``old_logprobs``) of the same weights. The PPO ratio is taken against the
trainer's ``pi_old``; the samples came from ``pi_rollout``. Truncated importance sampling
(TIS, Yao et al. 2025) reweights each token's policy-gradient loss by

    w_t = min(pi_old(a_t) / pi_rollout(a_t), cap)                       # level "token"
    w_i = min(prod_t pi_old / pi_rollout over sequence i, cap)           # level "sequence"
    w_i = min(exp(mean_t log(pi_old / pi_rollout) over sequence i), cap)  # level "geometric"

the sequence levels' weight on each of the sequence's tokens; a constant (no gradient)
computed once per step. ``sequence`` is verl's sequence-level ``rollout_is`` (the product);
``geometric`` is the length-normalised ratio (verl's ``geometric`` aggregation, GSPO's
sequence ratio), which stays near 1 where the product of hundreds of per-token ratios sits at
0 or at the cap. A streamed trajectory that went on under new weights (partial rollouts) mixes
behaviour policies of several versions, its tokens' ratios spread the wider; there
``sequence`` takes the geometric mean too (AReaL's sequence-level ratio), so ``sequence`` keeps
its product, and every number it gave, wherever a sequence was sampled by one policy.

The mismatch itself is measured whatever the level: ``rollout/logprob_abs_diff`` (mean
|old - rollout| per loss token) and ``rollout/logprob_kl`` (k3 estimate of
KL(pi_rollout || pi_old) per loss token, nats).
"""

from __future__ import annotations

import torch

ROLLOUT_CORRECTION_LEVELS = ("none", "token", "sequence", "geometric")


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
    old_logprobs,
    rollout_logprobs,
    loss_mask,
    cu_seqlens,
    *,
    level: str,
    cap: float,
    versions=None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights ([T] float32, 1 off the loss mask) and their metrics.

    Args:
        old_logprobs, rollout_logprobs: [T] log-probs (nats) of the sampled tokens under the
            trainer's pre-update policy and as the engine reported them.
        loss_mask: [T] 0/1.
        cu_seqlens: [R+1] row offsets; a row is a sequence for the sequence levels.
        level: ``token``, ``sequence`` or ``geometric`` (``algorithm.rollout_correction``).
        cap: upper bound of a weight (``algorithm.rollout_correction_cap``), >= 1.
        versions: [T] policy version that sampled each token (a streamed batch's
            ``policy_version`` column, -1 off the response), or None. With ``sequence``, a row
            whose loss tokens came from more than one version takes the geometric mean.

    Returns:
        ``(weights, metrics)``; metrics ``rollout_correction/weight_mean`` and
        ``rollout_correction/capped_frac`` over loss tokens, and with ``sequence`` and
        ``versions`` ``rollout_correction/mixed_version_rows``: the share of rows (with loss
        tokens) that mixed versions and so took the geometric mean.
    """
    if level not in ROLLOUT_CORRECTION_LEVELS[1:]:
        raise ValueError(
            f"algorithm.rollout_correction={level!r}: use token, sequence or geometric"
        )
    if not cap >= 1.0:
        raise ValueError(f"algorithm.rollout_correction_cap={cap!r} must be >= 1")
    from trainer.algorithms.losses import row_of_token

    on = loss_mask > 0
    log_w = torch.where(on, (old_logprobs - rollout_logprobs).double(), 0.0)
    extra: dict[str, float] = {}
    if level != "token":
        row = row_of_token(cu_seqlens)
        rows = len(cu_seqlens) - 1
        total = torch.zeros(rows, dtype=torch.float64).index_add(0, row, log_w)
        count = torch.zeros(rows, dtype=torch.float64).index_add(0, row, on.double())
        mean = total / count.clamp(min=1.0)  # log of the geometric mean of the ratios
        if level == "geometric":
            seq = mean
        else:
            seq = total
            if versions is not None:
                mixed = _mixed_version_rows(versions, on, row, rows)
                seq = torch.where(mixed, mean, total)
                extra["rollout_correction/mixed_version_rows"] = float(mixed.sum()) / max(
                    int((count > 0).sum()), 1
                )
        log_w = seq[row]
    log_cap = torch.log(torch.tensor(cap, dtype=torch.float64))
    capped = on & (log_w > log_cap)
    weights = torch.where(on, torch.exp(torch.minimum(log_w, log_cap)), 1.0)
    n = max(int(on.sum()), 1)
    metrics = {
        "rollout_correction/weight_mean": float(weights[on].sum()) / n,
        "rollout_correction/capped_frac": float(capped.sum()) / n,
        **extra,
    }
    return weights.float(), metrics


def _mixed_version_rows(versions, on, row, rows: int) -> torch.Tensor:
    """[R] bool: rows whose loss tokens were sampled by more than one policy version."""
    v = versions.to(torch.int64)[on]
    where = row[on]
    low = torch.full((rows,), torch.iinfo(torch.int64).max, dtype=torch.int64)
    high = torch.full((rows,), torch.iinfo(torch.int64).min, dtype=torch.int64)
    low = low.scatter_reduce(0, where, v, "amin")
    high = high.scatter_reduce(0, where, v, "amax")
    return (high > low) & (low != torch.iinfo(torch.int64).max)
