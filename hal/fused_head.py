"""The LM head's fused log-prob + entropy (``train.kernels`` op ``lm_head``): per token, the
log-probability of its target and the entropy of ``softmax(hidden @ weight.T / temperature)``,
a chunk of tokens at a time, with a hand-written backward.

Why our own: Liger-Kernel 0.8.5's fused linear cross-entropy returns the loss (per token with
``reduction="none"``) but neither the entropy nor a temperature, and torch_npu has no such
op; RL's losses need both (the policy loss reads the log-prob, the entropy bonus and its
metric the entropy). It is torch code, so every device runs the same function.

What it saves against the reference (``trainer.loop.ranks.forward``'s checkpointed chunks):
the reference recomputes each chunk's forward in backward (logits, float32 copy,
log-softmax, softmax, the entropy's products) and then runs autograd back through each of
them; here backward recomputes only the logits and forms their gradient in closed form,
with two ``[chunk, V]`` float32 tensors alive, updated in place:

    z = (h W^T + b) / T,  lse = logsumexp(z),  p = exp(z - lse),  E[z] = lse - H
    d logprob / dz = onehot(target) - p,   d H / dz = -p * (z - E[z])

Forward keeps per token only ``lse`` and ``H`` (two ``[T]`` float32 vectors) beside the
inputs. Weight and bias gradients are summed over chunks in float32, cast once: the weight's
with one ``addmm`` per chunk straight into the float32 ``[V, H]`` accumulator where the
device's torch offers a float32 output for the compute dtype's inputs (``addmm.dtype_out``:
CUDA in torch 2.11, NPU in torch_npu 2.10.0.post4's ``wrapper_NPU_dtype_out_addmm_out``; not
the CPU's torch 2.13; asked once per device type and dtype, ``_fp32_accumulates``), as
Liger's fused linear cross-entropy accumulates; else the compute dtype's ``[V, H]`` product
is added to it. In float32 the accumulator is ``addmm_``'s own output. An entropy that takes
no gradient (detached, or unused by the loss) reaches backward as None
(``set_materialize_grads(False)``), and its term is skipped.

The chunk: ``chunk_tokens`` tokens, chosen by the caller (``trainer.loop.ranks.forward``:
as many as fit ``LEAN_CHUNK_BYTES`` of float32 logits), which the memory budget counts
(``trainer.loop.plan.rank_memory``: the ``logits`` term, and the accumulator in ``kernel``).
"""

from __future__ import annotations

import torch


def _chunk_logits(hidden, weight, bias, temperature: float) -> torch.Tensor:
    """``[c, H] -> [c, V]`` float32 logits over ``temperature``."""
    z = (hidden @ weight.t() if bias is None else torch.addmm(bias, hidden, weight.t())).float()
    if temperature != 1.0:
        z.div_(temperature)
    return z


#: (device type, compute dtype) -> whether ``torch.addmm(..., out_dtype=torch.float32,
#: out=acc)`` sums that dtype's product into a float32 ``acc`` there; asked once each.
_FP32_ACCUMULATE: dict[tuple[str, torch.dtype], bool] = {}


def _fp32_accumulates(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this device's torch sums a ``dtype`` matrix product into a float32 tensor in
    place (``addmm.dtype_out``, beta 1), tried once per device type and dtype on a 2 x 2
    product; False for float32 itself (plain ``addmm_`` does it) and where the kernel is
    missing or refuses a float32 ``self`` (torch's CUDA kernel before it allowed one)."""
    key = (device.type, dtype)
    if key not in _FP32_ACCUMULATE:
        ok = False
        if dtype != torch.float32:
            try:
                a = torch.ones(2, 3, dtype=dtype, device=device)
                acc = torch.ones(2, 2, dtype=torch.float32, device=device)
                torch.addmm(acc, a, a.t(), out_dtype=torch.float32, out=acc)
                ok = bool((acc == 4).all())
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _FP32_ACCUMULATE[key] = ok
    return _FP32_ACCUMULATE[key]


def _accumulate(acc: torch.Tensor, grad_z: torch.Tensor, h: torch.Tensor, fp32: bool) -> None:
    """``acc += grad_z.T @ h`` into the float32 ``acc`` (``[V, H]``): one ``addmm`` writing
    ``acc`` where the dtype allows (``fp32``, or float32 inputs), else the compute dtype's
    product added."""
    if grad_z.dtype == torch.float32:
        acc.addmm_(grad_z.t(), h)
    elif fp32:
        torch.addmm(acc, grad_z.t(), h, out_dtype=torch.float32, out=acc)
    else:
        acc += grad_z.t() @ h  # the compute dtype's [V, H] product, summed in float32


class _LinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_tokens):
        tokens = hidden.shape[0]
        logprob = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprob)
        lse = torch.empty_like(logprob)
        for start in range(0, tokens, chunk_tokens):
            end = min(start + chunk_tokens, tokens)
            z = _chunk_logits(hidden[start:end], weight, bias, temperature)
            chunk_lse = torch.logsumexp(z, dim=-1)
            logprob[start:end] = z.gather(-1, targets[start:end, None]).squeeze(-1) - chunk_lse
            mean_z = (torch.softmax(z, dim=-1) * z).sum(dim=-1)
            entropy[start:end] = chunk_lse - mean_z
            lse[start:end] = chunk_lse
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # an output without a gradient comes back as None
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        temperature, chunk_tokens = ctx.temperature, ctx.chunk_tokens
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        if grad_logprob is None and grad_entropy is None:
            return None, None, None, None, None, None
        fp32 = need_weight and _fp32_accumulates(hidden.device, hidden.dtype)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = (
            torch.zeros_like(bias, dtype=torch.float32) if need_bias and bias is not None else None
        )
        for start in range(0, hidden.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, hidden.shape[0])
            h = hidden[start:end]
            z = _chunk_logits(h, weight, bias, temperature)
            p = (z - lse[start:end, None]).exp_()
            # dL/dz = -p * (g_lp + g_H * (z - E[z])) + g_lp * onehot, built in z's storage
            if grad_entropy is not None:
                mean_z = (lse[start:end] - entropy[start:end])[:, None]
                z.sub_(mean_z).mul_(grad_entropy[start:end, None])
                if grad_logprob is not None:
                    z.add_(grad_logprob[start:end, None])
                grad_z = p.mul_(z).neg_()
            else:  # no entropy gradient: -p * g_lp alone, z is not touched
                grad_z = p.mul_(grad_logprob[start:end, None]).neg_()
            if grad_logprob is not None:
                rows = torch.arange(end - start, device=h.device)
                grad_z[rows, targets[start:end]] += grad_logprob[start:end]
            if temperature != 1.0:
                grad_z.div_(temperature)
            grad_z = grad_z.to(h.dtype)
            if need_hidden:
                grad_hidden[start:end] = grad_z @ weight
            if need_weight:
                _accumulate(grad_weight, grad_z, h, fp32)
            if grad_bias is not None:
                grad_bias += grad_z.sum(dim=0, dtype=torch.float32)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None


def linear_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token ``t`` of ``hidden`` ``[T, H]``: (log-prob of ``targets[t]``, entropy in nats),
    both ``[T]`` float32, of ``softmax((hidden @ weight.T + bias) / temperature)``,
    ``chunk_tokens`` tokens at a time (``weight`` ``[V, H]``: the LM head's). Differentiable in
    ``hidden``, ``weight`` and ``bias``; nothing of size ``[T, V]`` is kept for backward."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be >= 1")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature!r} must be > 0")
    return _LinearLogprobEntropy.apply(hidden, weight, bias, targets, temperature, chunk_tokens)
