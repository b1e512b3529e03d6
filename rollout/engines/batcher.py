"""An asyncio front for any ``Engine``: one coroutine per request, batched ``generate`` calls.

The agent loop runs every trajectory as its own asyncio task; each awaits
``RequestBatcher.generate(request, key)`` for its next turn. The batcher gathers the requests
waiting at that moment and sends them to the engine in ONE call on a worker thread (the event
loop keeps running environment steps meanwhile), one call in flight at a time per **lane**.
Within a call requests are sorted by ``key`` (the trajectory id), so the call does not depend
on the order in which trajectories arrived.

Lanes. An engine that is several replicas behind a router (``Engine.lanes``) gets one lane per
replica: a request goes to the lane of its prompt (``Engine.lane_of``, dealt by the prompt
alone), and each lane has its own waiting list, its own call in flight and its own thread. So
the trajectories of a fast replica take their next turns while a slow replica is still busy,
instead of every replica waiting for the slowest at each call. A plain engine is one lane.

Two flush rules, applied per lane:

- ``waves=False`` (continuous): a call starts whenever the lane is free and a request waits;
  whatever arrives while it runs goes into the next call. A slow environment delays no other
  trajectory. The HF engine's samples do not depend on the batch (each request has its own
  seeded sampler), but its logprobs move in the last float bits with the batch's padding, and
  which requests share a call depends on environment timing.
- ``waves=True`` (deterministic): a call starts only when every live trajectory of the lane is
  waiting (``join``/``leave`` count them), i.e. exactly the replica's share of a lockstep
  loop's call, so logprobs repeat bit for bit whatever the environments' timing. Environment
  steps still overlap.

Continuous mode on a ``joinable`` lane (the HF engine, vLLM) goes further: the lane is an
engine server (``rollout.engines.server.EngineServer``) for the rollout's length, and each
request is submitted to it the moment the trajectory asks; it joins the running batch between
decode steps and comes back as soon as it ends, so a turn never waits for a call to finish.
Waves mode keeps one call per wave: which requests share a batch is then fixed by the
trajectories alone, not by when they arrived.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from rollout.engines.base import Engine, GenerationRequest, GenerationResult, SamplingParams
from rollout.engines.server import SERVER_KEYS, BatchStats, EngineServer, Pending


class _Lane:
    """One lane's state: its engine, waiting requests, live trajectories, call in flight."""

    def __init__(self, engine: Engine, index: int) -> None:
        self.engine = engine
        self.pending: list[tuple[int, GenerationRequest, asyncio.Future]] = []
        self.live = 0  # trajectories of this lane that will still ask for a turn (waves mode)
        self.busy = False
        self.flush_scheduled = False
        self.task: asyncio.Task | None = None  # the call in flight (a strong reference)
        self.thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"generate-{index}"
        )
        self.server: EngineServer | None = None  # continuous mode on a joinable engine


class RequestBatcher:
    """Async front of ``engine`` for one rollout (one ``SamplingParams`` for every request).

    Use inside a running event loop; ``close()`` when done. ``calls`` records the size
    (requests) of every engine call made, in the order they started (over all lanes).
    """

    def __init__(self, engine: Engine, sampling: SamplingParams, *, waves: bool) -> None:
        self.engine, self.sampling, self.waves = engine, sampling, waves
        self.calls: list[int] = []
        self._lanes = [_Lane(e, i) for i, e in enumerate(engine.lanes())]
        if not waves:
            for i, lane in enumerate(self._lanes):
                if getattr(lane.engine, "joinable", False):
                    lane.server = EngineServer(
                        lane.engine, name=f"rollout-server-{i}", on_batch=self._on_batch
                    )

    def _on_batch(self, stats: BatchStats) -> None:
        self.calls.append(stats.requests)  # from the server's thread (list.append is atomic)

    def _lane(self, group: int) -> _Lane:
        return self._lanes[self.engine.lane_of(group) if len(self._lanes) > 1 else 0]

    def join(self, groups: list[int]) -> None:
        """Trajectories of prompts ``groups`` (one entry each) will ask for turns (waves mode
        waits for them)."""
        for group in groups:
            self._lane(group).live += 1

    def leave(self, group: int) -> None:
        """A trajectory of prompt ``group`` asks for no more turns (it ended); its lane's wave
        may now be complete."""
        lane = self._lane(group)
        lane.live -= 1
        self._schedule_flush(lane)

    async def generate(self, request: GenerationRequest, key: int) -> GenerationResult:
        """Continue ``request`` in its lane's next engine call; ``key`` orders requests in a
        call."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        lane = self._lane(request.group)
        if lane.server is not None:  # straight to the running batch
            pending = lane.server.submit(request, self.sampling)
            pending.add_done_callback(lambda p: loop.call_soon_threadsafe(_settle, future, p))
            return await future
        lane.pending.append((key, request, future))
        self._schedule_flush(lane)
        return await future

    def close(self) -> None:
        """Stop the worker threads and engine servers (calls in flight finish first)."""
        for lane in self._lanes:
            lane.thread.shutdown(wait=True)
            if lane.server is not None:
                lane.server.close()

    def _schedule_flush(self, lane: _Lane) -> None:
        # Deferred to the next loop iteration: requests submitted in this one join the call.
        if not lane.flush_scheduled:
            lane.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._maybe_flush, lane)

    def _maybe_flush(self, lane: _Lane) -> None:
        lane.flush_scheduled = False
        if lane.busy or not lane.pending:
            return
        if self.waves and len(lane.pending) < lane.live:
            return
        batch = sorted(lane.pending, key=lambda item: item[0])
        lane.pending = []
        lane.busy = True
        self.calls.append(len(batch))
        lane.task = asyncio.get_running_loop().create_task(self._run(lane, batch))

    async def _run(
        self, lane: _Lane, batch: list[tuple[int, GenerationRequest, asyncio.Future]]
    ) -> None:
        loop = asyncio.get_running_loop()
        requests = [request for _, request, _ in batch]
        try:
            results = await loop.run_in_executor(
                lane.thread, lane.engine.generate, requests, self.sampling
            )
            if len(results) != len(requests):
                raise RuntimeError(
                    f"{type(lane.engine).__name__}.generate returned {len(results)} results "
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
            lane.busy = False
            self._schedule_flush(lane)


def _settle(future: asyncio.Future, pending: Pending) -> None:
    """``pending``'s outcome into ``future`` (on the event loop), the server's own keys out of
    the result."""
    if future.done():
        return
    try:
        result = pending.result(0)
    except BaseException as exc:  # noqa: BLE001 - raised in the awaiting trajectory
        future.set_exception(exc)
        return
    for key in SERVER_KEYS:
        result.extra.pop(key, None)
    future.set_result(result)
