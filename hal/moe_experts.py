"""A mixture-of-experts layer's experts, computed per device (``hal.kernels`` op
``moe_experts``).

transformers 5 keeps a layer's experts as one module with fused 3D weights (``Qwen3MoeExperts``
and the other ``@use_experts_implementation`` classes): ``gate_up_proj [E, 2I, H]`` (each
expert's gate rows, then its up rows), ``down_proj [E, H, I]`` and ``act_fn``, called as
``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``. Each token's k
(token, expert) slots go through their expert: ``down(act(gate(x)) * up(x))``, times the
slot's routing weight, summed over the k slots.

- ``reference_experts``: the golden the tests hold every implementation to (transformers'
  eager loop and each grouped GEMM): one expert at a time in float32, each slot's row written once and the k slots summed in a fixed order
  (no ``index_add_``, whose CUDA accumulation order is not fixed).
- ``grouped_experts``: the slots sorted by expert (a stable sort), both projections as one
  grouped GEMM each (``gmm(x [S, K], w [E, K, N], counts [E]) -> [S, N]``: rows of expert e
  against ``w[e]``), and the rows put back. ``torch_gmm``: torch's ``F.grouped_mm``
  (``torch._grouped_mm``: a CUDA kernel, bf16, SM >= 80; its backward is torch's own);
  ``npu_gmm``: torch_npu's ``npu_grouped_matmul``, which has no autograd, inside
  ``NpuGroupedMatmul`` with the backward verl's ``NPUGmmFunction`` and MindSpeed's FSDP2
  ``gmm`` use: ``dx = gmm(dy, w^T)`` and ``dw = gmm(x^T, dy, group_type=2)``.

torch_npu 2.10.0.post4's rule for ``npu_grouped_matmul(x, weight, *, group_list, split_item,
group_type, group_list_type)`` (``op_plugin/meta/_meta_registrations.py``): ``x`` and
``weight`` are lists; one 3D weight ``[E, K, N]`` and ``split_item`` 2 or 3 give one output;
``group_type`` 0 groups the rows of ``x`` (output ``[M, N]``), 2 groups its columns (the
weight gradient: ``x`` ``[K, M]``, ``weight`` ``[M, N]``, output ``[E, K, N]``);
``group_list`` holds the groups' ends (``group_list_type`` 0, a cumulative sum) or their sizes
(1). The tests run each convention against the reference with a CPU stand-in that follows
that rule (and torch's own ``F.grouped_mm``, which also runs on the CPU for aligned shapes).

On the NPU the rest of the layer is torch_npu's too, as MindSpeed's FSDP2 MoE calls it
(``npu_experts``): ``npu_swiglu(h, dim=-1)`` (``Swish(first half) * second half``: the gate
rows come first in ``gate_up_proj``) for a SiLU layer, and, in bf16 (the only dtype they
take), ``npu_moe_token_permute(tokens [T, H], indices [T, k] int64) -> (permuted [T*k, H]
grouped by expert in ascending order, sorted_indices [T*k] int32)`` and
``npu_moe_token_unpermute(permuted, sorted_indices, probs [T, k]) -> [T, H]`` (each slot's row
times its weight, summed over the k slots). Both have autograd. crossrl never reads
``sorted_indices``, only hands it back to the unpermute: its documentation's example shows it
as the argsort of the flattened indices while vllm-ascend 0.26 treats it as the inverse
(``reversed_..._permutation_mapping``), and the tests run both readings.

Under expert parallelism (``trainer.loop.ranks.expert_parallel``) the rows arrive at their
expert's rank already grouped: ``ExpertsKernel.rows`` computes them (the two GEMMs and the
activation), ``looped_rows`` is its per-expert loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

__all__ = [
    "ExpertsKernel",
    "NpuGroupedMatmul",
    "NPU_MOE_OPS",
    "NpuOps",
    "grouped_experts",
    "is_fused_experts",
    "is_silu",
    "looped_rows",
    "npu_experts",
    "npu_gmm",
    "reference_experts",
    "torch_experts",
    "torch_gmm",
]

#: ``gmm(x [S, K], weight [E, K, N], counts [E]) -> [S, N]``.
Gmm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
BF16 = torch.bfloat16
#: ``swiglu(h [S, 2I]) -> [S, I]``: ``act(first half) * second half`` for a SiLU layer.
Swiglu = Callable[[torch.Tensor], torch.Tensor]


def is_silu(act_fn) -> bool:
    """``act_fn`` is SiLU (torch's module or transformers' own class)."""
    return isinstance(act_fn, torch.nn.SiLU) or type(act_fn).__name__ in ("SiLUActivation", "SiLU")


def is_fused_experts(module: torch.nn.Module) -> bool:
    """A transformers experts module this op computes: fused ``gate_up_proj [E, 2I, H]`` and
    ``down_proj [E, H, I]`` (not transposed, no biases, gated), an ``act_fn``."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return False
    if gate_up.dim() != 3 or down.dim() != 3 or not hasattr(module, "act_fn"):
        return False
    plain = not getattr(module, "is_transposed", False) and not getattr(module, "has_bias", False)
    gated = getattr(module, "has_gate", True) and getattr(module, "is_concatenated", True)
    return plain and gated and gate_up.shape[0] == down.shape[0]


def reference_experts(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts' output (module docstring), one expert at a time in float32; slots routed
    to no expert of this module (an id >= E) add nothing."""
    tokens, k = top_k_index.shape
    experts = module.gate_up_proj.shape[0]
    x = hidden_states.float()
    slots = top_k_index.reshape(-1)
    weights = top_k_weights.reshape(-1).float()
    out = x.new_zeros(tokens * k, x.shape[-1])
    for e in range(experts):
        rows = (slots == e).nonzero().squeeze(-1)
        if rows.numel() == 0:
            continue
        gate, up = F.linear(x[rows // k], module.gate_up_proj[e].float()).chunk(2, dim=-1)
        y = F.linear(module.act_fn(gate) * up, module.down_proj[e].float())
        out = out.index_copy(0, rows, y * weights[rows, None])
    return out.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


def looped_rows(
    rows: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts: torch.Tensor,
    act_fn: Callable,
) -> torch.Tensor:
    """Each expert's gated MLP over its block of ``rows`` (``counts[e]`` rows of expert ``e``,
    in expert order), one expert at a time in the rows' dtype: ``down(act(gate(x)) * up(x))``
    with ``gate_up [E, 2I, H]``, ``down [E, H, I]``."""
    outs = []
    for e, part in enumerate(torch.split(rows, counts.tolist())):
        gate, up = F.linear(part, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(act_fn(gate) * up, down[e]))
    return torch.cat(outs) if outs else rows


def _grouped_rows(rows, gate_up, down, counts, act_fn, gmm: Gmm, swiglu: Swiglu | None):
    """``looped_rows`` through ``gmm``: both projections one grouped GEMM each, the
    activation through ``swiglu`` where given (a SiLU layer)."""
    h = gmm(rows, gate_up.transpose(1, 2), counts)
    if swiglu is not None:
        act = swiglu(h)
    else:
        gate, up = h.chunk(2, dim=-1)
        act = act_fn(gate) * up
    return gmm(act, down.transpose(1, 2), counts)


def _expert_counts(slots: torch.Tensor, experts: int) -> torch.Tensor:
    """Rows per expert, by ``histc`` as transformers counts them (no shape depends on the
    routing, so it runs on fake tensors too)."""
    # histc: float input on the CPU (its integer histc is missing), int elsewhere
    counted = slots.float() if slots.device.type in ("cpu", "mps") else slots.int()
    return torch.histc(counted, bins=experts, min=0, max=experts - 1).long()


def grouped_experts(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gmm: Gmm,
    swiglu: Swiglu | None = None,
) -> torch.Tensor:
    """The experts' output through ``gmm`` (module docstring), in the hidden states' dtype;
    the k slots are summed in float32. Shapes never depend on the routing, so it also runs
    on fake tensors; a slot routed to no expert here (an id >= E) goes through the last
    expert with weight 0."""
    tokens, k = top_k_index.shape
    experts = module.gate_up_proj.shape[0]
    slots = top_k_index.reshape(-1)
    routed = slots < experts
    slots = slots.clamp(max=experts - 1)
    order = torch.argsort(slots, stable=True)
    counts = _expert_counts(slots, experts)
    y = _grouped_rows(
        hidden_states[order // k],
        module.gate_up_proj,
        module.down_proj,
        counts,
        module.act_fn,
        gmm,
        swiglu,
    )
    weights = (top_k_weights.reshape(-1) * routed)[order, None]
    y = y.float() * weights.float()
    out = torch.zeros_like(y).index_copy(0, order, y)
    return out.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


def _permuted_experts(module, hidden_states, top_k_index, top_k_weights, gmm, swiglu, ops):
    """``grouped_experts`` with torch_npu's permute and unpermute (``NpuOps``; bf16) in place
    of the sort and the combine: the unpermute applies the weights and sums the k slots."""
    experts = module.gate_up_proj.shape[0]
    routed = top_k_index < experts
    index = top_k_index.clamp(max=experts - 1).long()
    rows, sorted_indices = ops.token_permute(hidden_states, index)
    counts = _expert_counts(index.reshape(-1), experts)
    y = _grouped_rows(
        rows, module.gate_up_proj, module.down_proj, counts, module.act_fn, gmm, swiglu
    )
    probs = (top_k_weights * routed).to(y.dtype)
    return ops.token_unpermute(y, sorted_indices, probs=probs).to(hidden_states.dtype)


@dataclass(frozen=True)
class NpuOps:
    """torch_npu's ops an NPU experts call takes beside ``npu_grouped_matmul`` (None: not in
    this torch_npu, the generic path instead)."""

    token_permute: Callable | None = None
    token_unpermute: Callable | None = None
    swiglu: Callable | None = None


@dataclass(frozen=True)
class ExpertsKernel:
    """One device's experts computation (the kernel set's ``moe_experts`` call): the whole
    module's call (``__call__``, as transformers calls experts) and the grouped rows' alone
    (``rows``, expert parallelism's local experts). ``dtypes``: the only dtypes its GEMM takes
    (None: any); ``npu``: torch_npu's permute, unpermute and SwiGLU, where they apply."""

    gmm: Gmm
    dtypes: frozenset | None = None
    npu: NpuOps | None = None

    def fits(self, dtype: torch.dtype) -> bool:
        """Whether activations of ``dtype`` suit this kernel's GEMM."""
        return self.dtypes is None or dtype in self.dtypes

    def _swiglu(self, act_fn) -> Swiglu | None:
        fn = self.npu.swiglu if self.npu is not None else None
        return None if fn is None or not is_silu(act_fn) else (lambda h: fn(h, dim=-1))

    def __call__(self, module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        """``module``'s experts over ``hidden_states`` routed by ``top_k_index`` with
        ``top_k_weights`` (module docstring)."""
        swiglu = self._swiglu(module.act_fn)
        npu = self.npu
        if npu and npu.token_permute and npu.token_unpermute and hidden_states.dtype == BF16:
            return _permuted_experts(
                module, hidden_states, top_k_index, top_k_weights, self.gmm, swiglu, npu
            )
        return grouped_experts(module, hidden_states, top_k_index, top_k_weights, self.gmm, swiglu)

    def rows(self, rows, gate_up, down, counts, act_fn) -> torch.Tensor:
        """``looped_rows`` through this kernel's grouped GEMM."""
        return _grouped_rows(rows, gate_up, down, counts, act_fn, self.gmm, self._swiglu(act_fn))


def torch_experts(fn) -> ExpertsKernel:
    """The experts through torch's ``F.grouped_mm`` (``fn``; its CUDA kernel takes bf16)."""
    return ExpertsKernel(torch_gmm(fn), dtypes=frozenset({BF16}))


#: torch_npu's ops beside ``npu_grouped_matmul`` that its experts call takes where present
#: (``NpuOps`` field -> torch_npu's name).
NPU_MOE_OPS = {
    "token_permute": "npu_moe_token_permute",
    "token_unpermute": "npu_moe_token_unpermute",
    "swiglu": "npu_swiglu",
}


def npu_experts(grouped_matmul, ops: NpuOps | ModuleType | None = None) -> ExpertsKernel:
    """The experts through torch_npu's ``npu_grouped_matmul`` and ``ops`` (permute,
    unpermute, SwiGLU): given, or read from a module (torch_npu) by ``NPU_MOE_OPS``'s names,
    None where it has no such op."""
    if isinstance(ops, ModuleType):
        ops = NpuOps(**{field: getattr(ops, name, None) for field, name in NPU_MOE_OPS.items()})
    return ExpertsKernel(npu_gmm(grouped_matmul), npu=ops)


def torch_gmm(fn) -> Gmm:
    """``gmm`` through torch's ``F.grouped_mm`` (``fn``): groups by their ends, int32."""

    def gmm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ends = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return fn(x, weight.to(x.dtype), offs=ends)

    return gmm


class NpuGroupedMatmul(torch.autograd.Function):
    """``npu_grouped_matmul`` (``fn``) over rows grouped by ``ends`` (cumulative), with its
    backward: ``dx = gmm(dy, w^T)``, ``dw = gmm(x^T, dy)`` grouped along the columns of
    ``x^T`` (``group_type`` 2: one ``[K, N]`` gradient per expert)."""

    @staticmethod
    def forward(ctx, x, weight, ends, fn):
        ctx.save_for_backward(x, weight, ends)
        ctx.fn = fn
        return fn([x], [weight], group_list=ends, split_item=3, group_type=0)[0]

    @staticmethod
    def backward(ctx, dy):
        x, weight, ends = ctx.saved_tensors
        fn, dy = ctx.fn, dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w_t = weight.transpose(1, 2).contiguous()
            dx = fn([dy], [w_t], group_list=ends, split_item=3, group_type=0)[0]
        if ctx.needs_input_grad[1]:
            dw = fn([x.t().contiguous()], [dy], group_list=ends, split_item=3, group_type=2)[0]
        return dx, dw, None, None


def npu_gmm(fn) -> Gmm:
    """``gmm`` through torch_npu's ``npu_grouped_matmul`` (``fn``), with its backward
    (``NpuGroupedMatmul``); the groups' ends as int64 (``group_list_type`` 0)."""

    def gmm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ends = torch.cumsum(counts, dim=0)
        return NpuGroupedMatmul.apply(x.contiguous(), weight.contiguous().to(x.dtype), ends, fn)

    return gmm
