"""crossrl's device abstraction layer: one small backend per device type (cpu, cuda, npu).

    backend = hal.get_backend(cfg.device)          # auto | cpu | cuda | npu
    backend.init_process_group(rank, world, master_addr=..., master_port=..., timeout_s=...)
    model = AutoModelForCausalLM.from_config(c, attn_implementation=hal.register_attention())
    logits = hal.packed_forward(model, input_ids, position_ids, cu_seqlens)   # [T, V]

See docs/hal.md. This package imports only torch (transformers only inside register_attention),
and that only when one of its names is first used: a process that needs ``BACKEND_NAMES`` alone
(the config schema, the CLI's driver before Ray starts) does not pay for importing torch.
"""

import importlib

BACKEND_NAMES = ("auto", "cpu", "cuda", "npu")
"""Allowed values of the `device` config key."""

RAY_RESOURCES = {"cpu": "CPU", "cuda": "GPU", "npu": "NPU"}
"""The Ray resource of each device type (a backend's ``ray_resource``), known without torch."""

DEFAULT_DEVICE_MEMORY_BYTES: dict[str, float] = {"cuda": 80e9, "npu": 64e9}
"""Memory of one device, in bytes, when the device is not on this machine (an H100, one A3
die): what the memory budget assumes for ``crossrl layout`` elsewhere; known without torch."""

DEFAULT_DEVICE_NAMES: dict[str, str] = {"cuda": "an 80 GB H100", "npu": "a 64 GB Atlas A3 die"}
"""The device ``DEFAULT_DEVICE_MEMORY_BYTES`` describes, for printing."""

#: Where each public name lives; imported on first use (PEP 562).
_EXPORTS = {
    "hal.attention": (
        "ATTN_IMPLEMENTATION",
        "crossrl_attention_forward",
        "cu_seqlens_from_position_ids",
        "packed_forward",
        "register_attention",
        "shared_prompt_kernel",
        "validate_cu_seqlens",
        "varlen_attention",
    ),
    "hal.base": ("DeviceBackend", "DeviceNotAvailableError", "walk_tensors"),
    "hal.handoff": ("close_shared_buffer", "ipc_rebuild_args", "open_shared_buffer"),
    "hal.cpu": ("CpuBackend",),
    "hal.cuda": ("CudaBackend", "flash_attn_varlen_kwargs"),
    "hal.collectives": ("all_gather_flat",),
    "hal.describe": ("describe",),
    "hal.device_memory": (
        "communicator_buffer_bytes",
        "device_total_memory",
        "device_used_reader",
        "process_bytes",
    ),
    "hal.npu": ("NpuBackend", "npu_causal_mask", "npu_fusion_attention_args"),
    "hal.registry": (
        "available_backends",
        "backend_class",
        "get_backend",
        "is_collective_error",
        "is_out_of_memory",
    ),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'hal' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "ATTN_IMPLEMENTATION",
    "BACKEND_NAMES",
    "RAY_RESOURCES",
    "CpuBackend",
    "CudaBackend",
    "DeviceBackend",
    "DeviceNotAvailableError",
    "NpuBackend",
    "all_gather_flat",
    "available_backends",
    "backend_class",
    "close_shared_buffer",
    "communicator_buffer_bytes",
    "crossrl_attention_forward",
    "cu_seqlens_from_position_ids",
    "describe",
    "device_total_memory",
    "device_used_reader",
    "flash_attn_varlen_kwargs",
    "get_backend",
    "ipc_rebuild_args",
    "is_collective_error",
    "is_out_of_memory",
    "npu_causal_mask",
    "npu_fusion_attention_args",
    "open_shared_buffer",
    "packed_forward",
    "process_bytes",
    "register_attention",
    "validate_cu_seqlens",
    "varlen_attention",
    "walk_tensors",
]
