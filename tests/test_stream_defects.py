"""Issue 57's defects of the stream (``rollout.streaming``, ``trainer.loop.engines.stream_host``):
a weight load that fails is said at the next take in one line naming its error (5);
``train.stale_prompts=retry`` gives a prompt up after ``train.max_prompt_retries`` (6); the
environment calls a stream's groups share wait in one first-in-first-out queue, without
polling (7); shutting a stream down stops its calls in flight and joins its threads (8)."""

from __future__ import annotations

import pytest

from rollout.agent_loop import RolloutOutput
from rollout.engines.base import GenerationRequest, GenerationResult, SamplingParams
from trainer.config import load_config
from trainer.loop.engines.stream_host import StreamingHost

STREAM = ["train.max_staleness=1", "rollout.engine_devices=1", "algorithm.rollout_correction=token"]


class _Engine:
    def generate(self, requests, sampling):
        return [GenerationResult([1], [0.0], "length") for _ in requests]


class _Prompts:
    def take(self, first, count):
        return list(range(first, first + count))


def _host(tmp_path, *keys: str, engine=None):
    """A ``StreamingHost`` (the shipped stream code) over a stub engine, prompts and agent
    loop: each group makes one engine call; ``take_weights`` loads through ``between_calls``
    as ``RolloutHost.take_weights`` does, its load ``host.load`` (None: a no-op)."""

    class Host(StreamingHost):
        cfg = load_config(
            None,
            [
                *STREAM,
                "train.batch_size=2",
                "train.mini_batch_size=2",
                f"run.dir={tmp_path}",
                *keys,
            ],
        )
        generator, prompts, prompts_consumed = engine or _Engine(), _Prompts(), 0
        load = None

        def _sample(self, ordinal, items, engine, env_slots=None):
            engine.generate([GenerationRequest([1], seed=0, group=ordinal)], SamplingParams())
            return RolloutOutput(rows=[], metrics={}, faults=[])

        def _batch_out(self, step, out, record_dir, version):
            return {"metrics": out.metrics, "policy_version": version}, [out]

        def take_weights(self, weights):
            self.between_calls(self.load or (lambda: None), weights[0])
            return weights[0]

    return Host()


# ---------------------------------------------------------------- 5: a failed weight load


class _BucketLost(Exception):
    """What a load into the replicas raised."""


def _fail_load():
    raise _BucketLost("bucket 3 of the weights after step 1 is gone from the object store")


def test_a_failed_load_is_raised_by_the_next_take_not_dropped(tmp_path):
    """Before issue 57 the load's error stayed in a ref nobody read and the stream went on
    with the old weights (the run died much later at a take timeout about staleness)."""
    host = _host(tmp_path)
    host.stream_start(0, 1)
    try:
        host.load = _fail_load
        with pytest.raises(_BucketLost):
            host.take_weights([1, "refs", "specs"])
        with pytest.raises(_BucketLost, match="bucket 3"):
            host.stream_take(1, None, timeout_s=60)
        with pytest.raises(_BucketLost):  # and at the hold of colocated engines
            host.stream_hold(60)
    finally:
        host.stream_stop()


def test_the_driver_reads_the_failed_load_as_one_line_with_its_own_kind(tmp_path):
    """The controller's take (``StreamingPipeline``, in-process workers) raises the load's
    ``WorkerFailedError``: one line naming the load and its error, its kind read from that
    error, so the restart path decides on the real error (a broken collective: restart)."""
    import torch.distributed as dist

    from trainer.loop.cluster.group import WorkerFailedError
    from trainer.loop.cluster.local import LocalHandle
    from trainer.loop.schedule.streaming import StreamingPipeline

    host = _host(tmp_path)

    def broken_collective():
        raise dist.DistBackendError("NCCL error: remote process exited during the weight push")

    pipeline = StreamingPipeline(LocalHandle(host), 1, None, timeout_s=60)
    pipeline.start(1)
    try:
        meta, _ = pipeline.take(1)
        host.load = broken_collective
        pipeline.after_update(1, ["refs", "specs"])
        with pytest.raises(WorkerFailedError) as err:
            pipeline.take(2)
        text = str(err.value)
        assert "\n" not in text
        assert text.startswith("rollout.take_weights (the weights after step 1): worker ")
        assert "DistBackendError: NCCL error: remote process exited" in text
        assert err.value.kind == "collective" and err.value.restartable
    finally:
        host.stream_stop()


# ---------------------------------------------------------------- 6: retry, capped


def test_retry_samples_a_stale_prompt_again_at_most_max_retries_times_then_gives_it_up():
    """Prompt 0's episodes outlast every bound: each attempt samples under the weights of its
    start, then is aborted once newer weights arrive. Before issue 57 it was restarted for
    ever, ahead of every new prompt; now it is tried 1 + 2 times, then dropped, counted, and
    prompt 1 starts."""
    import queue
    import threading

    from rollout.streaming import StreamSampler, VersionedEngine

    engine = VersionedEngine(_Engine())
    sampled: queue.Queue[int] = queue.Queue()
    go = threading.Semaphore(0)

    def sample_group(ordinal):
        request = [GenerationRequest([1], seed=0, group=ordinal)]
        engine.generate(request, SamplingParams())
        sampled.put(ordinal)
        if ordinal == 0:
            assert go.acquire(timeout=30)
            engine.generate(request, SamplingParams())  # aborted: GroupAborted
        return RolloutOutput(rows=[], metrics={}, faults=[])

    sampler = StreamSampler(
        sample_group, engine, workers=1, allowed=lambda: 100, retry=True, max_retries=2
    )
    try:
        for version in (1, 2, 3):  # three attempts of prompt 0, each aborted
            assert sampled.get(timeout=30) == 0
            engine.load(lambda: None, version)  # a weight load, nothing to load
            assert engine.abort_older_than(version) == [0]
            go.release()
        assert sampled.get(timeout=30) == 1  # given up: the stream goes on to new prompts
        assert sampler.take_retries() == (2, 1)
        assert [g.ordinal for g in sampler.take_aborted()] == [0, 0, 0]
    finally:
        sampler.stop()
        go.release()


def test_a_streamed_step_reports_its_retries_and_give_ups(tmp_path):
    host = _host(tmp_path, "train.stale_prompts=retry")
    host.stream_start(0, 1)
    try:
        assert host.stream.max_retries == 2  # train.max_prompt_retries' default
        metrics = host.stream_take(1, None, timeout_s=60)[0]["metrics"]
        assert metrics["stream/groups_retried"] == metrics["stream/groups_given_up"] == 0.0
    finally:
        host.stream_stop()


def test_a_negative_retry_cap_is_refused_in_one_line():
    from trainer.config import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.max_prompt_retries=-1"])
    assert str(err.value).startswith("train.max_prompt_retries: got -1;")
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- 7: one fair queue


def _env_call_on_own_loop(slots, fn, arg, out: dict, timeout_s: float | None = 30.0):
    """A thread running its own event loop (as each streamed group's rollout does) that makes
    one environment call ``fn(arg)`` through ``EnvCalls`` sharing ``slots``; ``out[arg]``
    gets its result or its exception."""
    import asyncio
    import threading

    from rollout.env_calls import EnvCalls

    async def main():
        calls = EnvCalls(4, timeout_s, slots)
        try:
            out[arg] = await calls(fn, arg)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out[arg] = exc
        finally:
            calls.close()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    return thread


def _until(condition, timeout_s: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_shared_env_calls_wait_in_one_queue_and_run_in_arrival_order():
    """One slot, held; three rollouts on threads of their own ask in turn: they queue (no
    polling loop each) and run first come, first served once the slot is free."""
    import threading

    from rollout.env_slots import EnvSlots

    slots, ran, out = EnvSlots(1), [], {}
    holding, free = threading.Event(), threading.Event()

    def step(name):
        ran.append(name)
        if name == "first":
            holding.set()
            free.wait(30)
        return name

    threads = [_env_call_on_own_loop(slots, step, "first", out)]
    _until(holding.is_set)
    for k, name in enumerate(["a", "b", "c"], start=1):
        threads.append(_env_call_on_own_loop(slots, step, name, out))
        _until(lambda k=k: slots.waiting == k)  # queued behind the others, in order
    free.set()
    for thread in threads:
        thread.join(30)
    assert ran == ["first", "a", "b", "c"] and out == {n: n for n in ran}
    assert slots.waiting == 0


def test_a_hung_call_holding_the_only_slot_times_out_and_the_next_one_runs():
    """User code may hang: its time limit (rollout.env_timeout_s) still ends it, and the slot
    it held goes to the call waiting for it."""
    import threading

    from rollout.env_calls import EnvTimeout
    from rollout.env_slots import EnvSlots

    slots, out = EnvSlots(1), {}
    started, never = threading.Event(), threading.Event()

    def step(name):
        if name == "hang":
            started.set()
            never.wait(20)
        return name

    hung = _env_call_on_own_loop(slots, step, "hang", out, timeout_s=0.5)
    _until(started.is_set)
    waiting = _env_call_on_own_loop(slots, step, "next", out, timeout_s=0.5)
    for thread in (hung, waiting):
        thread.join(30)
    never.set()
    assert isinstance(out["hang"], EnvTimeout) and out["next"] == "next"


def test_a_waiter_that_gives_up_leaves_the_queue_and_loses_no_slot():
    import asyncio

    from rollout.env_slots import EnvSlots

    slots = EnvSlots(1)

    async def main():
        await slots.acquire()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(slots.acquire(), 0.1)  # cancelled while queued
        assert slots.waiting == 0
        slots.release()
        await asyncio.wait_for(slots.acquire(), 10)  # the one slot, still there
        slots.release()

    asyncio.run(main())
    with pytest.raises(ValueError, match="rollout.env_concurrency=0"):
        EnvSlots(0)


# ---------------------------------------------------------------- 8: shutdown


class _HeldReplica:
    """An interruptible engine whose calls run until interrupted (a long decode); counts the
    calls in flight."""

    interruptible = True

    def __init__(self) -> None:
        import threading

        self.lock, self.in_flight, self.calls = threading.Lock(), 0, 0

    def generate(self, requests, sampling, interrupt=None):
        import time

        with self.lock:
            self.in_flight += 1
            self.calls += 1
        try:
            deadline = time.monotonic() + 60
            while not (interrupt is not None and interrupt()) and time.monotonic() < deadline:
                time.sleep(0.01)
            return [GenerationResult([4], [0.0], "interrupted") for _ in requests]
        finally:
            with self.lock:
                self.in_flight -= 1


def test_shutdown_stops_the_calls_in_flight_and_joins_the_threads_before_the_engine_goes(
    tmp_path,
):
    """Half the groups are in an engine call that runs until interrupted, half in an
    environment call that hangs (no rollout.env_timeout_s). Shutdown ends both and joins every
    stream thread before the engine host releases the engine; before issue 57 it only set a
    flag, and the threads went on calling an engine already released (workers sharing one
    process)."""
    import asyncio
    import threading

    from rollout.env_calls import EnvCalls

    replica, hang, released = _HeldReplica(), threading.Event(), []
    in_env = threading.Semaphore(0)

    class Base:
        def shutdown(self):  # the engine host's: releases the engine
            released.append(replica.in_flight)

    def hanging_tool(ordinal):
        in_env.release()
        hang.wait(60)
        return ordinal

    class Host(type(_host(tmp_path)), Base):
        def _sample(self, ordinal, items, engine, env_slots=None):
            if ordinal % 2:
                calls = EnvCalls(4, None, env_slots)
                try:
                    asyncio.run(calls(hanging_tool, ordinal))
                finally:
                    calls.close()
            else:
                engine.generate([GenerationRequest([1], seed=0, group=ordinal)], SamplingParams())
            return RolloutOutput(rows=[], metrics={}, faults=[])

    host = Host()
    host.generator = replica
    host.stream_start(0, 1)  # 2 prompts a step, s = 1: 4 groups in flight
    try:
        _until(lambda: replica.in_flight == 1)  # groups 0 and 2 share one engine call
        for _ in range(2):
            assert in_env.acquire(timeout=30)
        threads = list(host.stream._threads)
        assert len(threads) == 4 and all(t.is_alive() for t in threads)
        host.shutdown()
        assert released == [0]  # no engine call in flight when the engine was released
        assert not any(t.is_alive() for t in threads)
        assert host.stream.error is None  # stopping is not the run's error
        with pytest.raises(Exception, match="closed"):  # nothing new starts
            host.versioned.generate([GenerationRequest([1], seed=0, group=9)], SamplingParams())
    finally:
        hang.set()
        host.stream_stop()


def test_a_call_that_cannot_be_interrupted_is_waited_for_within_the_bound(tmp_path, capsys):
    """An engine call that cannot be interrupted (another replica's) and outlasts the bound:
    shutdown returns at the bound anyway, naming the threads still running, in one line."""
    import threading

    gate = threading.Event()

    class Stuck:
        def generate(self, requests, sampling):
            gate.wait(60)
            return [GenerationResult([1], [0.0], "length") for _ in requests]

    host = _host(tmp_path, engine=Stuck())
    host.stream_start(0, 1)
    try:
        _until(lambda: any(lane.server.running() for lane in host.versioned._lanes))
        late = host.stream_shutdown(timeout_s=0.5)
        assert late and all(name.startswith("stream-") for name in late)
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "still in a call 0.5 s after shutdown" in err
    finally:
        gate.set()
        host.stream_stop()
