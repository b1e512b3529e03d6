"""Per-token log-probabilities, entropies and values from packed logits.

Convention shared with rollout: the log-probability of token ``t`` is stored at position
``t`` and comes from the logits at position ``t - 1`` of the same row. The first token of a
row has no predecessor, so its entry is 0 (it is always a prompt token with loss mask 0).
"""

from __future__ import annotations

import functools

import torch


def row_start_mask(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Bool [T]: True at the first token of every row."""
    mask = torch.zeros(num_tokens, dtype=torch.bool, device=cu_seqlens.device)
    mask[cu_seqlens[:-1].long()] = True
    return mask


def shift_to_targets(per_position: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Move values computed at position ``t - 1`` to position ``t`` ([T] -> [T]), zero at row starts."""
    out = torch.zeros_like(per_position)
    out[1:] = per_position[:-1]
    return out.masked_fill(row_start_mask(cu_seqlens, per_position.shape[0]), 0.0)


def _per_chunk(fn, tensors: tuple[torch.Tensor, ...], chunk_tokens: int) -> torch.Tensor:
    """``fn`` over row chunks of ``tensors`` (split along dim 0), concatenated. Under autograd
    each chunk is checkpointed: its float32 copy of the logits and log-softmax are recomputed
    in backward instead of kept, so at most one chunk's exists at any time."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be >= 1")
    need_grad = torch.is_grad_enabled() and tensors[0].requires_grad
    pieces = []
    for chunk in zip(*(t.split(chunk_tokens, dim=0) for t in tensors)):
        if need_grad:
            pieces.append(torch.utils.checkpoint.checkpoint(fn, *chunk, use_reentrant=False))
        else:
            pieces.append(fn(*chunk))
    return torch.cat(pieces)


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
) -> torch.Tensor:
    """Log-probability [T] (float32) of each token under ``log_softmax(logits / temperature)``.

    ``logits`` is [T, V] from a packed forward, computed ``chunk_tokens`` tokens at a time
    (see ``_per_chunk``: no whole float32 copy of the logits, none kept for backward).
    """
    targets = torch.zeros_like(input_ids)
    targets[:-1] = input_ids[1:]

    def chunk_logprobs(part: torch.Tensor, part_targets: torch.Tensor) -> torch.Tensor:
        lp = torch.log_softmax(part.float() / temperature, dim=-1)
        return lp.gather(-1, part_targets[:, None]).squeeze(-1)

    return shift_to_targets(_per_chunk(chunk_logprobs, (logits, targets), chunk_tokens), cu_seqlens)


def logits_entropy(
    logits: torch.Tensor, *, temperature: float = 1.0, chunk_tokens: int = 4096
) -> torch.Tensor:
    """Entropy (nats, at least float32) of ``softmax(logits / temperature)`` per row:
    ``[T, V] -> [T]``, ``H = logsumexp(z) - sum_v softmax(z)_v z_v``, chunked as
    ``_per_chunk``. A banned token (logit -inf) adds exactly 0, with no NaN in backward."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, vocab], got shape {tuple(logits.shape)}")
    if logits.shape[0] == 0:
        return logits.new_zeros(0, dtype=torch.promote_types(logits.dtype, torch.float32))
    return _per_chunk(functools.partial(_entropy, temperature=temperature), (logits,), chunk_tokens)


def _entropy(z: torch.Tensor, temperature: float) -> torch.Tensor:
    z = z.to(torch.promote_types(z.dtype, torch.float32)) / temperature
    p = torch.softmax(z, dim=-1)
    # p = 0 at a -inf logit, and 0 * -inf would be NaN: replace z there (replacing z, not
    # the product, keeps the backward NaN-free too).
    z_safe = torch.where(p > 0, z, torch.zeros((), dtype=z.dtype, device=z.device))
    return torch.logsumexp(z, dim=-1) - (p * z_safe).sum(dim=-1)


def token_entropy(
    logits: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
) -> torch.Tensor:
    """Entropy [T] (float32) of the distribution that predicted each token (same alignment
    as ``token_logprobs``)."""
    entropy = logits_entropy(logits, temperature=temperature, chunk_tokens=chunk_tokens)
    return shift_to_targets(entropy.float(), cu_seqlens)
