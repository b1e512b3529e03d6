"""crossrl's weight-transfer engines for vLLM's ``WeightTransferEngineFactory`` (imports vLLM):
``crossrl_gloo`` (``rollout.engines.weights.transfer``'s receiver: pushes over gloo to engines of their
own) and ``crossrl_shm`` (``rollout.engines.weights.shm_transfer``'s chunks: colocated engines), on one
base that fits both pinned engine APIs. ``register`` is vLLM's plugin hook (the
``vllm.general_plugins`` entry point ``crossrl_weight_transfer`` in setup.cfg, run by vLLM's
plugin loader in every vLLM process, workers included, as vllm-ascend registers its engines).
"""

from __future__ import annotations

from rollout.engines.weights.shm_transfer import ENGINE_NAME as SHM_ENGINE
from rollout.engines.weights.shm_transfer import SharedMemoryTransfer, SharedUpdateInfo, load_chunk
from rollout.engines.weights.transfer import ENGINE_NAME as GLOO_ENGINE
from rollout.engines.weights.transfer import (
    GlooWeightTransfer,
    TransferInitInfo,
    TransferReceiver,
    TransferUpdateInfo,
)


def _worker_rank(parallel_config) -> int:
    """A vLLM worker's rank among every worker of the engine (data-parallel index x tp x pp +
    its rank), as vLLM's own engines count it."""
    dp = int(getattr(parallel_config, "data_parallel_index", 0) or 0)
    return dp * int(parallel_config.world_size) + int(parallel_config.rank)


_ENGINE_CLASSES: dict[str, type] = {}


def reload_engine_base() -> type:
    """The base of crossrl's ``WeightTransferEngine`` classes for vLLM (imports vLLM): it fits
    both engine APIs, vLLM 0.24's (constructor ``(config, parallel_config, model)``, the
    worker runs the layerwise reload, ``receive_weights(info, load_weights)``) and the CPU
    lane's 0.32 (``(config, vllm_config, device, model)``, the engine runs it in
    ``start_weight_update`` / ``finish_weight_update``, ``receive_weights(info)``)."""
    if "base" in _ENGINE_CLASSES:
        return _ENGINE_CLASSES["base"]
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class CrossrlEngine(WeightTransferEngine):
        """Loads through vLLM's layerwise reload (``layerwise``) and refreshes a tied LM head."""

        layerwise = True

        def start_weight_update(self) -> None:
            from rollout.engines.vllm.worker import prepacked_experts

            self._experts_before = prepacked_experts(self.model)
            if self.layerwise:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from rollout.engines.vllm.worker import refresh_after_load

            if self.layerwise:
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                finalize_layerwise_reload(self.model, self.model_config)
            refresh_after_load(self.model, getattr(self, "_experts_before", None))
            self._experts_before = None

    _ENGINE_CLASSES["base"] = CrossrlEngine
    return CrossrlEngine


def gloo_engine_class() -> type:
    """crossrl's ``crossrl_gloo`` engine for vLLM (built once; ``reload_engine_base``)."""
    if GLOO_ENGINE in _ENGINE_CLASSES:
        return _ENGINE_CLASSES[GLOO_ENGINE]

    class CrossrlGlooEngine(reload_engine_base()):
        """Receives crossrl's packed pushes over gloo (``TransferReceiver``) into the model."""

        init_info_cls = TransferInitInfo
        update_info_cls = TransferUpdateInfo

        def __init__(self, config, *rest) -> None:
            super().__init__(config, *rest)
            import hal

            self.receiver = TransferReceiver(hal.get_backend("cpu"))

        def init_transfer_engine(self, init_info: TransferInitInfo) -> None:
            self.layerwise = bool(init_info.layerwise)
            self.receiver.join(init_info, _worker_rank(self.parallel_config))

        def receive_weights(self, update_info: TransferUpdateInfo, load_weights=None) -> None:
            # Each chunk is a buffer of its own (never refilled), so the layerwise reload may
            # keep views of it until their layer is whole.
            self.receiver.receive(update_info, load_weights or self.model.load_weights)

        def shutdown(self) -> None:
            self.receiver.close()

        trainer_init = GlooWeightTransfer.trainer_init
        trainer_send_weights = staticmethod(GlooWeightTransfer.trainer_send_weights)

    _ENGINE_CLASSES[GLOO_ENGINE] = CrossrlGlooEngine
    return CrossrlGlooEngine


def shm_engine_class() -> type:
    """crossrl's ``crossrl_shm`` engine for vLLM (built once; imports vLLM): each worker maps
    its device's buffer and loads the chunk (``load_chunk``)."""
    if SHM_ENGINE in _ENGINE_CLASSES:
        return _ENGINE_CLASSES[SHM_ENGINE]

    class CrossrlSharedMemoryEngine(reload_engine_base()):
        """Loads chunks a colocated trainer packed in shared memory (``read_chunk``)."""

        init_info_cls = dict  # nothing to join: the buffers' handles come with each chunk
        update_info_cls = SharedUpdateInfo

        def init_transfer_engine(self, init_info) -> None:
            pass

        def receive_weights(self, update_info: SharedUpdateInfo, load_weights=None) -> None:
            load_chunk(update_info, load_weights or self.model.load_weights)

        def shutdown(self) -> None:
            pass

        trainer_send_weights = staticmethod(SharedMemoryTransfer.trainer_send_weights)

    _ENGINE_CLASSES[SHM_ENGINE] = CrossrlSharedMemoryEngine
    return CrossrlSharedMemoryEngine


def register() -> None:
    """vLLM's plugin hook (entry point ``vllm.general_plugins: crossrl_weight_transfer``): add
    crossrl's engines, ``crossrl_gloo`` and ``crossrl_shm``,
    to vLLM's ``WeightTransferEngineFactory`` (once per process; a vLLM without the
    weight-transfer API is left alone)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return
    for name, build in ((GLOO_ENGINE, gloo_engine_class), (SHM_ENGINE, shm_engine_class)):
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, build())
