"""Streaming rollouts (``train.max_staleness = s``): the rollout host samples groups without
step boundaries while the ranks train, and each step trains on the first ``train.batch_size``
groups to finish whose oldest token was sampled by a policy at most ``s`` versions behind the
one that trains on them (``trainer.loop.engines.stream_host``). It keeps the interface of the
fixed-lag pipeline (``trainer.loop.schedule.pipeline``):

- ``start``: the stream begins with the weights the run starts from;
- ``take(step)``: step ``step``'s batch, waited for;
- engines on devices of their own sample while the ranks train: ``after_update(step,
  snapshot)`` queues the new weights for the host, which loads them between two decode steps
  or two engine calls (``rollout.partial_rollout``; a trajectory then goes on under them: its
  tokens carry the version that sampled them);
- colocated engines give the devices to the ranks for the update: ``hold`` stops the stream's
  engine calls before the engines sleep (environment calls go on) and ``release`` lets them go
  on once the push has loaded the new weights;
- ``ahead`` keeps nothing: a checkpoint of a streamed run resumes with a fresh stream from the
  prompts it had drawn, not with the groups in flight.

What a step trains on depends on timing, so two streamed runs differ; every step's batch is
recorded (``run.record_rollouts``) and ``crossrl probe --rollouts`` replays the updates exactly
(docs/cluster.md, "Which mode promises what").
"""

from __future__ import annotations

from typing import Any

from trainer.loop.cluster.group import wait_all

__all__ = ["StreamingPipeline"]


class StreamingPipeline:
    """The streamed rollouts of the rollout host ``host`` for ``max_staleness`` versions;
    ``record_dir``: where each step's batch is recorded (or None); ``timeout_s``: how long a
    step may wait for its groups."""

    def __init__(
        self, host, max_staleness: int, record_dir: str | None, *, timeout_s: float
    ) -> None:
        self.host = host
        self.max_staleness = max_staleness
        self.record_dir = record_dir
        self.timeout_s = timeout_s
        self.validations: dict[int, Any] = {}
        # (step, ref) of each load queued since the last take, read by the next take
        self.loads: list[tuple[int, Any]] = []

    def start(
        self, first_step: int, weights: list | None = None, *, validate: bool = False
    ) -> None:
        """Load ``weights`` (a resume's snapshot; None: the engines' own, colocated engines'
        always), validate them if asked, and start the stream with the weights after step
        ``first_step - 1``."""
        if validate:
            self.validations[first_step - 1] = self.host.validate.remote(first_step - 1, weights)
        elif weights is not None:
            self.host.take_weights.remote(weights)
        wait_all(
            [self.host.stream_start.remote(first_step - 1, self.max_staleness)],
            ["rollout host"],
            timeout_s=self.timeout_s,
            what="rollout.stream_start",
        )

    def take(self, step: int) -> tuple[dict[str, Any], list]:
        """Step ``step``'s batch: ``(metadata, [batch ref])``, as the fixed-lag pipeline's. A
        queued load (``after_update``) that failed raises here, in one line naming the load
        and its error (``WorkerFailedError``, its ``kind`` read from that error): the host
        runs it before this take, and the take itself raises it too."""
        loads, self.loads = self.loads, []
        refs = [ref for _, ref in loads]
        whats = [f"rollout.take_weights (the weights after step {done})" for done, _ in loads]
        refs.append(self.host.stream_take.remote(step, self.record_dir, self.timeout_s))
        *_, result = wait_all(
            refs,
            ["rollout host"] * len(refs),
            timeout_s=self.timeout_s + 60.0,
            what=[*whats, "rollout.stream_take"],
        )
        meta, batch = result
        meta["metrics"] = {
            **meta["metrics"],
            "pipeline/max_staleness": float(self.max_staleness),
            "pipeline/policy_version": float(meta["policy_version"]),
        }
        return meta, batch

    def after_update(self, step: int, snapshot: list | None, *, validate: bool = False) -> None:
        """Step ``step`` has trained: queue its weights (``[refs, specs]`` or a push) for the
        host, which loads them between engine calls; ``validate``: then validate them."""
        weights = None if snapshot is None else [step, *snapshot]
        if validate:  # validate loads them first
            self.validations[step] = self.host.validate.remote(step, weights)
        elif weights is not None:
            self.loads.append((step, self.host.take_weights.remote(weights)))

    def hold(self) -> None:
        """Colocated engines: the stream stops sampling before the engines sleep for the
        update (``StreamingHost.stream_hold``)."""
        self._wait(self.host.stream_hold.remote(self.timeout_s), "rollout.stream_hold")

    def release(self, step: int) -> None:
        """Colocated engines, awake with the weights after step ``step``: sampling goes on."""
        self._wait(self.host.stream_release.remote(step), "rollout.stream_release")

    def _wait(self, ref, what: str) -> None:
        wait_all([ref], ["rollout host"], timeout_s=self.timeout_s + 60.0, what=what)

    def validation(self, step: int) -> Any:
        """The reference of the ``val/*`` metrics queued for the weights after step ``step``."""
        return self.validations.pop(step)

    def ahead(self, step: int) -> dict[int, Any]:
        """Nothing: a streamed run's checkpoint keeps no sampled groups (module docstring)."""
        return {}

    def resume(self, pending: dict) -> int | None:
        """A streamed run resumes with a fresh stream: nothing pending is taken."""
        return None
