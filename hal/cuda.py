"""The cuda backend: NVIDIA GPUs with NCCL; varlen attention in half precision through
flash-attn when installed and loadable, else torch's own flash varlen kernel
(``torch.nn.attention.varlen``), else SDPA per segment."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import warnings
from collections.abc import Callable

import torch

from hal import RAY_RESOURCES
from hal.base import DeviceBackend
from hal.kernels import LIGER
from hal.shared_prefix import LAST_LAYOUT

#: Dtypes the fused varlen kernels take.
HALF = (torch.float16, torch.bfloat16)

#: Kernels that failed once in this process (import or first call): never tried again.
_BROKEN: dict[str, str] = {}


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
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
) -> dict:
    """Keyword arguments for `flash_attn.flash_attn_varlen_func(q, k, v, **kwargs)` (causal).

    cu_seqlens: [R+1] token offsets of the packed segments; max_seqlen: longest segment in
    tokens; scale: softmax scale. flash-attn wants int32 offsets on the same device as q, and
    `deterministic` selects its deterministic backward. ``cu_seqlens_k`` / ``max_seqlen_k``:
    the keys' own offsets and longest segment when they differ from the queries' (shared
    prompts, ``hal.shared_prefix``; flash-attn aligns the causal mask bottom-right then).
    """
    offsets = cu_seqlens.to(torch.int32)
    keys = offsets if cu_seqlens_k is None else cu_seqlens_k.to(torch.int32)
    return {
        "cu_seqlens_q": offsets,
        "cu_seqlens_k": keys,
        "max_seqlen_q": int(max_seqlen),
        "max_seqlen_k": int(max_seqlen if max_seqlen_k is None else max_seqlen_k),
        "dropout_p": float(dropout),
        "softmax_scale": float(scale),
        "causal": True,
        "deterministic": bool(deterministic),
    }


def _mark_broken(kernel: str, err: BaseException) -> None:
    """Remember that ``kernel`` failed and say so once; the caller falls back."""
    if kernel not in _BROKEN:
        _BROKEN[kernel] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
        warnings.warn(
            f"crossrl: {kernel} failed ({_BROKEN[kernel]}); varlen attention falls back to "
            "SDPA per segment (slower, same results). `crossrl devices` shows the kernel in use.",
            RuntimeWarning,
            stacklevel=3,
        )


@functools.cache
def _torch_varlen_fn() -> Callable | None:
    """``torch.nn.attention.varlen.varlen_attn`` when this torch has it, else None (looked
    up once: attention runs once per layer per micro-batch)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _torch_varlen_params() -> frozenset[str]:
    """The parameter names of this torch's ``varlen_attn`` (read once)."""
    fn = _torch_varlen_fn()
    return frozenset(inspect.signature(fn).parameters) if fn is not None else frozenset()


def torch_varlen_kwargs(
    parameters, *, scale: float, head_dim: int, gqa: bool
) -> dict[str, object] | None:
    """Keyword arguments that make torch's ``varlen_attn`` causal with ``scale``, for the
    parameter names its signature has (they changed between torch releases: ``is_causal`` in
    2.9, ``window_size`` and ``scale`` from 2.10, ``enable_gqa`` later).

    ``parameters``: the names ``varlen_attn`` accepts. Returns None when this version cannot
    express the call (no way to ask for causal masking, or a non-default scale it cannot take);
    grouped-query attention without ``enable_gqa`` is handled by the caller repeating k/v.
    """
    names = set(parameters)
    kwargs: dict[str, object] = {}
    if "window_size" in names:
        kwargs["window_size"] = (-1, 0)  # causal: nothing to the right
    elif "is_causal" in names:
        kwargs["is_causal"] = True
    else:
        return None
    if "scale" in names:
        kwargs["scale"] = float(scale)
    elif abs(scale - head_dim**-0.5) > 1e-12 * max(1.0, scale):
        return None
    if gqa and "enable_gqa" in names:
        kwargs["enable_gqa"] = True
    return kwargs


class CudaBackend(DeviceBackend):
    """NVIDIA GPUs through torch.cuda and NCCL."""

    name = "cuda"
    device_type = "cuda"
    process_group_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    ray_resource = RAY_RESOURCES["cuda"]
    ray_noset_env_var = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
    # torch raises DistBackendError for NCCL's errors; its text, where only that survives: a
    # peer gone or a link down (ncclRemoteError, ncclSystemError), the watchdog's timeout.
    collective_error_patterns = (
        r"\bncclRemoteError\b|\bncclSystemError\b",
        r"remote process exited or there was a network error",
        r"Watchdog caught collective operation timeout",
        r"NCCL communicator was aborted",
    )
    # torch raises OutOfMemoryError for its allocator; cuBLAS's own workspace, and a kernel's
    # launch, word it in a plain RuntimeError
    out_of_memory_patterns = (r"CUBLAS_STATUS_ALLOC_FAILED", r"CUDA error: out of memory")
    # vLLM 0.24's batch_invariant.py: its own matmul/softmax/mean kernels, one-split attention
    vllm_batch_invariant = True
    # Liger-Kernel's RMSNorm, SwiGLU and RoPE, crossrl's fused head, torch's fused AdamW
    # (hal.kernels)
    kernel_providers = LIGER
    # vLLM 0.24's own engine (vllm/distributed/weight_transfer/nccl_engine.py): PyNccl over a
    # StatelessProcessGroup, one communicator per process.
    weight_transfer_engine = "nccl"
    weight_transfer_trainer = (
        "vllm.distributed.weight_transfer.nccl_engine",
        "NCCLWeightTransferEngine",
    )
    # ... and its engine for a colocated trainer (ipc_engine.py): CUDA IPC handles of one
    # packed buffer per GPU, keyed by the GPU's UUID.
    colocated_transfer_engine = "ipc"
    colocated_transfer_trainer = (
        "vllm.distributed.weight_transfer.ipc_engine",
        "IPCWeightTransferEngine",
    )

    def collective_timeout_env(self, timeout_s: float, environ=None) -> dict[str, str]:
        """NCCL's watchdog tears the process down when a collective passes the process
        group's timeout (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, torch's default, set here so a
        user's shell cannot turn it off unseen): a hung rank becomes a dead one, which
        ``run.max_restarts`` restarts. A value already exported is left to the user."""
        environ = os.environ if environ is None else environ
        wanted = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
        return {k: v for k, v in wanted.items() if k not in environ}

    def profiler_activities(self) -> list:
        """Host operators and CUDA kernels."""
        from torch.profiler import ProfilerActivity

        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]

    def device_names(self) -> list[str]:
        """Marketing name of every visible GPU."""
        return [torch.cuda.get_device_name(i) for i in range(self.device_count())]

    def deterministic_env(self) -> dict[str, str]:
        """cuBLAS needs a fixed workspace to pick deterministic GEMM algorithms.

        NCCL needs nothing: its reductions are deterministic for a fixed world size and topology.
        """
        return {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}

    def _set_deterministic_torch_flags(self) -> dict[str, str]:
        """cuDNN's deterministic convolutions, no autotuning, and no cuDNN attention inside
        SDPA: its backward has no deterministic mode (the H100 probe of 2026-11-26 warned
        `cuDNN Attention defaults to a non-deterministic algorithm` in SDPA per segment), while
        the flash and memory-efficient kernels SDPA then picks honour
        ``use_deterministic_algorithms``."""
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.enable_cudnn_sdp(False)
        return {
            "torch.backends.cudnn.deterministic": "True",
            "torch.backends.cudnn.benchmark": "False",
            "torch.backends.cuda.enable_cudnn_sdp": "False",
        }

    @property
    def attention_impl_name(self) -> str:
        if flash_attn_installed() and "flash-attn" not in _BROKEN:
            return "flash-attn varlen (fp16/bf16), sdpa-segmented (fp32)"
        if _torch_varlen_fn() is not None and "torch varlen_attn" not in _BROKEN:
            return (
                "torch varlen_attn (fp16/bf16, flash-attn not installed), "
                "sdpa-segmented (fp32 and deterministic runs)"
            )
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
        """Half precision: flash-attn varlen when installed and loadable, else torch's flash
        varlen kernel (not in deterministic mode: its backward accumulates with atomics);
        fp32, and any kernel that failed once, take SDPA per segment (the exact reference)."""
        if q.dtype in HALF and dropout == 0.0:
            if flash_attn_installed() and "flash-attn" not in _BROKEN:
                out = self._flash_attn(q, k, v, cu_seqlens, max_seqlen, scale)
                if out is not None:
                    return out
            if not torch.are_deterministic_algorithms_enabled():
                out = self._torch_varlen(q, k, v, cu_seqlens, max_seqlen, scale)
                if out is not None:
                    return out
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

    def shared_prompt_kernel(
        self, dtype: torch.dtype, deterministic: bool | None = None
    ) -> str | None:
        """flash-attn varlen, else torch's varlen_attn (not in deterministic mode), both with
        separate query and key offsets, in half precision; None otherwise."""
        if dtype not in HALF:
            return None
        if flash_attn_installed() and "flash-attn" not in _BROKEN:
            return "flash-attn varlen (query and key offsets)"
        if deterministic is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
        usable = _torch_varlen_fn() is not None and "torch varlen_attn" not in _BROKEN
        if usable and not deterministic:
            return "torch varlen_attn (query and key offsets)"
        return None

    def shared_prefix_attention(self, q, k, v, offsets, parents, *, scale, dropout=0.0):
        """The shared layout on a fused kernel (``hal.shared_prefix``): each segment's keys
        are gathered (its root's, then its own) and the kernel runs with separate query and
        key offsets; the SDPA reference where none applies."""
        kernel = self.shared_prompt_kernel(q.dtype)
        if kernel is not None and dropout == 0.0:
            layout, index, cu_q, cu_k = LAST_LAYOUT.get(offsets, parents, q.device)
            keys, values = k.index_select(0, index), v.index_select(0, index)
            lengths = (cu_q, layout.max_q, scale, cu_k, layout.max_k)
            if kernel.startswith("flash-attn"):
                out = self._flash_attn(q, keys, values, *lengths)
            else:
                out = self._torch_varlen(q, keys, values, *lengths)
            if out is not None:
                return out
        return super().shared_prefix_attention(
            q, k, v, offsets, parents, scale=scale, dropout=dropout
        )

    @staticmethod
    def _flash_attn(
        q, k, v, cu_seqlens, max_seqlen, scale, cu_k=None, max_k=None
    ) -> torch.Tensor | None:
        # PyPI ships flash-attn as source: an install built against another torch or CUDA
        # imports or loads badly, and must not take the run down with it.
        try:
            from flash_attn import flash_attn_varlen_func

            kwargs = flash_attn_varlen_kwargs(
                cu_seqlens.to(q.device),
                max_seqlen,
                scale,
                deterministic=torch.are_deterministic_algorithms_enabled(),
                cu_seqlens_k=None if cu_k is None else cu_k.to(q.device),
                max_seqlen_k=max_k,
            )
            return flash_attn_varlen_func(q, k, v, **kwargs)
        except torch.OutOfMemoryError:
            raise  # a real limit, not a broken kernel
        except (ImportError, OSError, RuntimeError) as err:
            _mark_broken("flash-attn", err)
            return None

    @staticmethod
    def _torch_varlen(
        q, k, v, cu_seqlens, max_seqlen, scale, cu_k=None, max_k=None
    ) -> torch.Tensor | None:
        fn = _torch_varlen_fn()
        if fn is None or "torch varlen_attn" in _BROKEN:
            return None
        gqa = q.shape[1] != k.shape[1]
        kwargs = torch_varlen_kwargs(
            _torch_varlen_params(), scale=scale, head_dim=q.shape[-1], gqa=gqa
        )
        if kwargs is None:
            return None
        if gqa and "enable_gqa" not in kwargs:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        keys = cu if cu_k is None else cu_k.to(device=q.device, dtype=torch.int32)
        max_keys = int(max_seqlen if max_k is None else max_k)
        try:
            return fn(q, k, v, cu, keys, int(max_seqlen), max_keys, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, NotImplementedError, TypeError) as err:
            _mark_broken("torch varlen_attn", err)
            return None
