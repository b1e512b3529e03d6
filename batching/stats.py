"""Performance statistics of a plan (padding rows count here, unlike accuracy metrics)."""

from __future__ import annotations

import numpy as np

from batching.planner import Plan

__all__ = ["plan_stats"]


def plan_stats(plan: Plan, seq_lens: np.ndarray | None = None) -> dict[str, float | int]:
    """Summary of a plan, keyed like metrics.jsonl.

    batch/token_efficiency: real tokens / computed tokens (a padding row computes 2 tokens).
    batch/dp_imbalance: max / mean rank tokens (computed tokens), averaged over mini-batches;
    batch/dp_imbalance_worst: the worst mini-batch's. batch/num_padding_rows,
    batch/micro_batches_per_rank_max, batch/num_mini_batches, batch/num_rows (real rows).
    `seq_lens` (tokens per row) defaults to the lengths the plan was made from.
    """
    lens = plan.seq_lens if seq_lens is None else np.asarray(seq_lens, dtype=np.int64)
    if lens.shape != plan.seq_lens.shape:
        raise ValueError(
            f"seq_lens has {lens.size} rows but the plan was made for {plan.seq_lens.size}"
        )
    real = int(lens.sum())
    padding = plan.num_padding_rows
    imbalance = []
    for mb in plan.mini_batches:
        tokens = mb.rank_tokens
        mean = tokens.sum() / tokens.size
        imbalance.append(float(tokens.max() / mean) if mean > 0 else 1.0)
    return {
        "batch/num_mini_batches": plan.num_mini_batches,
        "batch/num_rows": int(lens.size),
        "batch/num_padding_rows": padding,
        "batch/token_efficiency": real / (real + 2 * padding) if real + padding else 1.0,
        "batch/dp_imbalance": float(np.mean(imbalance)) if imbalance else 1.0,
        "batch/dp_imbalance_worst": float(np.max(imbalance)) if imbalance else 1.0,
        "batch/micro_batches_per_rank_max": max(
            (mb.num_micro_batches for mb in plan.mini_batches), default=0
        ),
    }
