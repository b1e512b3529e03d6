"""Several engine replicas behind one ``Engine``: requests are dealt to replicas by prompt.

Every sample and every turn of one prompt (``GenerationRequest.group``, the prompt's index in
the run's prompt stream) goes to replica ``deal_prompt(group, replicas)``: the choice depends
on the prompt only, never on timing or load, so a run is reproducible, and the samples of a
group share one replica's prefix cache. Each replica gets its share in one ``generate`` call,
all replicas at once; results come back in request order. The agent loop's batcher does not
wait for that: it sees the replicas as lanes (``lanes``, ``lane_of``) and keeps one call in
flight on each, so a slow replica delays only its own prompts.

Failover. A replica whose ``generate`` raises ``ReplicaLostError`` (its process is gone) is
marked lost for the rest of the router's life: that call's requests, and every later request
dealt to it, are dealt again over the surviving replicas by the same rule
(``survivors[deal_prompt(group, len(survivors))]``), so nothing is answered twice and the
rollout finishes. A lane keeps its place in the batcher and forwards its calls. Requests carry
their own sampling seeds, so a re-dealt request samples the same tokens; with one survivor a
lost lane's call reaches it whole, the same batch the lost replica had, so its log-probs repeat
bit for bit too (with several survivors the call is split, and log-probs may move in the last
float bits with the batch's shape). ``take_lost`` tells the rollout which replicas were lost,
``take_resubmitted`` how many requests went to the survivors. A caller that serves a peer's
turns through the peer's own engine server (``_Lane.peer_server``: the agent loop's batcher
with continuous admission) resubmits a lost peer's requests itself, to ``survivor_of`` their
prompt, and counts them here (``count_resubmitted``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from rollout.engines.base import Engine, GenerationRequest, GenerationResult, SamplingParams


class ReplicaLostError(RuntimeError):
    """An engine replica's process is gone (raised by the replica's ``Engine`` stand-in, e.g.
    the rollout host's handle on a dead peer); the router deals its requests to the others."""


def deal_prompt(prompt_index: int, num_replicas: int) -> int:
    """The replica that serves every sample and turn of prompt ``prompt_index``: round robin,
    so a step's consecutive prompts spread evenly over the replicas."""
    return int(prompt_index) % num_replicas


class ReplicaRouter(Engine):
    """``replicas[i].generate`` serves the requests dealt to replica i (see the module
    docstring). Weights and memory are each replica's own business (the trainer syncs every
    replica directly), so those methods are not routed. ``waiting``: replica indices not dealt
    to yet (they join when their owner says, ``serve``), e.g. a replacement that has not
    loaded the current weights."""

    def __init__(self, replicas: Sequence[Engine], waiting: Sequence[int] = ()) -> None:
        if not replicas:
            raise ValueError("ReplicaRouter needs at least one engine replica")
        self.replicas = list(replicas)
        self._pool = ThreadPoolExecutor(max_workers=len(self.replicas))
        # One call at a time per replica: a survivor serves its own lane and forwarded calls.
        self._locks = [threading.Lock() for _ in self.replicas]
        self._state = threading.Lock()
        self._out: set[int] = set(waiting)  # not dealt to: lost, or waiting to join
        self._lost: list[int] = []  # lost since the last take_lost, in order
        self._gone: set[int] = set()  # every replica ever lost: none comes back
        self._resubmitted = 0  # requests moved off a lost replica (take_resubmitted)

    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingParams
    ) -> list[GenerationResult]:
        """Deal the requests, generate on every replica at once, return results in order."""
        count = len(self.replicas)
        shares: list[list[int]] = [[] for _ in range(count)]
        for i, req in enumerate(requests):
            shares[deal_prompt(req.group, count)].append(i)
        futures = [
            self._pool.submit(self.serve_lane, r, [requests[i] for i in share], sampling)
            for r, share in enumerate(shares)
            if share
        ]
        results: list[GenerationResult | None] = [None] * len(requests)
        for share, future in zip([s for s in shares if s], futures):
            for i, res in zip(share, future.result()):
                results[i] = res
        return results  # type: ignore[return-value]

    def serve_lane(
        self,
        lane: int,
        requests: list[GenerationRequest],
        sampling: SamplingParams,
        *,
        failover: bool = True,
        **kwargs,
    ) -> list[GenerationResult]:
        """The requests dealt to replica ``lane``: served by it (``kwargs``: its own, e.g. an
        interruptible replica's ``interrupt``), or, once it is lost (or while it waits to
        join), dealt again over the surviving replicas (without ``kwargs``). Without
        ``failover`` a lost replica's call raises ``ReplicaLostError`` instead (marked lost
        all the same): the caller resubmits its requests itself (a stream's lanes)."""
        if lane not in self._out:
            try:
                with self._locks[lane]:
                    return self.replicas[lane].generate(requests, sampling, **kwargs)
            except ReplicaLostError:
                self.mark_lost(lane)
                if not failover:
                    raise
                self.count_resubmitted(len(requests))
        elif not failover and lane in self._gone:
            raise ReplicaLostError(f"engine replica {lane} is lost")
        return self._redeal(requests, sampling)

    def count_resubmitted(self, count: int) -> None:
        """``count`` requests of a lost replica were sent again to the survivors (by the
        router, or by a caller that serves the replicas itself: ``take_resubmitted``)."""
        with self._state:
            self._resubmitted += count

    def take_resubmitted(self) -> int:
        """Requests moved off lost replicas since the last call."""
        with self._state:
            count, self._resubmitted = self._resubmitted, 0
        return count

    def mark_lost(self, replica: int) -> None:
        """Replica ``replica`` is gone (found by its ``generate``, or by its owner, e.g. while
        loading weights): deal its prompts to the others from now on."""
        with self._state:
            if replica not in self._gone:
                self._out.add(replica)
                self._gone.add(replica)
                self._lost.append(replica)

    def serving(self, replica: int) -> bool:
        """Whether replica ``replica`` is dealt to now: neither lost nor waiting to join."""
        return replica not in self._out

    def is_lost(self, replica: int) -> bool:
        """Whether replica ``replica`` is lost (it never serves again)."""
        return replica in self._gone

    def survivor_of(self, group: int) -> int:
        """The replica that serves prompt ``group`` while its own is lost or waiting: dealt
        over the replicas that serve (``deal_prompt``); ``ReplicaLostError`` when none does."""
        survivors = [i for i in range(len(self.replicas)) if i not in self._out]
        if not survivors:
            raise ReplicaLostError("every engine replica is lost; none is left to generate")
        return survivors[deal_prompt(group, len(survivors))]

    def _redeal(
        self, requests: list[GenerationRequest], sampling: SamplingParams
    ) -> list[GenerationResult]:
        shares: dict[int, list[int]] = {}
        for i, req in enumerate(requests):
            shares.setdefault(self.survivor_of(req.group), []).append(i)
        results: list[GenerationResult | None] = [None] * len(requests)
        # A pool of its own: the calls may nest (a survivor lost while serving a re-deal).
        with ThreadPoolExecutor(max_workers=len(shares)) as pool:
            futures = {
                r: pool.submit(self.serve_lane, r, [requests[i] for i in share], sampling)
                for r, share in shares.items()
            }
            for r, future in futures.items():
                for i, res in zip(shares[r], future.result()):
                    results[i] = res
        return results  # type: ignore[return-value]

    def take_lost(self) -> list[int]:
        """The replicas lost since the last call (indices, in the order they were lost)."""
        with self._state:
            lost, self._lost = self._lost, []
        return lost

    def serve(self, replicas: Sequence[int]) -> None:
        """Deal to waiting ``replicas`` from now on (they hold the current weights)."""
        with self._state:
            self._out -= set(replicas) - self._gone

    def lanes(self) -> list[Engine]:
        """One lane per replica: a batching caller serves each replica's share on its own,
        so the slowest replica does not hold up the others' next turns; a lost replica's lane
        forwards to the survivors."""
        return [_Lane(self, i) for i in range(len(self.replicas))]

    def lane_of(self, group: int) -> int:
        """The replica ``deal_prompt`` gives prompt ``group``."""
        return deal_prompt(group, len(self.replicas))

    def update_weights(self, named_tensors) -> None:
        """Not routed: each replica is synced from its own tp group of training ranks."""
        raise NotImplementedError("sync each engine replica directly, not through the router")

    def shutdown(self) -> None:
        """Stop the dispatch threads (the replicas are shut down by their owners)."""
        self._pool.shutdown(wait=False)


class _Lane(Engine):
    """Replica ``index`` of ``router`` as an engine of its own, with the router's failover
    (``failover=False``: a lost replica's call raises ``ReplicaLostError``)."""

    reports_loss = True

    def __init__(self, router: ReplicaRouter, index: int) -> None:
        self.router, self.index = router, index
        # as interruptible as its replica (a local engine; a remote one's calls cannot be)
        self.interruptible = bool(getattr(router.replicas[index], "interruptible", False))
        self.abortable = bool(getattr(router.replicas[index], "abortable", False))
        self.joinable = bool(getattr(router.replicas[index], "joinable", False))

    def mark_lost(self) -> None:
        """This lane's replica is gone (found by its engine server's caller)."""
        self.router.mark_lost(self.index)

    def peer_server(self):
        """The engine server of this lane's replica in the replica's own process (a peer
        that has one: ``RemoteEngine.engine_server``), or None: the caller serves the lane
        itself."""
        open_server = getattr(self.router.replicas[self.index], "engine_server", None)
        return None if open_server is None else open_server(0)

    @property
    def replica_engine(self) -> Engine:
        """The replica's own engine (the same across the routers a host connects)."""
        return self.router.replicas[self.index]

    def generate(self, requests, sampling, **kwargs):
        """The router's ``serve_lane`` for this lane (``kwargs``: the replica's own)."""
        return self.router.serve_lane(self.index, requests, sampling, **kwargs)

    def update_weights(self, named_tensors) -> None:
        """Not routed (see ``ReplicaRouter.update_weights``)."""
        raise NotImplementedError("sync each engine replica directly, not through the router")
