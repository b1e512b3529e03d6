"""Parity fingerprints and rollout recording (DESIGN.md, "Cross-device parity").

A fingerprint is a small JSON object per step: the plan digest (must match exactly between
two runs of the same job on any devices and dp sizes) and numbers that must match within a
floating-point tolerance (losses, grad norms, logprob means, reward, parameter checksums).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from trainer.checkpoint import atomic_path


def fingerprint_of_step(plan, sums: dict[str, float], metrics: dict[str, Any],
                        checksum: dict[str, float] | None) -> dict[str, Any]:
    """The fingerprint of one training step from its plan, update sums and metrics."""
    fp: dict[str, Any] = {
        "plan_digest": plan.digest(),
        "mini_batch_rows": [int(mb.num_rows) for mb in plan.mini_batches],
        "mini_batch_tokens": [int(mb.num_tokens) for mb in plan.mini_batches],
        "reward_mean": metrics.get("reward/mean"),
        "actor_loss": metrics.get("actor/loss"),
        "actor_grad_norm": metrics.get("actor/grad_norm"),
        "actor_entropy": metrics.get("actor/entropy"),
        "actor_approx_kl": metrics.get("actor/approx_kl"),
    }
    if "critic/vf_loss" in metrics:
        fp["critic_loss"] = metrics["critic/vf_loss"]
    if checksum is not None:
        fp["param_checksum"] = checksum
    return fp


def record_rollout(record_dir: str | Path, step: int, arrays: dict[str, np.ndarray]) -> Path:
    """Save one step's rollout batch (``StepBatch.to_numpy()``) as ``step_<N>.npz``, atomically.

    npz holds plain arrays only (no pickle), so any machine can replay it.
    """
    path = Path(record_dir) / f"step_{step}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        np.savez(handle, **arrays)
    return path


def load_rollout(path: str | Path) -> dict[str, np.ndarray]:
    """Arrays of a recorded rollout batch, read without pickle."""
    with np.load(path, allow_pickle=False) as data:
        return {key: data[key] for key in data.files}
