"""An engine tagged with the policy version of its weights, serving every live group of a
stream in one continuous batch per replica (``VersionedEngine``; ``rollout.streaming`` runs
the groups).

Each group of a stream runs its own agent loop, whose turns arrive here as separate
``generate`` calls from many threads at once. They are not served one call at a time: calls
wait in a queue per **lane** (one per engine replica, ``Engine.lanes``; a prompt's requests go
to ``Engine.lane_of`` its group, as the replica router deals them), and whichever waiting
thread finds a lane free sends everything queued there, every group's requests with the same
sampling settings, in **one** engine call; the results go back to each caller. A lane whose
call just came back waits a moment before the next (``LINGER_SHARE`` of that call, at most
``LINGER_S``, none once as many requests wait as it carried), so the callers it answered,
asking again at once, join the next call rather than alternate with the others in calls of
their own; its first call waits ``LINGER_S`` for the groups that start together. So each
replica decodes every live trajectory that waits for a turn together (HF: one padded batch;
vLLM: its own scheduler over all of them), and the replicas run side by side. A
``joinable`` replica (``Engine.joinable``: the HF engine) is served instead by an engine server
of its own (``rollout.engines.server.EngineServer``): each caller's requests are submitted as
they come, join the running batch between decode steps and come back as each ends; a load
pauses the server (with ``partial``, after its decode step; else once its batch ends) and
every token carries the version that sampled it, and an abort ends the group's requests by
their ids.

A weight load (``load``; ``hold``/``release`` for colocated engines) waits for the lanes'
calls to end, none starting meanwhile, and raises the version once for every lane. With
``partial``, a call in flight on an ``interruptible`` lane ends after its current decode step
instead; its requests go on from their prefix under the new weights (the prompt plus the
tokens so far, prefilled again: no KV cache is kept from older weights). Every token records
the version it was sampled under (``extra["versions"]``), and per tracked prompt (the
request's ``group``) the counts by version (``tokens_of``).

Close (``close``, the stream's shutdown): no call starts any more, every caller waiting raises
``EngineClosed``, a call in flight on an interruptible lane ends after its current decode step,
and ``close`` returns once no lane is in a call (or after its bound).

Abort: a group that sampled a token older than what any later step may train on
(``abort_older_than``) is stopped: its jobs still queued are not sent and its next call raises
``GroupAborted``; in a call in flight on an ``abortable`` lane (``Engine.abortable``: HF, vLLM,
a remote replica) only that group's requests end after the current decode step, the rest of
the call goes on; on a lane only interruptible the whole call ends there and its other
requests go on in the next call. Requests from outside the stream (validation) go through ``untracked``:
the same lanes and batches, counted under no prompt, never aborted.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from rollout.engines.base import GenerationResult
from rollout.engines.router import ReplicaLostError
from rollout.engines.server import SERVER_KEYS, EngineServer, continued
from rollout.stream_jobs import EngineClosed, GroupAborted, Job
from rollout.stream_lanes import LINGER_S, LINGER_SHARE, Lane, Lanes, linger
from rollout.stream_served import ServedLanes

__all__ = [
    "LINGER_S",
    "LINGER_SHARE",
    "EngineClosed",
    "GroupAborted",
    "UntrackedEngine",
    "VersionedEngine",
]


class VersionedEngine(ServedLanes):
    """``engine`` (an ``rollout.engines.base.Engine``) tagged with the policy ``version`` of
    the weights it holds, its callers' requests batched per lane (see the module docstring).
    Forwards what the agent loop asks of an engine. ``busy_s``: seconds the lanes spent in
    engine calls, averaged over the lanes; ``engine_s``: summed; ``call_sizes``: requests per
    engine call; ``generated_tokens``: every token sampled, kept or not; ``interruptions``:
    calls ended early for a load, a close, or an abort on a lane that cannot end one group
    alone; ``group_aborts``: groups an abort ended mid-call while the rest of it went on.
    ``serve``: a ``joinable`` lane's requests go to an engine server of its own
    (``rollout.engines.server.EngineServer``: each request submitted as it comes, joining the
    running batch between decode steps) instead of the lane's queue of calls; so do those of a
    replica whose engine offers ``engine_server(version)`` (a peer's server in its own
    process, ``trainer.loop.engines.remote_engine.RemoteServer``)."""

    joinable = False  # batches across callers itself: its callers' fronts send it each turn

    def __init__(
        self, engine, version: int = 0, *, partial: bool = False, serve: bool = True
    ) -> None:
        self.engine = engine
        self._serve = serve
        self._servers: dict[int, EngineServer] = {}  # id(replica engine) -> its server
        self._served: dict[int, dict[str, EngineServer]] = {}  # group -> request id -> server
        self._request_ids = itertools.count()
        self.version = version
        self._routing = Lanes(engine)
        self._partial = partial
        self.partial = partial and any(lane.interruptible for lane in self._lanes)
        self._cond = threading.Condition()
        self._held = False  # a load, or a hold, has the engine
        self._loads_waiting = 0  # loads wait first: calls in flight yield to them
        self._tokens: dict[int, dict[int, int]] = {}  # group -> version -> tokens sampled
        self._doomed: set[int] = set()  # groups aborted (abort_older_than)
        self._doom_epoch = 0
        self._closed = False  # close(): no call starts, waiting callers raise EngineClosed
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
        among its lanes) from now on: its lanes take the next calls at once; jobs queued on
        the old ones go to the new, and calls in flight there finish (``rollout.stream_lanes``)."""
        with self._cond:
            self.engine = engine
            for job in self._routing.follow(engine):
                job.redo = job.done = True
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
        """Every job sent and answered: a served lane's to its server, request by request; the
        others queued on their lanes (``_run_queued``)."""
        with self._cond:  # what each lane has in flight places the next new prompts
            for job in jobs:
                self._routing.started(job.lane, len(job.requests))
        try:
            served = [job for job in jobs if job.lane.server is not None]
            for job in served:
                self._submit(job)
            queued = [job for job in jobs if job.lane.server is None]
            if queued:
                self._run_queued(queued)
            for job in served:
                self._await(job)
        finally:
            with self._cond:
                for job in jobs:
                    self._routing.ended(job.lane, len(job.requests))

    def _run_queued(self, jobs: list[Job]) -> None:
        """Queue ``jobs`` on their lanes and drive the lanes until every one has come back:
        this thread sends a free lane's whole queue (``_call``) or waits for another's call."""
        with self._cond:
            for job in jobs:
                if not job.lane.pending:
                    job.lane.queued_at = time.perf_counter()
                job.lane.pending.append(job)
            self._cond.notify_all()
        while True:
            with self._cond:
                while True:
                    waiting = [job.lane for job in jobs if not job.done]
                    if not waiting:
                        return
                    if self._closed:  # its jobs not sent yet leave the queues
                        for job in jobs:
                            if job in job.lane.pending:
                                job.lane.pending.remove(job)
                        raise EngineClosed("the stream's engine is closed (the stream shuts down)")
                    free = [
                        lane for lane in dict.fromkeys(waiting) if lane.pending and not lane.busy
                    ]
                    if free and not (self._held or self._loads_waiting):
                        wait_s = linger(free[0])
                        if wait_s <= 0:
                            break
                        self._cond.wait(wait_s)
                        continue
                    self._cond.wait()
                lane = free[0]
                self._drop_aborted(lane)
                if not lane.pending:
                    continue
                sampling = lane.pending[0].sampling
                batch = [job for job in lane.pending if job.sampling == sampling]
                lane.pending = [job for job in lane.pending if job.sampling != sampling]
                lane.busy = True
                version, epoch = self.version, self._doom_epoch
            self._call(lane, batch, version, epoch)

    def _drop_aborted(self, lane: Lane) -> None:
        """Queued jobs of aborted groups leave ``lane`` unsent: their callers raise
        ``GroupAborted`` (under ``_cond``)."""
        aborted = [job for job in lane.pending if not job.groups.isdisjoint(self._doomed)]
        for job in aborted:
            lane.pending.remove(job)
            job.error, job.done = GroupAborted(min(job.groups & self._doomed)), True
        if aborted:
            self._cond.notify_all()

    def _call(self, lane: Lane, batch: list[Job], version: int, epoch: int) -> None:
        """One engine call for every job of ``batch`` on ``lane`` (one sampling setting)."""
        groups = set().union(*(job.groups for job in batch))  # the call's tracked groups
        requests = [r for job in batch for r in job.requests]
        kwargs = {}
        if lane.interruptible:
            partial, abortable = self.partial, lane.abortable

            def interrupt() -> bool:
                # a load (partial rollouts) or a close ends the call; an abort does too where
                # the engine cannot end one group's requests alone
                if self._closed or (partial and self._loads_waiting):
                    return True
                if abortable:
                    return False
                return self._doom_epoch != epoch and not groups.isdisjoint(self._doomed)

            def abort_groups() -> frozenset:  # the groups of this call aborted since it began
                if self._doom_epoch == epoch:
                    return frozenset()
                with self._cond:
                    return frozenset(groups & self._doomed)

            kwargs["interrupt"] = interrupt
            if abortable:
                kwargs["abort_groups"] = abort_groups
        if lane.reports_loss:  # a lost replica's requests come back here, not to the router
            kwargs["failover"] = False
        started = time.perf_counter()
        outs, error = None, None
        try:
            outs = lane.engine.generate(requests, batch[0].sampling, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to each caller, which raises it
            error = exc
        seconds = time.perf_counter() - started
        with self._cond:
            self.engine_s += seconds
            self.busy_s += seconds / len(self._lanes)
            self.call_sizes.append(len(requests))
            if isinstance(error, ReplicaLostError) and lane.reports_loss:
                # Its replica is gone: the lane takes no work again, and its requests (this
                # call's and those queued) go to the lanes that serve.
                moved = batch + self._routing.lost(lane)
                for job in moved:
                    job.redo = job.done = True
                self._resubmitted += sum(len(job.requests) for job in moved)
            else:
                if outs is not None:
                    self.generated_tokens += sum(len(out.token_ids) for out in outs)
                    cut = {
                        r.group for r, o in zip(requests, outs) if o.finish_reason == "interrupted"
                    }
                    aborted = cut & self._doomed if lane.abortable else set()
                    self.interruptions += bool(cut - aborted)  # the call, not only aborted groups
                    self.group_aborts += len(aborted)
                start = 0
                for job in batch:
                    end = start + len(job.requests)
                    job.outs = None if outs is None else outs[start:end]
                    job.error, job.version, job.done = error, version, True
                    start = end
            lane.busy, lane.ended_at = False, time.perf_counter()
            lane.last_s, lane.last_size = seconds, len(requests)
            self._cond.notify_all()

    # ---------------------------------------------------------------- loads and aborts

    def _hold(self) -> None:
        with self._cond:
            self._loads_waiting += 1
            while self._held or self._routing.busy():
                self._cond.wait()
            self._loads_waiting -= 1
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
        """Run ``load()`` (new weights into every replica) once no lane is in a call (with
        ``partial``: after the current decode step of those in flight), then hold ``version``;
        returns what ``load`` returned."""
        self._hold()
        try:
            out = load()
            self.version = version
        finally:
            self._free()
        return out

    def hold(self) -> None:
        """Take the engine until ``release``: no call runs meanwhile (with ``partial``, calls
        in flight end after their current decode step and go on after ``release``). What
        colocated engines do while the ranks train on their devices."""
        self._hold()

    def release(self, version: int) -> None:
        """Give the engine back after ``hold``, holding the weights of policy ``version``."""
        self.version = version
        self._free()

    def abort_older_than(self, min_version: int) -> list[int]:
        """Stop every tracked group in flight that sampled a token of a policy older than
        ``min_version`` (no later step may train on it): its next call raises
        ``GroupAborted``, a call of it in flight on an interruptible lane ends after its
        decode step. Returns the groups newly aborted."""
        with self._cond:
            new = [
                g
                for g, counts in self._tokens.items()
                if counts and min(counts) < min_version and g not in self._doomed
            ]
            if new:
                self._doomed.update(new)
                self._doom_epoch += 1
                self._cond.notify_all()
                self._abort_served(new)
        return new

    def close(self, timeout_s: float) -> bool:
        """Stop serving: no call starts, callers waiting raise ``EngineClosed``, calls in flight
        on interruptible lanes end after their decode step. Returns once no lane is in a call
        (True), or after ``timeout_s`` seconds with a lane's call still running (False)."""
        deadline = time.perf_counter() + timeout_s
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            servers = list(self._servers.values())
        closed = all(server.close(timeout_s) for server in servers)
        with self._cond:
            if not closed:
                return False
            while self._routing.busy():
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 1.0))
        return True

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

    joinable = False  # as the VersionedEngine's

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
