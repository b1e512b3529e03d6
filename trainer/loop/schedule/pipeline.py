"""The fixed-lag rollout pipeline: engines on devices of their own generate ahead while the
ranks train, and the step number alone says which weights sample which step.

With ``train.rollout_lag = k`` step t's batch is sampled by the policy after step
``t - 1 - k`` (``sampled_by``; the initial weights for the first ``k + 1`` steps). The schedule
that keeps that promise without ever asking the clock:

- before step 1: the rollouts of steps 1 .. k+1 are queued on the rollout host (they all
  sample with the initial weights the engines loaded at start-up);
- after step t's update: the ranks snapshot the new weights into host memory
  (``WeightPush.snapshot_weights``) and the rollout of step t+1+k is queued with them; the
  rollout host loads them when its queue reaches that rollout, after steps t+1 .. t+k
  have been sampled with older ones.

Ray runs one actor's calls in the order they were submitted, so the queue is the schedule.
Which samples a step trains on thus never depends on timing, and two runs of the same job
give the same fingerprints (``crossrl parity`` compares lagged runs as any others). ``k = 0``
with engine devices of their own is the same loop with no overlap.

The pipeline samples ``k`` steps past ``train.total_steps`` (its ``horizon``): a checkpoint
of step t keeps the rollouts of steps t+1 .. t+k, sampled by weights it does not hold, so a
run resumed from it, with the same or a larger ``train.total_steps``, trains on the batches an
uninterrupted run would. The engines would idle through the last k steps anyway.

A snapshot lives while a queued call holds it: Ray keeps a call's arguments until the call
finishes, so ``train.rollout_lag + 1`` snapshots are alive at once (``trainer.loop.
plan.snapshot_budget`` counts them and refuses a job whose object store cannot hold them).

Nothing here waits for a rollout it does not train on: a validation after step t is queued
before the rollout that loads the same weights (it waits for no later rollout), and a
checkpoint takes the rollouts it keeps as references (``ahead``), read when they are done.
"""

from __future__ import annotations

from typing import Any

from trainer.loop.cluster.group import CALL_TIMEOUT_S, wait_all
from trainer.loop.cluster.local import LocalRef, fetch, put


def sampled_by(step: int, lag: int) -> int:
    """The training step whose weights sample step ``step`` under ``train.rollout_lag = lag``
    (0: the initial weights)."""
    return max(0, step - 1 - lag)


class RolloutPipeline:
    """The rollouts queued on the rollout host (``host``, replica 0), by step, for a run of
    ``total_steps`` steps with lag ``lag``; ``record_dir``: where rollouts are recorded
    (``run.record_rollouts``), or None. ``horizon``: the last step sampled, ``total_steps +
    lag`` by default (what a checkpoint of the last steps keeps); ``total_steps`` when
    replaying a recording, which has no steps beyond the run."""

    def __init__(
        self,
        host,
        lag: int,
        total_steps: int,
        record_dir: str | None,
        *,
        horizon: int | None = None,
        timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:
        self.host = host
        self.timeout_s = timeout_s  # seconds to wait for a queued rollout
        self.lag = lag
        self.total_steps = total_steps
        self.horizon = total_steps + lag if horizon is None else horizon
        self.record_dir = record_dir
        self.queued: dict[int, Any] = {}  # step -> the rollout's reference
        self.ready: dict[int, tuple[dict[str, Any], list]] = {}  # step -> waited-for rollout
        self.validations: dict[int, Any] = {}  # step -> the reference of its val/* metrics
        # The step whose weights the host was handed last. Only the version: a reference to
        # the snapshot itself here would keep it alive past the last call that reads it (one
        # snapshot more than ``trainer.loop.plan.snapshot_budget`` counts at train.rollout_lag=0).
        self.snapshot_version: int | None = None

    def start(
        self, first_step: int, weights: list | None = None, *, validate: bool = False
    ) -> None:
        """Queue the rollouts of steps ``first_step .. first_step + lag``, which all sample
        with the weights after step ``first_step - 1``: the engines' own (``weights`` None),
        or a snapshot of them (``[version, refs, specs]``, e.g. after a resume).
        ``validate``: queue a validation of those weights first (``run.val_before_train``)."""
        if validate:
            self.validations[first_step - 1] = self.host.validate.remote(first_step - 1, weights)
        for step in range(first_step, min(first_step + self.lag, self.horizon) + 1):
            if step not in self.ready:  # a resumed run brings those it had sampled
                self._queue(step, weights)

    def take(self, step: int) -> tuple[dict[str, Any], list]:
        """Wait for step ``step``'s rollout: ``(metadata, [batch ref])``; the metadata says
        which weights sampled it (``policy_version``) and the lag."""
        self._wait({step})
        meta, batch = self.ready.pop(step)
        if meta.get("policy_version") is None:  # a replay, or weights of no step
            meta["policy_version"] = sampled_by(step, self.lag)
        meta["metrics"] = {
            **meta["metrics"],
            "pipeline/rollout_lag": float(self.lag),
            "pipeline/policy_version": float(meta["policy_version"]),
        }
        return meta, batch

    def after_update(self, step: int, snapshot: list | None, *, validate: bool = False) -> None:
        """Step ``step`` has trained: queue the rollout that its weights sample, step
        ``step + 1 + lag``, with ``snapshot`` (``[refs, specs]`` of those weights, from
        ``WeightPush.snapshot_weights``; None when replaying, where no engine runs).
        ``validate``: queue a validation of the same weights just before it (``validation``
        reads it), so it waits only for the rollouts already queued, never for that one."""
        weights = None if snapshot is None else [step, *snapshot]
        self.snapshot_version = step
        if validate:
            self.validations[step] = self.host.validate.remote(step, weights)
        target = step + 1 + self.lag
        if target <= self.horizon:
            self._queue(target, weights)

    def validation(self, step: int) -> Any:
        """The reference of the ``val/*`` metrics queued for the weights after step ``step``
        (``start`` / ``after_update`` with ``validate``), not waited for."""
        return self.validations.pop(step)

    def _queue(self, step: int, weights: list | None) -> None:
        self.queued[step] = self.host.rollout.remote(step, self.record_dir, weights)

    def _wait(self, steps: set[int]) -> None:
        """Move the queued rollouts of ``steps`` to ``ready``, waiting for them."""
        steps = sorted(s for s in steps if s in self.queued)
        results = wait_all(
            [self.queued.pop(s) for s in steps],
            ["rollout host"] * len(steps),
            timeout_s=self.timeout_s,
            what="rollout",
        )
        self.ready.update(zip(steps, results))

    def ahead(self, step: int) -> dict[int, Any]:
        """For a checkpoint of step ``step``: the rollouts of steps ``step + 1 .. step + lag``,
        sampled by weights older than the checkpoint's, as step -> a reference to
        ``(metadata, [batch ref])``; none is waited for (``read_ahead`` reads them once
        ``is_done`` says so)."""
        out: dict[int, Any] = {}
        for s in range(step + 1, min(step + self.lag, self.horizon) + 1):
            if s in self.queued:
                out[s] = self.queued[s]
            elif s in self.ready:  # a copy: ``take`` rewrites the metadata's metrics
                meta, batch = self.ready[s]
                out[s] = LocalRef((dict(meta), batch))
        return out

    def resume(self, pending: dict[int, tuple[dict[str, Any], dict]]) -> int | None:
        """Take a checkpoint's pending rollouts (``ahead`` of the run that saved it)
        as ready; returns the prompts consumed after the last of them (None: there were none)."""
        from batching import StepBatch
        from trainer.loop.engines.rollout_meta import batch_metadata

        for step, (kept, arrays) in sorted(pending.items()):
            meta = batch_metadata(StepBatch.from_numpy(arrays), kept["metrics"])
            meta.update({k: v for k, v in kept.items() if k != "metrics"})
            self.ready[step] = (meta, [put(arrays)])
        return pending[max(pending)][0].get("prompts_consumed") if pending else None


def read_ahead(refs: dict[int, Any]) -> dict[int, tuple[dict[str, Any], dict]]:
    """The rollouts of ``RolloutPipeline.ahead`` (waited for), as step -> (metadata, the
    batch's numpy arrays): what a checkpoint keeps (``trainer.records.checkpoint.pending``)."""
    steps = sorted(refs)
    results = wait_all(
        [refs[s] for s in steps],
        ["rollout host"] * len(steps),
        timeout_s=CALL_TIMEOUT_S,
        what="rollout",
    )
    return {s: (meta, fetch(batch[0])) for s, (meta, batch) in zip(steps, results)}
