"""The rollout host's streaming mode (``train.max_staleness``): groups sampled without step
boundaries on the host's engines, handed to each step as they finish (``rollout.streaming``).

``RolloutHost`` mixes this in. ``stream_start`` (given the bound ``max_staleness`` by the
controller's ``StreamingPipeline``) wraps the replicas in a ``VersionedEngine``
(every weight load then lands between two engine calls: ``between_calls``) and starts a
``StreamSampler``: up to ``train.batch_size x (max_staleness + 1)`` groups in flight, and with
the weights after step v no more than ``(v + max_staleness + 1) x train.batch_size`` groups
started since the stream began (less those dropped), both at most the groups the steps left
take (``train.batch_size`` for each step to ``train.total_steps``: no thread, and no group,
that no step would train on);
``stream_take(step)`` returns step ``step``'s batch as ``rollout`` does: the first
``train.batch_size`` groups to finish whose oldest token was sampled by the policy after step
``step - 1 - max_staleness`` or later. Older groups are dropped; the rest carry over.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from rollout.agent_loop import RolloutOutput
from rollout.env_slots import EnvCallsClosed, EnvSlots
from rollout.streaming import FinishedGroup, StreamSampler, VersionedEngine
from trainer.loop.engines.rollout_meta import combine_rollout_metrics
from trainer.loop.plan.call_limits import CallLimits

__all__ = ["SHUTDOWN_S", "StreamingHost", "bias_metrics", "staleness_metrics"]

#: Seconds a shutdown waits for the stream's calls in flight to end and its threads to join
#: (an engine call that cannot be interrupted, on another replica, may take this long); past
#: it the engines are released anyway, the threads still running named in one line.
SHUTDOWN_S = 30.0


def bias_metrics(
    taken: list[FinishedGroup],
    dropped: list[FinishedGroup],
    aborted: list[FinishedGroup],
    n: int,
) -> dict[str, float]:
    """What a step's choice of groups leans towards: the mean response length (tokens per
    trajectory) and turns of the groups taken, and of those dropped (finished too stale) and
    aborted (stopped while sampling, ``output`` None: length so far, no turns); 0 where there
    are none. ``groups_aborted``; ``tokens_discarded``: every token the dropped and aborted
    groups had sampled (generated, never trained on)."""

    def mean(groups: list[FinishedGroup], key: str) -> float:
        done = [g.output.metrics.get(key, 0.0) for g in groups if g.output is not None]
        return sum(done) / len(done) if done else 0.0

    sampled = [sum(g.tokens.values()) / n for g in aborted]
    return {
        "stream/taken_mean_length": mean(taken, "rollout/mean_response_length"),
        "stream/taken_mean_turns": mean(taken, "rollout/mean_turns"),
        "stream/dropped_mean_length": mean(dropped, "rollout/mean_response_length"),
        "stream/dropped_mean_turns": mean(dropped, "rollout/mean_turns"),
        "stream/aborted_mean_length": sum(sampled) / len(sampled) if sampled else 0.0,
        "stream/groups_aborted": float(len(aborted)),
        "stream/tokens_discarded": float(sum(sum(g.tokens.values()) for g in (*dropped, *aborted))),
    }


def turn_wait_metrics(waits: list[float]) -> dict[str, float]:
    """A served replica's turns since the last batch: milliseconds from a request's submit to
    the first decode step that took it, median and 99th percentile (none: nothing served)."""
    if not waits:
        return {}
    ordered = sorted(waits)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {
        "stream/turn_wait_ms": 1000 * statistics.median(ordered),
        "stream/turn_wait_p99_ms": 1000 * p99,
    }


def staleness_metrics(groups: list[FinishedGroup], trained_version: int) -> dict[str, float]:
    """``stream/*`` of a step's groups, against ``trained_version`` (the policy that trains
    on them, the step before): the version gap of the batch's sampled tokens (min, mean and max
    over tokens); ``partial_token_share``: tokens sampled by a newer policy than their group's
    oldest (trajectories that went on under new weights)."""
    counts: dict[int, int] = {}
    for group in groups:
        for version, n in group.tokens.items():
            counts[version] = counts.get(version, 0) + n
    tokens = sum(counts.values())
    newer = sum(n for g in groups for v, n in g.tokens.items() if v > g.oldest)
    if not tokens:  # nothing sampled (every sample empty): the groups' own versions
        counts, tokens = {g.oldest: 1 for g in groups}, len(groups)
    return {
        "stream/staleness_min": float(trained_version - max(counts)),
        "stream/staleness_mean": sum((trained_version - v) * n for v, n in counts.items()) / tokens,
        "stream/staleness_max": float(trained_version - min(counts)),
        "stream/partial_token_share": newer / tokens if newer else 0.0,
    }


class StreamingHost:
    """``stream_start`` / ``stream_take`` / ``between_calls`` for ``RolloutHost``."""

    stream: StreamSampler | None = None
    versioned: VersionedEngine | None = None
    stream_bound = 0  # the stream's ``train.max_staleness`` (``stream_start``)
    env_slots: EnvSlots | None = None  # the groups' shared environment calls
    agent_workers = None  # rollout.agent_workers' processes (RolloutHost.setup), or None

    def between_calls(self, load: Callable[[], Any], version: int | None) -> Any:
        """Run ``load`` (weights into the replicas) at once, or while a stream samples: between
        two engine calls (``rollout.partial_rollout``: a trajectory's next call uses them), else
        once no group is in flight."""
        if self.versioned is None:
            return load()
        version = self.versioned.version if version is None else version
        try:
            if self.cfg.rollout.partial_rollout:  # trajectories in flight go on under them
                out = self.versioned.load(load, version)
            else:  # every group samples with one policy: the load waits for those in flight
                wait_s = CallLimits.for_config(self.cfg).rollout_s
                out = self.stream.quiesced(lambda: self.versioned.load(load, version), wait_s)
        except BaseException as exc:
            # The stream stops with it: the next take (or hold / release) raises this error,
            # not a take timeout on groups no step may train on any more.
            self.stream.fail(exc)
            raise
        self._abort_stale()
        self.stream.wake()  # newer weights: more groups may start
        return out

    def stream_start(self, version: int, bound: int) -> int:
        """Start sampling groups from the prompt stream's next one with the engines holding the
        weights after step ``version`` (0: the initial ones), no group trained more than
        ``bound`` policies behind (``train.max_staleness``); returns the first's ordinal."""
        cfg = self.cfg
        size, self.stream_bound = cfg.train.batch_size, bound
        start = self.weights_version = version
        self.versioned = VersionedEngine(
            self.generator, version=start, partial=cfg.rollout.partial_rollout
        )
        first = self.prompts_consumed
        # The steps left take this many batches: no more groups start, nor threads for them.
        steps_left = max(1, cfg.train.total_steps - start)

        # one pool of environment calls for every group in flight: rollout.env_concurrency
        env_slots = self.env_slots = EnvSlots(cfg.env_call_slots())

        def sample_group(ordinal: int) -> RolloutOutput:
            # ``step`` seeds the requests: the prompt's ordinal, unique in the run
            items = self.prompts.take(ordinal, 1)
            return self._sample(ordinal, items, engine=self.versioned, env_slots=env_slots)

        def allowed() -> int:  # what starts under version v is trained by step v + s + 1
            return min(self.versioned.version - start + bound + 1, steps_left) * size

        workers = size * min(bound + 1, steps_left)
        self.stream = StreamSampler(
            sample_group,
            self.versioned,
            workers=workers,
            allowed=allowed,
            first=first,
            retry=cfg.train.stale_prompts == "retry",
            max_retries=cfg.train.max_prompt_retries,
        )
        self.stream_started_at, self.last_take = time.perf_counter(), None
        return first

    def stream_take(
        self, step: int, record_dir: str | None, timeout_s: float
    ) -> tuple[dict[str, Any], list]:
        """Step ``step``'s batch (``rollout``'s return), from the groups the stream finished."""
        cfg = self.cfg
        n, size = cfg.rollout.n, cfg.train.batch_size
        trained = step - 1  # the policy that trains on this batch
        taken, dropped, waited = self.stream.take(size, self._min_version(trained), timeout_s)
        aborted = self.stream.take_aborted()
        retried, given_up = self.stream.take_retries()
        # since the last step's batch was handed over: how much of it each side waited
        engine = self.versioned
        engine.count_peer_batches()
        now, busy, cut = time.perf_counter(), engine.busy_s, engine.interruptions
        calls, made = len(engine.call_sizes), engine.generated_tokens
        last_at, last_busy, last_cut, last_calls, last_made = self.last_take or (
            self.stream_started_at,
            0.0,
            0,
            0,
            0,
        )
        self.last_take = (now, busy, cut, calls, made)
        recent_calls = engine.call_sizes[last_calls:calls]
        interval = max(now - last_at, 1e-9)
        rows = []
        for j, group in enumerate(taken):  # renumbered: group j of this batch
            for row in group.output.rows:
                sample = row.trajectory_id % n
                rows.append(dataclasses.replace(row, uid=j, trajectory_id=j * n + sample))
        out = RolloutOutput(
            rows=rows,
            metrics=combine_rollout_metrics([g.output.metrics for g in taken]),
            # every group's faults, those of a group whose resets all failed too (``admit``
            # takes it in its turn): the step's environment-fault check counts them
            faults=[
                (j * n + t % n, text) for j, g in enumerate(taken) for t, text in g.output.faults
            ],
        )
        out.metrics.update(staleness_metrics(taken, trained))
        out.metrics.update(bias_metrics(taken, dropped, aborted, n))
        out.metrics.update(
            {
                "stream/groups_dropped": float(len(dropped)),
                "stream/groups_carried": float(self.stream.waiting),
                # train.stale_prompts=retry: sampled again, or dropped past the cap
                "stream/groups_retried": float(retried),
                "stream/groups_given_up": float(given_up),
                "stream/take_wait_s": waited,
                "stream/trainer_idle_share": min(1.0, waited / interval),
                "stream/engine_idle_share": max(0.0, 1.0 - (busy - last_busy) / interval),
                "stream/calls_interrupted": float(self.versioned.interruptions - last_cut),
                # a lost replica's requests, sent again to the replicas that serve
                "stream/requests_resubmitted": float(engine.take_resubmitted()),
                # every live group's turns batched together (rollout.versioned)
                "stream/requests_per_call": (
                    sum(recent_calls) / len(recent_calls) if recent_calls else 0.0
                ),
                "stream/tokens_generated": float(made - last_made),
                **turn_wait_metrics(engine.take_turn_waits()),
            }
        )
        sampled = [g.oldest for g in taken if g.tokens] or [g.oldest for g in taken]
        return self._batch_out(step, out, record_dir, min(sampled))

    def _min_version(self, trained: int) -> int:
        """The oldest policy whose tokens the batch policy ``trained`` trains on may hold:
        ``train.max_staleness`` behind it; any (0) with ``train.stale_prompts=keep``."""
        if self.cfg.train.stale_prompts == "keep":
            return 0
        return max(0, trained - self.stream_bound)

    def _abort_stale(self) -> None:
        """New weights: the groups in flight that the next batch (trained by the policy now
        in the engines) could no longer take stop now, not at that batch's take."""
        if self.cfg.train.stale_prompts != "keep":
            self.versioned.abort_older_than(self._min_version(self.versioned.version))

    def stream_hold(self, timeout_s: float) -> None:
        """Colocated engines: stop sampling so the ranks can take the devices (the engines
        then sleep). With partial rollouts the engine call in flight ends after its current
        decode step (it goes on after ``stream_release``) and environment calls go on; else
        the groups in flight finish first and none starts."""
        self.stream.check()  # a weight load that failed is said here, not at a later take
        if not self.cfg.rollout.partial_rollout:
            self.stream.hold(timeout_s)
        self.versioned.hold()

    def stream_release(self, version: int) -> None:
        """Colocated engines, awake again with the weights after step ``version``: sampling
        goes on."""
        self.stream.check()
        self.weights_version = version
        self.versioned.release(version)
        if not self.cfg.rollout.partial_rollout:
            self.stream.release()
        self._abort_stale()
        self.stream.wake()  # newer weights: more groups may start

    def stream_stop(self) -> None:
        """Stop sampling (the workers end after their current group)."""
        if self.stream is not None:
            self.stream.stop()

    def stream_shutdown(self, timeout_s: float = SHUTDOWN_S) -> list[str]:
        """Stop the stream for good, within ``timeout_s`` seconds: no group, environment call
        or engine call starts; environment calls in flight are abandoned (their threads cannot
        be killed), engine calls in flight end after their decode step where the engine can
        be interrupted and are waited for elsewhere; the stream's threads are joined. Returns
        the names of those still running at the bound."""
        if self.stream is None:
            return []
        self.stream.stop()
        if self.env_slots is not None:
            self.env_slots.close()
        if self.agent_workers is not None:  # the groups' agent loops in workers end too
            self.agent_workers.cancel_all(EnvCallsClosed("the stream shuts down"))
        late = self.stream.shutdown(timeout_s)
        if late:
            print(
                f"rollout host: {len(late)} stream thread(s) still in a call {timeout_s:g} s "
                f"after shutdown ({', '.join(late[:4])}); releasing the engines anyway",
                file=sys.stderr,
            )
        return late

    def shutdown(self) -> None:
        """Stop the stream (``stream_shutdown``: its calls in flight end, its threads are
        joined), then release what the engine host holds."""
        self.stream_shutdown()
        super().shutdown()
