"""Varlen causal attention for HF models, registered with transformers as `crossrl_varlen`.

Packed rows (a batch of one row of T tokens holding several sequences, boundaries in cu_seqlens)
run through the current device's varlen kernel, so no token attends across a sequence boundary
and no dense [T, T] mask is built. Ordinary [B, S] input (generation, padded batches) runs as
plain causal attention per batch row, honouring the padding mask.

Why not transformers' own packing detection: it only works with use_cache=False and then builds a
dense mask; with the default use_cache=True, packed rows silently attend to each other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hal.base import DeviceBackend
from hal.cpu import CpuBackend
from hal.cuda import CudaBackend
from hal.npu import NpuBackend

ATTN_IMPLEMENTATION = "crossrl_varlen"
"""Pass as `attn_implementation=` when creating a model that will see packed rows."""

# Kernels are picked by the tensors' device type, so one registered function serves every backend.
_KERNELS: dict[str, DeviceBackend] = {
    "cpu": CpuBackend(),
    "cuda": CudaBackend(),
    "npu": NpuBackend(),
}


def _kernel_owner(device: torch.device) -> DeviceBackend:
    # other device types (meta, mps, xpu) get the reference path, which is plain torch
    return _KERNELS.get(device.type, _KERNELS["cpu"])


def shared_prompt_kernel(device: torch.device, dtype: torch.dtype) -> str | None:
    """The kernel that runs shared prompts on ``device`` at compute dtype ``dtype``, or None
    where no fused kernel takes them and prompts should stay unshared
    (``DeviceBackend.shared_prompt_kernel``)."""
    return _kernel_owner(device).shared_prompt_kernel(dtype)


def validate_cu_seqlens(cu_seqlens: torch.Tensor | list[int], total_tokens: int) -> list[int]:
    """Check packed-row offsets and return them as a python list.

    cu_seqlens: [R+1] token offsets, starting at 0, non-decreasing, ending at total_tokens.
    Raises ValueError naming the problem.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
            raise ValueError(
                f"cu_seqlens has shape {tuple(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}; "
                "it must be a 1-D int32/int64 tensor of R+1 token offsets"
            )
        offsets = [int(x) for x in cu_seqlens.tolist()]
    else:
        offsets = [int(x) for x in cu_seqlens]
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != total_tokens:
        head = offsets if len(offsets) <= 6 else offsets[:3] + ["..."] + offsets[-2:]
        raise ValueError(
            f"cu_seqlens={head} must start at 0 and end at the row length {total_tokens} tokens "
            "(R+1 offsets for R sequences)"
        )
    if any(b < a for a, b in zip(offsets[:-1], offsets[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing; got {offsets[:16]}")
    return offsets


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Segment offsets of a packed row from its position ids: a sequence starts wherever the
    position does not follow the previous one by +1 (as transformers' masking utils decide).

    position_ids: [T] positions. Returns int32 [R+1] offsets on the same device.
    """
    pos = position_ids.reshape(-1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    idx = torch.nonzero(starts).reshape(-1).to(torch.int32)
    end = torch.tensor([pos.numel()], dtype=torch.int32, device=pos.device)
    return torch.cat([idx, end])


class _HostOffsets:
    """Remembers the python-list form of the last cu_seqlens tensor seen, and its shared
    prompts (``parents``, see ``packed_forward``).

    Every layer of one forward receives the same tensor; converting it once saves a device-to-host
    sync per layer on the kernels that need host offsets (cpu reference, npu).
    """

    def __init__(self) -> None:
        self._tensor: torch.Tensor | None = None
        self._version = -1
        self._offsets: list[int] = []
        self._parents: list[int] | None = None

    def get(self, cu_seqlens: torch.Tensor) -> list[int]:
        if cu_seqlens is not self._tensor or cu_seqlens._version != self._version:
            self.put(cu_seqlens, [int(x) for x in cu_seqlens.tolist()])
        return self._offsets

    def parents(self, cu_seqlens: torch.Tensor) -> list[int] | None:
        """The shared prompts put with ``cu_seqlens`` (call ``get`` first), or None."""
        return self._parents if cu_seqlens is self._tensor else None

    def put(
        self, cu_seqlens: torch.Tensor, offsets: list[int], parents: list[int] | None = None
    ) -> None:
        self._tensor, self._version, self._offsets = cu_seqlens, cu_seqlens._version, offsets
        self._parents = parents


_HOST_OFFSETS = _HostOffsets()


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    max_seqlen: int | None = None,
    dropout: float = 0.0,
    parents: list[int] | None = None,
) -> torch.Tensor:
    """Causal attention over a packed row on whatever device q lives on.

    q: [T, H, D]; k, v: [T, Hkv, D] (Hkv divides H); cu_seqlens: [R+1] token offsets, 0..T;
    scale: softmax scale (default D**-0.5); max_seqlen: longest segment in tokens (computed when
    omitted); parents: per segment, the segment whose tokens it continues (a prompt several
    samples share: it attends to all of them first) or -1; None: every segment stands alone.
    Returns [T, H, D].
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"varlen_attention wants TND tensors; got q{tuple(q.shape)}, k{tuple(k.shape)}, "
            f"v{tuple(v.shape)}: pass [tokens, heads, head_dim]"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"query heads {q.shape[1]} is not a multiple of key/value heads {k.shape[1]}"
        )
    offsets = _HOST_OFFSETS.get(cu_seqlens)
    if not offsets or offsets[0] != 0 or offsets[-1] != q.shape[0]:
        validate_cu_seqlens(offsets, q.shape[0])  # raises the ValueError that names the fix
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if parents is not None:  # shared prompts: the backend's fused kernel or the reference
        return _kernel_owner(q.device).shared_prefix_attention(
            q, k, v, offsets, parents, scale=scale, dropout=dropout
        )
    if max_seqlen is None:
        max_seqlen = max((b - a for a, b in zip(offsets[:-1], offsets[1:])), default=0)
    return _kernel_owner(q.device).varlen_attention(
        q,
        k,
        v,
        cu_seqlens,
        max_seqlen=int(max_seqlen),
        scale=scale,
        dropout=dropout,
        cu_seqlens_host=offsets,
    )


def _dense_causal_attention(query, key, value, attention_mask, scale, dropout):
    """Plain causal attention on [B, H, S, D] tensors with an optional padding or 4-D mask.

    Queries are the last q_len positions of the kv_len keys (bottom-right aligned), which covers
    prefill (q_len == kv_len) and cached decoding (q_len < kv_len).
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if attention_mask is None and q_len == kv_len:
        return F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=gqa
        )
    if attention_mask is not None and attention_mask.dim() == 4:
        mask = attention_mask  # already a full mask (given by the caller): use it as is
    else:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)
        k_pos = torch.arange(kv_len, device=query.device)
        mask = (k_pos[None, :] <= q_pos[:, None])[None, None]  # [1, 1, q, kv]
        if attention_mask is not None:  # 2-D padding mask [B, kv], True = real token
            mask = mask & attention_mask[:, None, None, -kv_len:].to(torch.bool)
    if mask.dtype == torch.bool:
        # a query with no visible key (a left-padding slot) would give NaN; its output is unused
        mask = mask | ~mask.any(dim=-1, keepdim=True)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=gqa
    )


def _packed_offsets(kwargs: dict, batch: int, q_len: int, kv_len: int, attention_mask):
    """cu_seqlens for this call when the input is one packed row, else None."""
    if batch != 1 or q_len != kv_len or attention_mask is not None:
        return None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        return cu
    position_ids = kwargs.get("position_ids")
    if position_ids is None or q_len < 2:
        return None
    pos = position_ids[0] if position_ids.dim() == 3 else position_ids  # mrope: temporal row
    if pos.dim() != 2 or pos.shape[0] != 1 or pos.shape[1] != q_len:
        return None
    cu = cu_seqlens_from_position_ids(pos[0])
    return cu if cu.numel() > 2 else None  # one segment: the dense causal path is the same


def crossrl_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function for `crossrl_varlen`.

    query: [B, H, S, D]; key, value: [B, Hkv, Skv, D]. Returns ([B, S, H, D], None).
    Packed rows are recognised from `cu_seq_lens_q` (what `packed_forward` passes) or, failing
    that, from position ids that restart inside a single row.
    """
    if sliding_window is not None or softcap is not None:
        raise NotImplementedError(
            f"{ATTN_IMPLEMENTATION} does not implement sliding_window={sliding_window} or "
            f"softcap={softcap}; create this model with attn_implementation='sdpa' or 'flash_attention_2'"
        )
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise NotImplementedError(
            f"{ATTN_IMPLEMENTATION} implements causal decoder attention only; give non-causal "
            "sub-models (e.g. a vision tower) attn_implementation='sdpa'"
        )
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    batch, _, q_len, _ = query.shape
    cu = _packed_offsets(kwargs, batch, q_len, key.shape[2], attention_mask)
    if cu is None:
        out = _dense_causal_attention(query, key, value, attention_mask, scale, dropout)
        return out.transpose(1, 2).contiguous(), None
    max_len = kwargs.get("max_length_q")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [1, H, T, D] -> [T, H, D]
    _HOST_OFFSETS.get(cu)
    parents = _HOST_OFFSETS.parents(cu)
    out = varlen_attention(
        q, k, v, cu, scale=scale, max_seqlen=max_len, dropout=dropout, parents=parents
    )
    return out.unsqueeze(0), None


def crossrl_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """transformers mask-interface function for `crossrl_varlen`: never a dense mask.

    Returns the 2-D padding mask [B, kv_length] (True = real token) when some token is padding,
    else None; causality and packing are handled inside the attention function.
    """
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[-1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


_REGISTERED = False


def register_attention() -> str:
    """Register `crossrl_varlen` with transformers' attention and mask interfaces (idempotent).

    Returns the implementation name to pass as `attn_implementation=`.
    """
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, crossrl_attention_forward)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, crossrl_attention_mask)
        _REGISTERED = True
    return ATTN_IMPLEMENTATION


def _check_parents(parents: list[int], segments: int) -> None:
    """Raise ValueError unless ``parents`` names, per segment, -1 or an earlier segment that
    continues nothing itself."""
    if len(parents) != segments:
        raise ValueError(f"parents has {len(parents)} entries; want one per segment ({segments})")
    for s, p in enumerate(parents):
        if p >= s or p < -1 or (p >= 0 and parents[p] != -1):
            raise ValueError(
                f"parents[{s}]={p}: a segment continues -1 (none) or an earlier segment "
                "that continues none itself"
            )


def packed_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    parents: list[int] | None = None,
    **model_kwargs,
) -> torch.Tensor:
    """Run an HF causal LM on one packed row; returns logits [T, V].

    input_ids: [T] token ids; position_ids: [T] (or [3, T] for multimodal rope), restarting at
    each sequence; cu_seqlens: [R+1] token offsets of the R sequences. The model must have been
    created with attn_implementation=ATTN_IMPLEMENTATION. Calls it with use_cache=False (a cache
    is useless for training and would change transformers' mask handling).
    parents: per segment, the segment it continues, or -1 (``varlen_attention``): a prompt
    that several samples share is one segment, each sample's rest another whose positions
    continue the prompt's; None: every segment is a sequence of its own.
    """
    register_attention()
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"model uses attn_implementation={impl!r}; packed rows need {ATTN_IMPLEMENTATION!r} "
            "or sequences would attend to each other. Create the model with "
            f"attn_implementation=hal.ATTN_IMPLEMENTATION (after hal.register_attention())"
        )
    if input_ids.dim() != 1:
        raise ValueError(
            f"input_ids has shape {tuple(input_ids.shape)}; packed_forward wants one packed row [T]"
        )
    total = input_ids.shape[0]
    if position_ids.shape[-1] != total or position_ids.dim() not in (1, 2):
        raise ValueError(
            f"position_ids has shape {tuple(position_ids.shape)}; want [{total}] or [3, {total}]"
        )
    offsets = validate_cu_seqlens(cu_seqlens, total)
    cu = torch.tensor(offsets, dtype=torch.int32, device=input_ids.device)
    if parents is not None:
        _check_parents(parents, len(offsets) - 1)
    _HOST_OFFSETS.put(cu, offsets, parents)  # spare every layer the device-to-host copy
    max_len = max(b - a for a, b in zip(offsets[:-1], offsets[1:]))
    pos = position_ids[None] if position_ids.dim() == 1 else position_ids[:, None, :]
    out = model(
        input_ids=input_ids[None],
        position_ids=pos,
        use_cache=False,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=max_len,
        max_length_k=max_len,
        **model_kwargs,
    )
    return out.logits[0]
