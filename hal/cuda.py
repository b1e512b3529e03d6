"""The cuda backend: NVIDIA GPUs with NCCL, flash-attn varlen when installed."""

from __future__ import annotations

import importlib.util

import torch

from hal.base import DeviceBackend


def flash_attn_installed() -> bool:
    """True when the `flash_attn` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("flash_attn") is not None


def flash_attn_varlen_kwargs(
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    *,
    dropout: float = 0.0,
    deterministic: bool = False,
) -> dict:
    """Keyword arguments for `flash_attn.flash_attn_varlen_func(q, k, v, **kwargs)` (causal).

    cu_seqlens: [R+1] token offsets of the packed segments; max_seqlen: longest segment in
    tokens; scale: softmax scale. flash-attn wants int32 offsets on the same device as q, and
    `deterministic` selects its deterministic backward.
    """
    offsets = cu_seqlens.to(torch.int32)
    return {
        "cu_seqlens_q": offsets,
        "cu_seqlens_k": offsets,
        "max_seqlen_q": int(max_seqlen),
        "max_seqlen_k": int(max_seqlen),
        "dropout_p": float(dropout),
        "softmax_scale": float(scale),
        "causal": True,
        "deterministic": bool(deterministic),
    }


class CudaBackend(DeviceBackend):
    """NVIDIA GPUs through torch.cuda and NCCL."""

    name = "cuda"
    device_type = "cuda"
    process_group_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    ray_resource = "GPU"
    ray_noset_env_var = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"

    def device_names(self) -> list[str]:
        """Marketing name of every visible GPU."""
        return [torch.cuda.get_device_name(i) for i in range(self.device_count())]

    def deterministic_env(self) -> dict[str, str]:
        """cuBLAS needs a fixed workspace to pick deterministic GEMM algorithms.

        NCCL needs nothing: its reductions are deterministic for a fixed world size and topology.
        """
        return {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}

    def _set_deterministic_torch_flags(self) -> dict[str, str]:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        return {
            "torch.backends.cudnn.deterministic": "True",
            "torch.backends.cudnn.benchmark": "False",
        }

    @property
    def attention_impl_name(self) -> str:
        if flash_attn_installed():
            return "flash-attn varlen (fp16/bf16), sdpa-segmented (fp32)"
        return "sdpa-segmented (flash-attn not installed)"

    def varlen_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        *,
        max_seqlen: int,
        scale: float,
        dropout: float = 0.0,
        cu_seqlens_host: list[int] | None = None,
    ) -> torch.Tensor:
        """flash-attn varlen for half precision when installed, else SDPA per segment."""
        # flash-attn has no fp32 kernel; fp32 (parity runs) takes the exact reference path
        if q.dtype in (torch.float16, torch.bfloat16) and flash_attn_installed():
            from flash_attn import flash_attn_varlen_func

            kwargs = flash_attn_varlen_kwargs(
                cu_seqlens.to(q.device),
                max_seqlen,
                scale,
                dropout=dropout,
                deterministic=torch.are_deterministic_algorithms_enabled(),
            )
            return flash_attn_varlen_func(q, k, v, **kwargs)
        return super().varlen_attention(
            q,
            k,
            v,
            cu_seqlens,
            max_seqlen=max_seqlen,
            scale=scale,
            dropout=dropout,
            cu_seqlens_host=cu_seqlens_host,
        )
