"""The accelerator path, right by construction, shown on the CPU: gradients stay sharded
through accumulation, the step boundary hands the devices over one stage at a time, and a
streamed weight push never lets an engine read a bucket a tp peer is still writing.

Each runs the shipped code: ``PolicyWorker`` over gloo in spawned processes, the controller
with recording engine hosts, ``EngineHost.load_weight_stream`` with a recording engine.
"""

from __future__ import annotations

import queue as queue_module
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.multiprocessing as mp

from rollout.engines.base import Engine
from rollout.engines.weights.buckets import plan_buckets, stream_buckets, weight_group
from tests.gloo_ranks import report_and_finish
from trainer.loop.cluster.group import free_port
from trainer.loop.cluster.local import LocalRef

JOB = [
    "device=cpu",
    "model.path=builtin:tiny",
    "model.dtype=float32",
    "seed=1",
    "run.deterministic=false",
    "algorithm.kl_coef=0.0",
    "algorithm.use_kl_loss=false",
]


def _spawn(target, world: int, *args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, queue, *args)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict = {}
    deadline = time.monotonic() + 300
    while len(out) < world:  # a rank that dies fails the test at once, not at the deadline
        assert time.monotonic() < deadline, "ranks did not answer in 300 s"
        try:
            rank, value = queue.get(timeout=1)
            out[rank] = value
        except queue_module.Empty:  # look at the processes again
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a rank process exited with {dead}"
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    return out


# ------------------------------------------------------------------ 1. gradient memory


def _accumulate(rank: int, world: int, port: int, queue) -> None:
    from tests.test_trainer_dp_invariance import _recorded_batch
    from trainer.config import load_config
    from trainer.loop.ranks.fsdp_worker import WorkerSpec, held_gradient_bytes
    from trainer.loop.ranks.policy import PolicyWorker

    torch.set_num_threads(1)
    cfg = load_config(None, [*JOB, f"train.dp_size={world}"])
    worker = PolicyWorker(WorkerSpec(role="actor", rank=rank, cfg=cfg))
    worker.setup("127.0.0.1", port)
    arrays = _recorded_batch().to_numpy()
    worker.load_batch([arrays])
    worker.compute_advantages()
    rows = list(range(rank, worker.batch.num_rows, world))
    micro_batches = [rows[i::3] for i in range(3)]  # three micro-batches: two accumulations
    param_bytes = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * 4
        for p in worker.model.parameters()
    )
    held = []
    build = worker.micro_batch

    def recording(rows_):  # called before each micro-batch's forward: the previous backward's
        held.append(held_gradient_bytes(worker.model))
        return build(rows_)

    worker.micro_batch = recording
    worker.train_mini_batch(micro_batches, list(range(worker.batch.num_rows)))
    after_update = held_gradient_bytes(worker.model)
    worker.end_of_step([])
    after_offload = held_gradient_bytes(worker.model)
    # The defect this guards against, measured by the same accounting: sync off keeps whole
    # gradients beside the shards.
    worker.model.set_requires_gradient_sync(False)
    worker.micro_batch = build
    loss, _ = worker_loss(worker, micro_batches[0])
    (loss * world).backward()
    unsynced = held_gradient_bytes(worker.model)
    worker.model.set_requires_gradient_sync(True)
    report_and_finish(queue, (rank, (param_bytes, held, after_update, after_offload, unsynced)))


def worker_loss(worker, rows):
    from batching import loss_normalizers
    from trainer.loop.ranks.policy import actor_micro_batch_loss

    norm = loss_normalizers(worker.batch, list(range(worker.batch.num_rows)))
    mb = worker.micro_batch(rows)
    return actor_micro_batch_loss(worker.model, mb, norm, worker.spec.cfg, worker.device)


@pytest.mark.slow
def test_gradients_stay_sharded_through_accumulation():
    out = _spawn(_accumulate, 2)
    for rank, (param_bytes, held, after_update, after_offload, unsynced) in out.items():
        assert len(held) == 3
        assert held[0] == {"sharded": 0, "unsharded": 0}  # zeroed before the first
        for seen in held[1:]:  # after one and two backward passes
            assert seen["unsharded"] == 0, (rank, seen)
            assert seen["sharded"] == param_bytes  # each rank's shards: half the model
        assert after_update["unsharded"] == 0
        assert after_offload == {"sharded": 0, "unsharded": 0}  # freed before the push
        # With sync off, the whole fp32 gradient of every parameter sits on each rank.
        assert unsynced["unsharded"] >= 2 * param_bytes * 0.95, (rank, unsynced)


# ------------------------------------------------------------------ 3 and 5. streamed push


class RecordingEngine(Engine):
    """Loads nothing; records, per bucket, what each tp worker read from its own rank's slot
    (as vLLM's per-device workers do), copied out at the moment of reading."""

    def __init__(self) -> None:
        self.read: dict[str, list] = {}
        self.finished = 0
        self.calls = 0

    def generate(self, requests, sampling):
        raise NotImplementedError

    def update_weights(self, named_tensors):
        raise NotImplementedError

    def load_shared_bucket(self, open_bucket, handles, specs) -> None:
        from rollout.engines.weights.buckets import unpack_bucket

        self.calls += 1
        for handle in handles:  # tp worker t reads tp rank t's copy
            for name, view in unpack_bucket(open_bucket(handle), specs):
                # numpy: a torch tensor crosses the test's queue as shared memory that dies
                # with the rank's process
                self.read.setdefault(name, []).append(view.numpy().copy())

    def finish_weight_update(self) -> None:
        self.finished += 1


class ThreadHandle:
    """An engine host seen like a Ray actor handle whose calls run in a thread of their own:
    ``.remote`` returns at once, as Ray's does (a blocking call would deadlock the stream)."""

    def __init__(self, target) -> None:
        self._target = target
        self._pool = ThreadPoolExecutor(max_workers=1)

    def __getattr__(self, name):
        target, pool = self._target, self._pool

        class _Method:
            @staticmethod
            def remote(*args):
                future = pool.submit(getattr(target, name), *args)
                ref = _FutureRef()
                ref.future = future
                return ref

        return _Method


class _FutureRef(LocalRef):
    __slots__ = ("future",)

    def result(self):
        return self.future.result(timeout=120)

    def done(self) -> bool:
        """Whether the call has ended (the push watches its engine's reply)."""
        return self.future.done()


def _stream(rank: int, world: int, port: int, queue, bucket_bytes: int, delay_s: float) -> None:
    import rollout.engines.weights.buckets as buckets_mod
    from trainer.config import load_config
    from trainer.loop.engines.engine_host import EngineHost
    from trainer.loop.ranks.fsdp_worker import WorkerSpec
    from trainer.loop.ranks.policy import PolicyWorker
    from trainer.loop.weights.weight_push import full_state

    torch.set_num_threads(1)
    # tp 2 is a vLLM layout; the engine here is a recording one, so vLLM need not be installed
    tp2 = [f"train.dp_size={world}", f"rollout.tensor_parallel_size={world}", "rollout.engine=vllm"]
    cfg = load_config(None, [*JOB, *tp2], check_environment=False)
    worker = PolicyWorker(WorkerSpec(role="actor", rank=rank, cfg=cfg))
    worker.setup("127.0.0.1", port)
    with torch.no_grad():  # distinct weights, so a stale slot would show
        for p in worker.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(0.25 * (rank + 1))
    if rank == 1 and delay_s:  # the tp peer is slow to fill each bucket
        pack = buckets_mod.pack_tensor

        def slow_pack(flat, spec, tensor):
            time.sleep(delay_s)
            pack(flat, spec, tensor)

        buckets_mod.pack_tensor = slow_pack  # what the push imports when it runs
    host = engine = None
    if rank == 0:
        host = EngineHost(cfg)
        host.engine = engine = RecordingEngine()
        host = ThreadHandle(host)
    sent = worker.push_weights_streamed(host, bucket_bytes)
    # what the push carries: the state, a tied LM head under the embedding's name only
    expected = {n: t.detach().numpy().copy() for n, t in full_state(worker.push_state())}
    result = None
    if rank == 0:
        result = {
            "sent": sent,
            "calls": engine.calls,
            "finished": engine.finished,
            "read": engine.read,
            "expected": expected,
        }
    report_and_finish(queue, (rank, (sent, result)))


@pytest.mark.slow
@pytest.mark.parametrize("bucket_bytes", [1 << 40, 64 << 10])  # one bucket; many, two slots
def test_streamed_push_waits_for_every_tp_rank(bucket_bytes):
    out = _spawn(_stream, 2, bucket_bytes, 0.002)
    sent1, _ = out[1]
    sent0, rec = out[0]
    assert sent1 == 0 and sent0 == rec["calls"] >= 1
    if bucket_bytes > 1 << 30:
        assert sent0 == 1  # the whole model in one bucket: one engine call, one read
    else:
        assert sent0 > 2  # slots were reused: each only after the engine had read it
    assert rec["finished"] == 1  # finished once, within the same call
    assert set(rec["read"]) == set(rec["expected"])
    for name, want in rec["expected"].items():
        from_rank0, from_rank1 = rec["read"][name]
        # Both tp workers read the full weights, each from its own rank's slot, complete.
        assert (from_rank0 == want).all() and (from_rank1 == want).all(), name


def test_bucket_plan_keeps_each_layer_whole():
    shapes = [
        ("model.embed_tokens.weight", (64, 8)),
        *[(f"model.layers.{i}.{w}.weight", (8, 8)) for i in range(3) for w in ("q", "k", "v")],
        ("model.norm.weight", (8,)),
    ]
    buckets, _ = plan_buckets(shapes, torch.float32, bucket_bytes=4 * 8 * 8 * 4)
    for bucket in buckets:
        layers = {weight_group(s.name) for s in bucket}
        for layer in layers:
            whole = [n for n, _ in shapes if weight_group(n) == layer]
            assert whole == [s.name for s in bucket if weight_group(s.name) == layer]
    assert weight_group("model.layers.12.mlp.up_proj.weight") == "model.layers.12"
    assert weight_group("lm_head.weight") == "lm_head.weight"


def test_stream_buckets_fit_the_free_memory():
    gib = 1 << 30
    # 1.5B in bf16 (3.1 GB) on a card with 40 GB free: the whole model in one bucket.
    assert stream_buckets(
        3 * gib, 40 * gib, engine_bytes=3 * gib, reserve_bytes=2 * gib, floor_bytes=gib // 8
    ) == (3 * gib, 1)
    # Too little room for all of it: two slots of half the room each.
    bucket, slots = stream_buckets(
        15 * gib, 20 * gib, engine_bytes=8 * gib, reserve_bytes=2 * gib, floor_bytes=gib // 4
    )
    assert slots == 2 and bucket == 5 * gib
    # Never below the largest layer, which a bucket holds whole.
    assert stream_buckets(
        15 * gib, 9 * gib, engine_bytes=8 * gib, reserve_bytes=2 * gib, floor_bytes=gib // 2
    ) == (gib // 2, 2)


# ------------------------------------------------------------------ 2. step-boundary order


@pytest.mark.slow
def test_step_boundary_hands_over_one_stage_at_a_time(tmp_path, monkeypatch):
    """The ranks offload before any engine weight wakes, and the KV cache wakes only after
    the push has finished; the engines drop their weights at sleep (the push overwrites
    them). In one process every call runs when the controller makes it, so the recorded
    order is the controller's, which waits for each stage before starting the next."""
    from trainer.config import load_config
    from trainer.loop.engines.engine_host import EngineHost
    from trainer.loop.ranks.fsdp_worker import FSDPWorker
    from trainer.loop.start.run import run_training

    events: list[str] = []

    def record(cls, name, label):
        original = getattr(cls, name)

        def wrapper(self, *args):
            events.append(label(self, *args))
            return original(self, *args)

        monkeypatch.setattr(cls, name, wrapper)

    record(FSDPWorker, "offload_states", lambda self: f"offload {self.spec.role}")
    record(EngineHost, "sleep", lambda self, discard=False: f"sleep discard={discard}")
    record(EngineHost, "wake_up", lambda self, tags=None: f"wake {','.join(tags or ['all'])}")
    # An engine in the trainer's process loads the rank's tensors here, waking its weights.
    record(EngineHost, "load_weights", lambda self, named: "push")
    overrides = [
        "train.batch_size=2",
        "train.mini_batch_size=2",
        "rollout.n=2",
        "train.total_steps=1",
        "algorithm.kl_coef=0.01",  # a reference model too: every role offloads first
        f"run.dir={tmp_path / 'run'}",
    ]
    assert run_training(load_config(None, overrides)) == 0
    step = events[events.index("sleep discard=True") :]
    assert step == [
        "sleep discard=True",
        "offload actor",
        "offload reference",
        "push",
        "wake kv_cache",
    ], events


# ------------------------------------------------------------------ 7. NPU engine options


@pytest.mark.parametrize("backend_name", ["cuda", "npu"])
def test_engine_host_builds_vllm_with_the_devices_options(monkeypatch, backend_name):
    """On Ascend the engine asks vllm-ascend for the extra sleep cleanup (its sleep otherwise
    frees only its own allocator's memory), ND weights and no CPU binding, spelled for the
    installed release; both reload weights layer by layer (vLLM's layerwise reload, which
    vllm-ascend's own RL path also runs from 0.26.0rc1: ``hal.npu_versions``)."""
    import hal
    import rollout.engines
    from trainer.config import load_config
    from trainer.loop.engines.engine_host import EngineHost

    backend = hal.backend_class(backend_name)()
    built = {}
    monkeypatch.setattr(hal, "get_backend", lambda name="auto": backend)
    monkeypatch.setattr(
        rollout.engines, "make_engine", lambda name, model, tok=None, **kw: built.update(kw)
    )
    import hal.npu

    monkeypatch.setattr(hal.npu, "installed_version", lambda name: "0.26.0rc1")  # the pinned one
    cfg = load_config(None, [*JOB, "rollout.engine=vllm"], check_environment=False)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)  # the host sets it: restored after
    EngineHost(cfg).setup()
    assert built["layerwise_reload"] is True
    assert built["enable_sleep_mode"] is True
    options = built["engine_kwargs"]
    # the default rollout.engine_log_level (error) also turns the weights' progress bar off
    assert options.pop("use_tqdm_on_load") is False
    if backend_name == "cuda":
        assert options == {}
    else:
        # 0.26.0rc1 reads the top-level key and ignores rl_config (hal/npu_versions.py)
        extra = options["additional_config"]
        assert extra == {
            "enable_sleep_mode_extra_cleanup": True,
            "weight_nz_mode": 0,
            "enable_cpu_binding": False,
        }
