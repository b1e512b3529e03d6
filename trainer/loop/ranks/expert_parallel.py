"""Expert parallelism (``train.expert_parallel_size``): a mixture's experts split over groups
of ranks, each token's (token, expert) slots sent to the rank that holds the expert and back.

The ranks form a 2D mesh ``(dp, ep)`` (``ep`` = ``train.expert_parallel_size``, ``dp`` the
rest of ``train.dp_size``). Every fused experts module (``hal.moe_experts.is_fused_experts``:
transformers 5's ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``) has its weights
sharded by expert over ``ep`` (``Shard(0)``: rank j of an ep group holds experts
``j * E/ep .. (j + 1) * E/ep - 1``) and is its own FSDP2 unit over ``dp`` (by its dim 1); the other
parameters stay FSDP2 units over all ranks (the mesh flattened). A parameter is thus always
a DTensor, and what reads whole weights (the push, checkpoints, the export) reads them whole
as before (``full_tensor``).

The forward (``dispatching_forward``) is dropless: each slot's row goes to its expert's rank
by one all-to-all of the ep group (``all_to_all_single_autograd`` of torch's functional
collectives, which carries gradients back the same way), the rank computes its experts over
the rows it got, sorted by expert (through the kernel set's experts kernel,
``hal.kernels.KernelSet.expert_rows``: the device's grouped GEMM, or the per-expert loop), and
a second all-to-all returns them; the routing weights
are applied where the token lives. The exchanged sizes are counted first (one all-to-all of
the per-expert counts), so every collective is of known size, through the HAL's process group
(each device's collective library; gloo on the CPU).

Gradients: FSDP2 averages an expert's gradient over ``dp`` (``dp_size / ep`` ranks) where the
other parameters average over all ``dp_size``; each rank's loss is its share of the global loss
times ``dp_size`` (``FSDPWorker.run_micro_batches``), and an expert's gradient already sums
every ep rank's tokens, so the expert weights' gradients are scaled by ``1 / ep`` on their way
back (``_GradScale``): the losses and updates equal those of ``ep = 1`` (tests:
``tests/test_expert_parallel.py``). A custom divide factor would need ``ReduceOp.PREMUL_SUM``,
which gloo lacks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hal.moe_experts import is_fused_experts, looped_rows

__all__ = ["expert_modules", "grad_norm", "shard_experts"]

#: The expert weights of a fused experts module.
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The fused experts modules of ``model`` (one per MoE layer), in module order."""
    return [m for m in model.modules() if is_fused_experts(m)]


class _GradScale(torch.autograd.Function):
    """The identity forward; the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def shard_experts(
    model: torch.nn.Module, mesh, fsdp: Callable[..., None], compute: Callable = looped_rows
) -> int:
    """Shard every fused experts module of ``model`` by expert over ``mesh["ep"]``, make it an
    FSDP2 unit over ``mesh["dp"]`` (``fsdp(module, mesh=..., shard_placement_fn=...)``:
    ``fully_shard`` with the worker's policies) and give it the dispatching forward, whose
    local experts run through ``compute`` (``hal.moe_experts.looped_rows``'s signature). Returns
    the modules sharded. ValueError, naming ``train.expert_parallel_size``, when an expert
    count does not divide."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep = mesh["ep"].size()
    modules = expert_modules(model)
    for module in modules:
        experts = module.gate_up_proj.shape[0]
        if experts % ep:
            raise ValueError(
                f"train.expert_parallel_size={ep}: the model's layers have {experts} experts, "
                f"which {ep} ranks cannot split evenly; use a divisor of {experts}"
            )
        for name in EXPERT_WEIGHTS:
            weight = getattr(module, name)
            sharded = distribute_tensor(weight, mesh["ep"], [Shard(0)], src_data_rank=None)
            setattr(module, name, torch.nn.Parameter(sharded, requires_grad=weight.requires_grad))
        # over dp by the hidden dimension: the experts' dim 0 is ep's (two shardings of one
        # dim would make every whole read a strided, two-step gather)
        fsdp(module, mesh=mesh["dp"], shard_placement_fn=lambda _: Shard(1))
        module.forward = dispatching_forward(module, mesh["ep"].get_group(), ep, compute)
    return len(modules)


def dispatching_forward(module: torch.nn.Module, group, ep: int, compute: Callable = looped_rows):
    """``module``'s forward under expert parallelism (module docstring): ``(hidden [T, H],
    top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` as transformers calls it; the local
    experts through ``compute``."""
    from torch.distributed import all_to_all_single as exchange_counts
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    experts = module.gate_up_proj.shape[0]  # the logical count, all ranks' together
    local = experts // ep

    def forward(hidden, top_k_index, top_k_weights):
        tokens, k = top_k_index.shape
        slots = top_k_index.reshape(-1)
        order = torch.argsort(slots, stable=True)  # slots sorted by expert: by rank, then expert
        rows = hidden.index_select(0, order // k)
        counts = torch.bincount(slots, minlength=experts)
        got_counts = torch.empty_like(counts)
        exchange_counts(got_counts, counts, group=group)  # [ep * local]: what each rank sends me
        send = counts.view(ep, local).sum(1).tolist()
        per_source = got_counts.view(ep, local)
        receive = per_source.sum(1).tolist()
        got = all_to_all_single_autograd(rows, receive, send, group)
        # rows from each source rank arrive sorted by expert; group them by expert overall
        expert_of = torch.repeat_interleave(
            torch.arange(local, device=got.device).repeat(ep), per_source.reshape(-1)
        )
        by_expert = torch.argsort(expert_of, stable=True)
        y = _local_experts(module, got.index_select(0, by_expert), per_source.sum(0), ep, compute)
        back = torch.empty_like(y).index_copy(0, by_expert, y)
        done = all_to_all_single_autograd(back, send, receive, group)
        out = torch.empty_like(done).index_copy(0, order, done).view(tokens, k, -1)
        return (out.float() * top_k_weights.unsqueeze(-1).float()).sum(dim=1).to(hidden.dtype)

    return forward


def _local_experts(module, got: torch.Tensor, counts: torch.Tensor, ep: int, compute):
    """This rank's experts over ``got`` (``counts[j]`` rows of its expert j, in order) through
    ``compute``, the weights' gradients scaled by ``1 / ep`` (module docstring)."""
    gate_up = _GradScale.apply(module.gate_up_proj.to_local(), 1.0 / ep)
    down = _GradScale.apply(module.down_proj.to_local(), 1.0 / ep)
    return compute(got, gate_up, down, counts, module.act_fn)


def grad_norm(parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over parameters on more than one device mesh (the
    experts' ``(dp, ep)`` and the flattened one): each mesh's norm, then their root sum of
    squares, then every gradient clipped by it. Returns the global norm (a plain tensor)."""
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    by_mesh: dict[object, list[torch.nn.Parameter]] = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p, "device_mesh", None), []).append(p)
    squares = []
    for params in by_mesh.values():
        norm = get_total_norm([p.grad for p in params])
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        squares.append(norm.float().square())
    total = torch.stack(squares).sum().sqrt() if squares else torch.tensor(0.0)
    for params in by_mesh.values():
        clip_grads_with_norm_(params, max_norm, total)
    return total
