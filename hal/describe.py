"""What the HAL sees on this machine: the data behind `crossrl devices`."""

from __future__ import annotations

import importlib.metadata

import torch

from hal.kernels import choose_kernels
from hal.registry import available_backends, get_backend

VERSIONED_PACKAGES = (
    "torch",
    "torch_npu",
    "transformers",
    "vllm",
    "vllm_ascend",
    "flash_attn",
    "ray",
)


def package_version(name: str) -> str:
    """Installed version of a distribution, or "not installed"; never imports the package."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def describe(name: str = "auto") -> dict:
    """Facts about the backend `name` picks here, as plain JSON-able values.

    Keys: backend, available_backends, device_type, device_count, device_names,
    process_group_backend, attention_impl, kernels, visible_devices_env, ray_resource,
    versions.
    """
    backend = get_backend(name)
    try:
        names = backend.device_names()
    except Exception as exc:  # a device query can fail on a half-configured driver; say so
        names = [f"unknown ({type(exc).__name__})"]
    return {
        "backend": backend.name,
        "available_backends": available_backends(),
        "device_type": backend.device_type,
        "device_count": backend.device_count(),
        "device_names": names,
        "process_group_backend": backend.process_group_backend,
        "attention_impl": backend.attention_impl_name,
        # what train.kernels=auto runs here (hal.kernels), loaded as a training rank would
        "kernels": choose_kernels(backend.kernel_providers).report(),
        "visible_devices_env": backend.visible_devices_env,
        "ray_resource": backend.ray_resource,
        # torch's own string carries the build (+cu130, +cpu) that distribution metadata
        # may lack, and that is what a version mismatch turns on
        "versions": {
            pkg: torch.__version__ if pkg == "torch" else package_version(pkg)
            for pkg in VERSIONED_PACKAGES
        },
    }
