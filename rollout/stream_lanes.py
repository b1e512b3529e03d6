"""The lanes of a stream's engine (``rollout.versioned.VersionedEngine``): one per engine
replica, where that replica's requests queue for its next call, and which lane serves a
prompt now.

A new prompt's requests go to the least-loaded lane that serves (requests in flight; ties
dealt by the prompt, ``deal_prompt``), and every later request of that prompt to the same lane
while it runs, so every turn of its episodes finds its prefix there. A lane whose replica is
out of the routing (``ReplicaRouter.serving``: lost, or a replacement that has not loaded the
current weights yet) takes no work: its prompts are placed anew on the lanes that serve (a
replacement joins the placing as soon as it serves). A lane whose call finds its
replica lost (``ReplicaLostError``) is marked ``dead`` and never takes work again.

``follow``: the host connected a new router (a replacement replica started): the lanes are
rebuilt from it at once, the jobs queued on the old ones are routed again, and old lanes still
in a call finish it (``retired``; a load waits for them as for any lane).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rollout.engines.router import ReplicaLostError, deal_prompt

__all__ = ["LINGER_S", "LINGER_SHARE", "Lane", "Lanes", "linger"]

#: How long a lane waits after a call came back before it sends the next, at most: this
#: share of that call's seconds, and never more than ``LINGER_S``; it goes at once when as
#: many requests wait as the call carried. The callers a call answered ask again within
#: moments (an environment step later) and join the next call instead of alternating with
#: the others in calls of their own.
LINGER_SHARE = 0.05
LINGER_S = 0.05


@dataclass(eq=False)
class Lane:
    """One replica's queue and call state. ``interruptible``: its calls take ``interrupt``;
    ``abortable``: and ``abort_groups``; ``reports_loss``: its calls take ``failover=False``
    and raise ``ReplicaLostError`` when the replica is gone (a ``ReplicaRouter`` lane);
    ``joinable``: its calls take ``admit`` and ``on_result``, so requests can join a running
    call; ``server``: the replica's engine server, which serves the lane's requests instead of
    its queue of calls (``rollout.engines.server``, set by ``VersionedEngine``)."""

    engine: Any
    interruptible: bool
    abortable: bool = False
    reports_loss: bool = False
    joinable: bool = False
    pending: list = field(default_factory=list)  # jobs queued for its next call
    busy: bool = False
    dead: bool = False  # its replica was found lost: it takes no work again
    ended_at: float = 0.0  # when its last call came back (perf_counter)
    last_s: float = 0.0  # how long it took
    last_size: int = 0  # requests it carried (0: it has made no call yet)
    queued_at: float = 0.0  # when its queue last went from empty to not
    server: Any = None  # an EngineServer: its requests go there, not to the queue


def make_lane(engine) -> Lane:
    """A lane for replica ``engine``, as interruptible, abortable and joinable as the engine
    says."""
    interruptible = bool(getattr(engine, "interruptible", False))
    abortable = interruptible and bool(getattr(engine, "abortable", False))
    joinable = abortable and bool(getattr(engine, "joinable", False))
    reports_loss = bool(getattr(engine, "reports_loss", False))
    return Lane(engine, interruptible, abortable, reports_loss, joinable=joinable)


def _replicas(engine) -> list:
    return engine.lanes() if callable(getattr(engine, "lanes", None)) else [engine]


class Lanes:
    """The lanes of ``engine`` (a replica router's replicas, else the engine alone) and which
    one serves each prompt now (see the module docstring). Not thread-safe: its owner calls
    it under its own lock."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.lanes = [make_lane(e) for e in _replicas(engine)]
        self.retired: list[Lane] = []  # lanes of a router followed away from, still in a call
        self.placed: dict[int, int] = {}  # prompt -> the lane index its requests go to
        self.load: dict[int, int] = {}  # lane index -> requests in flight there

    def route(self, group: int, place: bool = True) -> Lane:
        """The lane that serves prompt ``group`` now: the one it was placed on (every turn of
        its episodes finds its prefix there), else (a new prompt, or its replica out of the
        routing, or its lane dead) the least-loaded lane serving, ties dealt by the prompt,
        where it is placed unless ``place`` is False (a request of no prompt of the stream).
        ``ReplicaLostError`` when none serves."""
        if len(self.lanes) == 1:
            return self.lanes[0]
        serving = getattr(self.engine, "serving", None)
        live = [
            i
            for i, lane in enumerate(self.lanes)
            if not lane.dead and (serving is None or serving(i))
        ]
        if not live:
            raise ReplicaLostError("every engine replica is lost; none is left to generate")
        placed = self.placed.get(group)
        if placed is None or placed not in live:
            least = min(self.load.get(i, 0) for i in live)
            ties = [i for i in live if self.load.get(i, 0) == least]
            placed = ties[deal_prompt(group, len(ties))]
            if place:
                self.placed[group] = placed
        return self.lanes[placed]

    def started(self, lane: Lane, requests: int) -> None:
        """``requests`` more in flight on ``lane`` (``ended`` takes them off)."""
        if lane in self.lanes:
            index = self.lanes.index(lane)
            self.load[index] = self.load.get(index, 0) + requests

    def ended(self, lane: Lane, requests: int) -> None:
        """``requests`` of ``lane``'s came back."""
        if lane in self.lanes:
            index = self.lanes.index(lane)
            self.load[index] = max(0, self.load.get(index, 0) - requests)

    def forget(self, group: int) -> None:
        """Prompt ``group`` is done: its next request, if any, is placed anew."""
        self.placed.pop(group, None)

    def follow(self, engine) -> list:
        """Serve through ``engine``'s replicas from now on; returns the jobs that were queued
        on the old lanes (never sent), for their callers to route again."""
        old, self.engine = self.lanes, engine
        self.lanes = [make_lane(e) for e in _replicas(engine)]
        self.retired = [lane for lane in [*self.retired, *old] if lane.busy]
        moved = [job for lane in old for job in lane.pending]
        for lane in old:
            lane.pending = []
        return moved

    def lost(self, lane: Lane) -> list:
        """``lane``'s replica is gone: it takes no work again; returns the jobs queued on it."""
        lane.dead = True
        moved, lane.pending = lane.pending, []
        return moved

    def busy(self) -> bool:
        """Whether any lane, one followed away from included, is in a call."""
        self.retired = [lane for lane in self.retired if lane.busy]
        return bool(self.retired) or any(lane.busy for lane in self.lanes)


def linger(lane: Lane) -> float:
    """Seconds ``lane`` still waits before its next call (<= 0: go). Its first call waits
    ``LINGER_S`` from the first request queued: the groups of a stream's start ask together."""
    now = time.perf_counter()
    if not lane.last_size:
        return LINGER_S - (now - lane.queued_at)
    if sum(len(job.requests) for job in lane.pending) >= lane.last_size:
        return 0.0
    return min(LINGER_S, LINGER_SHARE * lane.last_s) - (now - lane.ended_at)
