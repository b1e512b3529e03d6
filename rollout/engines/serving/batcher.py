"""An asyncio front for any ``Engine``: one coroutine per request, each lane an engine server.

The agent loop runs every trajectory as its own asyncio task; each awaits
``RequestBatcher.generate(request, key)`` for its next turn. Every **lane** (a replica of the
engine, ``Engine.lanes``; a plain engine is one) is served for the rollout's length by an
engine server of its own (``rollout.engines.serving.server.EngineServer``), a loop on its own thread:
the event loop keeps running environment steps while the lanes decode, and the trajectories of
a fast replica take their next turns while a slow one is still busy. A request goes to the lane
of its prompt (``Engine.lane_of``, dealt by the prompt alone).

Two admission orders, per lane:

- ``waves=False`` (continuous): each request is submitted the moment its trajectory asks. On a
  ``joinable`` engine (the HF engine, vLLM) it joins the running batch between decode steps and
  comes back as soon as it ends, so a turn never waits for a call to finish; another engine
  takes what waits whenever its last call ends. The HF engine's samples do not depend on the
  batch (each request has its own seeded sampler), but its logprobs move in the last float bits
  with the batch's padding, and which requests share a batch depends on environment timing.
- ``waves=True`` (deterministic): a lane's requests go to its server as one wave
  (``EngineServer.submit_wave``: one engine call of exactly them, nothing joining) only when
  every live trajectory of the lane is waiting (``join``/``leave`` count them), sorted by
  ``key`` (the trajectory id): exactly the replica's share of a lockstep loop's call, so
  logprobs repeat bit for bit whatever the environments' timing. Environment steps still
  overlap.

A replica in a process of its own that runs an engine server there (``peer_server``: a peer
whose actor has the ``serve`` group) takes, in continuous mode, each turn as a request to that
server, so turns join its running batch between decode steps rather than between calls from
here; when it is lost, the requests it held go to the replica the router deals their prompt
to (``ReplicaRouter.survivor_of``), counted. Waves stay one call from here.
"""

from __future__ import annotations

import asyncio
import itertools

from rollout.engines.base import Engine, GenerationRequest, GenerationResult, SamplingParams
from rollout.engines.serving.requests import BatchStats, Pending
from rollout.engines.serving.router import ReplicaLostError
from rollout.engines.serving.server import EngineServer

#: Ids of the requests batchers send to peers' servers (an abort names them).
_REQUEST_IDS = itertools.count()


class _Lane:
    """One lane's server (``server``: this process's, over the lane; or ``peer``: the engine
    server of a peer replica in its own process), and in waves mode its waiting requests and
    live trajectories."""

    def __init__(self, engine: Engine, server: EngineServer | None, peer=None) -> None:
        self.engine, self.server, self.peer = engine, server, peer
        self.pending: list[tuple[int, GenerationRequest, asyncio.Future]] = []
        self.live = 0  # trajectories of this lane that will still ask for a turn (waves mode)
        self.flush_scheduled = False
        self.in_flight: set[str] = set()  # request ids on the peer's server, not back yet


class RequestBatcher:
    """Async front of ``engine`` for one rollout (one ``SamplingParams`` for every request).

    Use inside a running event loop; ``close()`` when done. ``calls`` records the size
    (requests) of every engine batch, in the order they ended (over all lanes).
    """

    def __init__(self, engine: Engine, sampling: SamplingParams, *, waves: bool) -> None:
        self.engine, self.sampling, self.waves = engine, sampling, waves
        self.calls: list[int] = []
        self._lanes = [self._open(i, e) for i, e in enumerate(engine.lanes())]

    def _open(self, index: int, lane: Engine) -> _Lane:
        """Lane ``index``'s server: in continuous mode a peer replica's own, where it has one
        (``peer_server``); else one here, over the lane."""
        peer = None if self.waves else getattr(lane, "peer_server", lambda: None)()
        if peer is not None:
            return _Lane(lane, None, peer)
        server = EngineServer(lane, name=f"rollout-server-{index}", on_batch=self._on_batch)
        return _Lane(lane, server)

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
        """Continue ``request`` on its lane's server (waves mode: in its lane's next wave, where
        ``key`` orders it)."""
        lane = self._lane(request.group)
        if not self.waves:
            if lane.peer is not None:
                return await self._on_peer(request)
            return await _outcome(lane.server.submit(request, self.sampling))
        future = asyncio.get_running_loop().create_future()
        lane.pending.append((key, request, future))
        self._schedule_flush(lane)
        return await future

    async def _on_peer(self, request: GenerationRequest) -> GenerationResult:
        """``request`` on the peer server of its lane; while that replica is lost (or waiting
        to join), on the one the router deals its prompt to instead. A request whose replica
        is lost while it runs is sent again there, counted (``count_resubmitted``)."""
        while True:
            lane = self._lane(request.group)
            router = lane.engine.router
            if not router.serving(lane.engine.index):
                lane = self._lanes[router.survivor_of(request.group)]
                if lane.peer is None:  # this process's own replica
                    return await _outcome(lane.server.submit(request, self.sampling))
            request_id = f"b{next(_REQUEST_IDS)}"  # unique in this process
            lane.in_flight.add(request_id)
            ended = True
            try:
                pending = lane.peer.submit_many([request], self.sampling, [request_id])[0]
                return await _outcome(pending)
            except asyncio.CancelledError:
                ended = False  # still on the peer's server: close() aborts it there
                raise
            except ReplicaLostError:
                lane.engine.mark_lost()
                router.count_resubmitted(1)
            finally:
                if ended:
                    lane.in_flight.discard(request_id)

    def close(self) -> None:
        """Stop the engine servers once their calls in flight end (a joinable or interruptible
        engine's after its current decode step); a peer's server goes on serving others, and
        this batcher's requests still on it end (aborted) after its current decode step."""
        for lane in self._lanes:
            if lane.peer is not None:
                if lane.in_flight:
                    lane.peer.abort(sorted(lane.in_flight))
                continue
            lane.server.close(timeout_s=None)

    def _schedule_flush(self, lane: _Lane) -> None:
        # Deferred to the next loop iteration: requests submitted in this one join the wave.
        if not lane.flush_scheduled:
            lane.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._maybe_flush, lane)

    def _maybe_flush(self, lane: _Lane) -> None:
        lane.flush_scheduled = False
        if not lane.pending or len(lane.pending) < lane.live:
            return
        wave = sorted(lane.pending, key=lambda item: item[0])
        lane.pending = []
        loop = asyncio.get_running_loop()
        pending = lane.server.submit_wave([request for _, request, _ in wave], self.sampling)
        futures = [future for _, _, future in wave]
        left = itertools.count(len(pending) - 1, -1)  # next(): how many end after this one

        def ended(_: Pending) -> None:  # the last of the wave wakes the loop, once for all
            if next(left) == 0:
                _on_loop(loop, _settle_all, futures, pending)

        for p in pending:
            p.add_done_callback(ended)


async def _outcome(pending: Pending) -> GenerationResult:
    """What ``pending`` (a request on a server here or a peer's) returns, awaited on the
    running event loop without a thread waiting for it."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    pending.add_done_callback(lambda p: _on_loop(loop, _settle, future, p))
    return await future


def _on_loop(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Run ``fn(*args)`` on ``loop`` (from a server's thread); nothing once the loop is closed
    (its rollout has ended and nobody waits for the request: an aborted peer request's end
    must not raise in the peer server's thread)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is closed
        pass


def _settle_all(futures: list[asyncio.Future], pending: list[Pending]) -> None:
    """``_settle`` for each of a wave's requests."""
    for future, p in zip(futures, pending):
        _settle(future, p)


def _settle(future: asyncio.Future, pending: Pending) -> None:
    """``pending``'s outcome (what the engine returned) into ``future``, on the event loop."""
    if future.done():
        return
    try:
        future.set_result(pending.outcome(0))
    except BaseException as exc:  # noqa: BLE001 - raised in the awaiting trajectory
        future.set_exception(exc)
