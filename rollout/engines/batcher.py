"""An asyncio front for any ``Engine``: one coroutine per request, batched ``generate`` calls.

The agent loop runs every trajectory as its own asyncio task; each awaits
``RequestBatcher.generate(request, key)`` for its next turn. The batcher gathers the requests
waiting at that moment and sends them to ``engine.generate`` in ONE call on a worker thread
(the event loop keeps running environment steps meanwhile), one call in flight at a time.
Within a call requests are sorted by ``key`` (the trajectory id), so the call does not depend
on the order in which trajectories arrived.

Two flush rules:

- ``waves=False`` (continuous): a call starts whenever the engine is free and a request waits;
  whatever arrives while it runs goes into the next call. A slow environment delays no other
  trajectory. The HF engine's samples do not depend on the batch (each request has its own
  seeded sampler), but its logprobs move in the last float bits with the batch's padding, and
  which requests share a call depends on environment timing.
- ``waves=True`` (deterministic): a call starts only when every live trajectory is waiting
  (``join``/``leave`` count them), i.e. exactly the calls of a lockstep loop, so logprobs
  repeat bit for bit whatever the environments' timing. Environment steps still overlap.

Works for any engine behind ``Engine.generate(list)``, a replica router included (it deals the
call's requests to its replicas by ``group``). vLLM's own async engine (continuous batching per
token, not per call) could replace this front later without changing the agent loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from rollout.engines.base import Engine, GenerationRequest, GenerationResult, SamplingParams


class RequestBatcher:
    """Async front of ``engine`` for one rollout (one ``SamplingParams`` for every request).

    Use inside a running event loop; ``close()`` when done. ``calls`` records the size
    (requests) of every ``engine.generate`` call made, in order.
    """

    def __init__(self, engine: Engine, sampling: SamplingParams, *, waves: bool) -> None:
        self.engine, self.sampling, self.waves = engine, sampling, waves
        self.calls: list[int] = []
        self._pending: list[tuple[int, GenerationRequest, asyncio.Future]] = []
        self._live = 0  # trajectories that will still ask for a turn (waves mode)
        self._busy = False
        self._flush_scheduled = False
        self._task: asyncio.Task | None = None  # the call in flight (a strong reference)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="generate")

    def join(self, count: int = 1) -> None:
        """``count`` more trajectories will ask for turns (waves mode waits for them)."""
        self._live += count

    def leave(self) -> None:
        """A trajectory asks for no more turns (it ended); a wave may now be complete."""
        self._live -= 1
        self._schedule_flush()

    async def generate(self, request: GenerationRequest, key: int) -> GenerationResult:
        """Continue ``request`` in the next engine call; ``key`` orders requests in a call."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((key, request, future))
        self._schedule_flush()
        return await future

    def close(self) -> None:
        """Stop the worker thread (a call in flight finishes first)."""
        self._thread.shutdown(wait=True)

    def _schedule_flush(self) -> None:
        # Deferred to the next loop iteration: requests submitted in this one join the call.
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._maybe_flush)

    def _maybe_flush(self) -> None:
        self._flush_scheduled = False
        if self._busy or not self._pending:
            return
        if self.waves and len(self._pending) < self._live:
            return
        batch = sorted(self._pending, key=lambda item: item[0])
        self._pending = []
        self._busy = True
        self.calls.append(len(batch))
        self._task = asyncio.get_running_loop().create_task(self._run(batch))

    async def _run(self, batch: list[tuple[int, GenerationRequest, asyncio.Future]]) -> None:
        loop = asyncio.get_running_loop()
        requests = [request for _, request, _ in batch]
        try:
            results = await loop.run_in_executor(
                self._thread, self.engine.generate, requests, self.sampling
            )
            if len(results) != len(requests):
                raise RuntimeError(
                    f"{type(self.engine).__name__}.generate returned {len(results)} results "
                    f"for {len(requests)} requests"
                )
        except asyncio.CancelledError:
            for _, _, future in batch:
                future.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - an engine failure fails its callers
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(exc)
        else:
            for (_, _, future), result in zip(batch, results):
                if not future.done():
                    future.set_result(result)
        finally:
            self._busy = False
            self._schedule_flush()
