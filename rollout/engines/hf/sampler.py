"""Sampling one token per row: the top-k / top-p filters and an inverse-CDF draw from given
uniforms (so a request's random stream is its own and the same on every device type)."""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k and outside the top-p nucleus; ``[B, V]`` logits.

    ``top_k = 0`` and ``top_p = 1.0`` switch the filters off. The most likely token always stays.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass of the tokens strictly before it already reaches top_p.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample one token per row of ``probs`` ``[B, V]`` from uniforms ``[B]`` in [0, 1).

    Tokens with probability 0 are never chosen.
    """
    cdf = probs.cumsum(dim=-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # Float rounding can put the target at the very end: fall back to the last allowed token.
    last_allowed = probs.shape[-1] - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1)
    return torch.minimum(idx, last_allowed)
