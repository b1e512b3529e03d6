"""Accuracy metrics over a batch: padding rows never count here (DESIGN.md, "Padding rows")."""

from __future__ import annotations

import math

import torch

from batching.data import StepBatch

__all__ = ["real_row_mean", "response_length_mean", "trajectory_score_mean"]


def _mean(values: torch.Tensor) -> float:
    # NaN rather than 0 for "no rows": a fake 0 reward would look like a real one.
    return float(values.to(torch.float64).mean()) if values.numel() else math.nan


def real_row_mean(batch: StepBatch, field: str) -> float:
    """Mean of row field `field` over real (non-padding) rows; NaN when there are none."""
    if field not in batch.row_fields:
        raise ValueError(
            f"row field {field!r} is not in the batch; it has {sorted(batch.row_fields)}"
        )
    return _mean(batch.row_fields[field][~batch.is_padding])


def trajectory_score_mean(batch: StepBatch) -> float:
    """Mean trajectory score: one value per trajectory, read from its real last-step row."""
    keep = batch.is_last_step & ~batch.is_padding
    return _mean(batch.score[keep])


def response_length_mean(batch: StepBatch) -> float:
    """Mean response length in tokens over real rows."""
    return _mean(batch.response_len[~batch.is_padding])
