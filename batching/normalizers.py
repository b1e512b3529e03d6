"""Loss normalizers: the global counts every rank divides by, and the reference aggregation.

A mini-batch's loss is the sum of its micro-batches' contributions over all ranks. Each
contribution divides by counts of the WHOLE mini-batch (`LossNormalizers`), never by local
ones, so the summed loss (and its gradient) does not depend on `dp_size`, on micro-batch
boundaries or on padding rows (their `loss_mask` is 0, so they add exactly 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from batching.data import StepBatch
from batching.planner import MiniBatchPlan

__all__ = ["LOSS_AGG_MODES", "LossNormalizers", "aggregate_loss", "loss_normalizers"]

#: Values of `algorithm.loss_agg`.
LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


@dataclass(frozen=True)
class LossNormalizers:
    """Global counts of one mini-batch, padding rows excluded.

    num_rows: real rows. num_loss_tokens: real tokens with `loss_mask` 1.
    num_trajectories: distinct trajectories among the real rows. num_tokens: every token of
    the real rows, prompts included (what a mixture's load-balancing loss averages over).
    Per-row loss-token counts need no global exchange: rows are never split across
    micro-batches, so a micro-batch counts its own rows' tokens.
    """

    num_rows: int
    num_loss_tokens: int
    num_trajectories: int
    num_tokens: int = 0


def loss_normalizers(
    batch: StepBatch, mini_batch: MiniBatchPlan | Sequence[int] | None = None
) -> LossNormalizers:
    """Counts for the rows of `mini_batch` (a plan's `MiniBatchPlan`, whose row indices index
    `batch`, or a sequence of row indices; None: every row of `batch`). Padding rows, whether
    indexed as -1 or already present in `batch`, are not counted."""
    if mini_batch is None:
        idx = np.arange(batch.num_rows, dtype=np.int64)
    elif isinstance(mini_batch, MiniBatchPlan):
        idx = np.asarray(mini_batch.rows, dtype=np.int64)
    else:
        idx = np.asarray(mini_batch, dtype=np.int64).reshape(-1)
        idx = idx[idx >= 0]
    if idx.size and idx.max() >= batch.num_rows:
        raise ValueError(
            f"mini_batch refers to row {int(idx.max())} but the batch has {batch.num_rows} "
            "rows; pass the batch the plan was made for"
        )
    idx_t = torch.from_numpy(idx)
    real = ~batch.is_padding.index_select(0, idx_t)
    idx_t = idx_t[real]
    loss_tokens = batch.row_loss_tokens().index_select(0, idx_t)
    return LossNormalizers(
        num_rows=int(idx_t.numel()),
        num_loss_tokens=int(loss_tokens.sum()),
        num_trajectories=int(torch.unique(batch.trajectory_id.index_select(0, idx_t)).numel()),
        num_tokens=int(np.asarray(batch.seq_lens)[idx_t.numpy()].sum()),
    )


def aggregate_loss(
    token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor | np.ndarray,
    normalizers: LossNormalizers,
    mode: str,
    horizon: int | None = None,
) -> torch.Tensor:
    """This micro-batch's contribution to its mini-batch's loss (a scalar tensor).

    `token_loss`, `loss_mask`: `[T]` over this micro-batch's packed rows; `cu_seqlens`: `[R+1]`
    row offsets. With l = token_loss, m = loss_mask, per row r:
      token-mean:               sum(l*m) / num_loss_tokens
      seq-mean-token-sum:       sum_r(sum_t l*m) / num_rows
      seq-mean-token-mean:      sum_r(sum_t l*m / max(1, loss_tokens_r)) / num_rows
      seq-mean-token-sum-norm:  sum(l*m) / (num_rows * horizon)   (Dr. GRPO; horizon in tokens)
    Zero counts are clamped to 1, so a mini-batch without loss tokens yields 0, not NaN.
    Summing the contributions of all micro-batches of all ranks gives the mini-batch loss.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg mode {mode!r} is unknown; use one of {list(LOSS_AGG_MODES)}")
    if token_loss.shape != loss_mask.shape or token_loss.dim() != 1:
        raise ValueError(
            f"token_loss {tuple(token_loss.shape)} and loss_mask {tuple(loss_mask.shape)} "
            "must both be [T] over the packed tokens"
        )
    masked = token_loss * loss_mask.to(token_loss.dtype)
    num_rows = max(1, normalizers.num_rows)
    if mode == "token-mean":
        return masked.sum() / max(1, normalizers.num_loss_tokens)
    if mode == "seq-mean-token-sum":
        return masked.sum() / num_rows
    if mode == "seq-mean-token-sum-norm":
        if horizon is None or isinstance(horizon, bool) or int(horizon) != horizon or horizon < 1:
            raise ValueError(
                f"horizon = {horizon!r}; seq-mean-token-sum-norm needs a constant token count "
                ">= 1 (e.g. the maximum response length)"
            )
        return masked.sum() / (num_rows * int(horizon))
    # seq-mean-token-mean: a per-row mean needs per-row sums.
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64).to(token_loss.device)
    lens = cu[1:] - cu[:-1]
    if int(cu[-1]) != token_loss.numel():
        raise ValueError(
            f"cu_seqlens ends at {int(cu[-1])} but token_loss has {token_loss.numel()} tokens"
        )
    # Row id of every token: +1 at each row start, then a running sum (no repeat_interleave,
    # whose CPU kernel always enters a parallel region).
    # Empty rows at the very end start at T and own no token, so they are left out.
    row_starts = cu[1:-1][cu[1:-1] < token_loss.numel()]
    bumps = torch.zeros(token_loss.numel(), dtype=torch.int64, device=token_loss.device)
    bumps.index_add_(0, row_starts, torch.ones_like(row_starts))
    seg = bumps.cumsum(0)
    zeros = torch.zeros(lens.numel(), dtype=token_loss.dtype, device=token_loss.device)
    row_sum = zeros.index_add(0, seg, masked)
    row_tokens = zeros.index_add(0, seg, loss_mask.to(token_loss.dtype))
    return (row_sum / row_tokens.clamp(min=1)).sum() / num_rows
