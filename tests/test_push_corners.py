"""The streamed weight push's corners (issue 32, item 4), each through the shipped push:

(a) an engine that keeps what it was handed past a bucket or chunk (vLLM's layerwise reload
    holds a padded parameter until ``finalize``) still gets the right weights when a later
    bucket refills its slot (the streamed push) or a later chunk its buffer (vLLM's transfer
    API, ``push_transfer``);
(b) an engine that fails mid-stream fails the push at once with its own error, and a rank's
    failure stops the engine's wait (the doorbell's ``abort``);
(c) the mappings and files a push opens go with it: many pushes, the same few live;
(d) the doorbell orders its counters with a file lock, which two processes ring many times.

The training side is a real ``PolicyWorker`` (one rank, tp 1, the tiny model) pushing to an
``EngineHost`` whose calls run in a thread, as a Ray actor's run in its own process.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.multiprocessing as mp

import hal
from hal.shm import SharedCounters
from rollout.engines.base import WAKE_TAGS, Engine
from rollout.engines.weights.stream import RANK, Doorbell, PushAborted, receive_weight_stream
from trainer.loop.cluster.local import LocalRef

JOB = [
    "device=cpu",
    "model.path=builtin:tiny",
    "model.dtype=float32",
    "seed=1",
    "run.deterministic=false",
    "train.dp_size=1",
    "rollout.engine=vllm",  # an EngineHost whose engine the tests set: vLLM is not needed
]
#: Bytes per bucket: the tiny model's embedding, each layer and the head in buckets of their
#: own, so the push runs in two slots and bucket 2 refills bucket 0's.
SMALL_BUCKET_BYTES = 64 << 10


class _FutureRef(LocalRef):
    """The reply of a call running in a thread: ``done()`` says whether it has ended."""

    __slots__ = ("future",)

    def result(self):
        return self.future.result(timeout=120)

    def done(self) -> bool:
        return self.future.done()


class ThreadHandle:
    """An engine host called like a Ray actor handle: ``.remote`` returns at once and the call
    runs in a thread of its own (a blocking call would deadlock the stream)."""

    def __init__(self, target) -> None:
        self._target = target
        self._pool = ThreadPoolExecutor(max_workers=1)

    def __getattr__(self, name):
        target, pool = self._target, self._pool

        class _Method:
            @staticmethod
            def remote(*args):
                ref = _FutureRef()
                ref.future = pool.submit(getattr(target, name), *args)
                return ref

        return _Method


@pytest.fixture(scope="module")
def worker():
    from trainer.config import load_config
    from trainer.loop.cluster.group import free_port
    from trainer.loop.ranks.fsdp_worker import WorkerSpec
    from trainer.loop.ranks.policy import PolicyWorker

    cfg = load_config(None, JOB, check_environment=False)
    policy = PolicyWorker(WorkerSpec(role="actor", rank=0, cfg=cfg))
    policy.setup("127.0.0.1", free_port())
    with torch.no_grad():  # distinct values everywhere, so a stale or refilled slot shows
        for i, p in enumerate(policy.model.parameters()):
            p.copy_(torch.randn_like(p) + i)
    yield policy
    policy.shutdown()


def _host(worker, engine: Engine) -> ThreadHandle:
    from trainer.loop.engines.engine_host import EngineHost

    host = EngineHost(worker.spec.cfg)
    host.engine = engine
    return ThreadHandle(host)


def _expected(worker) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in worker.model.state_dict().items()}


def _pushed(worker) -> dict[str, torch.Tensor]:
    """What a push sends: the tiny model's tied LM head is its embedding, pushed once."""
    return {n: t for n, t in _expected(worker).items() if n in worker.push_state()}


# ------------------------------------------------------------------ (a) deferred loading


class FakeVllmModel:
    """vLLM's model as its layerwise reload (0.32.0, ``model_loader/reload/layerwise.py``)
    treats it: while a reload is open, each parameter's loader keeps what it is handed, by
    reference (``info.loaded_weights``), until its module has every element, then copies;
    the embedding and the head are padded to a multiple of 64 rows (vLLM's
    ``VocabParallelEmbedding``), so they never complete and wait for ``finalize``."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        def padded(name, shape):
            vocab = name.endswith(("embed_tokens.weight", "lm_head.weight"))
            return (-(-shape[0] // 64) * 64, *shape[1:]) if vocab else shape

        self.params = {n: torch.zeros(padded(n, s)) for n, s in shapes.items()}
        self.held: dict[str, list[tuple[str, torch.Tensor]]] = {}
        self.deferring = False
        self.finalized_padded = 0

    @staticmethod
    def module(name: str) -> str:
        return name.rsplit(".", 1)[0]

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            if not self.deferring:
                self._copy(name, tensor)
                continue
            module = self.module(name)
            self.held.setdefault(module, []).append((name, tensor))
            have = sum(t.numel() for _, t in self.held[module])
            want = sum(p.numel() for n, p in self.params.items() if self.module(n) == module)
            if have >= want:
                self._process(module)

    def _copy(self, name: str, tensor: torch.Tensor) -> None:
        self.params[name][: tensor.shape[0]].copy_(tensor)

    def _process(self, module: str) -> None:
        for name, tensor in self.held.pop(module):
            self._copy(name, tensor)

    def finalize(self) -> None:
        self.finalized_padded = len(self.held)
        for module in list(self.held):
            self._process(module)
        self.deferring = False


class FakeLLM:
    """``vllm.LLM``'s weight-transfer calls as vLLM's worker runs them for a checkpoint-format
    update, with crossrl's ``crossrl_shm`` engine receiving (``shm_transfer.load_chunk``):
    ``start_weight_update`` opens the layerwise reload, each ``update_weights`` loads one
    chunk, ``finish_weight_update`` finalizes."""

    def __init__(self, model: FakeVllmModel) -> None:
        self.model, self.chunks = model, 0

    def start_weight_update(self) -> None:
        self.model.deferring = True

    def update_weights(self, request: dict) -> None:
        from rollout.engines.weights.shm_transfer import SharedUpdateInfo, load_chunk

        load_chunk(SharedUpdateInfo(**request["update_info"]), self.model.load_weights)
        self.chunks += 1

    def finish_weight_update(self) -> None:
        self.model.finalize()

    def reset_prefix_cache(self) -> None:
        pass


def _vllm_engine(model: FakeVllmModel):
    """The shipped ``VLLMEngine`` (its ``VLLMTransfer`` calls) around ``FakeLLM``."""
    from rollout.engines.vllm.engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.llm, engine.layerwise_reload, engine.in_process = FakeLLM(model), True, True
    engine.sleep_mode, engine._awake, engine.adapter = False, set(WAKE_TAGS), None
    engine._updating = engine._weights_discarded = False
    return engine


def test_a_deferring_engine_gets_the_right_weights_from_a_refilled_buffer(worker):
    """The colocated vLLM push (``WeightPush.push_transfer`` through ``crossrl_shm``) in
    chunks of one buffer, refilled chunk after chunk, into an engine that holds what it is
    handed until a layer is whole and the padded vocabulary until it finalizes."""
    want = _pushed(worker)
    model = FakeVllmModel({n: tuple(t.shape) for n, t in want.items()})
    engine = _vllm_engine(model)
    sent = worker.push_transfer([_host(worker, engine)], SMALL_BUCKET_BYTES)
    assert sent > 2 and engine.llm.chunks == sent  # one buffer, refilled
    assert model.finalized_padded == 1  # the embedding (the tied head too) waited for it
    assert not model.deferring
    for name, tensor in want.items():
        got = model.params[name][: tensor.shape[0]]
        assert torch.equal(got, tensor), name
    from hal import shm

    assert not any("crossrl-weights" in path for path in shm._MAPPED)  # nothing left mapped


def test_the_hf_engine_gets_the_right_weights_from_two_slots(worker):
    """The HF engine copies each tensor as it loads it, so it needs no copy of its own."""
    from rollout.engines import make_engine
    from rollout.tokenizer import load_tokenizer

    engine = make_engine("hf", "builtin:tiny", load_tokenizer("builtin"), seed=1)
    assert worker.push_weights_streamed(_host(worker, engine), SMALL_BUCKET_BYTES) > 2
    want = _expected(worker)
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, want[name].to(tensor.dtype)), name


# ------------------------------------------------------------------ (b) a side that fails


class FailingEngine(Engine):
    """Reads buckets, and fails on the second, as an engine that raises mid-stream does."""

    def __init__(self) -> None:
        self.buckets = 0

    def generate(self, requests, sampling):
        raise NotImplementedError

    def update_weights(self, named_tensors):
        raise NotImplementedError

    def load_shared_bucket(self, open_bucket, handles, specs) -> None:
        self.buckets += 1
        if self.buckets == 2:
            raise RuntimeError("engine fell over on bucket 2")


def test_an_engine_error_fails_the_push_at_once_with_its_message(worker, monkeypatch):
    import rollout.engines.weights.stream as stream

    # Were the engine's reply not watched, the push would wait out this and report a timeout.
    monkeypatch.setattr(stream, "STREAM_TIMEOUT_S", 60.0)
    with pytest.raises(RuntimeError, match="engine fell over on bucket 2"):
        worker.push_weights_streamed(_host(worker, FailingEngine()), SMALL_BUCKET_BYTES)


def test_a_ray_reply_is_watched_without_waiting():
    """tp rank 0's check on a Ray reply (``ray.wait`` with a zero timeout): nothing when the
    call ended well, the call's own error once it failed."""
    import ray

    from trainer.loop.cluster.group import start_ray
    from trainer.loop.weights.weight_push import _raise_if_ended

    started = start_ray(None, num_cpus=1)
    try:

        @ray.remote(num_cpus=0)
        def engine_call(fail: bool) -> int:
            if fail:
                raise RuntimeError("engine fell over mid-stream")
            return 3

        ok = engine_call.remote(False)
        ray.get(ok)
        _raise_if_ended(ok)  # ended well: nothing to raise
        failed = engine_call.remote(True)
        with pytest.raises(Exception, match="engine fell over mid-stream"):
            for _ in range(60_000):  # until the call has ended (about 60 s at most)
                _raise_if_ended(failed)
                threading.Event().wait(1e-3)
    finally:
        if started:
            ray.shutdown()


def test_a_ranks_failure_stops_the_engine_and_the_engine_stops_the_ranks():
    bell, handle = Doorbell.create(2)
    cpu = hal.get_backend("cpu")
    buf, slot = cpu.shared_buffer(64)
    try:
        bell.ring(0, 1)  # tp rank 0 wrote bucket 1; tp rank 1 fails before writing it
        bell.abort(RANK)
        with pytest.raises(PushAborted, match="a training rank failed"):
            receive_weight_stream(
                FailingEngine(), hal.open_shared_buffer, [[slot, slot]], handle, [[]] * 2
            )
        # The engine's own failure, once noticed, names the side that failed first.
        other, other_handle = Doorbell.create(1)
        other.ring(0, 4)
        with pytest.raises(RuntimeError, match="bucket 2"):
            receive_weight_stream(
                FailingEngine(), hal.open_shared_buffer, [[slot]], other_handle, [[]] * 4
            )
        with pytest.raises(PushAborted, match="the engine failed"):  # a rank waiting to reuse
            other.wait(other.read, 4, "the engine to read", timeout_s=60.0)
        other.close()
        Doorbell.release(other_handle)
    finally:
        bell.close()
        Doorbell.release(handle)
        cpu.release_shared_buffer(slot)
        del buf


# ------------------------------------------------------------------ (c) mappings and files


class CopyingEngine(Engine):
    """Copies each bucket out of its slot, as the HF engine does."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def generate(self, requests, sampling):
        raise NotImplementedError

    def update_weights(self, named_tensors):
        for name, tensor in named_tensors:
            self.weights[name] = tensor.clone()


def _live_push_files() -> tuple[int, int]:
    """This process's mappings and open descriptors of crossrl's shared-memory files."""
    gc.collect()
    with open("/proc/self/maps") as maps:
        mapped = sum("crossrl-" in line for line in maps)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            fds += "crossrl-" in os.readlink(f"/proc/self/fd/{fd}")
    return mapped, fds


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts through /proc (Linux)")
def test_pushes_leave_no_mappings_behind(worker):
    engine = CopyingEngine()
    host = _host(worker, engine)
    before = _live_push_files()
    seen = []
    for _ in range(5):
        assert worker.push_weights_streamed(host, SMALL_BUCKET_BYTES) > 2  # two slots
        seen.append(_live_push_files())
    assert seen == [before] * 5, (before, seen)  # five pushes, nothing left by any
    for name, tensor in _pushed(worker).items():
        assert torch.equal(engine.weights[name], tensor), name


def test_a_reader_never_maps_a_released_buffer_as_fresh_zeros():
    cpu = hal.get_backend("cpu")
    buf, handle = cpu.shared_buffer(64)
    cpu.release_shared_buffer(handle)  # the writer let go before anyone mapped it
    with pytest.raises(FileNotFoundError, match="writer released it"):
        hal.open_shared_buffer(handle)
    assert not os.path.exists(handle[1])
    del buf


def test_the_mapping_cache_is_bounded():
    from hal import shm

    cpu = hal.get_backend("cpu")
    made = [cpu.shared_buffer(64) for _ in range(shm.MAX_MAPPINGS + 8)]
    try:
        for _, handle in made:  # a reader that never closes
            hal.open_shared_buffer(handle)
        assert len(shm._MAPPED) <= shm.MAX_MAPPINGS
    finally:
        for _, handle in made:
            cpu.release_shared_buffer(handle)


# ------------------------------------------------------------------ (d) the doorbell


def _ring_many(handle, slot, rings, queue) -> None:
    """A tp rank: write ``k`` into every byte-quad of the slot, ring ``k``, wait to reuse."""
    try:
        bell = Doorbell.open(handle)
        data = hal.open_shared_buffer(slot).view(torch.int32)
        for k in range(1, rings + 1):
            bell.wait(bell.read, k - 1, "the reader", timeout_s=120.0)
            data.fill_(k)
            bell.ring(0, k)
        bell.close()
        queue.put("ok")
    except Exception as err:  # noqa: BLE001 - reported to the test
        queue.put(repr(err))


def test_two_processes_ring_the_doorbell_many_times():
    rings = 2000
    bell, handle = Doorbell.create(1)
    cpu = hal.get_backend("cpu")
    buf, slot = cpu.shared_buffer(4096)
    data = buf.view(torch.int32)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_ring_many, args=(handle, slot, rings, queue))
    proc.start()
    try:
        for k in range(1, rings + 1):
            bell.wait(bell.ready, k, "the writer", timeout_s=120.0)
            # Once the ring is seen, the bytes written before it are too: all k, none stale.
            assert int(data.min()) == int(data.max()) == k
            bell.mark_read(k)
        assert queue.get(timeout=120) == "ok"
    finally:
        proc.join(timeout=60)
        bell.close()
        Doorbell.release(handle)
        cpu.release_shared_buffer(slot)


def test_a_ring_waits_for_the_doorbells_lock():
    """Every access takes the file's lock (what orders it on aarch64): a ring made while the
    lock is held elsewhere (another open file, as another process's is) lands only once it
    is let go."""
    bell, handle = Doorbell.create(1)
    try:
        with open(handle[0], "rb") as other:
            fcntl.flock(other, fcntl.LOCK_EX)
            ringer = threading.Thread(target=bell.ring, args=(0, 7))
            ringer.start()
            ringer.join(timeout=0.5)
            blocked = ringer.is_alive()
            fcntl.flock(other, fcntl.LOCK_UN)
        ringer.join(timeout=120)
        assert blocked  # it waited for the lock, rather than writing past it
        assert bell.ready() == 7
    finally:
        bell.close()
        Doorbell.release(handle)


def test_shared_counters_round_trip_across_handles():
    counters = SharedCounters.create(3)
    other = SharedCounters.open(counters.path, 3)
    try:
        other.set(2, -5)
        counters.set(0, 1 << 40)
        assert counters.values() == other.values() == [1 << 40, 0, -5]
    finally:
        other.close()
        counters.close()
        counters.unlink()
    assert not os.path.exists(counters.path)
    with pytest.raises(FileNotFoundError, match="are gone"):
        SharedCounters.open(counters.path, 3)
