"""Requests that join a lane's running engine call (``rollout.versioned.VersionedEngine`` on a
``joinable`` engine: the HF engine's step loop).

A lane's call does not end with the requests it began with: between decode steps the engine
asks ``admit`` for more, and the jobs queued on the lane meanwhile (the same sampling settings,
their groups not aborted) join it, as many requests as the batch has room for, first come
first served. Each job comes back as soon as its last request ends (``on_result``), not when
the call does, so a turn that finished early asks again and joins the same call while the
slowest requests still run. No job joins while a load waits (or holds the engine) or the
stream closes: the call then ends after its current decode step (partial rollouts) or once
its requests are done, and the load finds the lanes free.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from rollout.engines.base import GenerationRequest, GenerationResult

__all__ = ["JoinedCall"]


class JoinedCall:
    """The jobs of one engine call on ``lane`` (``rollout.stream_lanes.Lane``): ``batch``
    (those it began with) and those ``admit`` lets join, every request numbered in that order
    (the engine's request indices). ``cond``: the ``VersionedEngine``'s lock and condition;
    ``accepts()``: whether jobs may join now (under ``cond``); ``drop_aborted(lane)``: takes
    the jobs of aborted groups out of the lane's queue (under ``cond``); ``groups``: the
    tracked groups in the call, grown as jobs join (read by the call's ``abort_groups``)."""

    def __init__(
        self,
        cond: threading.Condition,
        lane,
        batch: list,
        version: int,
        accepts: Callable[[], bool],
        drop_aborted: Callable[[object], None],
        groups: set,
    ) -> None:
        self.cond, self.lane, self.version = cond, lane, version
        self.accepts, self.drop_aborted, self.groups = accepts, drop_aborted, groups
        self.sampling = batch[0].sampling
        self.jobs: list = []
        self.requests: list[GenerationRequest] = []
        self._slots: list[tuple[object, int]] = []  # request index -> (job, its k-th request)
        self._got: dict[int, dict[int, GenerationResult]] = {}  # id(job) -> k -> result
        for job in batch:
            self._take(job)

    def _take(self, job) -> None:
        self.jobs.append(job)
        self._got[id(job)] = {}
        self._slots += [(job, k) for k in range(len(job.requests))]
        self.requests += job.requests
        self.groups |= job.groups

    def admit(self, room: int) -> list[GenerationRequest]:
        """The requests of the jobs queued on the lane that join the call now (at most
        ``room``; a job joins whole or waits)."""
        with self.cond:
            if not self.accepts():
                return []
            self.drop_aborted(self.lane)
            joining = []
            for job in self.lane.pending:
                if job.sampling != self.sampling or len(job.requests) > room:
                    continue
                room -= len(job.requests)
                joining.append(job)
            if not joining:
                return []
            self.lane.pending = [job for job in self.lane.pending if job not in joining]
            first = len(self.requests)
            for job in joining:
                self._take(job)
            return self.requests[first:]

    def on_result(self, index: int, out: GenerationResult) -> None:
        """Request ``index`` ended: its job goes back to its caller once all of its requests
        have."""
        with self.cond:
            job, k = self._slots[index]
            got = self._got[id(job)]
            got[k] = out
            if len(got) == len(job.requests) and not job.done:
                job.outs = [got[i] for i in range(len(job.requests))]
                job.error, job.version, job.done = None, self.version, True
                self.cond.notify_all()

    def finish(self, outs: list[GenerationResult] | None, error: BaseException | None) -> None:
        """The call came back (``outs`` for every request, or ``error``): every job not yet
        answered gets its share (under ``cond``)."""
        start = 0
        for job in self.jobs:
            end = start + len(job.requests)
            if not job.done:
                job.outs = None if outs is None else outs[start:end]
                job.error, job.version, job.done = error, self.version, True
            start = end

    def unanswered(self) -> list:
        """The jobs not answered yet (under ``cond``)."""
        return [job for job in self.jobs if not job.done]
