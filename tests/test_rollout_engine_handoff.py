"""What colocated engine replicas rely on, without Ray: requests dealt by prompt, sleep / wake
of the HF engine, weight buckets handed to another process in shared memory (and, where a GPU
is, in device memory through an IPC handle), and the device-free parts of starting a tp > 1 replica on an accelerator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hal
from rollout.engines import GenerationRequest, GenerationResult, SamplingParams, make_engine
from rollout.engines.serving.router import ReplicaRouter
from rollout.engines.vllm.engine import executor_backend
from rollout.engines.weights.buckets import TensorSpec, pack_tensor, plan_buckets, unpack_bucket

ROOT = Path(__file__).resolve().parents[1]


class _Recorder:
    """A fake replica: answers each request with its own seed, remembers what it got."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def generate(self, requests, sampling):
        self.seen += [r.group for r in requests]
        return [GenerationResult([r.seed], [0.0], "length") for r in requests]


def test_router_keeps_a_prompt_on_one_replica_and_results_in_order():
    replicas = [_Recorder(), _Recorder(), _Recorder()]
    router = ReplicaRouter(replicas)
    # 4 samples of prompts 10..15, interleaved as the agent loop may send them
    requests = [
        GenerationRequest([1], seed=100 * g + k, group=g) for k in range(4) for g in range(10, 16)
    ]
    for _turn in range(2):
        results = router.generate(requests, SamplingParams())
        assert [r.token_ids[0] for r in results] == [r.seed for r in requests]
    for i, rep in enumerate(replicas):
        # every sample of a prompt, on every turn, went to the replica the prompt index names
        assert set(rep.seen) == {g for g in range(10, 16) if g % 3 == i}
        assert len(rep.seen) == 2 * 4 * 2
    router.shutdown()


def _tiny_engine():
    from rollout.tokenizer import load_tokenizer

    return make_engine("hf", "builtin:tiny", load_tokenizer("builtin"), seed=1)


def test_hf_engine_sleeps_and_wakes_weights_before_kv_cache():
    engine = _tiny_engine()
    request = [GenerationRequest([5, 6, 7], seed=3)]
    sampling = SamplingParams(max_new_tokens=3)
    before = engine.generate(request, sampling)
    assert engine.awake_tags == ("weights", "kv_cache")
    engine.sleep()
    assert engine.awake_tags == ()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(request, sampling)
    state = {n: t.clone() for n, t in engine.model.state_dict().items()}
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.update_weights(state.items())
    engine.wake_up(["weights"])  # the sync loads weights now; generation still waits
    engine.update_weights(state.items())
    with pytest.raises(RuntimeError, match="kv_cache asleep"):
        engine.generate(request, sampling)
    engine.wake_up(["kv_cache"])
    assert engine.generate(request, sampling)[0].token_ids == before[0].token_ids
    with pytest.raises(ValueError, match="use some of"):
        engine.wake_up(["everything"])


_READER = """
import pickle, sys, torch, hal
from rollout.engines.weights.buckets import TensorSpec, unpack_bucket
handle = pickle.loads(bytes.fromhex(sys.argv[1]))
specs = [TensorSpec(*s) for s in eval(sys.argv[2])]
flat = hal.open_shared_buffer(handle)
for name, t in unpack_bucket(flat, specs):
    print(name, t.double().sum().item(), tuple(t.shape), t.dtype, t.device.type)
"""


@pytest.mark.parametrize(
    "device",
    [
        "cpu",  # a shared-memory file
        # device memory through an IPC handle: the streamed push at tp 1
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
            ],
        ),
    ],
)
def test_bucket_reaches_another_process_through_shared_memory(device):
    import pickle

    backend = hal.get_backend(device)
    tensors = {"a.weight": torch.randn(3, 5), "b.bias": torch.arange(7.0), "c": torch.ones(2, 2)}
    buckets, nbytes = plan_buckets(
        ((n, t.shape) for n, t in tensors.items()), torch.bfloat16, bucket_bytes=1 << 20
    )
    assert len(buckets) == 1
    buf, handle = backend.shared_buffer(nbytes)
    specs = repr([tuple(s) for s in buckets[0]])
    try:
        for spec in buckets[0]:
            pack_tensor(buf, spec, tensors[spec.name].to(buf.device))  # the engine's dtype
        backend.synchronize()
        out = subprocess.run(
            [sys.executable, "-c", _READER, pickle.dumps(handle).hex(), specs],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=True,
        ).stdout.split("\n")
    finally:
        backend.release_shared_buffer(handle)
    for line, (name, t) in zip(out, tensors.items()):
        got_name, total, *_, where = line.split()
        assert got_name == name and where == buf.device.type  # mapped, not copied to the host
        assert float(total) == pytest.approx(t.bfloat16().double().sum().item())
    if device == "cpu":
        assert not Path(handle[1]).exists()  # released: nothing left in /dev/shm


def test_buckets_split_by_size_and_a_large_tensor_gets_its_own():
    shapes = [("x", (256,)), ("y", (256,)), ("big", (4096,)), ("z", (16,))]
    buckets, nbytes = plan_buckets(shapes, torch.float32, bucket_bytes=2048)
    assert [[s.name for s in b] for b in buckets] == [["x", "y"], ["big"], ["z"]]
    assert nbytes == 4096 * 4  # the buffer holds the largest bucket
    flat = torch.zeros(nbytes, dtype=torch.uint8)
    pack_tensor(flat, buckets[1][0], torch.arange(4096.0))
    ((name, view),) = unpack_bucket(flat, buckets[1])
    assert name == "big" and torch.equal(view, torch.arange(4096.0))


def test_hf_engine_loads_a_shared_bucket():
    engine = _tiny_engine()
    state = {n: torch.randn_like(t) for n, t in engine.model.state_dict().items()}
    if "lm_head.weight" in state:  # tied to the embedding: one tensor, one value
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    buckets, nbytes = plan_buckets(((n, t.shape) for n, t in state.items()), torch.float32, 1 << 30)
    cpu = hal.get_backend("cpu")
    buf, handle = cpu.shared_buffer(nbytes)
    try:
        for spec in buckets[0]:
            pack_tensor(buf, spec, state[spec.name])
        engine.load_shared_bucket(hal.open_shared_buffer, [handle], buckets[0])
    finally:
        cpu.release_shared_buffer(handle)
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, state[name]), name


def test_a_tp_replica_sees_its_group_devices():
    cuda, npu = hal.CudaBackend(), hal.NpuBackend()
    assert cuda.engine_env(["2", "3"]) == {
        "CUDA_VISIBLE_DEVICES": "2,3",
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
    }
    env = npu.engine_env(["14", "15"])
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "14,15"
    assert env["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"] == "1"
    assert env["VLLM_ASCEND_ENABLE_NZ"] == "0"  # vllm-ascend's in-place reload needs it
    assert hal.CpuBackend().engine_env([]) == {}
    # vLLM: one worker process per device for tp > 1, never its Ray executor
    assert executor_backend(2, in_process=True) == "mp"
    assert executor_backend(1, in_process=True) == "uni"
    assert executor_backend(1, in_process=False) is None


def test_ipc_handle_is_opened_on_the_readers_device_index():
    # rebuild_cuda_tensor's argument 6 is the storage device: the writer's index (say 3 among
    # all GPUs) becomes the reader's own (0 when it sees only its tp group's devices)
    args = ("cls", (4,), (1,), 0, "storage", torch.uint8, 3, b"handle", 4, 0, False)
    rebuilt = hal.ipc_rebuild_args(args, 0)
    assert rebuilt[6] == 0 and rebuilt[:6] == list(args[:6]) and rebuilt[7:] == list(args[7:])
    with pytest.raises(ValueError, match="expected 'file' or 'ipc'"):
        hal.open_shared_buffer(("pipe", 1))


def test_tensor_spec_survives_a_round_trip_as_a_tuple():
    spec = TensorSpec("w", "float32", (2, 3), 128)
    assert TensorSpec(*tuple(spec)) == spec
