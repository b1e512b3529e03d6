"""Streaming rollouts: groups sampled one after another, without step boundaries, and handed
to training as they complete, under a bound on how stale their tokens may be.

Two pieces, both free of the trainer:

- ``VersionedEngine``: an engine behind a lock, tagged with the policy version of the weights
  it holds. Every ``generate`` call takes the lock, so a weight load (``load``, which takes it
  too) lands between two calls, never inside one; each call records, per prompt (the
  request's ``group``), how many tokens it sampled with which version. A trajectory still
  running when new weights arrive continues under them at its next engine call (a partial
  rollout at engine-call granularity: for a multi-turn agent, the next turn).
- ``StreamSampler``: ``workers`` threads, each sampling one group at a time (``sample_group``,
  the caller's: a prompt's ``n`` trajectories through the agent loop), so up to ``workers``
  groups are in flight (``quiesced`` runs something once none is: a weight load without
  partial rollouts); a new group starts only while the groups started (less those dropped)
  stay under ``allowed()``, the caller's bound for the weights the engine holds (AReaL's rule:
  with weights after step v, ``(v + s + 1) x batch_size`` groups, so what starts now can still
  be trained on within the bound). A finished group waits in a queue with the oldest and newest
  version its tokens came from. ``take(count, min_version)`` hands over the first ``count`` groups to
  finish whose oldest version is at least ``min_version``; a group older than that is dropped
  (never trained on) and counted. Groups are whole: a group enters a batch only when every
  sample has ended (GRPO and RLOO normalise within it).

Which groups a step trains on depends on timing, so streamed runs are not identical run to
run; the caller records every step's batch for replay.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FinishedGroup", "StreamSampler", "VersionedEngine", "admit"]


class VersionedEngine:
    """``engine`` (an ``rollout.engines.base.Engine``) behind a lock, holding the weights of
    policy ``version``. Forwards what the agent loop asks of an engine; ``tokens_of(group)``
    pops the per-version token counts recorded for prompt ``group``."""

    def __init__(self, engine, version: int = 0) -> None:
        self.engine = engine
        self.version = version
        self.lock = threading.Lock()
        self._tokens: dict[int, dict[int, int]] = {}  # group -> version -> tokens sampled
        self.busy_s = 0.0  # seconds spent in generate calls, all told

    def generate(self, requests, sampling):
        """The engine's ``generate``, under the lock; tokens counted per prompt and version."""
        with self.lock:
            started = time.perf_counter()
            results = self.engine.generate(requests, sampling)
            self.busy_s += time.perf_counter() - started
            for request, result in zip(requests, results):
                counts = self._tokens.setdefault(request.group, {})
                counts[self.version] = counts.get(self.version, 0) + len(result.token_ids)
        return results

    def load(self, load: Callable[[], Any], version: int) -> Any:
        """Run ``load()`` (new weights into the engine) between two generate calls, then hold
        ``version``; returns what ``load`` returned."""
        with self.lock:
            out = load()
            self.version = version
        return out

    def tokens_of(self, group: int) -> dict[int, int]:
        """Tokens sampled for prompt ``group``, by policy version (and forgets them)."""
        with self.lock:
            return self._tokens.pop(group, {})

    def lanes(self) -> list:
        """One lane: the lock serialises the engine's calls anyway."""
        return [self]

    def lane_of(self, group: int) -> int:
        """Every prompt's requests go to the one lane."""
        return 0

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


@dataclass
class FinishedGroup:
    """One prompt's samples, all ended: ``output`` (the agent loop's ``RolloutOutput`` for
    that prompt alone), ``ordinal`` (its place in the prompt stream) and the policy versions
    its tokens came from (``tokens``: version -> tokens)."""

    ordinal: int
    output: Any
    tokens: dict[int, int] = field(default_factory=dict)
    finished_at: float = 0.0

    @property
    def oldest(self) -> int:
        """The oldest policy version among its tokens (the engine's version if none)."""
        return min(self.tokens) if self.tokens else 0

    @property
    def newest(self) -> int:
        """The newest policy version among its tokens."""
        return max(self.tokens) if self.tokens else 0


def admit(
    ready: list[FinishedGroup], count: int, min_version: int
) -> tuple[list[FinishedGroup], list[FinishedGroup], list[FinishedGroup]]:
    """Split the finished groups, in the order they finished, into those a step takes (the
    first ``count`` whose oldest token is of version ``min_version`` or newer), those it drops
    (older than that: they can never enter a batch again) and those left for later steps."""
    taken: list[FinishedGroup] = []
    dropped: list[FinishedGroup] = []
    left: list[FinishedGroup] = []
    for group in ready:
        if group.oldest < min_version:
            dropped.append(group)
        elif len(taken) < count:
            taken.append(group)
        else:
            left.append(group)
    return taken, dropped, left


class StreamSampler:
    """Samples groups on ``workers`` threads, forever, until ``stop``: worker threads take the
    next prompt ordinal (from ``first``) and call ``sample_group(ordinal)``; finished groups
    queue for ``take``. ``engine``: the ``VersionedEngine`` the groups sample through (for
    their versions). An exception in ``sample_group`` stops the sampler; ``take`` raises it."""

    def __init__(
        self,
        sample_group: Callable[[int], Any],
        engine: VersionedEngine,
        *,
        workers: int,
        allowed: Callable[[], int],
        first: int = 0,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers}: at least one group must be in flight")
        self.sample_group = sample_group
        self.engine = engine
        self.allowed = allowed  # groups that may have started (net of drops), now
        self.started = 0
        self.in_flight = 0
        self._paused = False  # quiesced: no group starts
        self.next_ordinal = first
        self.ready: deque[FinishedGroup] = deque()
        self.dropped_total = 0
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._work, name=f"stream-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._stop.is_set() and (
                    self._paused or self.started - self.dropped_total >= self.allowed()
                ):
                    self._cond.wait(1.0)
                if self._stop.is_set():
                    return
                ordinal = self.next_ordinal
                self.next_ordinal += 1
                self.started += 1
                self.in_flight += 1
            try:
                output = self.sample_group(ordinal)
            except BaseException as exc:  # noqa: BLE001 - handed to take(), which raises it
                with self._cond:
                    self.in_flight -= 1
                    self.error = self.error or exc
                    self._stop.set()
                    self._cond.notify_all()
                return
            group = FinishedGroup(
                ordinal, output, self.engine.tokens_of(ordinal), time.perf_counter()
            )
            with self._cond:
                self.in_flight -= 1
                self.ready.append(group)
                self._cond.notify_all()

    def take(
        self, count: int, min_version: int, timeout_s: float
    ) -> tuple[list[FinishedGroup], list[FinishedGroup], float]:
        """Wait for ``count`` finished groups of version ``min_version`` or newer (``admit``);
        returns ``(taken, dropped, waited seconds)``. TimeoutError after ``timeout_s``."""
        started = time.perf_counter()
        deadline = started + timeout_s
        dropped: list[FinishedGroup] = []
        with self._cond:
            while True:
                if self.error is not None:
                    raise self.error
                taken, gone, left = admit(list(self.ready), count, min_version)
                if gone:  # too old for any later step: room for new groups
                    dropped += gone
                    self.dropped_total += len(gone)
                    self._cond.notify_all()
                if len(taken) == count:
                    self.ready = deque(left)  # finishing order kept
                    return taken, dropped, time.perf_counter() - started
                self.ready = deque(taken + left)
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    raise TimeoutError(
                        f"{count} groups of policy version >= {min_version} did not finish "
                        f"within {timeout_s:.0f} s ({len(taken)} did)"
                    )
                self._cond.wait(min(remaining, 1.0))

    def quiesced(self, fn: Callable[[], Any], timeout_s: float) -> Any:
        """Run ``fn`` once no group is in flight (none starts meanwhile): what a weight load
        does without partial rollouts, so that every group samples with one policy.
        TimeoutError after ``timeout_s`` waiting for the groups in flight."""
        deadline = time.perf_counter() + timeout_s
        with self._cond:
            self._paused = True
            try:
                while self.in_flight and self.error is None:
                    remaining = deadline - time.perf_counter()
                    if remaining <= 0:
                        raise TimeoutError(
                            f"{self.in_flight} groups still in flight after {timeout_s:.0f} s; "
                            "the new weights wait for them (rollout.partial_rollout=false)"
                        )
                    self._cond.wait(min(remaining, 1.0))
                return fn()
            finally:
                self._paused = False
                self._cond.notify_all()

    def wake(self) -> None:
        """The bound may have moved (new weights): let waiting workers look again."""
        with self._cond:
            self._cond.notify_all()

    @property
    def waiting(self) -> int:
        """Finished groups not taken yet (they carry over to later steps)."""
        with self._cond:
            return len(self.ready)

    def stop(self) -> None:
        """Let the workers end after their current group (they are daemon threads)."""
        with self._cond:
            self._stop.set()
            self._cond.notify_all()
