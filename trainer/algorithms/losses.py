"""PPO-family losses, per token. Aggregation over tokens/rows is separate.

Every function here returns one value per packed token (shape ``[T]``), so the
same code serves every ``algorithm.loss_agg`` mode: ``loss_for_micro_batch``
combines the terms and hands them to ``batching.aggregate_loss``, which divides
by the mini-batch's GLOBAL counts. Metrics come back as masked SUMS for the same
reason: the trainer adds them over micro-batches and ranks, then divides once.

Symbols (PPO, Schulman et al. 2017; dual clip, Ye et al. 2020; GSPO, Zheng et al. 2025):
    ratio  r_t = pi(a_t|s_t) / pi_old(a_t|s_t) = exp(logp - old_logp)
    s_i    GSPO's sequence ratio: the geometric mean of r_t over sequence i's loss tokens
    w_t    rollout-correction weight, min(pi_old / pi_rollout, cap), a constant
    A_t    advantage
    eps_lo, eps_hi   clip_ratio_low / clip_ratio_high (asymmetric, DAPO)
    c      clip_ratio_c, the dual-clip bound for A_t < 0
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils.checkpoint

import batching
from trainer.algorithms.kl import LOG_RATIO_CLAMP, kl_divergence
from trainer.config.schema import Config

# ----------------------------------------------------------------------------- policy


def ppo_policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float,
):
    """PPO clipped surrogate with asymmetric clip and dual clip, per token.

        L_t = max(-A_t * r_t, -A_t * clip(r_t, 1 - eps_lo, 1 + eps_hi))
        L_t = min(L_t, -A_t * c)        only where A_t < 0 (dual clip)

    Args:
        logprobs: [T] current policy logprobs (carry the gradient).
        old_logprobs: [T] logprobs of the policy before this update (no gradient).
        advantages: [T] A_t.
        clip_ratio_low: eps_lo, in [0, 1).
        clip_ratio_high: eps_hi >= 0; None means eps_lo (symmetric PPO).
        clip_ratio_c: c > 1, bound on the loss of a negative-advantage token
            whose ratio has run away.

    Returns:
        ``(loss[T], ratio[T], clipped[T], dual_clipped[T])``; the flags are
        float 0/1: ``clipped`` where the clipped surrogate was the larger term
        (its gradient is 0), ``dual_clipped`` where the dual clip bound applied.
    """
    if clip_ratio_high is None:
        clip_ratio_high = clip_ratio_low
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"algorithm.clip_ratio_low={clip_ratio_low!r} must be in [0, 1)")
    if not clip_ratio_high >= 0.0:
        raise ValueError(f"algorithm.clip_ratio_high={clip_ratio_high!r} must be >= 0")
    if not clip_ratio_c > 1.0:
        raise ValueError(
            f"algorithm.clip_ratio_c={clip_ratio_c!r} must be > 1 (dual clip bounds -A*r at "
            f"r = c; 3.0 is the usual value)"
        )
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # r_t
    surr1 = -advantages * ratio  # -A r
    surr2 = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # -A clip(r)
    clip_loss = torch.maximum(surr1, surr2)
    clipped = (surr2 > surr1).to(logprobs.dtype)
    surr3 = -advantages * clip_ratio_c  # -A c
    negative = advantages < 0
    dual_clipped = (negative & (clip_loss > surr3)).to(logprobs.dtype)
    loss = torch.where(negative, torch.minimum(clip_loss, surr3), clip_loss)
    return loss, ratio, clipped, dual_clipped


def row_of_token(cu_seqlens) -> torch.Tensor:
    """[T] index of the packed row each token belongs to (``cu_seqlens``: [R+1] offsets)."""
    cu = torch.as_tensor(cu_seqlens, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)


def gspo_policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    loss_mask,
    cu_seqlens,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float | None = None,
):
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, clipped per sequence.

        s_i     = exp( sum_t m_t (logp_t - old_logp_t) / max(1, sum_t m_t) )
        s_i,t   = sg[s_i] * exp(logp_t - sg[logp_t])     # value s_i; gradient s_i * d logp_t
        L_t     = max(-A_t * s_i,t, -A_t * clip(s_i,t, 1 - eps_lo, 1 + eps_hi))

    The sequence is a packed row (``cu_seqlens``), its tokens those with ``loss_mask`` 1. No
    dual clip. As in verl, log s_i is clamped at 10 nats from above.

    Returns:
        ``(loss[T], ratio[T], clipped[T], dual_clipped[T])`` like ``ppo_policy_loss``;
        ``ratio`` is s_i on each token of sequence i, ``dual_clipped`` is all 0.
    """
    if clip_ratio_high is None:
        clip_ratio_high = clip_ratio_low
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"algorithm.clip_ratio_low={clip_ratio_low!r} must be in [0, 1)")
    row = row_of_token(cu_seqlens).to(logprobs.device)
    on = loss_mask > 0
    num_rows = int(row.max()) + 1 if row.numel() else 0
    log_ratio = torch.where(on, (logprobs - old_logprobs).detach(), torch.zeros_like(logprobs))
    seq_sum = torch.zeros(num_rows, dtype=logprobs.dtype, device=logprobs.device)
    seq_sum = seq_sum.index_add(0, row, log_ratio)
    count = torch.zeros(num_rows, dtype=logprobs.dtype, device=logprobs.device)
    count = count.index_add(0, row, on.to(logprobs.dtype))
    seq_log_ratio = seq_sum / count.clamp(min=1.0)  # log s_i
    log_s = (logprobs - logprobs.detach() + seq_log_ratio[row]).clamp(max=10.0)
    ratio = torch.exp(log_s)  # s_i,t
    surr1 = -advantages * ratio
    surr2 = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(surr1, surr2)
    clipped = (surr2 > surr1).to(logprobs.dtype)
    return loss, ratio, clipped, torch.zeros_like(clipped)


# ----------------------------------------------------------------------------- value


def value_loss(values, old_values, returns, *, cliprange_value: float):
    """Clipped value loss (PPO2 / verl critic), per token.

        V_clip = old_V + clip(V - old_V, -cliprange_value, cliprange_value)
        L_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)

    Args:
        values: [T] current critic predictions (carry the gradient).
        old_values: [T] critic predictions at rollout time (no gradient).
        returns: [T] targets R_t from ``compute_advantages``.
        cliprange_value: how far V may move from old_V before the loss stops
            rewarding the move, > 0.

    Returns:
        ``(loss[T], clipped[T])``; ``clipped`` is float 0/1 where the clipped
        error was the larger one.
    """
    if not cliprange_value > 0:
        raise ValueError(f"algorithm.cliprange_value={cliprange_value!r} must be > 0")
    v_clip = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    err1 = (values - returns).square()
    err2 = (v_clip - returns).square()
    return 0.5 * torch.maximum(err1, err2), (err2 > err1).to(values.dtype)


# ----------------------------------------------------------------------------- combine


@dataclass
class PolicyLossTerms:
    """Per-token ([T]) pieces of the actor loss and its metrics.

    ``kl`` (to the reference policy) and ``entropy`` are None when not computed.
    """

    pg_loss: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor
    approx_kl: torch.Tensor
    kl: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def policy_loss_terms(
    logprobs,
    old_logprobs,
    advantages,
    *,
    ref_logprobs=None,
    entropy=None,
    kl_estimator: str,
    clip_ratio_low: float,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float,
    policy_loss: str = "ppo",
    loss_mask=None,
    cu_seqlens=None,
    is_weights=None,
) -> PolicyLossTerms:
    """All per-token actor terms for one micro-batch.

    Args:
        logprobs: [T] current logprobs of the sampled tokens (with gradient).
        old_logprobs: [T] logprobs before this update.
        advantages: [T] from ``compute_advantages``.
        ref_logprobs: [T] reference-policy logprobs; when given, ``kl`` is the
            KL-to-reference loss term (with gradient).
        entropy: [T] per-token entropy (``trainer.loop.ranks.forward.packed_token_logprobs``).
        kl_estimator: one of ``trainer.algorithms.kl.KL_ESTIMATORS`` for the KL loss term.
        clip_ratio_low, clip_ratio_high, clip_ratio_c: see ``ppo_policy_loss``.
        policy_loss: ``algorithm.policy_loss``: ppo (``ppo_policy_loss``) or gspo
            (``gspo_policy_loss``, which needs ``loss_mask`` and ``cu_seqlens``).
        is_weights: optional [T] rollout-correction weights w_t (constants) that
            multiply the policy-gradient loss (``trainer.algorithms.rollout_correction``).

    Returns:
        ``PolicyLossTerms``; ``approx_kl`` is k1 between the old and current
        policy (old - new, detached), the usual "how far did this update move" metric.
    """
    if policy_loss == "gspo":
        if loss_mask is None or cu_seqlens is None:
            raise ValueError("algorithm.policy_loss=gspo needs loss_mask and cu_seqlens")
        pg_loss, ratio, clipped, dual_clipped = gspo_policy_loss(
            logprobs,
            old_logprobs,
            advantages,
            loss_mask,
            cu_seqlens,
            clip_ratio_low=clip_ratio_low,
            clip_ratio_high=clip_ratio_high,
        )
    elif policy_loss == "ppo":
        pg_loss, ratio, clipped, dual_clipped = ppo_policy_loss(
            logprobs,
            old_logprobs,
            advantages,
            clip_ratio_low=clip_ratio_low,
            clip_ratio_high=clip_ratio_high,
            clip_ratio_c=clip_ratio_c,
        )
    else:
        raise ValueError(f"algorithm.policy_loss={policy_loss!r}: use ppo or gspo")
    if is_weights is not None:
        pg_loss = pg_loss * is_weights.detach().to(pg_loss.dtype)  # w_t * L_t
    kl = None if ref_logprobs is None else kl_divergence(logprobs, ref_logprobs, kl_estimator)
    return PolicyLossTerms(
        pg_loss=pg_loss,
        ratio=ratio.detach(),
        clipped=clipped,
        dual_clipped=dual_clipped,
        approx_kl=(old_logprobs - logprobs).detach(),
        kl=kl,
        entropy=entropy,
    )


def _masked(x: torch.Tensor, loss_mask) -> torch.Tensor:
    # where(), not x * mask: a NaN/inf on a padding token times 0 is still NaN.
    return torch.where(loss_mask > 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sums(terms: PolicyLossTerms, loss_mask) -> dict[str, torch.Tensor]:
    """Detached float64 SUMS over loss tokens of every per-token metric.

    Keys: ``loss_tokens`` (count), ``pg_loss``, ``clipped``, ``dual_clipped``,
    ``approx_kl``, ``ratio``, and ``kl`` / ``entropy`` when present. The trainer
    adds these over micro-batches and ranks and divides by the global loss-token
    count (e.g. clip fraction = sum(clipped) / num_loss_tokens). Tokens with
    ``loss_mask`` 0, hence padding rows, add exactly 0.
    """
    out = {"loss_tokens": (loss_mask > 0).sum().to(torch.float64)}
    for name in ("pg_loss", "clipped", "dual_clipped", "approx_kl", "ratio", "kl", "entropy"):
        value = getattr(terms, name)
        if value is not None:
            out[name] = _masked(value.detach(), loss_mask).to(torch.float64).sum()
    return out


def loss_for_micro_batch(
    terms: PolicyLossTerms,
    loss_mask,
    cu_seqlens,
    normalizers,
    *,
    mode: str,
    kl_loss_coef: float = 0.0,
    entropy_coef: float = 0.0,
    horizon: int | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch actor loss (a scalar).

        loss_t = pg_loss_t + kl_loss_coef * kl_t - entropy_coef * entropy_t

    aggregated with ``batching.aggregate_loss`` under ``mode``
    (``algorithm.loss_agg``) and the mini-batch's GLOBAL ``normalizers``, so the
    shares of all micro-batches on all ranks add up to the mini-batch loss
    whatever the split or the padding. Every mode is linear in ``loss_t``, so
    combining before aggregating equals aggregating each term.

    The trainer calls ``backward()`` on this value multiplied by ``dp_size``:
    FSDP averages gradients over ranks, and the global normalizers already
    divide by the whole mini-batch, so the sum the normalizers expect needs that
    factor back. It is not applied here.

    Args:
        terms: from ``policy_loss_terms``.
        loss_mask: [T] 0/1 of this micro-batch.
        cu_seqlens: [R+1] int64 row offsets of this micro-batch.
        normalizers: the mini-batch's ``batching.LossNormalizers``.
        mode: token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm.
        kl_loss_coef: weight of the KL-to-reference term (needs ``terms.kl``).
        entropy_coef: weight of the entropy bonus (needs ``terms.entropy``).
        horizon: tokens, the constant divisor of ``seq-mean-token-sum-norm``.
    """
    token_loss = terms.pg_loss
    if kl_loss_coef:
        if terms.kl is None:
            raise ValueError(
                f"kl_loss_coef={kl_loss_coef!r} (algorithm.kl_coef with algorithm.use_kl_loss) "
                "but no ref_logprobs were given to policy_loss_terms; pass ref_logprobs or "
                "set kl_loss_coef=0"
            )
        token_loss = token_loss + kl_loss_coef * terms.kl
    if entropy_coef:
        if terms.entropy is None:
            raise ValueError(
                f"algorithm.entropy_coef={entropy_coef!r} but no entropy was given to "
                f"policy_loss_terms; pass entropy or set entropy_coef=0"
            )
        token_loss = token_loss - entropy_coef * terms.entropy
    return batching.aggregate_loss(
        _masked(token_loss, loss_mask), loss_mask, cu_seqlens, normalizers, mode, horizon=horizon
    )


def value_loss_for_micro_batch(
    values,
    old_values,
    returns,
    loss_mask,
    cu_seqlens,
    normalizers,
    *,
    mode: str,
    cliprange_value: float,
    horizon: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the mini-batch critic loss, plus metric sums.

    The loss is ``value_loss`` aggregated like ``loss_for_micro_batch`` (same
    global normalizers, same ``dp_size`` note). The sums (detached float64, over
    loss tokens only) are ``loss_tokens``, ``vf_loss``, ``vf_clipped``,
    ``values`` and ``returns``; divide them by the global loss-token count.
    """
    loss, clipped = value_loss(values, old_values, returns, cliprange_value=cliprange_value)
    share = batching.aggregate_loss(
        _masked(loss, loss_mask), loss_mask, cu_seqlens, normalizers, mode, horizon=horizon
    )
    sums = {"loss_tokens": (loss_mask > 0).sum().to(torch.float64)}
    for name, x in (
        ("vf_loss", loss),
        ("vf_clipped", clipped),
        ("values", values),
        ("returns", returns),
    ):
        sums[name] = _masked(x.detach(), loss_mask).to(torch.float64).sum()
    return share, sums


def actor_loss(
    logprobs,
    old_logprobs,
    advantages,
    loss_mask,
    cu_seqlens,
    normalizers,
    cfg: Config,
    *,
    ref_logprobs=None,
    entropy=None,
    is_weights=None,
) -> tuple[torch.Tensor, PolicyLossTerms]:
    """The job's actor loss for one micro-batch: ``policy_loss_terms`` and
    ``loss_for_micro_batch`` with ``cfg.algorithm``'s settings (the KL loss term only with
    ``use_kl_loss``; ``is_weights``, the rollout-correction weights, only with
    ``rollout_correction``). Returns this micro-batch's share of the mini-batch loss and its
    terms."""
    algo = cfg.algorithm
    terms = policy_loss_terms(
        logprobs,
        old_logprobs,
        advantages,
        ref_logprobs=ref_logprobs if algo.use_kl_loss else None,
        entropy=entropy,
        kl_estimator=algo.kl_estimator,
        clip_ratio_low=algo.clip_ratio_low,
        clip_ratio_high=algo.clip_ratio_high,
        clip_ratio_c=algo.clip_ratio_c,
        policy_loss=algo.policy_loss,
        loss_mask=loss_mask,
        cu_seqlens=cu_seqlens,
        is_weights=is_weights if algo.rollout_correction != "none" else None,
    )
    loss = loss_for_micro_batch(
        terms,
        loss_mask,
        cu_seqlens,
        normalizers,
        mode=algo.loss_agg,
        kl_loss_coef=algo.kl_coef if algo.use_kl_loss else 0.0,
        entropy_coef=algo.entropy_coef,
        horizon=cfg.loss_horizon_tokens(),
    )
    return loss, terms
