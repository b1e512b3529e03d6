"""crossrl's device abstraction layer: one small backend per device type (cpu, cuda, npu).

    backend = hal.get_backend(cfg.device)          # auto | cpu | cuda | npu
    backend.init_process_group(rank, world, master_addr=..., master_port=..., timeout_s=...)
    model = AutoModelForCausalLM.from_config(c, attn_implementation=hal.register_attention())
    logits = hal.packed_forward(model, input_ids, position_ids, cu_seqlens)   # [T, V]

See docs/hal.md. This package imports only torch (transformers only inside register_attention).
"""

from hal.attention import (
    ATTN_IMPLEMENTATION,
    crossrl_attention_forward,
    cu_seqlens_from_position_ids,
    packed_forward,
    register_attention,
    validate_cu_seqlens,
    varlen_attention,
)
from hal.base import (
    DeviceBackend,
    DeviceNotAvailableError,
    ipc_rebuild_args,
    open_shared_buffer,
    walk_tensors,
)
from hal.cpu import CpuBackend
from hal.cuda import CudaBackend, flash_attn_varlen_kwargs
from hal.describe import describe
from hal.npu import NpuBackend, npu_causal_mask, npu_fusion_attention_args
from hal.registry import BACKEND_NAMES, available_backends, backend_class, get_backend

__all__ = [
    "ATTN_IMPLEMENTATION",
    "BACKEND_NAMES",
    "CpuBackend",
    "CudaBackend",
    "DeviceBackend",
    "DeviceNotAvailableError",
    "NpuBackend",
    "available_backends",
    "backend_class",
    "crossrl_attention_forward",
    "cu_seqlens_from_position_ids",
    "describe",
    "flash_attn_varlen_kwargs",
    "get_backend",
    "ipc_rebuild_args",
    "npu_causal_mask",
    "npu_fusion_attention_args",
    "open_shared_buffer",
    "packed_forward",
    "register_attention",
    "validate_cu_seqlens",
    "varlen_attention",
    "walk_tensors",
]
