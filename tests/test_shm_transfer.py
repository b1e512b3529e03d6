"""Colocated engines take weights through vLLM's weight-transfer API
(``rollout.engines.weights.shm_transfer``; ``WeightPush.push_transfer``): CUDA's ``ipc`` and the NPU's
``npu_ipc`` are the pinned wheels' own engines (names read from the wheels,
``scripts/record_transfer_api.py``), the CPU's ``crossrl_shm`` speaks their update format.

Here: two gloo processes push an FSDP2-sharded model in chunks of one buffer (the first rank
on the host packs, every rank gathers), rank 0 reading each chunk as an engine worker does;
the chunk rule and its refusals; which pushes take this way (``weight_transport_rule``) and
what ``crossrl layout`` says of them. The vLLM lane runs it inside vLLM (``tests/
test_trainer_vllm_e2e.py``), and ``tests/test_push_corners.py`` into an engine that defers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hal
from hal.shm import shm_dir
from rollout.engines.weights.shm_transfer import (
    ENGINE_NAME,
    SharedMemoryTransfer,
    SharedUpdateInfo,
    device_key,
    ipc_chunks,
    load_chunk,
    read_chunk,
)
from tests.gloo_ranks import finish_rank
from trainer.config import load_config
from trainer.loop.cluster.group import free_port

ROOT = Path(__file__).resolve().parents[1]
API = json.loads((ROOT / "tests" / "fixtures" / "weight_transfer_api.json").read_text())
WORLD = 2


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.embed = torch.nn.Parameter(torch.randn(7, 4, generator=gen))
        self.norm = torch.nn.Parameter(torch.randn(1, generator=gen))
        self.proj = torch.nn.Parameter(torch.randn(6, 3, generator=gen))
        self.head = torch.nn.Parameter(torch.randn(5, 4, generator=gen))


def _pushes(rank: int, port: int, buffer_bytes: int, dtype: torch.dtype, shards: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer.loop.weights.gather import whole_tensors

    backend = hal.get_backend("cpu")
    backend.init_process_group(rank, WORLD, master_addr="127.0.0.1", master_port=port, timeout_s=60)
    try:
        want = {n: t.to(dtype) for n, t in _Model().state_dict().items()}
        model = _Model()
        fully_shard(model, mesh=init_device_mesh(backend.device_type, (WORLD,)))
        got, chunks = {}, []

        def send(info: SharedUpdateInfo) -> None:  # rank 0 only: an engine worker's read
            assert rank == 0
            assert list(info.ipc_handles) == [device_key()]  # one buffer for the host
            chunks.append(load_chunk(info, lambda named: got.update(dict(named))))

        args = {"send_mode": send, "packed_buffer_size_bytes": buffer_bytes}
        state = model.state_dict()
        if shards:  # FSDP2's shards as they are: each rank writes its rows into the one buffer
            items = ((n, t.detach().to(dtype)) for n, t in state.items())
        else:
            items = whole_tensors(state, dtype, 64)
        SharedMemoryTransfer.trainer_send_weights(items, args)
        if rank == 0:
            # fp32 bytes 112 | 4 + 72 | 80; bf16 56 + 2 + 36 | 40 (a chunk holds 112)
            small = [1, 2, 1] if dtype == torch.float32 else [3, 1]
            assert chunks == ([4] if buffer_bytes >= 1 << 20 else small), chunks
            for name, tensor in want.items():
                assert got[name].dtype == dtype and torch.equal(got[name], tensor), name
        dist.barrier()
        leftovers = [f for f in os.listdir(shm_dir()) if f"-{os.getpid()}-" in f]
        assert leftovers == [], leftovers  # the buffer's file went with the push
    except BaseException:
        dist.destroy_process_group()
        raise
    finish_rank()


@pytest.mark.parametrize("shards", [False, True], ids=["whole", "shards"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_ranks_push_a_sharded_model_in_chunks_of_one_buffer(dtype, shards):
    """Whole tensors (gathered first, the GPU's way) or each rank's rows of its shards (the
    embedding's 7 rows split 4 + 3, the norm's 1 row held by rank 0 alone)."""
    # 1 MiB: the whole model in one chunk; 112 bytes: the embedding's in fp32
    for buffer_bytes in (1 << 20, 7 * 4 * 4):
        args = (free_port(), buffer_bytes, dtype, shards)
        mp.spawn(_pushes, args=args, nprocs=WORLD, join=True)


def test_a_chunk_closes_before_the_tensor_that_would_not_fit():
    sizes = {"a": 3, "b": 4, "c": 2, "d": 8}
    items = [(n, torch.zeros(k, dtype=torch.uint8)) for n, k in sizes.items()]
    assert [[n for n, _ in c] for c in ipc_chunks(iter(items), 8)] == [["a", "b"], ["c"], ["d"]]
    with pytest.raises(ValueError, match=r"tensor 'd' has 8 bytes.*at least 8"):
        list(ipc_chunks(iter(items), 7))


def test_an_update_info_it_cannot_read_is_refused_in_one_line():
    with pytest.raises(ValueError, match="2 names, 1 dtype_names, 2 shapes, 2 tensor_sizes"):
        SharedUpdateInfo(["a", "b"], ["float32"], [[1], [1]], {"k": ()}, [4, 4])
    info = SharedUpdateInfo(["a"], ["float32"], [[1]], {"host:elsewhere": ("file", "x", 4)}, [4])
    with pytest.raises(ValueError, match=r"no buffer for 'host:.*training rank's host"):
        read_chunk(info)


# ----------------------------------------------------------------------------- which pushes


def _cfg(*keys: str):
    return load_config(None, ["train.dp_size=2", *keys], check_environment=False)


@pytest.mark.parametrize(
    ("keys", "rule"),
    [
        (["rollout.engine=vllm"], "ipc"),
        (["rollout.engine=vllm", "rollout.tensor_parallel_size=2"], "ipc"),
        (["rollout.engine=hf"], ""),  # the HF engine: crossrl's shared buckets
        (["rollout.engine=vllm", "model.lora.rank=8"], ""),  # adapters: vLLM's LoRA load
        (["rollout.engine=vllm", "rollout.engine_devices=1"], "collective"),
    ],
)
def test_colocated_vllm_engines_and_only_they_take_the_ipc_push(keys, rule):
    from trainer.loop.plan.layout import plan_layout, weight_transport_rule
    from trainer.loop.plan.layout_text import format_layout

    cfg = _cfg(*keys)
    assert weight_transport_rule(cfg) == rule
    if cfg.rollout.engine_devices:
        return
    layout = plan_layout(cfg, [2], "GPU", "cuda")
    assert layout.weight_transport == rule
    said = format_layout(layout)
    assert ("weight-transfer API ('ipc')" in said) == (rule == "ipc"), said


# ----------------------------------------------------------------------------- the pinned names


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_the_colocated_engines_called_on_accelerators_are_the_pinned_wheels_own(device):
    """The HAL's colocated engine and trainer class exist in the pinned wheel (vLLM 0.24.0,
    vllm-ascend 0.26.0rc1 on vLLM 0.26.0), every trainer argument crossrl passes is a field of that release's,
    and the CPU's update info is theirs field for field (so both lanes send one format)."""
    from dataclasses import fields

    backend = hal.backend_class(device)()  # its class facts: no device needed
    module, name = backend.colocated_transfer_trainer
    pinned = API[module]
    assert pinned["class"] == name
    assert backend.colocated_transfer_engine in pinned["registered_as"]
    assert "trainer_send_weights" in pinned["static_methods"]
    assert {"send_mode", "packed", "packed_buffer_size_bytes"} <= set(pinned["trainer_args"])
    # vLLM 0.24's base adds ``update_kind``; 0.26's (the NPU pin) has none
    ours = {f.name for f in fields(SharedUpdateInfo)} - {"update_kind"}
    assert ours <= set(pinned["update_info"])


def test_the_cpu_takes_crossrls_own_colocated_engine():
    backend = hal.get_backend("cpu")
    assert backend.colocated_transfer_engine == ENGINE_NAME
    assert backend.colocated_transfer_trainer == (
        "rollout.engines.weights.shm_transfer",
        "SharedMemoryTransfer",
    )
