"""The controller: one short loop over training steps, each a few named phases.

    rollout -> plan -> prepare (old / ref log-probs, values, advantages) -> update
    -> hand-over (offload, weight push, wake) -> the step's records (metrics, fingerprint)

The controller holds metadata and plans only, and each phase's body lives in the module that
owns its concern: where the rollouts come from in ``trainer.loop.schedule.rollouts`` (the
pipeline, decided once at start-up), the plan and the update in ``trainer.loop.schedule.update``,
the weight push in ``trainer.loop.weights.driver``, the metrics line, fingerprint and
checkpoint in ``trainer.loop.schedule.step_records``. Engine replicas share the training ranks'
devices (``trainer.loop.plan.layout``): they sleep while the ranks train and wake for the weight
sync, which goes from each tp group's ranks straight to their own replica. The batch goes from the
rollout host to the training workers through Ray's object store; per-token results (logprobs,
values) go from worker to worker the same way. The plan itself is ``batching``'s, the math
``trainer.algorithms``', the device ``hal``'s.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.config import Config
from trainer.loop.cluster.group import Later, WorkerGroup, wait_all
from trainer.loop.plan.call_limits import CallLimits
from trainer.loop.plan.lora_layout import pushes_whole_weights
from trainer.loop.ranks.step_stats import StepStats
from trainer.loop.schedule.health import NonfiniteStreak, check_env_faults
from trainer.loop.schedule.phase_memory import PhaseMemory, measured
from trainer.loop.schedule.replicas import ReplicaReplacer
from trainer.loop.schedule.rollouts import record_dir
from trainer.loop.schedule.step_records import (
    end_of_step,
    stage_checkpoint,
    step_fingerprint,
    step_metrics,
)
from trainer.loop.schedule.update import plan_step, prepare, update
from trainer.loop.schedule.validation import validation_due
from trainer.loop.weights.driver import snapshot_weights, sync_weights

if TYPE_CHECKING:
    from trainer.loop.schedule.backlog import PendingCheckpoint

#: Seconds ``Trainer.shutdown`` waits for the replicas to release their engines before it
#: kills them (a replica busy in a call it cannot leave is killed at this bound).
RELEASE_WAIT_S = 10.0


class Trainer:
    """A job's workers (started by ``trainer.loop.start.launch.start``) and its training step."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        *,
        replay_dir: str | None = None,
        limits: CallLimits | None = None,
    ) -> None:
        """``limits``: the run's call limits, kept across its attempts (``run_training``);
        default: those of ``cfg``."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.replay_dir = replay_dir
        self.start_step = 0
        self.placement = None
        self.in_process = False  # ray.in_process: workers in this process (set by launch.start)
        self.layout = None
        self.rollout = None  # replica 0, the rollout host
        self.replicas: list = []  # every engine replica's actor, replica order
        self.spawner = None  # makes the workers (set by launch.start); replaces lost replicas
        self.replacer = ReplicaReplacer(self)
        self.pushes = 0  # weight pushes through the weight group since the workers started
        self.rollout_info: dict[str, Any] = {}
        self.replica_info: list[dict[str, Any]] = []
        self.actor: WorkerGroup | None = None
        self.ref: WorkerGroup | None = None
        self.critic: WorkerGroup | None = None
        self.deterministic_settings: dict[str, str] = {}
        self.kernels: dict[str, dict[str, str]] = {}  # role -> op -> kernel (launch.start)
        self.nonfinite = NonfiniteStreak(cfg.run.max_nonfinite_steps)
        self.limits = limits or CallLimits.for_config(cfg)  # seconds each call may take
        # Where the steps' rollouts come from (trainer.loop.schedule.rollouts: the fixed-lag
        # pipeline, or the stream; None: sampled in the step); set up by launch.start.
        self.pipeline = None
        self.last_rollout: dict[str, Any] = {}  # the metadata of the step's rollout
        self.resumed_from: Path | None = None  # the checkpoint resumed, if any
        # every phase's peak memory on the busiest device (None where the HAL cannot read it)
        self.phase_memory = PhaseMemory.for_device(cfg.device)

    # ------------------------------------------------------------------ start-up
    def training_groups(self) -> list[WorkerGroup]:
        """The roles that train (actor, critic), in that order."""
        return [g for g in (self.actor, self.critic) if g is not None]

    def all_groups(self) -> list[WorkerGroup]:
        """Every role's workers (actor, reference, critic), in that order."""
        return [g for g in (self.actor, self.ref, self.critic) if g is not None]

    # ------------------------------------------------------------------ one step
    def train_step(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Run training step ``step`` (1-based); returns (metrics, fingerprint). Its phases,
        each in the module that owns it: rollout (``_take_rollout``) -> plan -> prepare and
        update (``trainer.loop.schedule.update``) -> hand-over of the devices and the new
        weights (``_hand_over``) -> the step's records (``trainer.loop.schedule.step_records``)."""
        from trainer.records.timings import StepTimer

        timer = StepTimer(watch=functools.partial(measured, self.phase_memory))
        with timer.section("rollout"):
            meta, batch_ref = self._take_rollout(step)
        self.last_rollout = meta
        check_env_faults(meta, self.cfg.run.max_env_error_fraction, step)
        plan = plan_step(self.cfg, meta)
        with timer.section("prepare"):
            adv_metrics = self._prepare(plan, batch_ref)
        with timer.section("update"):
            stats, mismatch = self._update(plan, step)
        adv_metrics.update(mismatch)
        with timer.section("sync"):
            records = self._hand_over(step, plan)
        metrics = step_metrics(
            step, meta, plan, stats, adv_metrics, timer, records, self.phase_memory
        )
        return metrics, step_fingerprint(step, plan, stats, metrics, records)

    def _take_rollout(self, step: int) -> tuple[dict[str, Any], list]:
        """The step's rows, from the pipeline (generated ahead, or streamed, while the ranks
        trained) or sampled now; a replica lost meanwhile gets a successor. Colocated engines
        then sleep: the training ranks get the devices."""
        if self.pipeline is not None:
            meta, batch_ref = self.pipeline.take(step)
        else:
            meta, batch_ref = self._rollout(step)
        self.replacer.start(meta)  # a replica lost mid-rollout: start its successor
        if not self.layout.separate:
            if self.pipeline is not None:  # streamed: its engine calls stop first
                self.pipeline.hold()
            # A push that overwrites every engine weight lets the engines drop theirs instead
            # of copying them to the host and back (not a LoRA push of adapters: the base must
            # survive the sleep).
            self._engines("sleep", self.replay_dir is None and pushes_whole_weights(self.cfg))
        return meta, batch_ref

    def _rollout(self, step: int) -> tuple[dict[str, Any], list]:
        """Rows of this step, sampled now (colocated engines, not streamed): metadata here,
        the batch itself in the object store."""
        return wait_all(
            [self.rollout.rollout.remote(step, record_dir(self))],
            ["rollout host"],
            timeout_s=self.limits.rollout_s,
            what="rollout",
        )[0]

    def _prepare(self, plan, batch_ref: list) -> dict[str, float]:
        """Old / reference log-probs, values and advantages of the step's rows
        (``trainer.loop.schedule.update.prepare``); returns the advantages' metrics."""
        return prepare(self, plan, batch_ref)

    def _update(self, plan, step: int) -> tuple[dict[str, StepStats], dict[str, float]]:
        """The step's update (``trainer.loop.schedule.update.update``): each training role's
        statistics, and the engine-vs-trainer metrics."""
        return update(self, plan, step)

    def _hand_over(self, step: int, plan) -> dict[str, Any]:
        """After the update: lost replicas' successors join, the ranks offload and report the
        step's records (``step_records.end_of_step``), and the new weights go to the engines.
        Engines of their own sample on: the weights queue for them (``after_update``).
        Colocated engines get the devices back one stage after the other, each waited for
        before the next starts (the engines' sleep-mode allocators map memory without asking
        what is free, so nothing may overlap): they wake their weights and load the new ones
        (``sync_weights``, after which the ranks have freed the staging), then the KV caches
        wake into what is left, and a stream samples on. Returns the step's records."""
        self.replacer.rejoin()  # successors join before the weights go to the engines
        records = end_of_step(self, step, plan)
        if self.layout.separate:  # the engines sample on; the new weights queue for them
            validate = validation_due(self.cfg, step)
            self.pipeline.after_update(step, self.snapshot_weights(), validate=validate)
            return records
        with measured(self.phase_memory, "push"):  # the budget's weight push: after the release
            self.sync_weights()
        self._engines("wake_up", ["kv_cache"])
        if self.pipeline is not None:  # streamed: sampling goes on, new weights loaded
            self.pipeline.release(step)
        return records

    def snapshot_weights(self) -> list | None:
        """The actor's new weights for engines of their own
        (``trainer.loop.weights.driver.snapshot_weights``)."""
        return snapshot_weights(self)

    def sync_weights(self, *, via_object_store: bool = False) -> None:
        """Load the actor's new weights into the engines now
        (``trainer.loop.weights.driver.sync_weights``); ``via_object_store``: the earlier path
        through Ray's object store, for ``bench e2e``."""
        sync_weights(self, via_object_store=via_object_store)

    def validate(self, step: int) -> dict[str, Any] | Later:
        """``val/*`` metrics on ``data.val_source`` with the weights after step ``step`` (see
        ``trainer.loop.engines.validation_rollouts``) and ``timing/val_s``; ``step``: the step just
        finished. Pipelined, the validation was queued with those weights when the step ended (the
        host's earlier rollouts sample with older ones), and comes as a ``Later``: waiting
        for it here would wait for every rollout queued before it."""
        from trainer.records.timings import StepTimer

        if self.layout.separate:  # queued behind the rollouts sampled ahead
            queued_s = self.limits.queued_s(self.cfg.train.rollout_lag + 1)
            ref = self.pipeline.validation(step)
            return Later(ref, "rollout host", "rollout.validate", timeout_s=queued_s)
        timer = StepTimer()
        with timer.section("val"):
            (metrics,) = wait_all(
                [self.rollout.validate.remote(step)],
                ["rollout host"],
                timeout_s=self.limits.validation_s,
                what="rollout.validate",
            )
        return {**metrics, "timing/val_s": timer.sections["val"]}

    def _engines(self, method: str, *args) -> list:
        """Call ``method`` on every engine replica and wait."""
        live = [(i, h) for i, h in enumerate(self.replicas) if h is not None]  # None: replacing
        return wait_all(
            [getattr(h, method).remote(*args) for _, h in live],
            [f"engine replica {i}" for i, _ in live],
            timeout_s=self.limits.push_s,  # sleep and wake move the engine's weights
            what=f"rollout.{method}",
        )

    # ------------------------------------------------------------------ records
    def save_checkpoint(self, step: int) -> PendingCheckpoint:
        """Stage a whole checkpoint of step ``step``
        (``trainer.loop.schedule.step_records.stage_checkpoint``); ``PendingCheckpoint.commit``
        makes it ``latest``."""
        return stage_checkpoint(self, step)

    @functools.cached_property
    def lora_state(self) -> dict[str, Any]:
        """What a LoRA run's checkpoint records of its adapters (``model.lora``): their
        settings and the digest of the base they train on (computed once)."""
        from trainer.loop.plan.lora_layout import lora_record

        return lora_record(self.cfg)

    def shutdown(self) -> None:
        """Stop every worker (best effort: a dead one is already gone)."""
        if self.phase_memory is not None:
            self.phase_memory.stop()
        if self.in_process:
            for handle in [h for g in self.all_groups() for h in g.handles] + self.replicas:
                handle.target.shutdown()
            return
        import ray

        # Replicas first release their engines and drop their handles to each other, each
        # within the bound; one busy in a call, or gone, is killed at the bound as before.
        released = [h.shutdown.remote() for h in self.replicas if h is not None]
        if released:
            ray.wait(released, num_returns=len(released), timeout=RELEASE_WAIT_S)
        for group in self.all_groups():
            for h in group.handles:
                ray.kill(h, no_restart=True)
        for handle in self.replicas + [h for h, _ in self.replacer.pending.values()]:
            if handle is not None:
                ray.kill(handle, no_restart=True)
        if self.placement is not None:
            self.placement.remove()
