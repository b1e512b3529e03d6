"""An engine tagged with the policy version of its weights, serving every live group of a
stream through one engine server per replica (``VersionedEngine``; ``rollout.streaming`` runs
the groups).

Each group of a stream runs its own agent loop, whose turns arrive here as separate
``generate`` calls from many threads at once. Each call's requests go to the **lane** of their
prompt (one per engine replica, ``Engine.lanes``; ``rollout.stream_lanes`` places a new prompt
on the least-loaded replica and keeps every later turn of it there), and from there to that
replica's engine server (``rollout.engines.serving.server.EngineServer``; a peer replica's, in its own
process, ``engine_server``): each request is submitted as it comes under an id of its own,
joins the running batch between decode steps where the engine is ``joinable`` (the HF engine,
vLLM; another engine takes what waits when its last batch ends) and comes back as it ends.

A weight load (``load``; ``hold``/``release`` for colocated engines) pauses every server and
raises the version once for all of them. With ``partial``, a batch in flight on an
``interruptible`` replica ends after its current decode step; its requests go on from their
prefix under the new weights (the prompt plus the tokens so far, prefilled again: no KV cache
is kept from older weights); without, the load waits for the running batches to end. Every
token records the version that sampled it (``extra["versions"]``, exact: a version changes
only while no batch runs), and per tracked prompt (the request's ``group``) the counts by
version (``tokens_of``).

Close (``close``, the stream's shutdown): no request is taken any more, every caller waiting
raises ``EngineClosed``, batches in flight on interruptible replicas end after their decode
step, and ``close`` returns once every server has stopped (or after its bound).

Abort: a group that sampled a token older than what any later step may train on
(``abort_older_than``) is stopped: its next call raises ``GroupAborted`` and its requests in
flight end by their ids after the current decode step; the rest of the batch goes on (on an
engine that cannot end one request alone, the whole batch ends there and its other requests go
on in the next). Requests from outside the stream (validation) go through ``untracked``: the
same lanes and batches, counted under no prompt, never aborted.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from rollout.engines.base import GenerationResult
from rollout.engines.serving.requests import SERVER_KEYS, continued
from rollout.engines.serving.server import EngineServer
from rollout.stream_jobs import EngineClosed, GroupAborted, Job
from rollout.stream_lanes import Lane, Lanes
from rollout.stream_served import ServedLanes

__all__ = [
    "EngineClosed",
    "GroupAborted",
    "UntrackedEngine",
    "VersionedEngine",
]


class VersionedEngine(ServedLanes):
    """``engine`` (an ``rollout.engines.base.Engine``) tagged with the policy ``version`` of
    the weights it holds, its callers' requests served per replica (see the module docstring).
    Forwards what the agent loop asks of an engine. ``busy_s``: seconds the replicas' servers
    spent in batches, averaged over the lanes; ``engine_s``: summed; ``call_sizes``: requests
    per batch; ``generated_tokens``: every token sampled, kept or not; ``interruptions``:
    batches a load, a close or an abort ended early with requests left to go on;
    ``group_aborts``: groups an abort ended in flight."""

    # It batches across callers itself: its callers' fronts send it each turn as one call,
    # never cut (its own servers cut, join and abort per replica).
    joinable = interruptible = abortable = False

    def __init__(self, engine, version: int = 0, *, partial: bool = False) -> None:
        self.engine = engine
        self._servers: dict[int, EngineServer] = {}  # id(replica engine) -> its server
        self._peers: set[int] = set()  # id(server) of those in a peer's process
        self._served: dict[int, dict[str, EngineServer]] = {}  # group -> request id -> server
        self._request_ids = itertools.count()
        self.version = version
        self._routing = Lanes(engine)
        self._partial = partial
        self.partial = partial and any(lane.interruptible for lane in self._lanes)
        self._cond = threading.Condition()
        self._held = False  # a load, or a hold, has the engine
        self._tokens: dict[int, dict[int, int]] = {}  # group -> version -> tokens sampled
        self._doomed: set[int] = set()  # groups aborted (abort_older_than)
        self._closed = False  # close(): no request is taken, waiting callers raise EngineClosed
        self.busy_s = 0.0
        self.engine_s = 0.0
        self.call_sizes: list[int] = []
        self.generated_tokens = 0
        self.interruptions = 0
        self.group_aborts = 0
        self._resubmitted = 0  # requests moved off a lost replica's lane (take_resubmitted)
        self._serve_lanes()

    @property
    def _lanes(self) -> list[Lane]:
        return self._routing.lanes

    def follow(self, engine) -> None:
        """Serve through ``engine`` (the router the host connected: a replacement replica
        among its lanes) from now on: its lanes take the next requests at once; requests in
        flight on the old ones finish there (each replica keeps its server)."""
        with self._cond:
            self.engine = engine
            self._routing.follow(engine)
            self._serve_lanes()
            self.partial = self._partial and any(lane.interruptible for lane in self._lanes)
            self._cond.notify_all()

    def take_resubmitted(self) -> int:
        """Requests resubmitted to live lanes since the last call, their replica lost."""
        with self._cond:
            count, self._resubmitted = self._resubmitted, 0
        return count

    # ---------------------------------------------------------------- calls

    def generate(self, requests, sampling):
        """The engine's ``generate`` for ``requests`` (batched with the other callers' on each
        lane); tokens counted per prompt and version. GroupAborted if a request's prompt was
        aborted."""
        return self._generate(requests, sampling, track=True)

    def untracked(self) -> UntrackedEngine:
        """This engine for requests outside the stream (validation): batched with the stream's,
        taking turns with the loads, but counted under no prompt and never aborted."""
        return UntrackedEngine(self)

    def _generate(self, requests, sampling, *, track: bool):
        results = [GenerationResult([], [], "length", {"versions": []}) for _ in requests]
        todo = list(range(len(requests)))
        while todo:
            self._raise_if_aborted(requests, todo, track)
            if self._closed:
                raise EngineClosed("the stream's engine is closed (the stream shuts down)")
            # One job per lane, whatever each request has left: a continued request carries
            # its own remaining budget (``GenerationRequest.max_new_tokens``).
            parts: dict[Lane, list[int]] = {}
            with self._cond:  # the lane that serves each prompt now
                for i in todo:
                    lane = self._routing.route(requests[i].group, place=track)
                    parts.setdefault(lane, []).append(i)
            jobs = [
                (
                    batch,
                    Job(
                        [continued(requests[i], results[i].token_ids, sampling) for i in batch],
                        sampling,
                        lane,
                        frozenset(requests[i].group for i in batch) if track else frozenset(),
                    ),
                )
                for lane, batch in parts.items()
            ]
            self._run([job for _, job in jobs])
            todo = []
            for batch, job in jobs:
                if job.redo:  # not answered: routed again, to a lane that serves
                    todo += batch
                    continue
                if job.error is not None:
                    raise job.error
                for i, out in zip(batch, job.outs):
                    self._add(results[i], out, job.version, requests[i].group if track else None)
                    if out.finish_reason == "interrupted":
                        if len(results[i].token_ids) < requests[i].budget(sampling):
                            todo.append(i)
                        else:
                            results[i].finish_reason = "length"
        return results

    def _add(self, into: GenerationResult, out: GenerationResult, version: int, group) -> None:
        """``out`` appended to ``into``; each token's version is the server's (exact), else the
        call's ``version``; counted under ``group`` (None: untracked)."""
        versions = out.extra.get("versions") or [version] * len(out.token_ids)
        into.token_ids += out.token_ids
        into.logprobs += out.logprobs
        into.extra["versions"] += versions
        into.extra.update((k, v) for k, v in out.extra.items() if k not in SERVER_KEYS)
        into.finish_reason = out.finish_reason
        if out.token_ids and group is not None:
            with self._cond:
                counts = self._tokens.setdefault(group, {})
                for v in versions:
                    counts[v] = counts.get(v, 0) + 1

    def _raise_if_aborted(self, requests, todo: list[int], track: bool) -> None:
        if not track:
            return
        with self._cond:
            for i in todo:
                if requests[i].group in self._doomed:
                    raise GroupAborted(requests[i].group)

    def _run(self, jobs: list[Job]) -> None:
        """Every job sent to its lane's server, request by request, and answered."""
        with self._cond:  # what each lane has in flight places the next new prompts
            for job in jobs:
                self._routing.started(job.lane, len(job.requests))
        try:
            for job in jobs:
                self._submit(job)
            for job in jobs:
                self._await(job)
        finally:
            with self._cond:
                for job in jobs:
                    self._routing.ended(job.lane, len(job.requests))

    # ---------------------------------------------------------------- loads and aborts

    def _hold(self) -> None:
        with self._cond:
            while self._held:
                self._cond.wait()
            self._held = True
            servers = list(self._servers.values())
        for server in servers:  # partial: cut after the decode step; else the batch ends first
            server.pause(wait=not self.partial)

    def _free(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()
            servers = list(self._servers.values())
        for server in servers:
            server.resume(self.version)

    def load(self, load: Callable[[], Any], version: int) -> Any:
        """Run ``load()`` (new weights into every replica) once every server is paused (with
        ``partial``: after the current decode step of the batches in flight, else once they
        end), then hold ``version``; returns what ``load`` returned."""
        self._hold()
        try:
            out = load()
            self.version = version
        finally:
            self._free()
        return out

    def hold(self) -> None:
        """Take the engine until ``release``: no batch runs meanwhile (with ``partial``,
        batches in flight end after their current decode step and go on after ``release``).
        What colocated engines do while the ranks train on their devices."""
        self._hold()

    def release(self, version: int) -> None:
        """Give the engine back after ``hold``, holding the weights of policy ``version``."""
        self.version = version
        self._free()

    def abort_older_than(self, min_version: int) -> list[int]:
        """Stop every tracked group in flight that sampled a token of a policy older than
        ``min_version`` (no later step may train on it): its next call raises
        ``GroupAborted``, its requests in flight end by their ids after the current decode
        step. Returns the groups newly aborted."""
        with self._cond:
            new = [
                g
                for g, counts in self._tokens.items()
                if counts and min(counts) < min_version and g not in self._doomed
            ]
            if new:
                self._doomed.update(new)
                self._cond.notify_all()
                self._abort_served(new)
        return new

    def close(self, timeout_s: float) -> bool:
        """Stop serving: no request is taken, callers waiting raise ``EngineClosed``, batches
        in flight on interruptible replicas end after their decode step. True once every
        server has stopped, False if one is still in a batch after ``timeout_s`` seconds."""
        deadline = time.perf_counter() + timeout_s
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            servers = list(self._servers.values())
        return all(server.close(max(0.0, deadline - time.perf_counter())) for server in servers)

    def tokens_of(self, group: int) -> dict[int, int]:
        """Tokens sampled for prompt ``group``, by policy version (and forgets the group)."""
        with self._cond:
            self._doomed.discard(group)
            self._routing.forget(group)
            return self._tokens.pop(group, {})

    def lanes(self) -> list:
        """One lane for the agent loop's batcher: the batching across groups and replicas
        happens here."""
        return [self]

    def lane_of(self, group: int) -> int:
        """Every prompt's requests come to the one lane."""
        return 0

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


class UntrackedEngine:
    """A ``VersionedEngine`` for requests that are no prompt of the stream (``untracked``):
    the same lanes and batches, each token tagged with its version, none counted for
    ``tokens_of`` and none aborted. A validation's ``group`` numbers (its records' indices)
    are the same numbers as the stream's prompt ordinals; counted, a prompt streamed later
    would inherit the version validation sampled at and be dropped as stale."""

    joinable = interruptible = abortable = False  # as the VersionedEngine's

    def __init__(self, versioned: VersionedEngine) -> None:
        self.versioned = versioned

    def generate(self, requests, sampling):
        """``VersionedEngine.generate`` without counting tokens under any prompt."""
        return self.versioned._generate(requests, sampling, track=False)

    def lanes(self) -> list:
        """One lane, as the ``VersionedEngine``'s."""
        return [self]

    def lane_of(self, group: int) -> int:
        """Every request goes to the one lane."""
        return 0

    def __getattr__(self, name: str):
        return getattr(self.versioned, name)
