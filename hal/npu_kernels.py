"""torch_npu's fused ops in the layouts their documentation names (``hal.kernels``, provider
convention ``torch_npu``; torch_npu 2.10.0.post4, ``torch_npu/_op_plugin_docs.py``):

- ``npu_rms_norm(input, gamma, epsilon=1e-06) -> (y, rstd)``;
- ``npu_swiglu(input, dim=-1)``: ``Swish(A) * B`` of ``input``'s halves ``A, B`` along
  ``dim``. One ``[..., 2I]`` tensor: a gated MLP whose gate and up projections are plain
  ``nn.Linear`` (no adapters, no bias) computes it with one matmul of the two weights
  concatenated (``gate_up``: a ``[2I, H]`` weight copy per forward, freed after it), so no
  ``[T, 2I]`` activation is copied by a ``cat`` of the two projections' outputs; others (LoRA
  on gate or up) concatenate the outputs;
- ``npu_rotary_mul(input, r1, r2, rotary_mode='half', rotate=None)``: ``r1 * x +
  r2 * rotate_half(x)``, its layouts BNSD, BSND and SBND with ``r1``, ``r2`` as ``1S1D``,
  ``BS1D`` or ``BSND`` for BSND, and ``r1``, ``r2`` in ``[-1, 1]``. transformers' attention
  holds q and k as ``[b, n, s, d]`` views of ``[b, s, n, d]`` storage (``view(...).
  transpose(1, 2)``): the op gets that storage as BSND, cos and sin as ``[b, s, 1, d]``, and
  its output goes back as the same kind of view. cos and sin scaled by a rope's
  ``attention_scaling`` other than 1 leave ``[-1, 1]``: ``KernelSet.apply`` keeps the
  reference rotation there (``ROPE_UNIT_RANGE``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: The provider conventions whose rope takes cos and sin in [-1, 1] only.
ROPE_UNIT_RANGE = frozenset({"torch_npu"})


def rms_norm_call(fn) -> Callable:
    """``(x, weight, eps) -> y`` through ``npu_rms_norm``."""
    return lambda x, weight, eps: fn(x, weight, epsilon=eps)[0]


class _GateUp(torch.autograd.Function):
    """``x @ cat(gate_w, up_w).T`` (``[..., 2I]``) without keeping the concatenated weight:
    backward takes each half of the gradient against its own weight."""

    @staticmethod
    def forward(ctx, x, gate_w, up_w):
        ctx.save_for_backward(x, gate_w, up_w)
        return torch.nn.functional.linear(x, torch.cat((gate_w, up_w)))

    @staticmethod
    def backward(ctx, grad):
        x, gate_w, up_w = ctx.saved_tensors
        inter = gate_w.shape[0]
        grad2d, x2d = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_gate, grad_up = grad2d[:, :inter], grad2d[:, inter:]
        grad_x = grad_gate_w = grad_up_w = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_gate @ gate_w).addmm_(grad_up, up_w).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            grad_gate_w = grad_gate.t() @ x2d
        if ctx.needs_input_grad[2]:
            grad_up_w = grad_up.t() @ x2d
        return grad_x, grad_gate_w, grad_up_w


def _plain(linear: torch.nn.Module) -> bool:
    """An ``nn.Linear`` as torch ships it, without a bias (no adapter wraps it)."""
    return type(linear).forward is torch.nn.Linear.forward and linear.bias is None


def gate_up(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``[gate_proj(x); up_proj(x)]`` along the last axis as one tensor: one matmul of the
    concatenated weights when both are plain ``nn.Linear`` without bias, else the two
    outputs concatenated."""
    gate, up = mlp.gate_proj, mlp.up_proj
    if _plain(gate) and _plain(up):
        return _GateUp.apply(x, gate.weight, up.weight)
    return torch.cat((gate(x), up(x)), dim=-1)


def swiglu_call(fn) -> Callable:
    """``(mlp, x) -> silu(gate_proj(x)) * up_proj(x)`` through ``npu_swiglu`` on ``gate_up``."""
    return lambda mlp, x: fn(gate_up(mlp, x), dim=-1)


def rope_call(fn) -> Callable:
    """``(q, k, cos, sin) -> (q, k)`` rotated (q, k ``[b, n, s, d]`` views of ``[b, s, n, d]``
    storage; cos, sin ``[b, s, d]``) through ``npu_rotary_mul`` in its BSND layout."""

    def rotate(q, k, cos, sin):
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [b, s, 1, d]: BSND's BS1D

        def one(x):
            bsnd = x.transpose(1, 2).contiguous()  # transformers' own storage: no copy
            return fn(bsnd, cos, sin).to(x.dtype).transpose(1, 2)

        return one(q), one(k)

    return rotate
