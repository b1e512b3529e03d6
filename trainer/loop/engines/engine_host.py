"""Engine replicas: ``train.dp_size / rollout.tensor_parallel_size`` of them run colocated with
the training ranks (``trainer.loop.plan.layout``), or on devices of their own
(``rollout.engine_devices``). Each is an ``EngineHost``: the engine on its tp group's devices,
generating what the rollout host deals it (``trainer.loop.engines.rollout_host``, replica 0,
is one too), sleeping while the ranks train and taking new weights from them.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import hal
from rollout.engines.capacity import concurrent_sequences
from rollout.engines.vllm.logs import set_engine_log_level
from trainer.config.schema import Config
from trainer.loop.cluster.group import agree_on_settings
from trainer.loop.cluster.startup import Phases, process_start_time
from trainer.loop.engines.remote_engine import CallSignals
from trainer.loop.plan.layout import weight_transport_rule
from trainer.loop.weights.engine_weights import EngineWeights


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
        self.server = (
            None  # a peer's engine server (start_server): a stream's, or continuous turns'
        )

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

    def settle_server(self) -> None:
        """Wait until the engine server, if any, has no batch running (its requests ended:
        a lag run's rollout aborts those it leaves behind), so the engine may sleep or take
        weights; a stream pauses the server itself around those and this returns at once."""
        if self.server is not None:
            self.server.pause(wait=True)
            self.server.resume()

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
        self.settle_server()
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
