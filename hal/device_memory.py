"""Device memory facts the memory budget needs before anything starts, known without making a
device context in the asking process.

- ``device_total_memory(name)``: bytes of device 0 of a backend, asked in a short child process:
  torch_npu's ``get_device_properties`` (like any first call into the device runtime) sets the
  device and creates a context on it, which the driver would then keep for the whole run on a
  die the ranks and engines share.
- ``process_bytes(name)``: device memory one process holds beyond its tensors (context,
  workspaces, communicators, allocator cache), measured on cuda, the context alone on npu.
- ``communicator_buffer_bytes(name)``: device memory one collective communicator of a backend
  takes for its buffers: HCCL gives every communicator ``2 x HCCL_BUFFSIZE`` MB (send and
  receive; CANN's HCCL_BUFFSIZE reference: default 200, in MB, exclusive to HCCL); on cuda none
  beyond the device context the budget counts (NCCL's buffers, NCCL_BUFFSIZE 4 MiB per channel
  and peer, depend on the topology); none on the cpu.
- ``device_used_reader(name)``: a function that reads the bytes in use on the busiest device
  of backend ``name`` this process can see, every process's allocations and contexts
  counted, without making a device context (NVML on cuda); None where no such reading exists.

- ``allocator_reserve(name)``: what the device's caching allocator reserves per byte its
  tensors take at a step's peak (its cached blocks and fragmentation), which the budget's
  ``auto`` sizes fill the device with (``trainer.loop.plan.auto_sizes``).
- ``FUSED_HEAD_DEVICES``: the backends whose kernel set (``hal.kernels``) offers the fused LM
  head, whose backward holds a float32 ``[V, H]`` weight-gradient accumulator the budget
  counts (a test holds it equal to the backends' ``kernel_providers``).

Imports no torch: the budget's process reads these before any worker starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping

__all__ = [
    "ALLOCATOR_RESERVE",
    "FUSED_HEAD_DEVICES",
    "HCCL_BUFFSIZE_DEFAULT_MB",
    "allocator_reserve",
    "communicator_buffer_bytes",
    "device_total_memory",
    "device_used_reader",
    "process_bytes",
]

#: Device memory one process holds beyond its tensors, bytes, by backend: its context, the
#: libraries' workspaces, its communicators and its allocator's cached blocks. cuda: measured on
#: an H100 (torch 2.11+cu130) on 2026-11-26, three processes of a 1.5B job (actor, reference,
#: HF engine) holding 5.5-5.6 GB beyond their tensors in each of rollout, update and weight push
#: (docs/gpu.md, tier 1). npu: not measured; the context alone, HCCL's buffers counted apart
#: (``communicator_buffer_bytes``).
PROCESS_BYTES = {"cuda": 1.85e9, "npu": 0.5e9, "cpu": 0.0}
#: Bytes the caching allocator reserves per byte of tensors at a step's peak, by backend.
#: cuda: measured on an H100 (torch 2.11+cu130, docs/gpu.md tier 1, the 7B shape's update at
#: 16k tokens): 82.65 GB reserved over 68.63 GB allocated, 1.20. npu: not measured; torch_npu's
#: allocator is a port of torch's (the same block sizes and caching), so the same is assumed.
#: cpu: the host's allocator returns what is freed.
ALLOCATOR_RESERVE = {"cuda": 1.20, "npu": 1.20, "cpu": 1.0}
#: The backends whose kernel set offers ``hal.fused_head`` (``hal.kernels.FUSED_HEAD``).
FUSED_HEAD_DEVICES = frozenset({"cuda", "npu"})
#: CANN's default HCCL_BUFFSIZE, in MB (2**20 bytes), for each communicator's two buffers.
HCCL_BUFFSIZE_DEFAULT_MB = 200

_QUERY = (
    "import sys, hal\n"
    "props = hal.get_backend(sys.argv[1]).device_module().get_device_properties(0)\n"
    "print(int(props.total_memory))\n"
)


def process_bytes(name: str) -> float:
    """Device memory one process of backend ``name`` holds beyond its tensors, bytes
    (``PROCESS_BYTES``)."""
    return PROCESS_BYTES[name]


def allocator_reserve(name: str) -> float:
    """Bytes backend ``name``'s caching allocator reserves per byte its tensors take at a
    step's peak (``ALLOCATOR_RESERVE``)."""
    return ALLOCATOR_RESERVE[name]


def communicator_buffer_bytes(name: str, environ: Mapping[str, str] | None = None) -> float:
    """Device bytes one collective communicator of backend ``name`` holds for its buffers:
    on npu ``2 x HCCL_BUFFSIZE`` MB (``environ``'s HCCL_BUFFSIZE, default os.environ, else
    ``HCCL_BUFFSIZE_DEFAULT_MB``; a value that is not a whole number >= 1 raises ValueError
    naming it); 0 on cuda (inside the device context) and on the cpu."""
    if name != "npu":
        return 0.0
    env = os.environ if environ is None else environ
    raw = env.get("HCCL_BUFFSIZE", "").strip()
    if not raw:
        return 2.0 * HCCL_BUFFSIZE_DEFAULT_MB * 2**20
    try:
        mb = int(raw)
    except ValueError:
        mb = 0
    if mb < 1:
        raise ValueError(
            f"HCCL_BUFFSIZE={raw!r}: must be a whole number of MB >= 1 (CANN's default is "
            f"{HCCL_BUFFSIZE_DEFAULT_MB}); set it so or unset it"
        )
    return 2.0 * mb * 2**20


def device_total_memory(
    name: str,
    *,
    timeout_s: float = 120.0,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> float | None:
    """Bytes of device 0 of backend ``name`` as its runtime reports them, asked in a child
    process so that this one makes no device context; None when the child cannot say (no
    driver, a timeout, an error). ``run``: ``subprocess.run`` (tests pass a fake)."""
    try:
        done = run(
            [sys.executable, "-c", _QUERY, name],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = (done.stdout or "").strip().splitlines()
    if done.returncode != 0 or not lines:
        return None
    try:
        total = float(int(lines[-1]))
    except ValueError:
        return None
    return total if total > 0 else None


def _visible_indices(environ: Mapping[str, str], count: int) -> list[int]:
    """The physical indices of the devices ``CUDA_VISIBLE_DEVICES`` lets this process see
    (every one of ``count`` when it is unset; entries that are not indices, such as UUIDs, are
    skipped)."""
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return list(range(count))
    return [int(x) for x in raw.split(",") if x.strip().isdigit() and int(x) < count]


def device_used_reader(
    name: str, environ: Mapping[str, str] | None = None
) -> Callable[[], int] | None:
    """A function returning the bytes in use right now on the busiest device of backend
    ``name`` that this process may see, as the driver counts them (every process's
    allocations, caches and contexts): what a phase of a step really takes from a device
    that its processes share. On cuda it reads NVML (nvidia-ml-py), which makes no device
    context; None on other backends, where NVML is missing, or where no device answers."""
    if name != "cuda":
        return None
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        indices = _visible_indices(
            os.environ if environ is None else environ, pynvml.nvmlDeviceGetCount()
        )
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
    except pynvml.NVMLError:
        return None
    if not handles:
        return None

    def read() -> int:
        return max(int(pynvml.nvmlDeviceGetMemoryInfo(h).used) for h in handles)

    return read
