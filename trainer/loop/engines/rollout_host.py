"""The rollout host.

Of the engine replicas (``trainer.loop.engines.engine_host``), replica 0 is the
``RolloutHost``: it also owns the environment, the prompt stream and the agent loop, and deals
generation requests to every replica by prompt. The others are plain ``EngineHost``s. The host hands the controller only
metadata (row lengths, trajectory and group ids, metrics); the packed batch itself goes into
Ray's object store as numpy arrays for the training workers.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import hal
from batching import StepBatch
from rollout.agent_loop import RolloutOutput
from trainer.loop.cluster.local import put
from trainer.loop.engines.engine_host import EngineHost
from trainer.loop.engines.rollout_meta import batch_metadata, combine_rollout_metrics
from trainer.loop.engines.sampling import run_config_rollouts
from trainer.loop.engines.stream_host import StreamingHost
from trainer.loop.weights.weight_group import PUSHED


class RolloutHost(StreamingHost, EngineHost):
    """Replica 0, which also owns the environment, the prompt stream and the agent loop:
    ``rollout(step) -> (metadata, [batch_ref])``. With several replicas its agent loop deals
    requests to all of them by prompt (``rollout.engines.serving.router``); only it reads prompts."""

    def setup(self) -> dict[str, Any]:
        """Load tokenizer, model and engine; check the environment spec."""
        from rollout.envs import bind_env
        from rollout.envs.prompts import PromptSource
        from rollout.rewards import RewardFunction

        info = super().setup()
        cfg, roll = self.cfg, self.cfg.rollout
        reward_fn = None
        if cfg.reward.function is not None:
            # One worker per concurrent env step: a reward call never queues behind others.
            reward_fn = RewardFunction(
                cfg.reward.function,
                timeout_s=cfg.reward.timeout_s,
                max_workers=cfg.env_call_slots(),
            )
        self.env_factory = bind_env(roll.env, roll.env_kwargs, reward_fn)
        if roll.agent_workers:  # the agent loops in processes of their own
            from rollout.agent_workers import AgentContext, AgentWorkers

            context = AgentContext(
                self.tokenizer, roll.env, roll.env_kwargs, cfg.reward.function, cfg.reward.timeout_s
            )
            self.agent_workers = AgentWorkers(roll.agent_workers, context, cfg.env_call_slots())
            self.agent_workers.start()
        self.prompts = PromptSource(cfg.data.source, seed=cfg.seed)
        self.prompts_consumed = 0
        self.val_items = []
        if cfg.data.val_source is not None:
            val = PromptSource(cfg.data.val_source, seed=cfg.seed, key="data.val_source")
            self.val_items = val.all_records()
        info["val_records"] = len(self.val_items)  # the validation's time limit
        self.generator = self.engine
        self.peers: list = []  # the other replicas' EngineHost handles (connect)
        self.waiting: list[int] = []  # replicas that serve once they load weights (connect)
        self.weights_version: int | None = 0  # the step whose weights the replicas hold
        self.weight_load_s = 0.0  # seconds the last take_weights loaded for (every replica)
        self.startup.done("env")
        return info

    def connect(self, peers: list, waiting: list[int] | None = None) -> int:
        """Generate on this replica and on ``peers`` (the other replicas' ``EngineHost``
        handles, in replica order); returns the replica count. ``waiting``: replica indices
        that do not hold the weights this host holds (a replacement, whose engines load
        snapshots: ``take_weights``); they serve once the next snapshot is loaded into them."""
        from rollout.engines.serving.router import ReplicaRouter
        from trainer.loop.engines.remote_engine import RemoteEngine, peer_actor_options

        self.peers = list(peers)
        self.waiting = sorted(waiting or [])
        if self.waiting and getattr(self, "push_receiver", None) is not None:
            self.push_receiver.include(self.waiting)  # members of the next transfer group
        if peers:
            # peers with engine servers of their own (a stream; continuous admission)
            served = bool(peer_actor_options(self.cfg))
            remotes = [RemoteEngine(h, i, served) for i, h in enumerate(peers, start=1)]
            self.generator = ReplicaRouter([self.engine, *remotes], self.waiting)
            if self.versioned is not None:  # a stream samples: its lanes follow the new router
                self.versioned.follow(self.generator)
        return 1 + len(peers)

    def shutdown(self) -> None:
        """Stop the stream and release the engine (``StreamingHost.shutdown``), then drop the
        other replicas' handles while this worker is still connected: ray reports a handle
        still held when the process is killed as a traceback on the driver's stderr."""
        super().shutdown()
        if self.agent_workers is not None:
            self.agent_workers.close()
        self.stream = self.versioned = None  # the stream's lanes follow the router
        self.generator, self.peers = self.engine, []
        gc.collect()  # the router, its lanes and their remote engines held the handles too

    def take_weights(self, weights: list | None) -> int:
        """Load ``weights``: ``[version, bucket refs, bucket specs]`` (a host-memory snapshot,
        ``WeightPush.snapshot_weights``, of the policy after training step ``version``) or
        ``[version, PUSHED, seq]`` (push ``seq`` of the weight group: ``load_pushed``), into
        every replica unless they hold that version already (a version of None always loads:
        ``Trainer.sync_weights``), and into waiting replicas (``connect``) whatever they hold;
        None: keep what they hold. Returns the version the replicas hold (0: the initial
        weights; None: weights of no step)."""
        version, waiting = self.weights_version, self.waiting
        held = weights is not None and weights[0] is not None and weights[0] == version
        if weights is None or (held and not waiting):
            return version
        from trainer.loop.weights.engine_weights import load_into_peers

        target, source, detail = weights
        if source == PUSHED:  # through the weight group: push number ``detail``
            method, args = "load_pushed", (detail,)
        else:  # a host-memory snapshot: bucket refs and specs by rank
            method, args = "load_host_buckets", (source, detail)
        # Replicas that hold the version already skip it; a waiting replacement never does.
        replicas = waiting if held else range(1, 1 + len(self.peers))
        mine = None if held else (lambda: getattr(self, method)(*args))
        began = time.perf_counter()

        def load() -> None:
            load_into_peers(self.peers, self.generator, replicas, method, args, mine)
            if waiting:  # before a stream's groups go on: they are dealt to them at once
                self.generator.serve(waiting)

        self.between_calls(load, None if target is None else int(target))
        self.weight_load_s = time.perf_counter() - began
        if waiting:
            self.waiting = []
        self.weights_version = None if target is None else int(target)
        return self.weights_version

    def rollout(
        self, step: int, record_dir: str | None = None, weights: list | None = None
    ) -> tuple[dict[str, Any], list]:
        """Roll out training step ``step`` (1-based): ``train.batch_size`` prompts x ``rollout.n``.
        ``weights``: a snapshot to load first (``take_weights``; the fixed-lag pipeline sends
        the one its step number asks for, ``trainer.loop.schedule.pipeline``).

        Returns metadata for planning and metrics, and ``[ref]`` to the batch's numpy arrays
        (a list, so Ray passes the reference on instead of resolving it); the metadata's
        ``policy_version`` is the training step whose weights sampled it.
        """
        from trainer.algorithms.dynamic_sampling import GroupSelection

        version = self.take_weights(weights)

        size = self.cfg.train.batch_size
        batches = self.cfg.rollout.max_sample_batches
        # Without dynamic sampling every step takes exactly batch_size prompts.
        first = (step - 1) * size if batches == 1 else self.prompts_consumed
        selection, outputs = GroupSelection(), []
        for _ in range(batches):
            outputs.append(self._sample(step, self.prompts.take(first, size)))
            first += size
            if batches == 1:
                break
            selection.add(outputs[-1].rows)
            if len(selection.kept) >= size:
                break
        self.prompts_consumed = first
        metrics = combine_rollout_metrics([o.metrics for o in outputs])
        if batches == 1:
            rows = outputs[0].rows
        else:
            rows, picked = selection.final(size)
            metrics.update(picked, **{"dynamic_sampling/sample_batches": float(len(outputs))})
        faults = [fault for o in outputs for fault in o.faults]
        out = RolloutOutput(rows=rows, metrics=metrics, faults=faults)
        return self._batch_out(step, out, record_dir, version)

    def _batch_out(
        self, step: int, out: RolloutOutput, record_dir: str | None, version: int | None
    ) -> tuple[dict[str, Any], list]:
        """Step ``step``'s rows as ``rollout`` returns them: the batch's arrays put in the
        object store (recorded under ``record_dir`` first, when given) and its metadata;
        ``version``: the policy version that sampled it."""
        if not out.rows:
            from rollout.env_calls import fault_summary

            total = int(out.metrics.get("rollout/num_trajectories", 0))
            why = fault_summary(out.faults, total) if out.faults else out.metrics
            raise RuntimeError(
                f"step {step}: the rollout produced no rows ({why}); check rollout.env and "
                "rollout.max_input_len"
            )
        batch = StepBatch.from_rows(out.rows)
        arrays = batch.to_numpy()
        if record_dir is not None:
            from rollout.replay import record_rollout

            record_rollout(record_dir, step, arrays)
        meta = batch_metadata(batch, out.metrics)
        meta["prompts_consumed"] = self.prompts_consumed
        if self.stream is not None:  # drawn by the stream, ahead of the steps
            meta["prompts_consumed"] = self.stream.next_ordinal
        meta["policy_version"] = version
        meta["env_faults"] = (
            out.faults
        )  # the health gate shows them (trainer/loop/schedule/health.py)
        # Peers lost mid-rollout, their requests dealt to others: trainer/loop/schedule/replicas.py
        lost = self.generator.take_lost() if self.peers else []
        meta["lost_replicas"] = lost
        meta["metrics"]["rollout/replicas_lost"] = float(len(lost))
        moved = self.generator.take_resubmitted() if self.peers else 0
        meta["metrics"]["rollout/requests_resubmitted"] = float(moved)
        if self.cfg.rollout.engine_devices:  # seconds this rollout waited for its weights
            meta["metrics"]["rollout/weight_load_s"] = self.weight_load_s
            self.weight_load_s = 0.0
        peak = hal.get_backend(self.cfg.engine_device()).peak_memory_bytes()
        meta["metrics"]["memory/engine_peak_gb"] = peak / 1e9  # this replica's process
        return meta, [put(arrays)]

    def _sample(self, step: int, items: list, engine=None, env_slots=None) -> RolloutOutput:
        """One sampled batch: ``items`` x ``rollout.n`` trajectories, with reward shaping;
        ``engine``: what generates (default: the replicas, ``self.generator``); ``env_slots``:
        environment-call slots shared with other batches sampling at once (a stream's)."""
        from rollout.engines import SamplingParams
        from rollout.rewards import apply_overlong_penalty

        cfg, roll = self.cfg, self.cfg.rollout
        sampling = SamplingParams(
            max_new_tokens=roll.max_new_tokens,
            temperature=roll.temperature,
            top_p=roll.top_p,
            top_k=roll.top_k,
        )
        out = run_config_rollouts(
            self.generator if engine is None else engine,
            self.tokenizer,
            self.env_factory,
            items,
            cfg,
            n=roll.n,
            sampling=sampling,
            seed=cfg.seed,
            step=step,
            env_slots=env_slots,
            agent_workers=self.agent_workers,
        )
        if cfg.reward.overlong_buffer_len:
            rows, shaped = apply_overlong_penalty(
                out.rows,
                horizon=roll.max_new_tokens - 1,  # the engine generates at most this many
                buffer_len=cfg.reward.overlong_buffer_len,
                factor=cfg.reward.overlong_penalty_factor,
            )
            out = RolloutOutput(rows=rows, metrics={**out.metrics, **shaped}, faults=out.faults)
        return out

    def validate(self, step: int, weights: list | None = None) -> dict[str, float]:
        """``val/*`` metrics of the validation set (``data.val_source``) under the engine's
        current weights, after loading ``weights`` (``take_weights``), and ``timing/val_s``
        (seconds on this host); ``step``: the training step just finished (0 before training)."""
        import time

        from trainer.loop.engines.validation_rollouts import run_validation

        started = time.perf_counter()
        self.take_weights(weights)
        if not self.val_items:
            raise ValueError("run.val_every / run.val_before_train need data.val_source")
        # Beside a stream: its engine, without counting tokens under the stream's prompts.
        engine = self.generator if self.versioned is None else self.versioned.untracked()
        metrics = run_validation(
            engine,
            self.tokenizer,
            self.env_factory,
            self.val_items,
            self.cfg,
            step,
            self.agent_workers,
        )
        # The host's own time: a lagged run reads validations queued behind its rollouts.
        return {**metrics, "timing/val_s": time.perf_counter() - started}

    def get_prompts_consumed(self) -> int:
        """Training prompts taken from the stream so far (saved in checkpoints)."""
        return self.prompts_consumed

    def set_prompts_consumed(self, count: int) -> None:
        """Resume the prompt stream after ``count`` prompts (from a checkpoint)."""
        self.prompts_consumed = int(count)
