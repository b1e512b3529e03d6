"""Two CPU processes through the HAL: gloo all_reduce and one FSDP2 optimizer step."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hal
from trainer.loop.cluster.group import free_port

WORLD = 2
LR = 0.05


def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8),
        torch.nn.Tanh(),
        torch.nn.Linear(8, 8),
        torch.nn.Tanh(),
        torch.nn.Linear(8, 3),
    )


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def _step(model, x, y) -> None:
    """One AdamW step on the mean-squared error of (x, y)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()


def _worker(rank: int, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    backend = hal.get_backend("cpu")
    backend.init_process_group(rank, WORLD, master_addr="127.0.0.1", master_port=port, timeout_s=60)
    try:
        assert dist.get_backend() == backend.process_group_backend == "gloo"

        t = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
        dist.all_reduce(t)
        assert t.tolist() == [3.0, 30.0], t

        x, y = _batch()
        reference = _tiny_model()
        _step(reference, x, y)  # the whole batch in one process

        sharded = _tiny_model()
        # an explicit CPU mesh: FSDP2's default takes the machine's accelerator when it has one
        mesh = init_device_mesh(backend.device_type, (WORLD,))
        for layer in sharded:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        half = x.shape[0] // WORLD  # each rank takes its half; FSDP2 averages the gradients
        rows = slice(rank * half, (rank + 1) * half)
        _step(sharded, x[rows], y[rows])

        for (name, p_ref), (_, p_fsdp) in zip(
            reference.named_parameters(), sharded.named_parameters()
        ):
            full = p_fsdp.full_tensor()
            assert torch.allclose(full, p_ref, atol=1e-6, rtol=0), name
            assert not torch.equal(full, _tiny_model().state_dict()[name]), name  # it did step
        # Both ranks are done with every collective before either tears gloo down: a rank
        # that destroys its group while its peer still reads from it aborts that peer.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_gloo_all_reduce_and_fsdp2_step_match_single_process():
    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD, join=True)
