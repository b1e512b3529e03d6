"""Engine replicas and the rollout host.

``train.dp_size / rollout.tensor_parallel_size`` engine replicas run colocated with the
training ranks (``trainer.loop.plan.layout``). Replica 0 is the ``RolloutHost``: it also owns the
environment, the prompt stream and the agent loop, and deals generation requests to every
replica by prompt. The others are plain ``EngineHost``s. The host hands the controller only
metadata (row lengths, trajectory and group ids, metrics); the packed batch itself goes into
Ray's object store as numpy arrays for the training workers.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import torch

import hal
from batching import StepBatch
from rollout.agent_loop import RolloutOutput
from rollout.engines.capacity import concurrent_sequences
from rollout.engines.vllm.logs import set_engine_log_level
from trainer.config.schema import Config
from trainer.loop.cluster.group import agree_on_settings
from trainer.loop.cluster.local import put
from trainer.loop.cluster.startup import Phases, process_start_time
from trainer.loop.engines.remote_engine import CallSignals
from trainer.loop.engines.rollout_meta import batch_metadata, combine_rollout_metrics
from trainer.loop.engines.sampling import run_config_rollouts
from trainer.loop.engines.stream_host import StreamingHost
from trainer.loop.plan.layout import weight_transport_rule
from trainer.loop.weights.engine_weights import EngineWeights
from trainer.loop.weights.weight_group import PUSHED


def agree_with_engine_workers(
    host: dict[str, str], workers: list[dict[str, str]], replica: int = 0
) -> dict[str, str]:
    """The deterministic settings of engine replica ``replica``: those its process applied
    (``host``) and each of its engine's workers (``workers``, in tp rank order) must be the
    same (``agree_on_settings`` raises naming the odd one)."""
    applied = [(f"engine replica {replica} process", host)]
    applied += [(f"engine replica {replica} worker {rank}", s) for rank, s in enumerate(workers)]
    return agree_on_settings(applied)


def engine_batch_invariance(cfg: Config, backend) -> dict[str, str]:
    """The environment that turns on the vLLM engine's batch-invariant mode on ``backend``
    under ``run.deterministic``: a request's tokens then do not depend on which others share
    its batch, so a restarted or resumed run samples them again. Empty for the HF engine
    (seeded per request already), where the device has no such mode (vLLM's CPU platform:
    ``hal`` ``vllm_batch_invariant``) and when the run does not ask for determinism."""
    if cfg.rollout.engine != "vllm" or not cfg.run.deterministic:
        return {}
    return {"VLLM_BATCH_INVARIANT": "1"} if backend.vllm_batch_invariant else {}


class EngineHost(EngineWeights):
    """One engine replica's process: the engine on its tp group's devices, sharing them with
    that group's training ranks. Generates what the rollout host deals it, sleeps while the
    ranks train, and takes new weights from its ranks (``EngineWeights``)."""

    def __init__(self, cfg: Config, threads: int = 1, replica: int = 0) -> None:
        """``cfg``: the typed job config (it pickles into Ray); ``threads``: CPU threads;
        ``replica``: this replica's index (``trainer.loop.plan.layout``)."""
        # Start-up phases, from this process's start: its boot and imports, then setup's.
        self.startup = Phases(process_start_time())
        self.startup.done("boot")
        self.cfg = cfg
        self.threads = threads
        self.replica = replica
        self.engine = None
        self.calls = CallSignals()  # what the rollout host asks of its calls in flight
        self.server = None  # a streamed run's peer: its engine server (start_server)

    def setup(self) -> dict[str, Any]:
        """Load tokenizer, model and engine."""
        from rollout.engines import make_engine
        from rollout.models import builtin_weights_dir, load_model
        from rollout.tokenizer import load_tokenizer

        self.startup.done("queued")
        torch.set_num_threads(max(1, self.threads))
        cfg = self.cfg
        backend = hal.get_backend(cfg.engine_device())  # rollout.device, else the trainer's
        # The engine's process gets the same deterministic switches as the trainers, before
        # any kernel or engine starts (device libraries read theirs once, at start-up).
        deterministic = backend.set_deterministic(cfg.seed) if cfg.run.deterministic else {}
        model_path = cfg.model.path
        is_builtin = model_path.startswith("builtin:")
        self.tokenizer = load_tokenizer("builtin" if is_builtin else model_path)
        self.startup.done("tokenizer")
        roll = cfg.rollout
        invariance = engine_batch_invariance(cfg, backend)
        routed = cfg.algorithm.routing_replay != "none"  # a mixture's routing, returned
        if roll.engine == "hf":
            model = load_model(
                model_path, dtype=cfg.model.dtype, seed=cfg.seed, device=backend.device(0)
            )
            lora = cfg.model.lora
            if lora.enabled:  # the actor's adapters on the same base: pushes load only them
                from rollout.lora import inject

                inject(model, lora.rank, lora.alpha, 0.0, lora.target_modules)
            model.eval()
            self.engine = make_engine("hf", model, self.tokenizer, routed_experts=routed)
        else:
            directory = builtin_weights_dir(model_path, cfg.seed) if is_builtin else model_path
            quiet = set_engine_log_level(roll.engine_log_level)  # before vLLM reads it, once
            # fail fast, in one line, when the engine's platform plugin targets another chip
            backend.check_engine_build()
            os.environ.update(invariance)  # read at engine start; its workers inherit it
            self.engine = make_engine(
                "vllm",
                str(directory),
                self.tokenizer,
                dtype=cfg.model.dtype,
                seed=cfg.seed,
                gpu_memory_utilization=engine_memory_fraction(cfg, backend.is_accelerator),
                tensor_parallel_size=roll.tensor_parallel_size,
                max_model_len=roll.max_input_len + roll.max_new_tokens,
                # colocated: free the devices while the ranks train (ignored on the CPU)
                enable_sleep_mode=backend.is_accelerator and not roll.engine_devices,
                layerwise_reload=backend.vllm_layerwise_reload,
                engine_kwargs={
                    **quiet,
                    **backend.vllm_engine_options(),
                    **backend.vllm_expert_parallel_options(roll.expert_parallel),
                },
                lora=_served_adapters(cfg),
                weight_transfer=_transfer_engine(cfg, backend),
                engine_loop=roll.engine_loop,
                routed_experts=routed,
            )
            if cfg.run.deterministic:
                # At tp > 1 each device has a worker process of its own, and the
                # deterministic-algorithms flag does not travel with the environment.
                workers = self.engine.set_worker_deterministic(backend.name, cfg.seed)
                deterministic = agree_with_engine_workers(deterministic, workers, self.replica)
        self.startup.done("engine")
        return {
            "engine": roll.engine,
            "replica": self.replica,
            "deterministic": deterministic,
            "batch_invariant": invariance,
            "startup": self.startup.seconds,
            "kv_sequences": concurrent_sequences(self.engine),  # the rollout limit's waves
        }

    def generate(self, requests: list, sampling, call: str | None = None) -> list:
        """The engine's ``generate`` on the requests dealt to this replica; ``call``: its name,
        for ``interrupt_call`` (a stream's calls, ``RemoteEngine``)."""
        return self.calls.run(self.engine, requests, sampling, call)

    # ---------------------------------------------------------------- the engine server
    # A streamed run's peer serves the rollout host's jobs through an engine server of its
    # own (``RemoteServer`` on the host's side): ``serve`` in the actor's ``serve`` group, the
    # rest in its ``control`` group.

    def start_server(self, version: int) -> None:
        """Serve from now on, holding the weights of policy ``version`` (once per stream)."""
        from rollout.engines.serving.server import EngineServer

        if self.server is None:
            self.server = EngineServer(self.engine, version, name=f"engine-server-{self.replica}")

    def serve(self, requests: list, sampling, request_ids: list[str]) -> list:
        """One job's requests through the engine server; their results, in order."""
        pending = self.server.submit_many(requests, sampling, request_ids)
        return [p.result() for p in pending]

    def abort_requests(self, request_ids: list[str]) -> int:
        """``EngineServer.abort``."""
        return self.server.abort(request_ids)

    def pause_server(self, wait: bool = False) -> None:
        """``EngineServer.pause`` (before a weight load, or while the ranks hold the devices)."""
        self.server.pause(wait)

    def resume_server(self, version: int | None = None) -> None:
        """``EngineServer.resume``."""
        self.server.resume(version)

    def close_server(self, timeout_s: float = 30.0) -> bool:
        """``EngineServer.close``."""
        return self.server.close(timeout_s)

    def server_waits(self) -> list[float]:
        """``EngineServer.take_waits``."""
        return self.server.take_waits()

    def server_batches(self) -> list:
        """``EngineServer.take_batches``."""
        return self.server.take_batches()

    def interrupt_call(self, call: str, groups: list[int] | None = None) -> None:
        """End call ``call`` after its current decode step, or (``groups``) only the requests
        of those groups in it; runs in the actor's ``control`` group beside the call."""
        self.calls.interrupt(call, groups)

    def sleep(self, discard_weights: bool = False) -> None:
        """Free the devices for the training ranks (weights and KV cache); ``discard_weights``:
        a weight push follows before the next rollout, so the weights are dropped rather than
        kept in host memory (``Engine.sleep``)."""
        self.engine.sleep(discard_weights)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Retake ``tags`` (``rollout.engines.base.WAKE_TAGS``; None: all)."""
        self.engine.wake_up(tags)

    def awake_tags(self) -> list[str]:
        """What of the engine is awake (``weights``, ``kv_cache``)."""
        return list(getattr(self.engine, "awake_tags", ()))

    def shutdown(self) -> None:
        """Stop the engine server, if any, and release the engine (its transfer engine with
        it)."""
        if self.server is not None:
            self.server.close()
        if self.engine is not None:
            self.engine.shutdown()


def engine_memory_fraction(cfg: Config, on_accelerator: bool) -> float:
    """The share of its device memory one replica's engine may take: ``rollout.memory_fraction``
    of each of its own devices on an accelerator; on the CPU all replicas share the host's
    memory, so they split the fraction."""
    if on_accelerator:
        return cfg.rollout.memory_fraction
    devices = cfg.rollout.engine_devices or cfg.train.dp_size
    replicas = devices // cfg.rollout.tensor_parallel_size
    return cfg.rollout.memory_fraction / replicas


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
                max_workers=roll.env_concurrency,
            )
        self.env_factory = bind_env(roll.env, roll.env_kwargs, reward_fn)
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
        from trainer.loop.engines.remote_engine import RemoteEngine

        self.peers = list(peers)
        self.waiting = sorted(waiting or [])
        if self.waiting and getattr(self, "push_receiver", None) is not None:
            self.push_receiver.include(self.waiting)  # members of the next transfer group
        if peers:
            streamed = self.cfg.train.max_staleness is not None  # peers take interrupts
            remotes = [RemoteEngine(h, i, streamed) for i, h in enumerate(peers, start=1)]
            self.generator = ReplicaRouter([self.engine, *remotes], self.waiting)
            if self.versioned is not None:  # a stream samples: its lanes follow the new router
                self.versioned.follow(self.generator)
        return 1 + len(peers)

    def shutdown(self) -> None:
        """Stop the stream and release the engine (``StreamingHost.shutdown``), then drop the
        other replicas' handles while this worker is still connected: ray reports a handle
        still held when the process is killed as a traceback on the driver's stderr."""
        super().shutdown()
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
            engine, self.tokenizer, self.env_factory, self.val_items, self.cfg, step
        )
        # The host's own time: a lagged run reads validations queued behind its rollouts.
        return {**metrics, "timing/val_s": time.perf_counter() - started}

    def get_prompts_consumed(self) -> int:
        """Training prompts taken from the stream so far (saved in checkpoints)."""
        return self.prompts_consumed

    def set_prompts_consumed(self, count: int) -> None:
        """Resume the prompt stream after ``count`` prompts (from a checkpoint)."""
        self.prompts_consumed = int(count)


def _transfer_engine(cfg: Config, backend) -> str | None:
    """The weight-transfer engine a vLLM replica's workers take pushes through
    (``weight_transport_rule``): the backend's collective one for engines of their own, its
    colocated one (IPC) beside the ranks; None where pushes take another way."""
    rule = weight_transport_rule(cfg)
    if rule == "collective":
        return backend.weight_transfer_engine
    return backend.colocated_transfer_engine if rule == "ipc" else None


def _served_adapters(cfg) -> dict | None:
    """The LoRA settings a vLLM engine serves adapters of (``model.lora``: its pushes carry
    adapters, ``trainer.loop.plan.lora_layout.lora_push``), else None."""
    lora = cfg.model.lora
    if not lora.enabled:
        return None
    return {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.target_modules)}
