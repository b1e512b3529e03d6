"""Health gates: stop a run that would otherwise train on garbage or save it.

A run that "succeeds" while every trajectory failed, or while its weights turned to inf, lies to
its user and may destroy the good checkpoints it had (retention prunes them). Three gates, each
raising ``HealthError`` (the CLI exits 1, before the step's checkpoint):

- ``check_env_faults``: more than ``run.max_env_error_fraction`` of a step's trajectories
  ended by an environment fault (exception, wrong type, reward outside the env's range);
  the message shows the first few distinct faults with their trajectory ids.
- ``NonfiniteStreak``: workers skip an optimizer step whose loss or grad norm is not finite
  (``<role>/skipped_updates``); ``run.max_nonfinite_steps`` such steps in a row stop the run.
- ``check_finite_weights``: weights that are no longer finite (a finite gradient times a huge
  lr) stop the run before they reach the rollout engine or a checkpoint.
- ``checkpoint_veto``: a step with a skipped update is not checkpointed (its weights are
  suspect), so retention never prunes a good checkpoint in favour of it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rollout.env_calls import fault_summary
from trainer.loop.ranks.step_stats import StepStats


class HealthError(RuntimeError):
    """A health gate stopped the run; the message says why and what to change."""


def check_env_faults(meta: Mapping[str, Any], max_fraction: float, step: int) -> None:
    """Raise ``HealthError`` when more than ``max_fraction`` of the rollout's trajectories were
    ended by an environment fault. ``meta``: the rollout host's step metadata (``env_faults``:
    ``(trajectory_id, text)`` pairs; ``metrics["rollout/num_trajectories"]``)."""
    faults = meta.get("env_faults") or []  # a replayed recording has none
    if not faults:
        return
    total = int(meta["metrics"]["rollout/num_trajectories"])
    if len(faults) <= max_fraction * total:
        return
    raise HealthError(
        f"step {step}: {fault_summary(faults, total)}. More than run.max_env_error_fraction="
        f"{max_fraction:g} of the step's trajectories faulted, so the run stops before this "
        "step's checkpoint: fix the environment (rollout.env), or raise "
        "run.max_env_error_fraction (1 = never stop)"
    )


class NonfiniteStreak:
    """Counts optimizer steps in a row that a role's workers skipped for a non-finite loss or
    grad norm; ``limit`` (``run.max_nonfinite_steps``) in a row raise ``HealthError``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_a_row: dict[str, int] = {}

    def observe(self, role: str, report: StepStats, step: int) -> None:
        """Fold in one optimizer step as rank 0 of ``role`` reported it (skips agree on every
        rank) during training step ``step``."""
        if not report.values.get("skipped"):
            self.in_a_row[role] = 0
            return
        self.in_a_row[role] = self.in_a_row.get(role, 0) + 1
        if self.in_a_row[role] >= self.limit:
            loss = report.values.get("loss", math.nan)
            grad_norm = report.values.get("grad_norm", math.nan)
            raise HealthError(
                f"step {step}: the {role}'s last {self.in_a_row[role]} optimizer steps had a "
                f"non-finite loss or grad norm (last: loss {loss:g}, grad norm {grad_norm:g}) "
                f"and were skipped; run.max_nonfinite_steps={self.limit} stops the run before "
                "this step's checkpoint. Lower the lr, set a grad clip, or check the rewards"
            )


def checkpoint_veto(metrics: Mapping[str, Any]) -> str | None:
    """Why the step described by ``metrics`` must not be checkpointed, or None: an update of
    it was skipped for a non-finite loss or grad norm, so its weights are suspect (a finite
    update that sends them towards inf shows up as the next update's nan loss)."""
    skipped = {
        key.split("/")[0]: int(value)
        for key, value in metrics.items()
        if key.endswith("/skipped_updates") and value
    }
    if not skipped:
        return None
    what = ", ".join(f"{n} {role} update{'s' if n > 1 else ''}" for role, n in skipped.items())
    return (
        f"step {metrics.get('step')}: not checkpointed: {what} skipped for a non-finite loss or "
        "grad norm; the last whole checkpoint stays `latest`"
    )


def check_finite_weights(role: str, per_rank: Sequence[bool], step: int) -> None:
    """Raise ``HealthError`` unless every rank of ``role`` reported finite weights."""
    bad = [rank for rank, finite in enumerate(per_rank) if not finite]
    if bad:
        key = "critic.lr" if role == "critic" else "train.lr"
        raise HealthError(
            f"step {step}: the {role}'s weights are no longer finite (inf/nan on rank "
            f"{', '.join(map(str, bad))}) after a finite update; no checkpoint is written from "
            f"them and the last whole checkpoint stays `latest`. Lower {key}"
        )
