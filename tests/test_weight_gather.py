"""The push's gather (``trainer.loop.weights.gather.whole_tensors``) in two CPU processes over
gloo: FSDP2 shards of uneven rows (7 over 2 ranks; 1 row, which the second rank holds none of),
a bf16 and an fp32 parameter, a buffer FSDP2 does not shard, buckets that close mid-model; every
rank gets each whole tensor in the engine's dtype, equal bit for bit to the unsharded model's
tensor cast, in the state dict's order."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hal
from tests.gloo_ranks import finish_rank
from trainer.loop.cluster.group import free_port

WORLD = 2


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.embed = torch.nn.Parameter(torch.randn(7, 4, generator=gen))
        self.norm = torch.nn.Parameter(torch.randn(1, generator=gen))
        self.proj = torch.nn.Parameter(torch.randn(6, 3, generator=gen).bfloat16())
        self.head = torch.nn.Parameter(torch.randn(5, 4, generator=gen))
        self.register_buffer("inv_freq", torch.randn(3, generator=gen))


def _worker(rank: int, port: int, bucket_bytes: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer.loop.weights.gather import whole_tensors

    backend = hal.get_backend("cpu")
    backend.init_process_group(rank, WORLD, master_addr="127.0.0.1", master_port=port, timeout_s=60)
    try:
        want = _Model().state_dict()
        model = _Model()
        fully_shard(model, mesh=init_device_mesh(backend.device_type, (WORLD,)))
        for dtype in (torch.float32, torch.bfloat16):
            got = list(whole_tensors(model.state_dict(), dtype, bucket_bytes))
            assert [n for n, _ in got] == list(want), [n for n, _ in got]
            for name, tensor in got:
                assert tensor.dtype == dtype and torch.equal(tensor, want[name].to(dtype)), name
    except BaseException:
        dist.destroy_process_group()
        raise
    finish_rank()


def test_every_rank_gets_each_whole_tensor_in_the_engines_dtype():
    for bucket_bytes in (1 << 20, 40):  # one bucket; a bucket closed after about every tensor
        mp.spawn(_worker, args=(free_port(), bucket_bytes), nprocs=WORLD, join=True)
