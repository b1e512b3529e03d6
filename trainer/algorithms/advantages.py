"""``compute_advantages``: run one estimator over a packed ``StepBatch``.

The estimators in this package work on plain arrays; this module owns the
layout questions they should not care about:

- Outcome estimators (GRPO, RLOO, REINFORCE++ with baseline) see one score per trajectory,
  taken from its ``is_last_step`` row and grouped by that row's ``uid``. A KL reward penalty
  (``token_penalty``) is summed over the trajectory's loss tokens into that score before the
  group statistics, as verl sums its penalised token rewards. The trajectory's
  advantage is then broadcast to EVERY row of that trajectory, under each row's
  own ``loss_mask``: in step-wise mode an early step must not get 0 just because
  the outcome arrived at the last step.
- Token estimators (GAE, REINFORCE++) chain a trajectory's loss tokens, step by
  step in ``step_index`` order, into one sequence, run the recursion over it and
  scatter the result back. Tokens outside the loss mask (prompts, tool
  observations, an appended EOS) are skipped, so discounting counts generated
  tokens only. Whole-trajectory mode is the one-step case of the same rule.
- Padding rows and tokens with ``loss_mask`` 0 get exactly 0.
"""

from __future__ import annotations

import numpy as np
import torch

from trainer.algorithms.common import whiten
from trainer.algorithms.gae import gae_advantages
from trainer.algorithms.grpo import grpo_advantages
from trainer.algorithms.reinforce_pp import (
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
)
from trainer.algorithms.rloo import rloo_advantages

ADV_ESTIMATORS = ("grpo", "rloo", "gae", "reinforce_pp", "reinforce_pp_baseline")
"""Values allowed for ``algorithm.adv_estimator``."""


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _field(batch, name: str, required_by: str) -> np.ndarray:
    value = getattr(batch, name, None)
    if value is None:
        # Optional StepBatch fields (values, ...) live only in its field dicts.
        for fields in ("token_fields", "row_fields"):
            value = getattr(batch, fields, {}).get(name, value)
    if value is None:
        raise ValueError(
            f"batch.{name} is missing but algorithm.adv_estimator={required_by!r} needs it; "
            f"fill it before compute_advantages (or pick another estimator)"
        )
    return _np(value)


def _token_layout(batch, estimator: str):
    """(row_of_token[T], real_loss_token[T] bool) for a packed batch."""
    cu = _field(batch, "cu_seqlens", estimator).astype(np.int64)
    loss_mask = _field(batch, "loss_mask", estimator)
    is_padding = _field(batch, "is_padding", estimator).astype(bool)
    row_of_token = np.repeat(np.arange(cu.size - 1), np.diff(cu))
    if row_of_token.size != loss_mask.size:
        raise ValueError(
            f"batch.cu_seqlens ends at {int(cu[-1])} but batch.loss_mask has {loss_mask.size} "
            f"tokens; cu_seqlens must be [0, ..., total tokens]"
        )
    return row_of_token, (loss_mask > 0) & ~is_padding[row_of_token]


#: Estimators that read one outcome score per trajectory (and group by ``uid``).
OUTCOME_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline")


def _outcome_per_row(
    batch,
    estimator: str,
    *,
    norm_adv_by_std: bool,
    eps: float,
    score_penalty: dict | None = None,
) -> np.ndarray:
    """Outcome advantage of each row's trajectory ([R] float64; 0 on padding rows).
    ``score_penalty``: trajectory id -> amount added to its score first (KL in reward)."""
    traj = _field(batch, "trajectory_id", estimator)
    is_padding = _field(batch, "is_padding", estimator).astype(bool)
    last = _field(batch, "is_last_step", estimator).astype(bool) & ~is_padding
    last_traj = traj[last]
    uniq, counts = np.unique(last_traj, return_counts=True)
    if np.any(counts > 1):
        raise ValueError(
            f"trajectory_id {uniq[counts > 1][0]} has {counts.max()} rows with is_last_step=True; "
            f"each trajectory needs exactly one last step"
        )
    real_traj = traj[~is_padding]
    missing = ~np.isin(real_traj, last_traj)
    if np.any(missing):
        raise ValueError(
            f"trajectory_id {real_traj[missing][0]} has no row with is_last_step=True, so it has "
            f"no outcome score; keep every step of a trajectory in the batch handed to "
            f"compute_advantages"
        )
    scores = _field(batch, "score", estimator)[last].astype(np.float64)
    if score_penalty:
        scores = scores + np.array([score_penalty.get(int(t), 0.0) for t in last_traj])
    groups = _field(batch, "uid", estimator)[last]
    if estimator == "grpo":
        traj_adv = grpo_advantages(scores, groups, norm_adv_by_std=norm_adv_by_std, eps=eps)
    elif estimator == "rloo":
        traj_adv = rloo_advantages(scores, groups)
    else:
        traj_adv = reinforce_pp_baseline_advantages(scores, groups)
    # Broadcast: row -> its trajectory's last-step entry.
    sorter = np.argsort(last_traj, kind="stable")
    row_adv = np.zeros(traj.size, dtype=np.float64)
    real = ~is_padding
    row_adv[real] = traj_adv[sorter[np.searchsorted(last_traj, traj[real], sorter=sorter)]]
    return row_adv


def _chain(batch, estimator: str, row_of_token: np.ndarray, real_token: np.ndarray):
    """Order real loss tokens trajectory by trajectory, in step order.

    Returns ``(token_index[n], lengths[S])``: ``token_index`` lists positions in
    the packed batch; consecutive runs of ``lengths`` are one trajectory each.
    """
    tokens = np.nonzero(real_token)[0]
    rows = row_of_token[tokens]
    traj = _field(batch, "trajectory_id", estimator)[rows]
    step = _field(batch, "step_index", estimator)[rows]
    # lexsort: last key is primary -> by trajectory, then step, then position.
    order = np.lexsort((tokens, step, traj))
    _, lengths = np.unique(traj[order], return_counts=True)
    return tokens[order], lengths


def compute_advantages(
    batch,
    estimator: str,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
    whiten_gae: bool = True,
    token_penalty=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns for every token of a packed batch.

    Args:
        batch: a ``batching.StepBatch`` (any object with its field names works).
            Reads ``cu_seqlens``, ``loss_mask``, ``is_padding``, ``trajectory_id``
            and: ``score``, ``uid``, ``is_last_step`` (grpo, rloo, reinforce_pp_baseline);
            ``token_rewards``, ``step_index`` (reinforce_pp, gae); ``values`` (gae).
            Hand it whole trajectories: a trajectory's steps must all be present.
        estimator: ``algorithm.adv_estimator``, one of ``ADV_ESTIMATORS``.
        gamma: discount per generated token (gae, reinforce_pp).
        lam: GAE lambda (gae).
        norm_adv_by_std: GRPO divides by the group std; False is Dr. GRPO.
        eps: GRPO std epsilon.
        whiten_gae: whiten GAE advantages over the batch's real loss tokens.
        token_penalty: optional [T] reward added per token (the KL penalty,
            ``-kl_coef * KL_t``, 0 off the loss mask): the token estimators add it to
            ``token_rewards``; the outcome estimators add each trajectory's sum over its real
            loss tokens to its score, before the group statistics.

    Returns:
        ``(advantages[T], returns[T])`` float32 tensors over all packed tokens,
        exactly 0 on padding rows and wherever ``loss_mask`` is 0. For the outcome
        estimators the returns equal the advantages (there is no critic to fit).
        reinforce_pp_baseline: the group-centred score ``s_i - mean(s)`` of each
        trajectory on its tokens, whitened over the batch's real loss tokens.
    """
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(
            f"algorithm.adv_estimator={estimator!r} is not supported; use one of "
            f"{', '.join(ADV_ESTIMATORS)}"
        )
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"algorithm.{name}={value!r} must be in [0, 1]")
    row_of_token, real_token = _token_layout(batch, estimator)
    penalty = None if token_penalty is None else _np(token_penalty).astype(np.float64)
    adv = np.zeros(row_of_token.size, dtype=np.float64)
    ret = np.zeros(row_of_token.size, dtype=np.float64)
    if estimator in OUTCOME_ESTIMATORS:
        score_penalty = None
        if penalty is not None:
            traj_of_token = _field(batch, "trajectory_id", estimator)[row_of_token[real_token]]
            tids, where = np.unique(traj_of_token, return_inverse=True)
            sums = np.bincount(where.reshape(-1), weights=penalty[real_token])
            score_penalty = dict(zip(tids.tolist(), sums.tolist()))
        row_adv = _outcome_per_row(
            batch, estimator, norm_adv_by_std=norm_adv_by_std, eps=eps, score_penalty=score_penalty
        )
        adv[real_token] = row_adv[row_of_token[real_token]]
        if estimator == "reinforce_pp_baseline":
            adv[real_token] = whiten(adv[real_token])
        ret[:] = adv
    else:
        index, lengths = _chain(batch, estimator, row_of_token, real_token)
        rewards = _field(batch, "token_rewards", estimator).astype(np.float64)[index]
        if penalty is not None:
            rewards = rewards + penalty[index]
        if estimator == "reinforce_pp":
            a, r = reinforce_pp_advantages(rewards, lengths, gamma=gamma)
        else:
            values = _field(batch, "values", estimator).astype(np.float64)[index]
            a, r = gae_advantages(
                rewards, values, lengths, gamma=gamma, lam=lam, whiten_advantages=whiten_gae
            )
        adv[index] = a
        ret[index] = r
    return torch.from_numpy(adv.astype(np.float32)), torch.from_numpy(ret.astype(np.float32))
