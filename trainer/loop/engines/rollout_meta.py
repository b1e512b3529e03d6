"""What the controller gets of a rollout besides the batch itself: its metadata (lengths and
ids for planning, metrics), and one step's metrics from those of its sampled batches."""

from __future__ import annotations

from typing import Any

import numpy as np

from batching import StepBatch, response_length_mean, trajectory_score_mean

#: rollout metrics that count things: summed over a step's sampled batches (the rest are
#: means, weighted by each batch's trajectories).
_COUNTS = ("num_trajectories", "num_rows", "_trajectories", "errors")


def combine_rollout_metrics(per_batch: list[dict[str, float]]) -> dict[str, float]:
    """One step's rollout metrics from those of its sampled batches (dynamic sampling)."""
    if len(per_batch) == 1:
        return dict(per_batch[0])
    weights = [m.get("rollout/num_trajectories", 1.0) for m in per_batch]
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for m in per_batch for k in m):
        present = [(m[key], w) for m, w in zip(per_batch, weights) if key in m]
        if key.endswith(_COUNTS):
            out[key] = sum(v for v, _ in present)
        else:
            out[key] = sum(v * w for v, w in present) / max(sum(w for _, w in present), 1e-12)
    return out


def batch_metadata(batch: StepBatch, rollout_metrics: dict[str, float]) -> dict[str, Any]:
    """What the controller needs of a batch: lengths and ids for planning, metrics."""
    return {
        "seq_lens": batch.seq_lens.astype(np.int64),
        "trajectory_ids": batch.row_fields["trajectory_id"].numpy().copy(),
        "group_ids": batch.row_fields["uid"].numpy().copy(),
        "num_tokens": int(batch.num_tokens),
        "metrics": {
            **rollout_metrics,
            "reward/mean": float(trajectory_score_mean(batch)),
            "response_length/mean": float(response_length_mean(batch)),
        },
    }
