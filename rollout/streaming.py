"""Streaming rollouts: groups sampled one after another, without step boundaries, and handed
to training as they complete, under a bound on how stale their tokens may be.

Two pieces, both free of the trainer:

- ``VersionedEngine``: an engine tagged with the policy version of the weights it holds, its
  calls and weight loads one at a time; every token a call samples records its version (per
  result, and per prompt: the request's ``group``). With partial rollouts a load interrupts
  the call in flight after its current decode step (an ``interruptible`` engine: HF, vLLM) and
  the requests still running continue from their prefix under the new weights; else it waits
  for the call to end (a multi-turn trajectory still goes on under the new weights at its next
  turn). Requests from outside the stream (validation) go through its ``untracked`` view: the
  same turns, their tokens counted under none of the stream's prompts.
- ``StreamSampler``: ``workers`` threads, each sampling one group at a time (``sample_group``,
  the caller's: a prompt's ``n`` trajectories through the agent loop), so up to ``workers``
  groups are in flight (``quiesced`` runs something once none is: a weight load without
  partial rollouts); a new group starts only while the groups started (less those dropped)
  stay under ``allowed()``, the caller's bound for the weights the engine holds (AReaL's rule:
  with weights after step v, ``(v + s + 1) x batch_size`` groups, so what starts now can still
  be trained on within the bound). A finished group waits in a queue with the oldest and newest
  version its tokens came from. ``take(count, min_version)`` hands over the first ``count`` groups to
  finish whose oldest version is at least ``min_version``; a group older than that is dropped
  (never trained on) and counted; a group that sampled no token (every environment reset
  failed) is never stale, and is taken in its turn with its faults. Groups are whole: a group
  enters a batch only when every sample has ended (GRPO and RLOO normalise within it).

Which groups a step trains on depends on timing, so streamed runs are not identical run to
run; the caller records every step's batch for replay.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout.engines.base import GenerationRequest, GenerationResult

__all__ = ["FinishedGroup", "StreamSampler", "UntrackedEngine", "VersionedEngine", "admit"]


class VersionedEngine:
    """``engine`` (an ``rollout.engines.base.Engine``) tagged with the policy ``version`` of the
    weights it holds; one call or one weight load at a time. Forwards what the agent loop asks
    of an engine; ``tokens_of(group)`` pops the per-version token counts recorded for prompt
    ``group``; every result carries its tokens' versions (``extra["versions"]``).

    ``partial``: a weight load does not wait for the call in flight to end. An
    ``interruptible`` engine ends the call after its current decode step, the load runs, and
    the requests still running go on from their prefix under the new weights (the prompt plus
    the tokens so far prefilled again: their KV cache is recomputed, never kept from the old
    weights, so every token's behaviour log-prob is the new policy's own). Without it, the
    load waits for the call."""

    def __init__(self, engine, version: int = 0, *, partial: bool = False) -> None:
        self.engine = engine
        self.version = version
        self.partial = partial and bool(getattr(engine, "interruptible", False))
        self._cond = threading.Condition()
        self._busy = False  # a call or a load holds the engine
        self._loads_waiting = 0  # loads wait first: a call in flight yields to them
        self._tokens: dict[int, dict[int, int]] = {}  # group -> version -> tokens sampled
        self.busy_s = 0.0  # seconds spent in generate calls, all told
        self.interruptions = 0  # calls ended early for a weight load

    def _hold(self, *, loading: bool) -> None:
        with self._cond:
            self._loads_waiting += loading
            while self._busy or (not loading and self._loads_waiting):
                self._cond.wait()
            self._loads_waiting -= loading
            self._busy = True

    def _free(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def _load_waiting(self) -> bool:
        return self._loads_waiting > 0

    def generate(self, requests, sampling):
        """The engine's ``generate``, its calls and the loads one at a time; tokens counted per
        prompt and version. With ``partial``, a call a load interrupts goes on after it."""
        return self._generate(requests, sampling, track=True)

    def untracked(self) -> UntrackedEngine:
        """This engine for requests outside the stream (validation): their calls take turns
        with the stream's and with the loads, but their tokens are counted under no prompt
        (``tokens_of``), whatever ``group`` numbers they carry."""
        return UntrackedEngine(self)

    def _generate(self, requests, sampling, *, track: bool):
        results = [GenerationResult([], [], "length", {"versions": []}) for _ in requests]
        todo = list(range(len(requests)))
        while todo:
            room = sampling.max_new_tokens - len(results[todo[0]].token_ids)
            batch = [i for i in todo if sampling.max_new_tokens - len(results[i].token_ids) == room]
            todo = [i for i in todo if i not in batch]
            asked = [_continued(requests[i], results[i].token_ids) for i in batch]
            kwargs = {"interrupt": self._load_waiting} if self.partial else {}
            self._hold(loading=False)
            try:
                started, version = time.perf_counter(), self.version
                outs = self.engine.generate(
                    asked, dataclasses.replace(sampling, max_new_tokens=room), **kwargs
                )
                self.busy_s += time.perf_counter() - started
            finally:
                self._free()
            for i, out in zip(batch, outs):
                into = results[i]
                into.token_ids += out.token_ids
                into.logprobs += out.logprobs
                into.extra["versions"] += [version] * len(out.token_ids)
                into.extra.update((k, v) for k, v in out.extra.items() if k != "versions")
                into.finish_reason = out.finish_reason
                if out.token_ids and track:
                    with self._cond:
                        counts = self._tokens.setdefault(requests[i].group, {})
                        counts[version] = counts.get(version, 0) + len(out.token_ids)
                if out.finish_reason == "interrupted":
                    if len(into.token_ids) < sampling.max_new_tokens:
                        todo.append(i)
                    else:
                        into.finish_reason = "length"
            self.interruptions += any(out.finish_reason == "interrupted" for out in outs)
        return results

    def load(self, load: Callable[[], Any], version: int) -> Any:
        """Run ``load()`` (new weights into the engine) between two engine calls (with
        ``partial``: between two decode steps of the call in flight), then hold ``version``;
        returns what ``load`` returned."""
        self._hold(loading=True)
        try:
            out = load()
            self.version = version
        finally:
            self._free()
        return out

    def hold(self) -> None:
        """Take the engine until ``release``: no call runs meanwhile (with ``partial``, the
        call in flight ends after its current decode step and goes on after ``release``). What
        colocated engines do while the ranks train on their devices."""
        self._hold(loading=True)

    def release(self, version: int) -> None:
        """Give the engine back after ``hold``, holding the weights of policy ``version``."""
        self.version = version
        self._free()

    def tokens_of(self, group: int) -> dict[int, int]:
        """Tokens sampled for prompt ``group``, by policy version (and forgets them)."""
        with self._cond:
            return self._tokens.pop(group, {})

    def lanes(self) -> list:
        """One lane: the calls take the engine one at a time anyway."""
        return [self]

    def lane_of(self, group: int) -> int:
        """Every prompt's requests go to the one lane."""
        return 0

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


class UntrackedEngine:
    """A ``VersionedEngine`` for requests that are no prompt of the stream (``untracked``):
    the same calls, one at a time with the stream's and the loads, each token tagged with its
    version, none counted for ``tokens_of``. A validation's ``group`` numbers (its records'
    indices) are the same numbers as the stream's prompt ordinals; counted, a prompt streamed
    later would inherit the version validation sampled at and be dropped as stale."""

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


def _continued(request: GenerationRequest, sampled: list[int]) -> GenerationRequest:
    """``request`` continued after the tokens ``sampled`` so far: their prefix joins the prompt
    and the seed moves on (the continuation draws fresh numbers, not the first ones again)."""
    if not sampled:
        return request
    return dataclasses.replace(
        request,
        prompt_ids=[*request.prompt_ids, *sampled],
        seed=(int(request.seed) * 1_000_003 + len(sampled)) % (2**63),
    )


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
    """Split the finished groups, in the order they finished, into those a step takes (the
    first ``count`` whose oldest token is of version ``min_version`` or newer), those it drops
    (older than that: they can never enter a batch again) and those left for later steps.
    A group that sampled no token (every reset of its environment failed) holds nothing
    stale: it is taken in its turn, as a synchronous step takes a prompt whose resets all
    failed, so its faults reach the step's environment-fault check, never dropped unseen."""
    taken: list[FinishedGroup] = []
    dropped: list[FinishedGroup] = []
    left: list[FinishedGroup] = []
    for group in ready:
        if group.tokens and group.oldest < min_version:
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
                ordinal,
                output,
                self.engine.tokens_of(ordinal),
                time.perf_counter(),
                self.engine.version,
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
