"""What a benchmark ran on: CPU model, cores, load, torch and the HAL's device.

Every figure in ``bench/`` is a ratio measured side by side, but absolute numbers still need the
machine next to them, and a shared machine's load says how much to trust them.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform

import torch

__all__ = ["cpu_load", "cpu_model", "cpu_pressure", "describe_machine", "machine_line"]


def cpu_model() -> str:
    """The processor's marketing name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_load() -> dict[str, float] | None:
    """1/5/15-minute load averages (runnable processes), or None where the OS has none."""
    try:
        one, five, fifteen = os.getloadavg()
    except (AttributeError, OSError):
        return None
    return {"1min": one, "5min": five, "15min": fifteen}


def cpu_pressure() -> dict[str, float] | None:
    """Linux PSI: % of the last 10/60/300 s in which some runnable task waited for a CPU.
    Unlike the load average it sees processes in other containers on the same kernel; None
    where /proc/pressure/cpu is absent."""
    try:
        with open("/proc/pressure/cpu", encoding="utf-8") as f:
            first = f.readline().split()
    except OSError:
        return None
    if not first or first[0] != "some":
        return None
    fields = dict(item.split("=", 1) for item in first[1:])
    try:
        return {k: float(fields[k]) for k in ("avg10", "avg60", "avg300")}
    except (KeyError, ValueError):
        return None


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def describe_machine() -> dict:
    """Facts about this machine as JSON-able values.

    Keys: date (UTC, ISO 8601), cpu_model, logical_cores, usable_cores, torch_threads,
    memory_gib, load (see ``cpu_load``), cpu_pressure (see ``cpu_pressure``), python, platform, torch, transformers, device
    (the backend ``hal.get_backend("auto")`` picks) and device_names.
    """
    import hal

    backend = hal.get_backend("auto")
    try:
        names = backend.device_names()
    except Exception as exc:  # a half-configured driver: say so instead of failing the bench
        names = [f"unknown ({type(exc).__name__})"]
    memory_gib = None
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (AttributeError, ValueError, OSError):
        pass
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": _usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(memory_gib, 1) if memory_gib else None,
        "load": cpu_load(),
        "cpu_pressure": cpu_pressure(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "device": backend.name,
        "device_names": names,
    }


def machine_line(machine: dict) -> str:
    """One line for a table header: CPU, cores, torch, device and load."""
    load = machine.get("load")
    load_s = f", load avg {load['1min']:.2f} (1 min)" if load else ""
    psi = machine.get("cpu_pressure")
    if psi:
        load_s += f", CPU pressure {psi['avg60']:.0f}% (60 s)"
    return (
        f"{machine['cpu_model']}, {machine['usable_cores']} cores "
        f"({machine['torch_threads']} torch threads), torch {machine['torch']}, "
        f"device {machine['device']}{load_s}, {machine['date']}"
    )
