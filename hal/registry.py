"""Choosing a backend: `get_backend(name)` and `available_backends()`."""

from __future__ import annotations

import torch

from hal import BACKEND_NAMES
from hal.base import DeviceBackend, DeviceNotAvailableError
from hal.cpu import CpuBackend
from hal.cuda import CudaBackend
from hal.npu import NpuBackend, import_torch_npu, torch_npu_installed

_CLASSES: dict[str, type[DeviceBackend]] = {
    "cpu": CpuBackend,
    "cuda": CudaBackend,
    "npu": NpuBackend,
}
_INSTANCES: dict[str, DeviceBackend] = {}


def _npu_status() -> str | None:
    """None when an NPU is usable, else why not (never raises, imports torch_npu only if installed)."""
    if not torch_npu_installed():
        return "torch_npu is not installed"
    try:
        import_torch_npu()
        if not torch.npu.is_available():
            return "torch_npu is installed but sees no NPU"
    except Exception as exc:  # a broken CANN install surfaces here; report it, do not crash
        return f"torch_npu failed to initialise ({type(exc).__name__}: {exc})"
    return None


def _cuda_status() -> str | None:
    """None when a GPU is usable, else why not."""
    try:
        if torch.version.cuda is None:
            return "this torch build has no CUDA support (a +cpu wheel)"
        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
    except Exception as exc:
        return f"CUDA failed to initialise ({type(exc).__name__}: {exc})"
    return None


_STATUS = {"cpu": lambda: None, "cuda": _cuda_status, "npu": _npu_status}
_NEEDS = {
    "cuda": "an NVIDIA driver and a CUDA build of torch",
    "npu": "CANN plus torch_npu (never install torch_npu without CANN: it breaks `import torch`)",
}


def unavailable_reason(name: str) -> str | None:
    """None when device type `name` (cpu, cuda, npu) is usable here, else why not; never raises."""
    return _STATUS[backend_class(name).name]()


def available_backends() -> list[str]:
    """Device types usable in this process, best first among accelerators, cpu always last.

    Cheap and never raises; torch_npu is imported only when it is installed.
    """
    return [name for name in ("npu", "cuda", "cpu") if _STATUS[name]() is None]


def backend_class(name: str) -> type[DeviceBackend]:
    """The backend class for cpu/cuda/npu, without checking that the device is present."""
    if name not in _CLASSES:
        raise ValueError(f"device={name!r} is not a known device type; use one of {list(_CLASSES)}")
    return _CLASSES[name]


def get_backend(name: str = "auto") -> DeviceBackend:
    """The backend for `name` in auto | cpu | cuda | npu (the `device` config key).

    auto picks npu if torch_npu imports and sees a device, else cuda if available, else cpu.
    Raises ValueError for an unknown name and DeviceNotAvailableError (a RuntimeError) when the
    asked-for device is absent.
    """
    if not isinstance(name, str) or name not in BACKEND_NAMES:
        raise ValueError(
            f"device={name!r} is not a known device; use one of {list(BACKEND_NAMES)} "
            "(e.g. device=auto to pick the best one present)"
        )
    if name == "auto":
        name = available_backends()[0]
    else:
        why = _STATUS[name]()
        if why is not None:
            found = ", ".join(available_backends())
            raise DeviceNotAvailableError(
                f"asked for {name!r} but {why}; found: {found}. Fix: set device=auto to use what "
                f"is here, or run on a host with {name} devices and {_NEEDS[name]}."
            )
    if name not in _INSTANCES:
        _INSTANCES[name] = _CLASSES[name]()
    return _INSTANCES[name]


def is_collective_error(err: BaseException) -> bool:
    """Whether any device's backend recognises ``err`` as a broken collective
    (``CollectiveFaults.is_collective_error`` of the cpu, cuda and npu backends; no device
    is touched): the driver reading a worker's error does not always run that device."""
    return any(backend_class(name).is_collective_error(err) for name in BACKEND_NAMES[1:])


def is_out_of_memory(err: BaseException) -> bool:
    """Whether any device's backend recognises ``err`` as device memory running out
    (``MemoryFaults.is_out_of_memory`` of the cpu, cuda and npu backends; no device is
    touched): never a reason to fall back to a kernel that needs more memory."""
    return any(backend_class(name).is_out_of_memory(err) for name in BACKEND_NAMES[1:])
