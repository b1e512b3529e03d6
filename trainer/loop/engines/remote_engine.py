"""A peer engine replica's actor handle seen as an ``Engine`` by the rollout host's router
(``rollout.engines.serving.router``): its ``generate`` waits for the peer, and a peer whose process is
gone raises ``ReplicaLostError``, so the router deals its requests to the others. Loading new
weights into the peers skips lost ones the same way
(``trainer.loop.weights.engine_weights.load_into_peers``).

A streamed run's peers serve the stream as the local replica does, through an engine server
of their own (``rollout.engines.serving.server``) behind ``RemoteServer``: each job of the stream is
one ``EngineHost.serve`` call in the actor's ``serve`` concurrency group, where it waits for
its requests while others join the peer's running batch; aborts by request id, pauses and
resumes for weight loads go through its ``control`` group.

Calls not served (a peer in this process) can be interrupted as the local replica's are: their actors have a
``control`` concurrency group (``peer_actor_options``) where ``EngineHost.interrupt_call`` runs
beside the call in flight. ``RemoteEngine.generate`` names each call it sends, and while it
waits, polls the stream's ``interrupt`` and ``abort_groups`` and passes on what they say; the
peer's call (``CallSignals.run``) reads it between decode steps. So a load with partial
rollouts ends every replica's call after its current step, and a stale group's requests end
on any replica.
"""

from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass

from rollout.engines.base import Engine
from rollout.engines.serving.requests import SERVER_KEYS
from rollout.engines.serving.router import ReplicaLostError
from trainer.loop.cluster.local import LocalHandle, LocalRef, fetch

#: The concurrency group of a peer's actor where calls to its call in flight run.
CONTROL_GROUP = "control"
#: The concurrency group of a peer's actor where the rollout host's jobs wait on the peer's
#: engine server (``EngineHost.serve``), one thread each.
SERVE_GROUP = "serve"
#: Seconds between two looks at the stream's interrupt and aborts while a peer's call runs.
POLL_S = 0.01
_CALL_IDS = itertools.count()


#: Jobs of a lag run's rollout that one peer's ``serve`` group runs at once, at most (one
#: request each); more wait in the actor's queue for a thread.
MAX_LAG_JOBS = 1024


def peer_actor_options(cfg) -> dict:
    """``ray.remote`` options of a peer replica's actor (``trainer.loop.start.spawn``): the
    ``serve`` and ``control`` concurrency groups where the peer serves from an engine server of
    its own: in a streamed run (``train.max_staleness``), and at lag 0 or a fixed lag with
    continuous admission (``run.deterministic: false``: each turn a request of its own, which
    joins the peer's running batch); none otherwise (waves: one call per wave, on the actor's
    main thread, as before)."""
    train = cfg.train
    if train.max_staleness is not None:
        # every group the stream may run at once can wait on one peer (and validation's beside)
        jobs = 2 * train.batch_size * (train.max_staleness + 1) + 8
    elif not cfg.run.deterministic:
        # one request per trajectory in flight (and validation's beside)
        jobs = min(train.batch_size * cfg.rollout.n, MAX_LAG_JOBS) + 8
    else:
        return {}
    return {"concurrency_groups": {CONTROL_GROUP: 1, SERVE_GROUP: jobs}}


class RemoteEngine(Engine):
    """An ``EngineHost`` actor (``handle``, engine replica ``replica``) seen as an ``Engine``.
    ``controllable``: its actor has the ``control`` group (``peer_actor_options``), so its
    calls are ``interruptible`` and ``abortable`` as a local engine's."""

    def __init__(self, handle, replica: int | None = None, controllable: bool = False) -> None:
        self.handle = handle
        self.replica = replica
        self.interruptible = self.abortable = controllable

    def generate(self, requests, sampling, interrupt=None, abort_groups=None):
        """Generate on the remote replica and wait for it; ``ReplicaLostError`` when its
        process died (before or during the call). ``interrupt`` / ``abort_groups``: polled
        every ``POLL_S`` while the call runs, and passed on to it (``interruptible`` only)."""
        import ray

        watched = self.interruptible and (interrupt is not None or abort_groups is not None)
        try:
            if not watched:
                return fetch(self.handle.generate.remote(requests, sampling))
            call = f"{os.getpid()}-{next(_CALL_IDS)}"
            ref = self.handle.generate.remote(requests, sampling, call)
            self._watch(ref, call, interrupt, abort_groups)
            return fetch(ref)
        except ray.exceptions.RayActorError as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ReplicaLostError(f"engine replica {self.replica} is lost: {first}") from err

    def _watch(self, ref, call: str, interrupt, abort_groups) -> None:
        """Until ``ref`` is ready: pass the stream's interrupt and newly aborted groups to the
        peer's call ``call`` (``EngineHost.interrupt_call``, in its ``control`` group)."""
        control = self.handle.interrupt_call.options(concurrency_group=CONTROL_GROUP)
        cut, sent = False, frozenset()
        while not _ready(ref, POLL_S):
            if not cut and interrupt is not None and interrupt():
                control.remote(call)
                cut = True
            gone = abort_groups() if abort_groups is not None else frozenset()
            if gone - sent:
                control.remote(call, sorted(gone - sent))
                sent |= gone

    def engine_server(self, version: int):
        """The peer's engine server (a streamed run's peer: ``controllable``), holding the
        weights of ``version``: a ``RemoteServer``, or an in-process peer's
        ``EngineServer`` itself; None where its actor has no ``serve`` group."""
        if not self.interruptible:
            return None
        if isinstance(self.handle, LocalHandle):  # in this process: its server, no proxy
            host = self.handle.target
            host.start_server(version)
            return host.server
        return RemoteServer(self.handle, self.replica, version)

    def update_weights(self, named_tensors) -> None:
        """Not here: the replica's own training ranks sync it."""
        raise NotImplementedError("engine replicas are synced by their own training ranks")


class _Call:
    """One ``EngineHost.serve`` call in flight: its results, fetched once (or handed over by
    ``add_done_callback``)."""

    def __init__(self, ref, replica: int | None) -> None:
        self.ref, self.replica = ref, replica
        self._lock = threading.Lock()
        self._out: list | BaseException | None = None

    def _keep(self, value=None, error: BaseException | None = None) -> None:
        """Keep the call's outcome (under the lock): a dead actor's error as
        ``ReplicaLostError``."""
        import ray

        if self._out is not None:
            return
        if isinstance(error, ray.exceptions.RayActorError):
            text = str(error).strip()
            first = text.splitlines()[0] if text else type(error).__name__
            error = ReplicaLostError(f"engine replica {self.replica} is lost: {first}")
        self._out = error if error is not None else value

    def get(self) -> list:
        """The call's results (waiting for them); its error raised, a lost peer's as
        ``ReplicaLostError``."""
        with self._lock:
            if self._out is None:
                try:
                    value, error = fetch(self.ref), None
                except BaseException as exc:  # noqa: BLE001 - each request's caller raises it
                    value, error = None, exc
                self._keep(value, error)
        if isinstance(self._out, BaseException):
            raise self._out
        return self._out

    def add_done_callback(self, fn) -> None:
        """Call ``fn()`` once the call has ended (at once in this process; else on Ray's
        thread, with its outcome kept, so ``get`` no longer waits)."""
        if isinstance(self.ref, LocalRef):
            fn()
            return

        def ended(future) -> None:
            error = future.exception()
            with self._lock:
                self._keep(None if error is not None else future.result(), error)
            fn()

        self.ref.future().add_done_callback(ended)


@dataclass
class RemotePending:
    """One request submitted to a peer's engine server (``RemoteServer.submit_many``)."""

    request_id: str
    call: _Call
    index: int

    def result(self, timeout: float | None = None):
        """Its ``GenerationResult`` once the peer's call for its job has come back;
        ``ReplicaLostError`` when the peer's process is gone."""
        return self.call.get()[self.index]

    def outcome(self, timeout: float | None = None):
        """``result`` without the server's keys in its ``extra`` (``SERVER_KEYS``), as a
        local server's ``Pending.outcome`` gives it."""
        out = self.result(timeout)
        for key in SERVER_KEYS:
            out.extra.pop(key, None)
        return out

    def add_done_callback(self, fn) -> None:
        """Call ``fn(self)`` once the peer's call has come back (``Pending``'s)."""
        self.call.add_done_callback(lambda: fn(self))


class RemoteServer:
    """A peer replica's ``rollout.engines.serving.server.EngineServer`` (in its ``EngineHost``), seen
    from the rollout host as a local server is: a job's requests go in one call
    (``EngineHost.serve``, in the actor's ``serve`` group, one thread per job waiting),
    aborts, pauses and resumes go through its ``control`` group. A lost peer: its jobs raise
    ``ReplicaLostError``; pausing, resuming and closing it do nothing."""

    def __init__(self, handle, replica: int | None, version: int) -> None:
        self.handle, self.replica = handle, replica
        self._control = {
            name: getattr(handle, name).options(concurrency_group=CONTROL_GROUP)
            for name in (
                "start_server",
                "abort_requests",
                "pause_server",
                "resume_server",
                "close_server",
                "server_waits",
                "server_batches",
            )
        }
        self._ask("start_server", version)

    def _ask(self, name: str, *args):
        import ray

        try:
            return fetch(self._control[name].remote(*args))
        except ray.exceptions.RayActorError:
            return None  # lost: its jobs say so

    def submit_many(self, requests: list, sampling, request_ids: list[str]) -> list:
        """Send one job's requests to the peer's server; a ``RemotePending`` per request."""
        call = _Call(
            self.handle.serve.options(concurrency_group=SERVE_GROUP).remote(
                requests, sampling, request_ids
            ),
            self.replica,
        )
        return [RemotePending(rid, call, i) for i, rid in enumerate(request_ids)]

    def abort(self, request_ids) -> int:
        """End those requests on the peer after its current decode step (not waited for)."""
        ids = list(request_ids)
        self._control["abort_requests"].remote(ids)
        return len(ids)

    def pause(self, wait: bool = False) -> None:
        """``EngineServer.pause`` on the peer; returns once its engine is idle."""
        self._ask("pause_server", wait)

    def resume(self, version: int | None = None) -> None:
        """``EngineServer.resume`` on the peer."""
        self._ask("resume_server", version)

    def close(self, timeout_s: float = 30.0) -> bool:
        """``EngineServer.close`` on the peer (a lost peer is closed)."""
        out = self._ask("close_server", timeout_s)
        return True if out is None else bool(out)

    def take_waits(self) -> list[float]:
        """The peer's request waits since the last call (``EngineServer.take_waits``)."""
        return list(self._ask("server_waits") or [])

    def take_batches(self) -> list:
        """The peer's batches (``BatchStats``) since the last call, oldest first (a local
        server reports each through its ``on_batch`` instead)."""
        return list(self._ask("server_batches") or [])


def _ready(ref, timeout_s: float) -> bool:
    """Whether the call behind ``ref`` has ended, waiting up to ``timeout_s`` seconds (an
    in-process call has ended when its ref exists)."""
    if isinstance(ref, LocalRef):
        return True
    import ray

    return bool(ray.wait([ref], timeout=timeout_s)[0])


@dataclass
class _Signal:
    cut: bool = False  # the whole call ends after its current decode step
    groups: frozenset = frozenset()  # the groups whose requests end there


class CallSignals:
    """A peer engine host's side (``EngineHost.generate`` / ``interrupt_call``): what the
    dealer asked of each named call, read by the call between decode steps."""

    #: Signals kept for calls that have not begun or have already ended, at most.
    KEPT = 256

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._signals: dict[str, _Signal] = {}

    def _signal(self, call: str) -> _Signal:
        with self._lock:
            if call not in self._signals and len(self._signals) >= self.KEPT:
                self._signals.pop(next(iter(self._signals)))  # the oldest: long over
            return self._signals.setdefault(call, _Signal())

    def run(self, engine, requests, sampling, call: str | None):
        """``engine.generate`` on ``requests``; a named ``call`` ends after its current decode
        step once ``interrupt`` names it, and the requests of the groups ``interrupt`` names
        end there (``Engine.interruptible`` / ``abortable`` engines)."""
        if call is None or not getattr(engine, "interruptible", False):
            return engine.generate(requests, sampling)
        signal = self._signal(call)
        kwargs = {"interrupt": lambda: signal.cut}
        if getattr(engine, "abortable", False):
            kwargs["abort_groups"] = lambda: signal.groups
        try:
            return engine.generate(requests, sampling, **kwargs)
        finally:
            with self._lock:
                self._signals.pop(call, None)

    def interrupt(self, call: str, groups=None) -> None:
        """End call ``call`` after its current decode step (``groups`` None), or only the
        requests of ``groups`` in it; a call not begun yet reads it when it begins."""
        signal = self._signal(call)
        with self._lock:
            if groups is None:
                signal.cut = True
            else:
                signal.groups = signal.groups | frozenset(groups)
