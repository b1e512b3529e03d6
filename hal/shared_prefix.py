"""Shared prompts on the fused varlen kernels: separate query and key offsets.

A packed row in the shared layout (``batching.share_prompts``) holds each shared prompt once,
as a *root* segment, and each sample's rest as a *continuation* segment that attends to its
root first (``parents``). The fused varlen kernels take that as ordinary varlen attention
with separate query and key offsets: the queries are the row as it is (``cu_q`` = its
offsets); segment s's keys are its root's tokens followed by its own (a gather of k and v,
not a second pass through the model), and the causal mask is aligned bottom-right (a
query at position i of an L-token continuation sees every key up to its own place among
the P + L keys). flash-attn's ``flash_attn_varlen_func`` (``cu_seqlens_q`` / ``cu_seqlens_k``,
``causal=True``), torch's ``varlen_attn`` (``cu_seq_q`` / ``cu_seq_k``, window (-1, 0)) and
``torch_npu.npu_fusion_attention`` (``actual_seq_qlen`` / ``actual_seq_kvlen``,
``sparse_mode=3``, right-down causal) all align it so.

``shared_kv_layout`` is that bookkeeping (pure, on the host); ``kv_varlen_sdpa`` computes
the same attention with SDPA per segment, the reference the layout is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SharedKV:
    """Keys of a shared-layout row: ``kv_index`` ``[T_k]`` token of the row behind each key,
    ``cu_k`` ``[S + 1]`` key offsets per segment (the queries' are the row's own offsets),
    and the longest query and key segment, in tokens."""

    kv_index: list[int]
    cu_k: list[int]
    max_q: int
    max_k: int


def shared_kv_layout(offsets: list[int], parents: list[int]) -> SharedKV:
    """The keys of every segment of a row with ``offsets`` (S + 1 token boundaries) whose
    segment s continues ``parents[s]`` (or -1): the parent's tokens, then its own."""
    kv_index: list[int] = []
    cu_k = [0]
    max_q = max_k = 0
    for s, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        p = parents[s]
        if p >= 0:
            kv_index.extend(range(offsets[p], offsets[p + 1]))
        kv_index.extend(range(start, end))
        cu_k.append(len(kv_index))
        max_q = max(max_q, end - start)
        max_k = max(max_k, cu_k[-1] - cu_k[-2])
    return SharedKV(kv_index, cu_k, max_q, max_k)


def kv_varlen_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: list[int],
    cu_k: list[int],
    *,
    scale: float,
) -> torch.Tensor:
    """Varlen causal attention with separate query and key offsets, bottom-right aligned:
    segment s's ``cu_q[s+1] - cu_q[s]`` queries are the last of its keys
    ``k[cu_k[s]:cu_k[s+1]]``. q: [T_q, H, D]; k, v: [T_k, Hkv, D]. Returns [T_q, H, D]. One
    SDPA call per segment: the reference of what the fused kernels compute."""
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    gqa = q.shape[1] != k.shape[1]
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        if q1 == q0:
            continue
        length, span = q1 - q0, k1 - k0
        mask = torch.arange(span, device=q.device)[None, :] <= (
            span - length + torch.arange(length, device=q.device)[:, None]
        )
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (q[q0:q1], k[k0:k1], v[k0:k1]))
        seg = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
        out[q0:q1] = seg[0].transpose(0, 1)
    return out


class _LastLayout:
    """The layout of the last (offsets, parents) seen, on one device: every layer of a
    forward asks with the same ones."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: tuple[SharedKV, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def get(self, offsets: list[int], parents: list[int], device: torch.device):
        """``(layout, kv_index, cu_q, cu_k)``, the last three as int tensors on ``device``."""
        key = (tuple(offsets), tuple(parents), device)
        if key != self._key:
            layout = shared_kv_layout(offsets, parents)
            self._key = key
            self._value = (
                layout,
                torch.tensor(layout.kv_index, dtype=torch.long, device=device),
                torch.tensor(offsets, dtype=torch.int32, device=device),
                torch.tensor(layout.cu_k, dtype=torch.int32, device=device),
            )
        return self._value


LAST_LAYOUT = _LastLayout()
