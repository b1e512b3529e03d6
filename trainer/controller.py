"""The controller: one short loop over training steps.

    rollout -> old/ref logprobs (+ values) -> advantages -> plan_minibatches
    -> actor (and critic) updates for ppo_epochs -> weight sync -> metrics, fingerprint, checkpoint

The controller holds metadata and plans only. The batch goes from the rollout host to the
training workers through Ray's object store; per-token results (logprobs, values) go from
worker to worker the same way. Each concern lives in its own module: the plan in
``batching``, the math in ``trainer.algorithms`` / ``trainer.losses``, the device in ``hal``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np

from batching import plan_minibatches, plan_stats
from trainer.config import Config
from trainer.workers.group import WorkerFailedError, wait_all

CALL_TIMEOUT_S = 1800.0


class WorkerGroup:
    """The Ray actors of one role, one per data-parallel rank, called together."""

    def __init__(self, role: str, handles: list) -> None:
        self.role = role
        self.handles = handles
        self.names = [f"{role} rank {r}" for r in range(len(handles))]

    def call(
        self, method: str, *args, per_rank: list | None = None, timeout_s: float = CALL_TIMEOUT_S
    ) -> list:
        """Call ``method`` on every rank (``per_rank[r]`` prepended to rank r's args) and wait,
        failing fast with the worker's name."""
        refs = self.submit(method, *args, per_rank=per_rank)
        return wait_all(refs, self.names, timeout_s=timeout_s, what=f"{self.role}.{method}")

    def submit(self, method: str, *args, per_rank: list | None = None) -> list:
        """Start ``method`` on every rank; returns the object refs."""
        return [
            getattr(h, method).remote(*(([per_rank[r]] if per_rank else []) + list(args)))
            for r, h in enumerate(self.handles)
        ]


def _flatten_rank_micro_batches(plan, rank: int) -> list[list[int]]:
    """Every micro-batch of one rank across all mini-batches (for the no-grad passes)."""
    return [mb for mini in plan.mini_batches for mb in mini.micro_batches[rank]]


class Trainer:
    """Builds the workers for a config and runs the training loop."""

    def __init__(self, cfg: Config, run_dir: Path, *, replay_dir: str | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.replay_dir = replay_dir
        self.start_step = 0
        self.placement = None
        self.rollout = None
        self.rollout_info: dict[str, Any] = {}
        self.actor: WorkerGroup | None = None
        self.ref: WorkerGroup | None = None
        self.critic: WorkerGroup | None = None
        self.deterministic_settings: dict[str, str] = {}

    # ------------------------------------------------------------------ start-up
    def start(self) -> None:
        """Reserve devices, start rollout host and training workers, resume if asked."""
        import ray

        import hal
        from trainer.workers.critic import CriticWorker
        from trainer.workers.fsdp_worker import WorkerSpec
        from trainer.workers.group import actor_options, make_placement
        from trainer.workers.policy import PolicyWorker
        from trainer.workers.rollout_host import ReplayHost, RolloutHost

        cfg = self.cfg
        dp = cfg.train.dp_size
        backend = hal.get_backend(cfg.device)
        placement = make_placement(backend.ray_resource, dp, timeout_s=cfg.ray.placement_timeout_s)
        self.placement = placement
        threads = max(1, (os.cpu_count() or 1) // dp) if backend.name == "cpu" else 4
        cfg_dict = cfg.model_dump()
        self.use_ref = cfg.algorithm.kl_coef > 0
        self.use_critic = cfg.critic.enable
        shares = {"actor": 0.4, "reference": 0.2, "critic": 0.2, "rollout": 0.2}

        host_opts = actor_options(placement, 0, shares["rollout"])
        if self.replay_dir is not None:
            self.rollout = ray.remote(ReplayHost).options(**host_opts).remote(self.replay_dir)
        else:
            self.rollout = (
                ray.remote(RolloutHost)
                .options(**host_opts)
                .remote(cfg_dict, threads=os.cpu_count() or 1)
            )
        (self.rollout_info,) = wait_all(
            [self.rollout.setup.remote()],
            ["rollout host"],
            timeout_s=CALL_TIMEOUT_S,
            what="rollout.setup",
        )

        steps_per_opt = cfg.optimizer_steps_per_step()
        total_opt = steps_per_opt * cfg.train.total_steps

        def spawn(role: str, cls, trainable: bool, **over) -> WorkerGroup:
            handles = []
            for rank in range(dp):
                spec = WorkerSpec(
                    role=role,
                    rank=rank,
                    world_size=dp,
                    device=cfg.device,
                    model_path=over.get("path", cfg.model.path),
                    # Master weights and optimizer state are fp32 always; param_dtype is only
                    # FSDP2's compute dtype (AdamW on bf16 weights drops lr-1e-6 updates).
                    dtype="float32",
                    seed=cfg.seed,
                    trainable=trainable,
                    lr=over.get("lr", cfg.train.lr),
                    weight_decay=over.get("weight_decay", cfg.train.weight_decay),
                    warmup_steps=over.get("warmup_steps", cfg.train.warmup_steps),
                    total_optimizer_steps=total_opt,
                    lr_schedule=cfg.train.lr_schedule,
                    min_lr_ratio=cfg.train.min_lr_ratio,
                    grad_clip=over.get("grad_clip", cfg.train.grad_clip) or 1e9,
                    param_dtype=cfg.train.param_dtype,
                    reduce_dtype=cfg.train.reduce_dtype,
                    activation_checkpointing=cfg.train.activation_checkpointing,
                    deterministic=cfg.run.deterministic,
                    threads=threads,
                    param_offload=cfg.train.param_offload,
                    optimizer_offload=cfg.train.optimizer_offload,
                    extra={"temperature": cfg.rollout.temperature},
                )
                remote_cls = ray.remote(cls).options(**actor_options(placement, rank, shares[role]))
                handles.append(remote_cls.remote(spec))
            group = WorkerGroup(role, handles)
            # Ranks may sit on several nodes: they meet at rank 0's node.
            addr, port = ray.get(handles[0].rendezvous_address.remote())
            group.setup_info = group.call("setup", addr, port)
            return group

        self.actor = spawn("actor", PolicyWorker, True)
        self.ref = spawn("reference", PolicyWorker, False) if self.use_ref else None
        self.critic = None
        if self.use_critic:
            c = cfg.critic
            self.critic = spawn(
                "critic",
                CriticWorker,
                True,
                path=cfg.model.critic_path or cfg.model.path,
                lr=c.lr,
                weight_decay=c.weight_decay,
                warmup_steps=c.warmup_steps,
                grad_clip=c.grad_clip,
            )
        self.deterministic_settings = deterministic_settings_everywhere(self)
        self._resume()

    def _resume(self) -> None:
        from trainer.checkpoint import LAYOUT, load_json, resolve_resume

        ckpt = resolve_resume(self.run_dir, self.cfg.run.resume)
        if ckpt is None:
            return
        state = load_json(ckpt / LAYOUT.trainer_state)
        for group in self._training_groups():
            group.call("load_pieces", str(ckpt))
        self.start_step = int(state["step"])
        self._sync_weights()
        print(f"crossrl: resumed from {ckpt} (step {self.start_step})", file=sys.stderr)

    def _training_groups(self) -> list[WorkerGroup]:
        return [g for g in (self.actor, self.critic) if g is not None]

    def _all_groups(self) -> list[WorkerGroup]:
        return [g for g in (self.actor, self.ref, self.critic) if g is not None]

    # ------------------------------------------------------------------ one step
    def train_step(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Run training step ``step`` (1-based); returns (metrics, fingerprint)."""
        from trainer.metrics import StepTimer

        timer = StepTimer()
        with timer.section("rollout"):
            meta, batch_ref = self._rollout(step)
        plan = self._plan(meta)
        with timer.section("prepare"):
            adv_metrics = self._prepare(plan, batch_ref)
        with timer.section("update"):
            sums = self._update(plan)
        with timer.section("sync"):
            self._sync_weights()
            for group in self._all_groups():
                group.call("offload_states")
        metrics = self._metrics(step, meta, plan, sums, adv_metrics, timer)
        metrics.update(self._peak_memory())
        fingerprint = self._fingerprint(step, plan, sums, metrics)
        return metrics, fingerprint

    def _rollout(self, step: int) -> tuple[dict[str, Any], list]:
        """Rows of this step: metadata here, the batch itself in the object store."""
        record = str(self.run_dir / "rollouts") if self.cfg.run.record_rollouts else None
        return wait_all(
            [self.rollout.rollout.remote(step, record)],
            ["rollout host"],
            timeout_s=CALL_TIMEOUT_S,
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

    def _prepare(self, plan, batch_ref: list) -> dict[str, float]:
        """Old / reference logprobs and values on every rank's rows, then advantages."""
        rank_mbs = [_flatten_rank_micro_batches(plan, r) for r in range(self.cfg.train.dp_size)]
        for group in self._all_groups():
            group.call("load_batch", batch_ref)
        self._share("old_logprobs", self.actor.submit("compute_logprobs", per_rank=rank_mbs))
        if self.ref is not None:
            self._share("ref_logprobs", self.ref.submit("compute_logprobs", per_rank=rank_mbs))
        if self.critic is not None:
            self._share("values", self.critic.submit("compute_values", per_rank=rank_mbs))
        options = self._advantage_options()
        return [g.call("compute_advantages", options)[0] for g in self._training_groups()][0]

    def _share(self, field: str, piece_refs: list) -> None:
        """Give every worker that needs it the full token field computed piecewise by ranks."""
        for group in self._training_groups():
            group.call("set_token_field", field, piece_refs)

    def _advantage_options(self) -> dict[str, Any]:
        a = self.cfg.algorithm
        return {
            "estimator": a.adv_estimator,
            "gamma": a.gamma,
            "lam": a.lam,
            "norm_adv_by_std": a.norm_adv_by_std,
            "kl_penalty_coef": 0.0 if a.use_kl_loss else a.kl_coef,
            "kl_estimator": a.kl_estimator,
        }

    def _loss_options(self) -> dict[str, Any]:
        a = self.cfg.algorithm
        return {
            "loss_agg": a.loss_agg,
            "horizon": self.cfg.loss_horizon_tokens(),
            "clip_ratio_low": a.clip_ratio_low,
            "clip_ratio_high": a.clip_ratio_high,
            "clip_ratio_c": a.clip_ratio_c,
            "kl_coef": a.kl_coef,
            "kl_estimator": a.kl_estimator,
            "use_kl_loss": a.use_kl_loss,
            "entropy_coef": a.entropy_coef,
        }

    def _update(self, plan) -> dict[str, float]:
        """``ppo_epochs`` passes over the plan's mini-batches; one optimizer step each."""
        cfg, totals = self.cfg, {}
        loss_options = self._loss_options()
        critic_options = {
            "mode": cfg.algorithm.loss_agg,
            "horizon": cfg.loss_horizon_tokens(),
            "cliprange_value": cfg.algorithm.cliprange_value,
        }
        for _epoch in range(cfg.train.ppo_epochs):
            for mini in plan.mini_batches:
                rows = mini.rows.tolist()
                per_rank = list(mini.micro_batches)
                refs = self.actor.submit("train_mini_batch", rows, loss_options, per_rank=per_rank)
                if self.critic is not None:
                    crefs = self.critic.submit(
                        "train_mini_batch", rows, critic_options, per_rank=per_rank
                    )
                    _add(
                        totals,
                        wait_all(
                            crefs,
                            self.critic.names,
                            timeout_s=CALL_TIMEOUT_S,
                            what="critic.train_mini_batch",
                        ),
                        prefix="critic/",
                    )
                _add(
                    totals,
                    wait_all(
                        refs,
                        self.actor.names,
                        timeout_s=CALL_TIMEOUT_S,
                        what="actor.train_mini_batch",
                    ),
                    prefix="actor/",
                )
        return totals

    def _sync_weights(self) -> None:
        """Push the actor's weights into the rollout engine (nothing to push when replaying)."""
        if self.replay_dir is None:
            self.actor.call("push_weights", self.rollout, 64 << 20)

    # ------------------------------------------------------------------ records
    def _peak_memory(self) -> dict[str, float]:
        """``memory/<role>_peak_gb``: the largest rank's peak of this step, per role."""
        out = {}
        for group in self._all_groups():
            out[f"memory/{group.role}_peak_gb"] = max(group.call("peak_memory_gb"))
        return out

    def _metrics(self, step, meta, plan, sums, adv_metrics, timer) -> dict[str, Any]:
        stats = plan_stats(plan)
        tokens = max(1.0, sums.get("actor/loss_tokens", 0.0))
        n_updates = max(1, sums.get("actor/_updates", 1))
        metrics: dict[str, Any] = {
            "step": step,
            **meta["metrics"],
            **stats,
            "batch/max_seq_len": int(np.max(meta["seq_lens"])),
            "actor/loss": sums.get("actor/loss", 0.0) / n_updates,
            "actor/pg_loss": sums.get("actor/pg_loss", 0.0) / tokens,
            "actor/clip_frac": sums.get("actor/clipped", 0.0) / tokens,
            "actor/approx_kl": sums.get("actor/approx_kl", 0.0) / tokens,
            "actor/entropy": sums.get("actor/entropy", 0.0) / tokens,
            "actor/grad_norm": sums.get("actor/grad_norm", 0.0) / n_updates,
            "actor/lr": sums.get("actor/lr_last", 0.0),
            **adv_metrics,
        }
        if "actor/kl" in sums:
            metrics["actor/kl"] = sums["actor/kl"] / tokens
        if self.critic is not None:
            ctok = max(1.0, sums.get("critic/loss_tokens", 0.0))
            metrics["critic/vf_loss"] = sums.get("critic/vf_loss", 0.0) / ctok
            metrics["critic/grad_norm"] = sums.get("critic/grad_norm", 0.0) / n_updates
        metrics.update(timer.metrics())
        metrics["throughput/tokens_per_s"] = meta["num_tokens"] / max(
            metrics["timing/step_s"], 1e-9
        )
        return metrics

    def _fingerprint(self, step, plan, sums, metrics) -> dict[str, Any]:
        from trainer.parity import combine_param_stats, fingerprint_of_step

        rows = [mb.rows.tolist() for mb in plan.mini_batches]
        counts_ref = self.actor.handles[0].mini_batch_counts.remote(rows)
        checksum = None
        every = self.cfg.run.fingerprint_every
        if every and step % every == 0:
            # Each rank sums its own shards (no collective); the ranks' shares add up here.
            checksum = combine_param_stats(self.actor.call("param_stats"))
        counts = wait_all(
            [counts_ref],
            self.actor.names[:1],
            timeout_s=CALL_TIMEOUT_S,
            what="actor.mini_batch_counts",
        )[0]
        return fingerprint_of_step(plan, sums, metrics, checksum, counts)

    def save_checkpoint(self, step: int) -> Path:
        """Write a whole checkpoint atomically (workers write their pieces, then commit)."""
        from trainer.checkpoint import (
            LAYOUT,
            begin_checkpoint,
            commit_checkpoint,
            rng_state,
            save_json,
            save_torch,
        )

        staging = begin_checkpoint(self.run_dir, step)
        for group in self._training_groups():
            group.call("save_pieces", str(staging))
        save_json(
            {"step": step, "prompts_consumed": step * self.cfg.train.batch_size},
            staging / LAYOUT.trainer_state,
        )
        save_torch(rng_state(), staging / LAYOUT.controller_rng)
        return commit_checkpoint(self.run_dir, step, staging)

    def shutdown(self) -> None:
        """Stop every worker (best effort: a dead one is already gone)."""
        import ray

        for group in self._all_groups():
            for h in group.handles:
                ray.kill(h, no_restart=True)
        if self.rollout is not None:
            ray.kill(self.rollout, no_restart=True)
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement.group)


def _add(totals: dict[str, float], per_rank: list[dict[str, float]], prefix: str) -> None:
    """Add per-rank metric sums into ``totals``; grad norm and lr are the same on every rank."""
    for key, value in per_rank[0].items():
        if key in ("grad_norm",):
            totals[prefix + key] = totals.get(prefix + key, 0.0) + value
        elif key == "lr":
            totals[prefix + "lr_last"] = value
    for sums in per_rank:
        for key, value in sums.items():
            if key not in ("grad_norm", "lr"):
                totals[prefix + key] = totals.get(prefix + key, 0.0) + value
    totals[prefix + "_updates"] = totals.get(prefix + "_updates", 0) + 1


def deterministic_settings_everywhere(trainer: Trainer) -> dict[str, str]:
    """The deterministic settings every worker and the rollout engine's process applied; they
    must be the same everywhere (a process that skipped them would make the run
    irreproducible)."""
    groups = [g for g in (trainer.actor, trainer.ref, trainer.critic) if g is not None]
    applied = [
        (name, info.get("deterministic", {}))
        for g in groups
        for name, info in zip(g.names, g.setup_info)
    ]
    if "deterministic" in trainer.rollout_info:  # a replaying probe runs no engine
        applied.append(("rollout host", trainer.rollout_info["deterministic"]))
    first = applied[0][1]
    for name, settings in applied:
        if settings != first:
            raise WorkerFailedError(
                f"{name} applied deterministic settings {settings}, {applied[0][0]} applied {first}"
            )
    return first


def _write_run_config(cfg: Config, run_dir: Path, deterministic: dict[str, str]) -> None:
    """``config.yaml``: the resolved config, plus the deterministic settings the workers
    applied (as comments, so the file still loads as a config)."""
    from rollout.files import atomic_write_text

    lines = [cfg.to_yaml().rstrip("\n")]
    if deterministic:
        lines.append("# run.deterministic applied on every worker:")
        lines += [f"#   {key}={value}" for key, value in sorted(deterministic.items())]
    atomic_write_text(run_dir / "config.yaml", "\n".join(lines) + "\n")


class _StopRequests:
    """SIGINT / SIGTERM handling for a run.

    The first signal asks the loop to stop after the current step (and its checkpoint, if one
    is due): a flag, not an exception, because Ray's own waits may swallow a
    KeyboardInterrupt raised inside them. A second signal abandons the step at once. Either
    way Ray shuts down and ``latest`` names the last whole checkpoint.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopRequests:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        if self.signum is not None:
            raise KeyboardInterrupt(f"signal {signum} again: abandoning the step")
        self.signum = signum
        print(
            f"crossrl: signal {signum}: stopping after this step (again to stop now)",
            file=sys.stderr,
        )

    def check(self) -> None:
        """Raise KeyboardInterrupt if a stop was asked for."""
        if self.signum is not None:
            raise KeyboardInterrupt(f"signal {self.signum}")


def run_training(
    cfg: Config,
    *,
    replay_dir: str | None = None,
    save_checkpoints: bool = True,
    command: str = "train",
) -> int:
    """Run a whole job; returns the process exit status (0 done, 1 failed, 130 interrupted).

    ``replay_dir``: train on recorded rollouts (``step_<N>.npz``) instead of sampling (the
    parity probe, which also passes ``save_checkpoints=False``: a probe of a 7B job should not
    write tens of GB). ``command`` names the CLI command in messages.
    """
    from trainer.workers.group import start_ray

    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with _StopRequests() as stop:
        started_ray = start_ray(
            cfg.ray.address, num_cpus=cfg.ray.num_cpus or max(4, 2 * cfg.train.dp_size + 2)
        )
        trainer = Trainer(cfg, run_dir, replay_dir=replay_dir)
        try:
            trainer.start()
            _write_run_config(cfg, run_dir, trainer.deterministic_settings)
            _train_loop(cfg, trainer, run_dir, stop, save_checkpoints=save_checkpoints)
            return 0
        except WorkerFailedError as err:
            print(f"crossrl {command}: {err}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(
                f"crossrl {command}: interrupted; the last whole checkpoint stays `latest`",
                file=sys.stderr,
            )
            return 130
        finally:
            import ray

            try:
                trainer.shutdown()
            finally:
                if started_ray:
                    ray.shutdown()


def _train_loop(
    cfg: Config, trainer: Trainer, run_dir: Path, stop: _StopRequests, *, save_checkpoints: bool
) -> None:
    """Steps from where the trainer starts to ``train.total_steps``: train, log, checkpoint."""
    from trainer.metrics import FingerprintLogger, MetricsLogger

    total = cfg.train.total_steps
    with (
        MetricsLogger(run_dir, total, start_step=trainer.start_step) as log,
        FingerprintLogger(run_dir, start_step=trainer.start_step) as fp_log,
    ):
        for step in range(trainer.start_step + 1, total + 1):
            stop.check()  # a signal during start-up or the previous step ends the run here
            metrics, fingerprint = trainer.train_step(step)
            log.log(step, metrics)
            fp_log.log(step, fingerprint)
            due = step == total or (cfg.run.save_every and step % cfg.run.save_every == 0)
            if save_checkpoints and due:
                trainer.save_checkpoint(step)
