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
"""

from __future__ import annotations

from typing import Any

from trainer.loop.workers.group import CALL_TIMEOUT_S, wait_all


def sampled_by(step: int, lag: int) -> int:
    """The training step whose weights sample step ``step`` under ``train.rollout_lag = lag``
    (0: the initial weights)."""
    return max(0, step - 1 - lag)


class RolloutPipeline:
    """The rollouts queued on the rollout host (``host``, replica 0), by step, for a run of
    ``total_steps`` steps with lag ``lag``; ``record_dir``: where rollouts are recorded
    (``run.record_rollouts``), or None."""

    def __init__(self, host, lag: int, total_steps: int, record_dir: str | None) -> None:
        self.host = host
        self.lag = lag
        self.total_steps = total_steps
        self.record_dir = record_dir
        self.queued: dict[int, Any] = {}  # step -> the rollout's reference
        self.ready: dict[int, tuple[dict[str, Any], list]] = {}  # step -> waited-for rollout
        self.snapshot: list | None = None  # the last weights handed to the host

    def start(self, first_step: int, weights: list | None = None) -> None:
        """Queue the rollouts of steps ``first_step .. first_step + lag``, which all sample
        with the weights after step ``first_step - 1``: the engines' own (``weights`` None),
        or a snapshot of them (``[version, refs, specs]``, e.g. after a resume)."""
        for step in range(first_step, min(first_step + self.lag, self.total_steps) + 1):
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

    def after_update(self, step: int, snapshot: list | None) -> None:
        """Step ``step`` has trained: queue the rollout that its weights sample, step
        ``step + 1 + lag``, with ``snapshot`` (``[refs, specs]`` of those weights, from
        ``WeightPush.snapshot_weights``; None when replaying, where no engine runs)."""
        self.snapshot = None if snapshot is None else [step, *snapshot]
        target = step + 1 + self.lag
        if target <= self.total_steps:
            self._queue(target, self.snapshot)

    def _queue(self, step: int, weights: list | None) -> None:
        self.queued[step] = self.host.rollout.remote(step, self.record_dir, weights)

    def _wait(self, steps: set[int]) -> None:
        """Move the queued rollouts of ``steps`` to ``ready``, waiting for them."""
        steps = sorted(s for s in steps if s in self.queued)
        results = wait_all(
            [self.queued.pop(s) for s in steps],
            ["rollout host"] * len(steps),
            timeout_s=CALL_TIMEOUT_S,
            what="rollout",
        )
        self.ready.update(zip(steps, results))

    def sampled_ahead(self, step: int) -> dict[int, tuple[dict[str, Any], dict]]:
        """For a checkpoint of step ``step``: the rollouts of steps ``step + 1 .. step + lag``,
        sampled by weights older than the checkpoint's (waited for; they stay ready for
        ``take``), as step -> (metadata, the batch's numpy arrays)."""
        import ray

        ahead = set(range(step + 1, min(step + self.lag, self.total_steps) + 1))
        self._wait(ahead)
        return {s: (self.ready[s][0], ray.get(self.ready[s][1][0])) for s in sorted(ahead)}

    def resume(self, pending: dict[int, tuple[dict[str, Any], dict]]) -> int | None:
        """Take a checkpoint's pending rollouts (``sampled_ahead`` of the run that saved it)
        as ready; returns the prompts consumed after the last of them (None: there were none)."""
        import ray

        from batching import StepBatch
        from trainer.loop.workers.rollout_host import batch_metadata

        for step, (kept, arrays) in sorted(pending.items()):
            meta = batch_metadata(StepBatch.from_numpy(arrays), kept["metrics"])
            meta.update({k: v for k, v in kept.items() if k != "metrics"})
            self.ready[step] = (meta, [ray.put(arrays)])
        return pending[max(pending)][0].get("prompts_consumed") if pending else None
