"""The served lanes of the stream's engine (``rollout.versioned.VersionedEngine``): each
replica's engine server (``rollout.engines.serving.server``; a peer replica's own, in its process,
where it offers one: ``engine_server``), and its callers' jobs sent there request by request,
under ids an abort can name."""

from __future__ import annotations

from rollout.engines.serving.requests import BatchStats, ServerClosed
from rollout.engines.serving.router import ReplicaLostError
from rollout.engines.serving.server import EngineServer
from rollout.stream_jobs import EngineClosed, GroupAborted, Job

__all__ = ["ServedLanes"]


class ServedLanes:
    """``VersionedEngine``'s side of its engine servers (its lock, lanes, routing and
    counters are the engine's own)."""

    def _serve_lanes(self) -> None:
        """Give each lane its replica's server (made once per replica engine)."""
        for lane in self._lanes:
            replica = getattr(lane.engine, "replica_engine", lane.engine)
            # one server per replica engine, kept across the routers the host connects
            server = self._servers.get(id(replica))
            if server is None:
                remote = getattr(replica, "engine_server", None)  # a peer's, in its process
                server = remote(self.version) if remote is not None else None
                if server is not None:
                    self._peers.add(id(server))
                else:
                    server = EngineServer(
                        lane.engine,
                        self.version,
                        name=f"engine-server-{len(self._servers)}",
                        on_batch=self._on_batch,
                        reports_loss=True,
                    )
                self._servers[id(replica)] = server
            lane.server = server

    def _on_batch(self, stats: BatchStats) -> None:
        """A server's batch ended: counted as a call of its lane."""
        with self._cond:
            self.engine_s += stats.seconds
            self.busy_s += stats.seconds / len(self._lanes)
            self.call_sizes.append(stats.requests)
            self.generated_tokens += stats.tokens
            self.interruptions += bool(stats.cut)

    def count_peer_batches(self) -> None:
        """Count the batches the peers' servers ran since the last call (a peer's server, in
        its own process, reports them when asked: ``take_batches``) as the local servers'
        are counted (``_on_batch``), so ``busy_s`` and ``call_sizes`` cover every replica."""
        with self._cond:
            peers = [s for s in self._servers.values() if id(s) in self._peers]
        for server in peers:
            for stats in server.take_batches():
                self._on_batch(stats)

    def take_turn_waits(self) -> list[float]:
        """Seconds each request served since the last call waited for its first decode step
        (every engine server's, ``EngineServer.take_waits``)."""
        with self._cond:
            servers = list(self._servers.values())
        return [wait for server in servers for wait in server.take_waits()]

    def _submit(self, job: Job) -> None:
        """Each of ``job``'s requests to its lane's server, under an id of its own (kept per
        tracked group, so an abort reaches it); none if its group is aborted already."""
        with self._cond:
            if self._closed:
                raise EngineClosed("the stream's engine is closed (the stream shuts down)")
            doomed = job.groups & self._doomed
            if doomed:
                job.error, job.done = GroupAborted(min(doomed)), True
                return
            server = job.lane.server
            request_ids = [f"v{next(self._request_ids)}" for _ in job.requests]
            for request, request_id in zip(job.requests, request_ids):
                if request.group in job.groups:
                    self._served.setdefault(request.group, {})[request_id] = server
            try:
                job.pending = server.submit_many(job.requests, job.sampling, request_ids)
            except ServerClosed as exc:
                raise EngineClosed("the stream's engine is closed") from exc

    def _await(self, job: Job) -> None:
        """Wait for ``job``'s requests on its server; its outputs, or the first error."""
        if job.done:
            return
        outs, error = [], None
        for pending in job.pending:
            try:
                outs.append(pending.result())
            except ServerClosed:
                error = error or EngineClosed("the stream's engine is closed")
            except BaseException as exc:  # noqa: BLE001 - raised by the caller (_generate)
                error = error or exc
        with self._cond:
            for request, pending in zip(job.requests, job.pending):
                self._served.get(request.group, {}).pop(pending.request_id, None)
            if isinstance(error, ReplicaLostError) and job.lane.reports_loss:
                # Its replica is gone: the lane takes no work again, the router deals its
                # prompts to the others, and this job is routed again.
                if not job.lane.dead:
                    job.lane.engine.mark_lost()
                self._routing.lost(job.lane)
                self._resubmitted += len(job.requests)
                job.redo = job.done = True
                return
        job.outs, job.error = (outs if error is None else None), error
        job.version, job.done = self.version, True

    def _abort_served(self, groups: list[int]) -> None:
        """The served requests in flight of ``groups`` (newly aborted) end by their ids after
        the current decode step (under the lock)."""
        by_server: dict[int, tuple[EngineServer, list[str]]] = {}
        for group in groups:
            served = self._served.get(group, {})
            self.group_aborts += bool(served)
            for request_id, server in served.items():
                by_server.setdefault(id(server), (server, []))[1].append(request_id)
        for server, request_ids in by_server.values():
            server.abort(request_ids)
