"""Reference varlen causal attention: torch SDPA once per packed segment.

Runs on any device torch runs on; the cpu backend uses it, the others fall back to it. It computes
exactly what separate per-sequence calls would, which is why it is the reference the fused kernels
are checked against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segmented_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: list[int],
    *,
    scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention per segment of a packed row, TND layout.

    q: [T, H, D]; k, v: [T, Hkv, D] (Hkv divides H: grouped-query attention); offsets: the R+1
    segment boundaries in tokens, from 0 to T. Returns [T, H, D].
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    gqa = num_heads != num_kv_heads
    outputs = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        if end <= start:
            continue  # an empty segment has no tokens to attend from
        # [L, H, D] -> [1, H, L, D], the layout SDPA wants
        qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out = F.scaled_dot_product_attention(
            qs, ks, vs, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=gqa
        )
        outputs.append(out[0].transpose(0, 1))
    if not outputs:
        return q.new_zeros(q.shape[0], num_heads, v.shape[-1])
    return torch.cat(outputs, dim=0)
