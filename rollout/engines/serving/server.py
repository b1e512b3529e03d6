"""One replica's engine as a server: a step loop that is always running, which takes a request
at any moment, aborts a request by its id and takes new weights between two decode steps
(``EngineServer``; the HF engine's loop is ``rollout.engines.hf.steps.DecodeBatch``).

A caller submits one request (``submit``: a ``GenerationRequest`` and its ``SamplingParams``)
and waits on what comes back (``Pending.result``); many callers submit from many threads. The
server's own thread runs the engine: it begins a decode batch with the requests waiting (one
sampling setting per batch, first come first served) and, between decode steps, lets the
requests submitted meanwhile join it (``Engine.joinable``), each leaving the batch as it ends
and going back to its caller at once. Joining lays the batch's cache out anew, so requests join
in handfuls: once the waiting ones are at least ``JOIN_SHARE`` of the running rows, or the
oldest has waited ``JOIN_WAIT_S`` seconds. A fresh batch begins once requests stop arriving
(``QUIET_S``), so the callers a batch answered at one step, asking again together, begin the
next one together rather than one joining after another.

Waves (``submit_wave``): requests submitted together as one engine call, exactly the
``generate(requests, sampling)`` the caller would have made itself: begun with nothing else
in the batch, joined by no one, split by nobody (however many), and ended only by its engine;
so which requests share a call, and their padding, depend on the caller alone (what a
deterministic admission order needs: identical runs under ``run.deterministic``).

Abort (``abort``): a request still queued leaves at once; a running one ends after the current
decode step; both come back with the tokens they have, finish reason ``interrupted`` and
``extra["aborted"]``. Nothing else in the batch is cut.

Weights in flight (``pause`` / ``resume``): ``pause`` ends the running batch after its decode
step and returns once the engine is idle; the requests that were running go back to the head
of the queue, each continued from its prefix (the prompt plus its tokens so far, prefilled
again under the new weights: no KV cache of older weights is kept) with what is left of its
budget (``pause(wait=True)`` instead lets the batch run to its end, admitting no one). The
caller loads the weights, then ``resume(version)``. Every token carries the policy
version of the weights that sampled it (``extra["versions"]``), exact by construction: the
version changes only while no batch runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable

from rollout.engines.base import GenerationRequest, GenerationResult, SamplingParams
from rollout.engines.serving.requests import BatchStats, Pending, ServerClosed, continued

__all__ = ["JOIN_SHARE", "JOIN_WAIT_S", "QUIET_S", "EngineServer"]

#: Waiting requests join a running batch once they are at least this share of its rows...
JOIN_SHARE = 0.25
#: ...or once the oldest of them has waited this many seconds.
JOIN_WAIT_S = 0.02
#: How many of the latest requests' waits (submit to first decode step) ``waits`` keeps.
WAITS_KEPT = 4096
#: A fresh batch (none running) begins once no request has arrived for this many seconds (the
#: callers a batch just answered ask again together), or at ``JOIN_WAIT_S``.
QUIET_S = 0.002


class EngineServer:
    """``engine`` (an ``Engine``; its batches take joiners where it is ``joinable``) served by a
    loop on a thread of its own, holding the weights of policy ``version`` (see the module
    docstring). ``tokens``: tokens sampled; ``batches``: decode batches begun; ``joined``:
    requests that joined a running batch; ``waits``: seconds from submit to the first decode
    step, of the latest ``WAITS_KEPT`` requests; ``on_batch``: told of each batch as it ends (from
    the server's thread, no lock held); ``reports_loss``: ``engine`` being one replica of a
    router that says so (``ReplicaEngine``), its loss raises to the callers (see ``_options``)."""

    def __init__(
        self,
        engine,
        version: int = 0,
        *,
        name: str = "engine-server",
        on_batch: Callable[[BatchStats], None] | None = None,
        reports_loss: bool = False,
    ) -> None:
        self.engine = engine
        self.reports_loss = reports_loss and bool(getattr(engine, "reports_loss", False))
        self.on_batch = on_batch
        self.version = version
        # a joinable engine's batch holds its rows; another's call takes whatever waits (the
        # engine splits it as it must)
        joinable = bool(getattr(engine, "joinable", False))
        self.max_batch = int(getattr(engine, "max_batch_size", 256)) if joinable else 1 << 30
        self._cond = threading.Condition()
        self._queue: deque[Pending] = deque()
        self._slots: list[Pending] = []  # the running batch's requests, by engine index
        self._aborting: set[int] = set()  # engine indices of running requests to abort
        self._reported: set[int] = set()  # engine indices whose result came back
        self._pauses = 0
        self._cuts = 0  # pauses that end the running batch after its decode step
        self._in_batch = False
        self._batch_version = version  # the version the running batch samples under
        self._batch_tokens = 0  # tokens the running batch has reported
        self._closed = False
        self._ids = itertools.count()
        self._waves = itertools.count()
        self.tokens = self.batches = self.joined = 0
        self.waits: deque[float] = deque(maxlen=WAITS_KEPT)
        self._batches: deque[BatchStats] = deque(maxlen=WAITS_KEPT)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- requests

    def submit(
        self, request: GenerationRequest, sampling: SamplingParams, request_id: str | None = None
    ) -> Pending:
        """Queue ``request`` (sampled under ``sampling``, up to its own budget); returns its
        ``Pending`` at once. ServerClosed once closed."""
        return self._queued([request], sampling, [request_id], None)[0]

    def submit_wave(
        self, requests: list[GenerationRequest], sampling: SamplingParams
    ) -> list[Pending]:
        """Queue ``requests`` as one wave: one engine call of exactly these requests, in this
        order, with no other request in it and none joining (see the module docstring);
        their ``Pending`` in order. ServerClosed once closed."""
        if not requests:
            return []
        return self._queued(requests, sampling, [None] * len(requests), next(self._waves))

    def _queued(
        self,
        requests: list[GenerationRequest],
        sampling: SamplingParams,
        request_ids: list[str | None],
        wave: int | None,
    ) -> list[Pending]:
        now = time.perf_counter()
        pending = [
            Pending(i if i is not None else f"r{next(self._ids)}", r, sampling, now, wave=wave)
            for r, i in zip(requests, request_ids)
        ]
        with self._cond:
            if self._closed:
                raise ServerClosed("the engine server is closed")
            self._queue.extend(pending)
            self._cond.notify_all()
        return pending

    def submit_many(
        self,
        requests: list[GenerationRequest],
        sampling: SamplingParams,
        request_ids: list[str] | None = None,
    ) -> list[Pending]:
        """``submit`` for each request (under ``request_ids``, when given), in order."""
        ids = request_ids if request_ids is not None else [None] * len(requests)
        return [self.submit(r, sampling, i) for r, i in zip(requests, ids)]

    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingParams
    ) -> list[GenerationResult]:
        """Submit every request and wait for all of them; results in request order (the
        ``Engine.generate`` of a caller that needs them together)."""
        pending = [self.submit(r, sampling) for r in requests]
        return [p.result() for p in pending]

    def abort(self, request_ids) -> int:
        """End the requests named: those queued at once, those running after the current decode
        step (the rest of the batch goes on). Returns how many were found."""
        wanted, found = set(request_ids), 0
        with self._cond:
            for p in [p for p in self._queue if p.request_id in wanted]:
                self._queue.remove(p)
                p.aborted = True
                self._finish(p, "interrupted")
                found += 1
            for index, p in enumerate(self._slots):
                if p.request_id in wanted and not p.done.is_set():
                    p.aborted = True
                    self._aborting.add(index)
                    found += 1
        return found

    def take_waits(self) -> list[float]:
        """The waits (seconds from submit to the first decode step) kept since the last call,
        oldest first; forgets them."""
        with self._cond:
            waits = list(self.waits)
            self.waits.clear()
        return waits

    def take_batches(self) -> list[BatchStats]:
        """The batches that ended since the last call (the latest ``WAITS_KEPT``), oldest
        first; forgets them (what a caller in another process reads instead of
        ``on_batch``)."""
        with self._cond:
            batches = list(self._batches)
            self._batches.clear()
        return batches

    def queued(self) -> int:
        """Requests waiting for a batch."""
        with self._cond:
            return len(self._queue)

    def running(self) -> int:
        """Requests in the running batch (0: no batch runs)."""
        with self._cond:
            return len(self._slots) if self._in_batch else 0

    # ---------------------------------------------------------------- weights

    def pause(self, wait: bool = False) -> None:
        """Stop decoding and return once the engine is idle, so the caller may load weights
        into it. By default the running batch ends after its decode step (its requests go back
        to the head of the queue, continued from their prefix); with ``wait`` it runs to its
        end, taking no more requests. Pauses nest; each needs its ``resume``."""
        with self._cond:
            self._pauses += 1
            self._cuts += not wait
            self._cond.notify_all()
            while self._in_batch:
                self._cond.wait()
            self._cuts -= not wait

    def resume(self, version: int | None = None) -> None:
        """Decode again, under the weights of policy ``version`` (None: unchanged)."""
        with self._cond:
            if self._pauses == 0:
                raise RuntimeError("EngineServer.resume without a pause")
            if version is not None:
                self.version = version
            self._pauses -= 1
            self._cond.notify_all()

    def close(self, timeout_s: float | None = 30.0) -> bool:
        """Stop for good: the running batch ends after its decode step (a wave, or an engine
        that cannot be interrupted, when its call ends), every request not finished raises
        ServerClosed to its caller. True once the loop has ended, False if it is still in a
        batch after ``timeout_s`` seconds (None: wait for it)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ---------------------------------------------------------------- the loop

    def _finish(self, p: Pending, reason: str) -> None:
        p.finish_reason = reason
        p._end()

    def _fail(self, p: Pending, error: BaseException) -> None:
        p.error = error
        p._end()

    def _take(self, sampling: SamplingParams, room: int) -> list[GenerationRequest]:
        """Move up to ``room`` queued requests under ``sampling`` into the batch (under the
        lock); their engine requests, numbered after those in it."""
        taking = [p for p in self._queue if p.sampling == sampling and p.wave is None][:room]
        self._queue = _without(self._queue, taking)
        now = time.perf_counter()
        for p in taking:
            if p.first_step_at is None:
                p.first_step_at = now
                self.waits.append(now - p.submitted_at)
        first = len(self._slots)
        self._slots += taking
        requests = [continued(p.request, p.tokens, p.sampling) for p in taking]
        if not getattr(self.engine, "abortable", False):
            return requests  # the prompt's own group: a stream's engine counts and aborts by it
        # an engine that ends a request early by its group (``abort_groups``): here, its index
        return [dataclasses.replace(r, group=first + k) for k, r in enumerate(requests)]

    def _take_wave(self, wave: int) -> list[GenerationRequest]:
        """Move every request of ``wave`` into the batch, in order (under the lock)."""
        taking = [p for p in self._queue if p.wave == wave]
        self._queue = _without(self._queue, taking)
        now = time.perf_counter()
        for p in taking:
            p.first_step_at = now
            self.waits.append(now - p.submitted_at)
        self._slots += taking
        return [p.request for p in taking]

    def _options(self, sampling: SamplingParams) -> dict:
        """What a batch's engine call takes besides its requests, as far as the engine
        offers it: ``interrupt`` (a pause, a close, or an abort the engine cannot make alone
        ends the batch after a decode step), ``abort_groups`` (one request ends alone),
        ``admit``/``on_result`` (requests join and leave), ``failover=False`` (with
        ``reports_loss``: a lost replica's batch raises ``ReplicaLostError`` to its callers,
        for them to route again, instead of the router dealing it to another replica)."""
        engine, kwargs = self.engine, {}
        abortable = getattr(engine, "abortable", False)
        if getattr(engine, "interruptible", False):
            kwargs["interrupt"] = self._interrupted if abortable else self._interrupted_or_aborted
        if abortable:
            kwargs["abort_groups"] = self._aborted_now
        if getattr(engine, "joinable", False):
            kwargs["admit"] = lambda room: self._admit(sampling, room)
            kwargs["on_result"] = self._on_result
        if self.reports_loss:
            kwargs["failover"] = False
        return kwargs

    def _ready(self, sampling: SamplingParams, running: int) -> float:
        """Seconds until the requests waiting under ``sampling`` should go into the batch
        (``running`` rows in it): 0 now, ``inf`` with none waiting (under the lock)."""
        waiting = [p for p in self._queue if p.sampling == sampling and p.wave is None]
        if not waiting:
            return float("inf")
        now = time.perf_counter()
        by_age = JOIN_WAIT_S - (now - waiting[0].submitted_at)
        if running == 0:
            quiet = QUIET_S - (now - waiting[-1].submitted_at)
            enough = len(waiting) >= self.max_batch
        else:
            quiet, enough = float("inf"), len(waiting) >= JOIN_SHARE * running
        return 0.0 if enough else max(0.0, min(by_age, quiet))

    def _admit(self, sampling: SamplingParams, room: int) -> list[GenerationRequest]:
        """Between decode steps: the requests that join the batch now (see JOIN_SHARE)."""
        with self._cond:
            if self._pauses or self._closed or self._ready(sampling, self.max_batch - room) > 0:
                return []
            taken = self._take(sampling, room)
            self.joined += len(taken)
            return taken

    def _on_result(self, index: int, out: GenerationResult) -> None:
        with self._cond:
            p = self._slots[index]
            self._reported.add(index)
            p.tokens += out.token_ids
            p.logprobs += out.logprobs
            p.extra.update(out.extra)
            p.versions += [self._batch_version] * len(out.token_ids)
            self.tokens += len(out.token_ids)
            self._batch_tokens += len(out.token_ids)
            if out.finish_reason != "interrupted" or p.wave is not None:
                self._finish(p, out.finish_reason)
            elif p.aborted:
                self._finish(p, "interrupted")
            elif p.left() <= 0:
                self._finish(p, "length")
            # else: cut by a pause or close; _end_batch requeues it or fails it

    def _interrupted(self) -> bool:
        return bool(self._cuts) or self._closed

    def _interrupted_or_aborted(self) -> bool:
        # an engine that cannot end one request alone ends them all; the others go on from
        # their prefix in the next batch
        return self._interrupted() or bool(self._aborting)

    def _aborted_now(self) -> frozenset[int]:
        with self._cond:
            return frozenset(self._aborting)

    def _end_batch(self, error: BaseException | None) -> int:
        """The batch came back: requests it cut (a pause) go back to the head of the queue in
        their order; on a close or an error, every request not finished fails (under the
        lock). Returns how many went back."""
        cut = [p for p in self._slots if not p.done.is_set()]
        self._slots, self._aborting, self._in_batch = [], set(), False
        self._reported = set()
        requeued = 0
        if error is not None or self._closed:
            failure = error or ServerClosed("the engine server is closed")
            for p in [*cut, *(self._queue if self._closed else ())]:
                self._fail(p, failure)
            if self._closed:
                self._queue.clear()
        else:
            self._queue.extendleft(reversed(cut))
            requeued = len(cut)
        self._cond.notify_all()
        return requeued

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    if self._pauses or not self._queue:
                        self._cond.wait()
                        continue
                    head = self._queue[0]
                    wait_s = 0.0 if head.wave is not None else self._ready(head.sampling, 0)
                    if wait_s <= 0:
                        break
                    self._cond.wait(wait_s)
                if self._closed:
                    self._end_batch(None)
                    return
                head = self._queue[0]
                sampling, wave = head.sampling, head.wave
                if wave is not None:
                    first = self._take_wave(wave)
                else:
                    first = self._take(sampling, self.max_batch)
                self._batch_version, self._in_batch = self.version, True
                self._batch_tokens = 0
                self.batches += 1
            engine = self.engine
            kwargs = {} if wave is not None else self._options(sampling)
            error, started = None, time.perf_counter()
            try:
                outs = engine.generate(first, sampling, **kwargs)
                if len(outs) < len(first) or (wave is not None and len(outs) != len(first)):
                    raise RuntimeError(
                        f"{type(engine).__name__}.generate returned {len(outs)} results for "
                        f"{len(first)} requests"
                    )
                for index, out in enumerate(outs):  # those it did not report as they ended
                    if index not in self._reported:  # (cut by a pause, or not joinable)
                        self._on_result(index, out)
            except BaseException as exc:  # noqa: BLE001 - handed to each waiting caller
                error = exc
            with self._cond:
                size, tokens = len(self._slots), self._batch_tokens
                cut = self._end_batch(error)
                stats = BatchStats(size, time.perf_counter() - started, tokens, cut)
                self._batches.append(stats)
            if self.on_batch is not None:
                self.on_batch(stats)


def _without(queue: deque, taken: list) -> deque:
    """``queue`` less ``taken`` (some of its entries), in order, in one pass."""
    if not taken:
        return queue
    gone = {id(p) for p in taken}
    return deque(p for p in queue if id(p) not in gone)
