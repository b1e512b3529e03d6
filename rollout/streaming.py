"""Streaming rollouts: groups sampled one after another, without step boundaries, and handed
to training as they complete, under a bound on how stale their tokens may be.

Two pieces, both free of the trainer:

- ``VersionedEngine`` (``rollout.versioned``): an engine tagged with the policy version of the
  weights it holds, every live group's requests batched per replica, weight loads between
  calls (with partial rollouts: between decode steps), every token tagged with its version,
  and groups that can no longer be trained aborted (``GroupAborted``).
- ``StreamSampler``: ``workers`` threads, each sampling one group at a time (``sample_group``,
  the caller's: a prompt's ``n`` trajectories through the agent loop), so up to ``workers``
  groups are in flight (``quiesced`` runs something once none is: a weight load without
  partial rollouts); a new group starts only while the groups started (less those dropped or
  aborted) stay under ``allowed()``, the caller's bound for the weights the engine holds
  (AReaL's rule: with weights after step v, ``(v + s + 1) x batch_size`` groups, so what
  starts now can still be trained on within the bound). A finished group waits in a queue
  with the oldest and newest version its tokens came from. ``take(count, min_version)`` first
  aborts the groups in flight that sampled a token older than ``min_version`` (their
  generation stops; ``retry`` puts their prompts back at the head of the queue, at most
  ``max_retries`` times each, else they count as dropped), then hands over ``count`` finished groups whose oldest version is at least
  ``min_version``, oldest first (``admit``); a finished group older than that is dropped
  (never trained on) and counted; a group that sampled no token (every environment reset
  failed) is never stale, and is taken in its turn with its faults. Groups are whole: a
  group enters a batch only when every sample has ended (GRPO and RLOO normalise within it).

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

from rollout.versioned import GroupAborted, UntrackedEngine, VersionedEngine

__all__ = [
    "FinishedGroup",
    "GroupAborted",
    "StreamSampler",
    "UntrackedEngine",
    "VersionedEngine",
    "admit",
]


@dataclass
class FinishedGroup:
    """One prompt's samples, all ended: ``output`` (the agent loop's ``RolloutOutput`` for
    that prompt alone), ``ordinal`` (its place in the prompt stream), the policy versions
    its tokens came from (``tokens``: version -> tokens) and ``version``, the engine's when
    the group finished."""

    ordinal: int
    output: Any
    tokens: dict[int, int] = field(default_factory=dict)
    finished_at: float = 0.0
    version: int = 0

    @property
    def oldest(self) -> int:
        """The oldest policy version among its tokens (``version`` if it sampled none)."""
        return min(self.tokens) if self.tokens else self.version

    @property
    def newest(self) -> int:
        """The newest policy version among its tokens (``version`` if it sampled none)."""
        return max(self.tokens) if self.tokens else self.version


def admit(
    ready: list[FinishedGroup], count: int, min_version: int
) -> tuple[list[FinishedGroup], list[FinishedGroup], list[FinishedGroup]]:
    """Split the finished groups into those a step takes (``count`` whose oldest token is of
    version ``min_version`` or newer, oldest first: by that version, then by their place in
    the prompt stream, so the groups nearest to expiring train first and a long group is not
    passed over for shorter ones that finished after it), those it drops (older than
    ``min_version``: they can never enter a batch again) and those left for later steps, in
    the order they finished.
    A group that sampled no token (every reset of its environment failed) holds nothing
    stale: it is taken in its turn, as a synchronous step takes a prompt whose resets all
    failed, so its faults reach the step's environment-fault check, never dropped unseen."""
    dropped = [g for g in ready if g.tokens and g.oldest < min_version]
    fresh = [g for g in ready if not (g.tokens and g.oldest < min_version)]
    chosen = {id(g) for g in sorted(fresh, key=lambda g: (g.oldest, g.ordinal))[:count]}
    taken = sorted((g for g in fresh if id(g) in chosen), key=lambda g: (g.oldest, g.ordinal))
    left = [g for g in fresh if id(g) not in chosen]
    return taken, dropped, left


class StreamSampler:
    """Samples groups on ``workers`` threads, forever, until ``stop``: worker threads take the
    next prompt ordinal (from ``first``) and call ``sample_group(ordinal)``; finished groups
    queue for ``take``. ``engine``: the ``VersionedEngine`` the groups sample through (for
    their versions). An exception in ``sample_group`` stops the sampler; ``take`` raises it,
    except ``GroupAborted``: the group is set aside (``take_aborted``) and, with ``retry``,
    its prompt ordinal is sampled again before any new one, at most ``max_retries`` times
    (``train.max_prompt_retries``); aborted once more, the prompt is given up (dropped).
    ``take_retries`` counts both."""

    def __init__(
        self,
        sample_group: Callable[[int], Any],
        engine: VersionedEngine,
        *,
        workers: int,
        allowed: Callable[[], int],
        first: int = 0,
        retry: bool = False,
        max_retries: int = 2,
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
        self.retry = retry
        self._again: deque[int] = deque()  # aborted prompts to sample again (retry)
        self.max_retries = max_retries
        self._retries: dict[int, int] = {}  # prompt ordinal -> times sampled again so far
        self._retried = self._given_up = 0  # since the last take_retries
        self._aborted: list[FinishedGroup] = []  # since the last take_aborted
        self.dropped_total = 0  # dropped or aborted: room for new groups
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
                if self._again:
                    ordinal = self._again.popleft()
                else:
                    ordinal = self.next_ordinal
                    self.next_ordinal += 1
                self.started += 1
                self.in_flight += 1
            try:
                output = self.sample_group(ordinal)
            except GroupAborted:
                self._set_aside(ordinal)
                continue
            except BaseException as exc:  # noqa: BLE001 - handed to take(), which raises it
                with self._cond:
                    self.in_flight -= 1
                    if self._stop.is_set():  # stopped meanwhile (shutdown): not the run's error
                        self._cond.notify_all()
                        return
                    self.error = self.error or exc
                    self._stop.set()
                    self._cond.notify_all()
                return
            group = FinishedGroup(
                ordinal,
                output,
                self.engine.tokens_of(ordinal),
                time.perf_counter(),
                self.engine.version,
            )
            with self._cond:
                self.in_flight -= 1
                self.ready.append(group)
                self._retries.pop(ordinal, None)
                self._cond.notify_all()

    def _set_aside(self, ordinal: int) -> None:
        """Group ``ordinal`` was aborted: its tokens so far are discarded, its start slot
        freed, its prompt queued again with ``retry`` unless it was ``max_retries`` times
        already (then given up: dropped, counted)."""
        group = FinishedGroup(
            ordinal, None, self.engine.tokens_of(ordinal), time.perf_counter(), self.engine.version
        )
        with self._cond:
            self.in_flight -= 1
            self.dropped_total += 1
            self._aborted.append(group)
            if self.retry:
                tries = self._retries.pop(ordinal, 0)
                if tries < self.max_retries:
                    self._retries[ordinal] = tries + 1
                    self._again.append(ordinal)
                    self._retried += 1
                else:
                    self._given_up += 1
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Stop sampling with ``error`` (a weight load that failed, ``StreamingHost.
        between_calls``): the next ``take`` or ``check`` raises it, in its own words, rather
        than timing out later on groups too stale to take."""
        with self._cond:
            self.error = self.error or error
            self._stop.set()
            self._cond.notify_all()

    def check(self) -> None:
        """Raise the error that stopped the stream (``fail``, or a group's), if any."""
        with self._cond:
            if self.error is not None:
                raise self.error

    def take_retries(self) -> tuple[int, int]:
        """Since the last call: aborted groups whose prompt was queued to be sampled again, and
        those whose prompt was given up after ``max_retries`` (``retry`` only)."""
        with self._cond:
            counts = (self._retried, self._given_up)
            self._retried = self._given_up = 0
        return counts

    def take_aborted(self) -> list[FinishedGroup]:
        """The groups aborted since the last call (``output`` None; ``tokens``: what they had
        sampled, discarded)."""
        with self._cond:
            aborted, self._aborted = self._aborted, []
        return aborted

    def take(
        self, count: int, min_version: int, timeout_s: float
    ) -> tuple[list[FinishedGroup], list[FinishedGroup], float]:
        """Abort the groups in flight that can no longer be taken (``VersionedEngine.
        abort_older_than``), then wait for ``count`` finished groups of version
        ``min_version`` or newer (``admit``); returns ``(taken, dropped, waited seconds)``.
        TimeoutError after ``timeout_s``."""
        abort = getattr(self.engine, "abort_older_than", None)
        if abort is not None:
            abort(min_version)
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
        self.hold(timeout_s)
        try:
            return fn()
        finally:
            self.release()

    def hold(self, timeout_s: float) -> None:
        """Return once no group is in flight, and start none until ``release``. TimeoutError
        (nothing held) after ``timeout_s`` waiting for the groups in flight."""
        deadline = time.perf_counter() + timeout_s
        with self._cond:
            self._paused = True
            while self.in_flight and self.error is None:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    self._paused = False
                    self._cond.notify_all()
                    raise TimeoutError(
                        f"{self.in_flight} groups still in flight after {timeout_s:.0f} s; "
                        "the new weights wait for them (rollout.partial_rollout=false)"
                    )
                self._cond.wait(min(remaining, 1.0))

    def release(self) -> None:
        """Let groups start again after ``hold``."""
        with self._cond:
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

    def shutdown(self, timeout_s: float) -> list[str]:
        """Stop for good: no group starts, the engine's calls stop (``VersionedEngine.close``:
        waiting callers raise, interruptible calls in flight end after their decode step,
        others are waited for), and the worker threads are joined, all within ``timeout_s``
        seconds. Returns the names of the threads still running then (none, normally)."""
        deadline = time.perf_counter() + timeout_s
        self.stop()
        close = getattr(self.engine, "close", None)
        if close is not None:
            close(timeout_s)
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.perf_counter()))
        return [thread.name for thread in self._threads if thread.is_alive()]
