"""The lanes of a stream's engine (``rollout.versioned.VersionedEngine``): one per engine
replica, each with that replica's engine server, and which lane serves a prompt now.

A new prompt's requests go to the least-loaded lane that serves (requests in flight; ties
dealt by the prompt, ``deal_prompt``), and every later request of that prompt to the same lane
while it runs, so every turn of its episodes finds its prefix there. A lane whose replica is
out of the routing (``ReplicaRouter.serving``: lost, or a replacement that has not loaded the
current weights yet) takes no work: its prompts are placed anew on the lanes that serve (a
replacement joins the placing as soon as it serves). A lane whose call finds its
replica lost (``ReplicaLostError``) is marked ``dead`` and never takes work again.

``follow``: the host connected a new router (a replacement replica started): the lanes are
rebuilt from it at once (their servers are kept per replica, so requests in flight on a
replica that stays finish there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout.engines.serving.router import ReplicaLostError, deal_prompt

__all__ = ["Lane", "Lanes"]


@dataclass(eq=False)
class Lane:
    """One replica: its engine, whether a batch of it can end after a decode step
    (``interruptible``), whether its loss raises ``ReplicaLostError`` to the callers rather
    than being failed over by the router (``reports_loss``: a ``ReplicaRouter`` lane), and its
    engine server (``rollout.engines.serving.server``, set by ``VersionedEngine``)."""

    engine: Any
    interruptible: bool
    reports_loss: bool = False
    dead: bool = False  # its replica was found lost: it takes no work again
    server: Any = None


def make_lane(engine) -> Lane:
    """A lane for replica ``engine``, as the engine says."""
    return Lane(
        engine,
        bool(getattr(engine, "interruptible", False)),
        bool(getattr(engine, "reports_loss", False)),
    )


def _replicas(engine) -> list:
    return engine.lanes() if callable(getattr(engine, "lanes", None)) else [engine]


class Lanes:
    """The lanes of ``engine`` (a replica router's replicas, else the engine alone) and which
    one serves each prompt now (see the module docstring). Not thread-safe: its owner calls
    it under its own lock."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.lanes = [make_lane(e) for e in _replicas(engine)]
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

    def follow(self, engine) -> None:
        """Serve through ``engine``'s replicas from now on."""
        self.engine = engine
        self.lanes = [make_lane(e) for e in _replicas(engine)]

    def lost(self, lane: Lane) -> None:
        """``lane``'s replica is gone: it takes no work again."""
        lane.dead = True
