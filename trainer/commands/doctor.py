"""`crossrl doctor`: is this node ready for the job? A table of checks, each failure with its fix.

    rows, exit_code = run_doctor("configs/gpu/qwen2.5-7b-grpo.yaml", [], smoke=True)
    print(format_rows(rows))      # exit_code: 0 when no row is FAIL, else 1

Rows: Python and package versions against setup.cfg's minimums; the config's device; that
device type's packages, version pairs and env settings (from `hal.doctor_facts`: device facts
live in hal/); local devices against `train.dp_size`; the Ray cluster's resources when
`ray.address` is set; then the smoke tests of `trainer.commands.doctor_smoke` unless `smoke=False`.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import torch

from hal import DeviceNotAvailableError, backend_class, get_backend
from hal.doctor_facts import (
    FAIL,
    NOT_PRESENT,
    OK,
    WARN,
    Check,
    device_checks,
    dist_version,
    release,
)

__all__ = ["Check", "format_rows", "run_doctor"]

MINIMUM_VERSIONS = {"python": "3.10", "torch": "2.6", "transformers": "4.56", "ray": "2.40"}
"""setup.cfg's python_requires and install_requires (tests/test_doctor.py keeps them in step)."""
RAY_CONNECT_TIMEOUT_S = 30.0
"""Seconds to wait for the cluster at ray.address before reporting it unreachable."""


# ---- versions ---------------------------------------------------------------------------------


def version_check(name: str, found: str | None, minimum: str) -> Check:
    """`found` (None: not installed) against the minimum version crossrl supports."""
    fix = (
        f"use Python >= {minimum} (a new virtual environment)"
        if name == "python"
        else f"pip install '{name}>={minimum}'"
    )
    if found is None:
        return Check(name, FAIL, "not installed", fix)
    have, need = release(found), release(minimum)
    if have is None or have < need:
        return Check(name, FAIL, f"{found}, crossrl needs >= {minimum}", fix)
    return Check(name, OK, f"{found} (>= {minimum})")


def version_checks() -> list[Check]:
    """Python, torch, transformers and ray; versions from metadata (ray is not imported)."""
    found = {
        "python": platform.python_version(),
        # torch's own string carries the build tag (+cpu, +cu126) that metadata may lack
        "torch": torch.__version__,
        "transformers": dist_version("transformers"),
        "ray": dist_version("ray"),
    }
    return [version_check(name, found[name], need) for name, need in MINIMUM_VERSIONS.items()]


# ---- device, devices, cluster -----------------------------------------------------------------


def device_check(requested: str):
    """Resolve the config's `device` key; returns (backend or None, device type, row)."""
    try:
        backend = get_backend(requested)
    except DeviceNotAvailableError as err:
        detail, _, fix = str(err).partition(" Fix: ")
        return None, requested, Check("device", FAIL, detail, fix or "run `crossrl devices`")
    try:
        names = sorted(set(backend.device_names()))
    except Exception as err:  # a half-configured driver: the device row says so
        names = [f"names unknown ({type(err).__name__})"]
    how = " (device=auto)" if requested == "auto" else ""
    detail = (
        f"{backend.name}{how}: {backend.device_count()} x {', '.join(names)}; "
        f"{backend.process_group_backend}; attention: {backend.attention_impl_name}; "
        f"kernels: {_kernel_words(backend)}"
    )
    return backend, backend.name, Check("device", OK, detail)


def _kernel_words(backend) -> str:
    """What ``train.kernels=auto`` runs on ``backend`` (``hal.kernels``), op by op."""
    from hal.kernels import choose_kernels

    report = choose_kernels(backend.kernel_providers).report()
    return ", ".join(f"{op} {name}" for op, name in report.items())


def visible_devices_check(backend, device: str, dp_size: int) -> Check:
    """The visible-devices variable and the local device count against train.dp_size."""
    name = "visible devices"
    var = backend_class(device).visible_devices_env
    if var is None:
        return Check(
            name, NOT_PRESENT, f"not present (host; train.dp_size={dp_size} ranks share it)"
        )
    value = os.environ.get(var)
    shown = f"{var}={value}" if value is not None else f"{var} unset (all devices)"
    if backend is None:
        return Check(name, NOT_PRESENT, f"{shown}; the device is not usable (see device row)")
    count = backend.device_count()
    detail = f"{shown}; {count} local devices, train.dp_size={dp_size}"
    if count < dp_size:
        return Check(name, WARN, detail, "multi-node (set ray.address) or lower train.dp_size")
    return Check(name, OK, detail)


_RAY_PROBE = """
import json, sys
import ray
ray.init(address=sys.argv[1], include_dashboard=False, logging_level="ERROR", log_to_driver=False)
print(json.dumps(ray.cluster_resources()))
ray.shutdown()
"""


def ray_check(
    address: str | None, resource: str, dp_size: int, timeout_s: float = RAY_CONNECT_TIMEOUT_S
) -> Check:
    """Join the cluster at `address` in a child process (so an unreachable one cannot hang the
    doctor) and compare its `resource` count (the HAL's Ray resource) with train.dp_size."""
    name = "ray cluster"
    if address is None:
        return Check(name, OK, "ray.address=null: local Ray (started by crossrl train)")
    fix = "start the cluster (`ray start --head` on the head node) or fix ray.address"
    env = dict(os.environ)
    env.setdefault("RAY_AUTH_MODE", "disabled")  # what crossrl train does when it joins
    try:
        done = subprocess.run(
            [sys.executable, "-c", _RAY_PROBE, address],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
        resources = json.loads(done.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return Check(name, FAIL, f"ray.address={address}: no answer in {timeout_s:.0f} s", fix)
    except (json.JSONDecodeError, IndexError):
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        return Check(name, FAIL, f"ray.address={address}: cannot join ({lines[-1][:200]})", fix)
    have = float(resources.get(resource, 0))
    detail = f"ray.address={address}: {have:g} {resource}, {resources.get('CPU', 0):g} CPU"
    if have < dp_size:
        return Check(
            name,
            FAIL,
            f"{detail}; train.dp_size={dp_size} needs {dp_size} {resource}",
            f"add nodes with {resource} to the cluster or lower train.dp_size",
        )
    return Check(name, OK, detail)


# ---- the whole table --------------------------------------------------------------------------


def run_doctor(cfg_path, overrides, smoke: bool = True) -> tuple[list[Check], int]:
    """Every check for the job at `cfg_path` (None: the CPU default job) with `key=value`
    overrides; returns (rows, exit code: 1 when any row is FAIL, else 0).

    The config is loaded without its environment checks, so a missing device or package is a
    row here rather than an error; a bad path or key raises `trainer.config.ConfigError`.
    """
    from trainer.config import load_config

    cfg = load_config(cfg_path, overrides, check_environment=False)
    rows = version_checks()
    backend, device, row = device_check(cfg.device)
    rows.append(row)
    rows += device_checks(
        device,
        rollout_engine=cfg.rollout.engine,
        torch_version=torch.__version__,
        device_probes=smoke,
    )
    rows.append(visible_devices_check(backend, device, cfg.train.dp_size))
    resource = backend_class(device).ray_resource
    rows.append(ray_check(cfg.ray.address, resource, cfg.train.dp_size))
    if smoke and backend is not None:
        from trainer.commands.doctor_smoke import smoke_checks

        rows += smoke_checks(backend, cfg.rollout.engine)
    elif smoke:
        rows.append(Check("smoke tests", NOT_PRESENT, "skipped: the device is not usable"))
    return rows, 1 if any(r.status == FAIL for r in rows) else 0


def format_rows(rows: list[Check]) -> str:
    """The table: one line per check (name, status, detail), the fix under each WARN/FAIL, and
    a summary line."""
    width = max([len("check"), *(len(r.name) for r in rows)])
    lines = [f"{'check'.ljust(width)}  {'status':<6}  detail"]
    for r in rows:
        lines.append(f"{r.name.ljust(width)}  {r.status:<6}  {r.detail}".rstrip())
        if r.fix and r.status in (FAIL, WARN):
            lines.append(f"{'':{width}}  {'':6}  fix: {r.fix}")
    counts = {s: sum(r.status == s for r in rows) for s in (OK, WARN, FAIL)}
    lines.append(
        f"{len(rows)} checks: {counts[OK]} ok, {counts[WARN]} WARN, {counts[FAIL]} FAIL"
        + ("" if counts[FAIL] else " - ready")
    )
    return "\n".join(lines)
