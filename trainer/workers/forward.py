"""Per-token log-probabilities, entropies and values from packed logits.

Convention shared with rollout: the log-probability of token ``t`` is stored at position
``t`` and comes from the logits at position ``t - 1`` of the same row. The first token of a
row has no predecessor, so its entry is 0 (it is always a prompt token with loss mask 0).
"""

from __future__ import annotations

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


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
) -> torch.Tensor:
    """Log-probability [T] (float32) of each token under ``log_softmax(logits / temperature)``.

    ``logits`` is [T, V] from a packed forward. Computed in chunks of ``chunk_tokens`` tokens
    so the float32 copy of the logits never exists whole.
    """
    num_tokens = logits.shape[0]
    targets = torch.zeros_like(input_ids)
    targets[:-1] = input_ids[1:]
    pieces = []
    for start in range(0, num_tokens, chunk_tokens):
        part = logits[start : start + chunk_tokens].float() / temperature
        lp = torch.log_softmax(part, dim=-1)
        pieces.append(lp.gather(-1, targets[start : start + chunk_tokens, None]).squeeze(-1))
    return shift_to_targets(torch.cat(pieces), cu_seqlens)


def token_entropy(
    logits: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
) -> torch.Tensor:
    """Entropy [T] (float32) of the distribution that predicted each token (same alignment)."""
    pieces = []
    for start in range(0, logits.shape[0], chunk_tokens):
        part = logits[start : start + chunk_tokens].float() / temperature
        lp = torch.log_softmax(part, dim=-1)
        pieces.append(-(lp.exp() * lp).sum(-1))
    return shift_to_targets(torch.cat(pieces), cu_seqlens)
