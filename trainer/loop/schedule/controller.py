"""The controller: one short loop over training steps.

    rollout -> old/ref logprobs (+ values) -> advantages -> plan_minibatches
    -> actor (and critic) updates for ppo_epochs -> weight sync -> metrics, fingerprint, checkpoint

The controller holds metadata and plans only. Engine replicas share the training ranks'
devices (``trainer.loop.plan.layout``): they sleep while the ranks train and wake for the weight
sync, which goes from each tp group's ranks straight to their own replica. The batch goes from the
rollout host to the training workers through Ray's object store; per-token results (logprobs,
values) go from worker to worker the same way. Each concern lives in its own module: the plan in
``batching``, the math in ``trainer.algorithms`` / ``trainer.algorithms.losses``, the device in
``hal``.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from batching import plan_minibatches, plan_stats
from trainer.config import Config
from trainer.loop.cluster.group import (
    Later,
    PendingCalls,
    WorkerGroup,
    wait_all,
)
from trainer.loop.plan.call_limits import CallLimits
from trainer.loop.plan.lora_layout import pushes_whole_weights
from trainer.loop.ranks.step_stats import StepStats
from trainer.loop.schedule.health import NonfiniteStreak, check_env_faults, check_finite_weights
from trainer.loop.schedule.phase_memory import PhaseMemory, measured
from trainer.loop.schedule.replicas import ReplicaReplacer
from trainer.loop.schedule.validation import validation_due

if TYPE_CHECKING:
    from trainer.loop.schedule.backlog import PendingCheckpoint


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
        self.nonfinite = NonfiniteStreak(cfg.run.max_nonfinite_steps)
        self.limits = limits or CallLimits.for_config(cfg)  # seconds each call may take
        # Engines on devices of their own: the fixed-lag pipeline, or the stream
        # (train.max_staleness, colocated engines too); set up by launch.start.
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
        """Run training step ``step`` (1-based); returns (metrics, fingerprint)."""
        from trainer.records.metrics import StepTimer

        timer = StepTimer(watch=functools.partial(measured, self.phase_memory))
        with timer.section("rollout"):
            if self.pipeline is not None:  # generated ahead, or streamed, while ranks trained
                meta, batch_ref = self.pipeline.take(step)
            else:
                meta, batch_ref = self._rollout(step)
            self.replacer.start(meta)  # a replica lost mid-rollout: start its successor
            if not self.layout.separate:
                if self.pipeline is not None:  # streamed: its engine calls stop first
                    self.pipeline.hold()
                # The training ranks get the devices; a push that overwrites every engine
                # weight lets the engines drop theirs instead of copying them to the host
                # and back (not a LoRA push of adapters: the base must survive the sleep).
                self._engines("sleep", self.replay_dir is None and pushes_whole_weights(self.cfg))
        self.last_rollout = meta
        check_env_faults(meta, self.cfg.run.max_env_error_fraction, step)
        plan = self._plan(meta)
        with timer.section("prepare"):
            adv_metrics = self._prepare(plan, batch_ref)
        with timer.section("update"):
            stats, mismatch = self._update(plan, step)
        adv_metrics.update(mismatch)
        with timer.section("sync"):
            self.replacer.rejoin()  # successors join before the weights go to the engines
            if self.layout.separate:  # the engines sample on; the new weights queue for them
                records = self._end_of_step(step, plan)
                validate = validation_due(self.cfg, step)
                self.pipeline.after_update(step, self.snapshot_weights(), validate=validate)
            else:
                records = self._hand_over(step, plan)
                if self.pipeline is not None:  # streamed: sampling goes on, new weights loaded
                    self.pipeline.release(step)
        metrics = self._metrics(step, meta, plan, stats, adv_metrics, timer)
        metrics.update(records["memory"])
        if self.phase_memory is not None:  # each phase's device-wide peak, where it is read
            metrics.update(self.phase_memory.metrics())
        fingerprint = self._fingerprint(step, plan, stats, metrics, records)
        return metrics, fingerprint

    def record_dir(self) -> str | None:
        """Where the rollouts are recorded (``run.record_rollouts``; always for a streamed
        run, which only its recording replays), or None."""
        streamed = bool(self.cfg.train.max_staleness) and self.replay_dir is None
        return str(self.run_dir / "rollouts") if self.cfg.run.record_rollouts or streamed else None

    def _rollout(self, step: int) -> tuple[dict[str, Any], list]:
        """Rows of this step: metadata here, the batch itself in the object store."""
        return wait_all(
            [self.rollout.rollout.remote(step, self.record_dir())],
            ["rollout host"],
            timeout_s=self.limits.rollout_s,
            what="rollout",
        )[0]

    def _plan(self, meta: dict[str, Any]):
        """The mini-batch plan: whole groups per mini-batch, balanced ranks, same on every rank."""
        train = self.cfg.train
        return plan_minibatches(
            meta["trajectory_ids"],
            meta["seq_lens"],
            mini_batch_size=train.mini_batch_size,
            dp_size=train.dp_size,
            max_tokens_per_micro_batch=train.max_tokens_per_micro_batch,
            group_ids=meta["group_ids"],
        )

    def _old_from_update(self) -> bool:
        """Whether the step's first mini-batch takes its old log-probs from its own update
        (``train.old_logprobs_from_update``): not when something reads them before the update
        (``algorithm.rollout_correction``, a KL reward penalty), nor under a rollout lag, where
        the update's weights are not those that sampled (the recomputed old log-probs are the
        proximal policy of decoupled PPO)."""
        algo = self.cfg.algorithm
        kl_penalty = algo.kl_coef > 0 and not algo.use_kl_loss
        return (
            self.cfg.train.old_logprobs_from_update
            and not self.cfg.train.rollout_lag
            and algo.rollout_correction == "none"
            and not kl_penalty
        )

    def _busiest_rank_tokens(self, plan) -> int:
        """Tokens of the step's rows on the rank that holds the most (an update's limit)."""
        lens = self.last_rollout["seq_lens"]
        ranks = self._rank_micro_batches(plan.mini_batches)
        return max(sum(int(lens[i]) for mb in mbs for i in mb) for mbs in ranks)

    def _rank_micro_batches(self, minis) -> list[list[list[int]]]:
        """Per rank, its micro-batches of the mini-batches ``minis``, in order."""
        return [
            [mb for mini in minis for mb in mini.micro_batches[r]]
            for r in range(self.cfg.train.dp_size)
        ]

    def _prepare(self, plan, batch_ref: list) -> dict[str, float]:
        """Old / reference logprobs and values on every rank's rows, then advantages.
        Submitted as one chain per worker (``PendingCalls``) and waited for once. With
        ``_old_from_update`` the first mini-batch's old log-probs come with its update."""
        # every micro-batch of each rank across all mini-batches: the no-grad passes
        rank_mbs = self._rank_micro_batches(plan.mini_batches)
        from_update = self._old_from_update()
        old_mbs = self._rank_micro_batches(plan.mini_batches[1:]) if from_update else rank_mbs
        calls = PendingCalls()
        for group in self.all_groups():
            calls.submit(group, "load_batch", batch_ref)
        pieces = {"old_logprobs": calls.submit(self.actor, "compute_logprobs", per_rank=old_mbs)}
        if self.ref is not None:
            pieces["ref_logprobs"] = calls.submit(self.ref, "compute_logprobs", per_rank=rank_mbs)
        elif self.cfg.algorithm.kl_coef > 0:  # LoRA: the actor with its adapters off
            pieces["ref_logprobs"] = calls.submit(
                self.actor, "compute_ref_logprobs", per_rank=rank_mbs
            )
        if self.critic is not None:
            pieces["values"] = calls.submit(self.critic, "compute_values", per_rank=rank_mbs)
        # every training worker gets the full token fields computed piecewise by the ranks
        for field, piece_refs in pieces.items():
            for group in self.training_groups():
                calls.submit(group, "set_token_field", field, piece_refs)
        advantages = [
            calls.submit(g, "compute_advantages", not from_update) for g in self.training_groups()
        ]
        results = calls.wait(self.limits.update_s(self._busiest_rank_tokens(plan)))
        return results[advantages[0][0]]

    def _update(self, plan, step: int) -> tuple[dict[str, StepStats], dict[str, float]]:
        """``ppo_epochs`` passes over the plan's mini-batches, one optimizer step each, all
        submitted at once (each worker runs them in order); then a stop if any weights are
        non-finite. Returns each training role's statistics of the whole step, and the
        engine-vs-trainer metrics when the old log-probs were completed by the update."""
        groups = self.training_groups()
        from_update = self._old_from_update()
        calls = PendingCalls()
        steps = []  # (role, refs of one mini-batch), in order
        for epoch in range(self.cfg.train.ppo_epochs):
            for m, mini in enumerate(plan.mini_batches):
                rows, per_rank = mini.rows.tolist(), list(mini.micro_batches)
                for g in groups:
                    first = from_update and g is self.actor and epoch == 0 and m == 0
                    args = (rows, True) if first else (rows,)
                    refs = calls.submit(g, "train_mini_batch", *args, per_rank=per_rank)
                    steps.append((g.role, refs))
        finite = [(g.role, calls.submit(g, "weights_finite")) for g in groups]
        mismatch = []
        if from_update:
            rank_mbs = self._rank_micro_batches(plan.mini_batches)
            mismatch = calls.submit(self.actor, "rollout_mismatch_sums", per_rank=rank_mbs)
        results = calls.wait(self.limits.update_s(self._busiest_rank_tokens(plan)))
        totals = {g.role: StepStats(g.role) for g in groups}
        for role, refs in steps:
            reports = [results[r] for r in refs]
            totals[role].add_update(reports)
            self.nonfinite.observe(role, reports[0], step)
        # Stop before non-finite weights reach the rollout engine or a checkpoint.
        for role, refs in finite:
            check_finite_weights(role, [results[r] for r in refs], step)
        if not mismatch:
            return totals, {}
        from trainer.algorithms.rollout_correction import mismatch_from_sums

        return totals, mismatch_from_sums([results[r] for r in mismatch])

    def snapshot_weights(self) -> list | None:
        """The actor's new weights for engines of their own, as ``RolloutHost.take_weights``
        finds them: pushed through the weight group (``rollout.weight_transport``: every
        rank broadcasts its own rows to every engine, which queues them until a rollout
        loads them), ``[PUSHED, push number]``; else in host memory, ``[bucket refs, bucket
        specs]``, each indexed by rank, then bucket (every rank publishes its own rows,
        ``WeightPush.snapshot_weights``); None when replaying (no engine)."""
        if self.replay_dir is not None:
            return None
        if self.layout.weight_transport == "collective":
            from trainer.loop.weights.weight_group import PUSHED

            seq, self.pushes = self.pushes, self.pushes + 1
            self.actor.call("broadcast_weights", seq, timeout_s=self.limits.push_s)
            return [PUSHED, seq]
        parts = self.actor.call("snapshot_weights", timeout_s=self.limits.push_s)
        return [[refs for refs, _ in parts], [specs for _, specs in parts]]

    def _check_weights(self, step: int) -> None:
        """Stop before non-finite weights reach the rollout engine or a checkpoint."""
        for group in self.training_groups():
            check_finite_weights(group.role, group.call("weights_finite"), step)

    def validate(self, step: int) -> dict[str, Any] | Later:
        """``val/*`` metrics on ``data.val_source`` with the weights after step ``step`` (see
        ``trainer.loop.engines.validation_rollouts``) and ``timing/val_s``; ``step``: the step just
        finished. Pipelined, the validation was queued with those weights when the step ended (the
        host's earlier rollouts sample with older ones), and comes as a ``Later``: waiting
        for it here would wait for every rollout queued before it."""
        from trainer.records.metrics import StepTimer

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

    def _hand_over(self, step: int, plan) -> dict[str, Any]:
        """The devices go back from the training ranks to the engines, one stage after the
        other, each waited for before the next starts (the engines' sleep-mode allocators map
        memory without asking what is free, so nothing may overlap): the ranks offload and
        report the step's records (``_end_of_step``); the engines wake their weights and load
        the new ones (``sync_weights``, after which the ranks have freed the staging); then
        the KV caches wake into what is left. Returns ``_end_of_step``'s records."""
        records = self._end_of_step(step, plan)
        with measured(self.phase_memory, "push"):  # the budget's weight push: after the release
            self.sync_weights()
        self._engines("wake_up", ["kv_cache"])
        return records

    def sync_weights(self, *, via_object_store: bool = False) -> None:
        """Load the actor's new weights into the engines: every tp group's ranks hand them to
        their own replica on the same devices, which wakes its weights (not its KV cache) as
        it loads them (nothing to push when replaying); engines of their own load a snapshot
        of them from host memory. ``via_object_store``: the earlier path through Ray's object
        store, for ``bench e2e``."""
        if self.replay_dir is not None:
            return
        started = time.monotonic()
        if self.layout.separate:  # engines of their own: a host-memory snapshot, loaded now
            wait_all(
                [self.rollout.take_weights.remote([None, *self.snapshot_weights()])],
                ["rollout host"],
                timeout_s=self.limits.push_s,
                what="rollout.take_weights",
            )
        else:
            owner = [
                self.replicas[self.layout.replica_of_rank(r)] for r in range(self.cfg.train.dp_size)
            ]
            self.actor.call(
                "push_weights", None, via_object_store, per_rank=owner, timeout_s=self.limits.push_s
            )
        self.limits.observe("push", time.monotonic() - started)  # later pushes' limit

    def _end_of_step(self, step: int, plan) -> dict[str, Any]:
        """After the update, in one wait: the ranks offload and the step's records are read:
        ``memory`` (``memory/<role>_peak_gb``, the
        largest rank's peak per role), ``counts`` (rows and loss tokens per mini-batch, for
        the fingerprint) and ``checksum`` (the parity checksum of the weights, or None when
        ``run.fingerprint_every`` skips this step)."""
        from trainer.records.fingerprint import combine_param_stats

        every = self.cfg.run.fingerprint_every
        checksum = bool(every) and step % every == 0
        # One call per rank (``FSDPWorker.end_of_step``): offload, peak memory, then the
        # actor's records: rank 0 counts the mini-batches, every rank its checksum share.
        rows = [mb.rows.tolist() for mb in plan.mini_batches]
        calls = PendingCalls()
        ends = {}
        for group in self.all_groups():
            asks: list[list] = [[] for _ in group.handles]
            if group is self.actor:
                asks[0].append(("mini_batch_counts", (rows,)))
                if checksum:
                    for ask in asks:
                        ask.append(("param_stats", ()))
            ends[group.role] = calls.submit(group, "end_of_step", per_rank=asks)
        results = calls.wait(self.limits.setup_s)
        ends = {role: [results[r] for r in refs] for role, refs in ends.items()}
        actor = ends[self.actor.role]
        memory = {
            f"memory/{role}_peak_gb": max(rank[0] for rank in answers)
            for role, answers in ends.items()
        }
        if len(actor) > 1:  # rank 0 holds what no other rank does (unsharded tensors, stores)
            memory["memory/actor_rank0_peak_gb"] = actor[0][0]
            memory["memory/actor_others_peak_gb"] = max(rank[0] for rank in actor[1:])
        return {
            "memory": memory,
            "counts": actor[0][1],
            # Each rank sums its own shards (no collective); the ranks' shares add up here.
            "checksum": combine_param_stats([rank[-1] for rank in actor]) if checksum else None,
        }

    # ------------------------------------------------------------------ records

    def _metrics(self, step, meta, plan, stats, adv_metrics, timer) -> dict[str, Any]:
        metrics: dict[str, Any] = {
            "step": step,
            **meta["metrics"],
            **plan_stats(plan),
            "batch/max_seq_len": int(np.max(meta["seq_lens"])),
            **adv_metrics,
        }
        for role_stats in stats.values():
            metrics.update(role_stats.metrics())
        metrics.update(timer.metrics())
        metrics["throughput/tokens_per_s"] = meta["num_tokens"] / max(
            metrics["timing/step_s"], 1e-9
        )
        return metrics

    def _fingerprint(self, step, plan, stats, metrics, records) -> dict[str, Any]:
        from trainer.records.fingerprint import fingerprint_of_step

        fields = {
            k: v for role_stats in stats.values() for k, v in role_stats.fingerprint().items()
        }
        return fingerprint_of_step(plan, fields, metrics, records["checksum"], records["counts"])

    def save_checkpoint(self, step: int) -> PendingCheckpoint:
        """Stage a whole checkpoint of step ``step`` (``trainer.records.checkpoint.save``),
        never of non-finite weights; ``PendingCheckpoint.commit`` makes it ``latest``. A
        lagged run's checkpoint keeps the rollouts of the next ``train.rollout_lag`` steps,
        sampled by older weights, taken as references (``RolloutPipeline.ahead``)."""
        from trainer.loop.schedule.backlog import PendingCheckpoint
        from trainer.records.checkpoint.save import stage_step

        self._check_weights(step)  # never commit non-finite weights over good checkpoints
        ahead: dict[int, Any] = {}
        if self.pipeline is not None:  # the host is sampling later steps already
            consumed = self.last_rollout.get("prompts_consumed", step * self.cfg.train.batch_size)
            ahead = self.pipeline.ahead(step)
        else:
            (consumed,) = wait_all(
                [self.rollout.get_prompts_consumed.remote()],
                ["rollout host"],
                timeout_s=self.limits.setup_s,
                what="rollout.get_prompts_consumed",
            )
        state = {"rollout_lag": self.cfg.train.rollout_lag}  # a resume checks it
        if self.cfg.model.lora.enabled:  # the adapters, and the base they fit (resume checks)
            state["lora"] = self.lora_state
        started = time.monotonic()
        staged = stage_step(
            self.run_dir,
            step,
            self.training_groups(),
            consumed,
            state,
            timeout_s=self.limits.checkpoint_save_s,
        )
        self.limits.observe("checkpoint_save", time.monotonic() - started)  # later saves' limit
        return PendingCheckpoint(staged, ahead)

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

        for group in self.all_groups():
            for h in group.handles:
                ray.kill(h, no_restart=True)
        for handle in self.replicas + [h for h, _ in self.replacer.pending.values()]:
            if handle is not None:
                ray.kill(handle, no_restart=True)
        if self.placement is not None:
            self.placement.remove()
