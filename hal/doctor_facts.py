"""Device facts behind `crossrl doctor`: which packages, versions and env settings each device
type needs, checked without touching the device.

Everything here reads versions from package metadata or imports packages in a child process:
never `import torch_npu` where CANN may be broken (it breaks `import torch`), and a vLLM built
against another driver may crash the process that imports it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from hal.check_row import ABSENT, FAIL, NOT_PRESENT, OK, WARN, Check, dist_version
from hal.npu_versions import (
    ASCEND_STACKS,
    INSTALL_HINT,
    PINNED_VLLM_ASCEND,
    AscendStack,
    VllmAscendVersionError,
    engine_option_spelling,
    known_stack,
    vllm_ascend_engine_options,
)
from hal.registry import BACKEND_NAMES, unavailable_reason

IMPORT_TIMEOUT_S = 180.0
"""Seconds a child process may take to import vllm (and its plugin) before it counts as hung."""


def release(version: str, parts: int = 3) -> tuple[int, ...] | None:
    """The leading release numbers of a version string, padded with zeros to `parts`
    (`2.6.0.post3` -> (2, 6, 0), `0.9.2rc1` -> (0, 9, 2), `2.13.0+cpu` -> (2, 13, 0)); None when
    it does not start with a number. Plain parsing: hal/ depends on torch only."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version or "")
    if not match:
        return None
    numbers = [int(x) for x in match.group(1).split(".")][:parts]
    return tuple(numbers + [0] * (parts - len(numbers)))


# ---- version pairs ----------------------------------------------------------------------------


def torch_npu_pairing(torch_version: str, torch_npu_version: str) -> Check:
    """torch_npu A.B.C[.postN] is built for torch A.B.C: another major.minor fails to load or
    crashes; another patch release usually works."""
    name = "torch_npu"
    want = release(torch_npu_version, 3)
    have = release(torch_version, 3)
    found = f"torch_npu {torch_npu_version} with torch {torch_version}"
    if want is None or have is None:
        return Check(name, WARN, f"{found}: cannot parse the versions", "reinstall both from PyPI")
    built_for = ".".join(map(str, want))
    fix = f"pip install torch=={built_for} (torch_npu {torch_npu_version} is built for it)"
    if want[:2] != have[:2]:
        return Check(name, FAIL, f"{found}: built for torch {built_for}", fix)
    if want != have:
        return Check(name, WARN, f"{found}: built for torch {built_for}", fix)
    return Check(name, OK, found)


def vllm_ascend_pairing(vllm_version: str, vllm_ascend_version: str) -> Check:
    """vllm-ascend 0.X.Y[rcN] is released for vllm 0.X.*: the plugin patches vllm internals
    that change with every minor release."""
    name = "vllm-ascend pair"
    want = release(vllm_ascend_version, 2)
    have = release(vllm_version, 2)
    found = f"vllm-ascend {vllm_ascend_version} with vllm {vllm_version}"
    if want is None or have is None:
        return Check(name, WARN, f"{found}: cannot parse the versions", "reinstall both")
    if want != have:
        minor = ".".join(map(str, want))
        fix = (
            f"VLLM_TARGET_DEVICE=empty pip install --no-binary vllm 'vllm=={minor}.*' "
            f"(or the vllm-ascend release made for vllm {vllm_version})"
        )
        return Check(name, FAIL, f"{found}: the plugin is made for vllm {minor}.*", fix)
    return Check(name, OK, found)


_STACK_FIXES = {
    "vllm": "VLLM_TARGET_DEVICE=empty pip install --no-binary vllm 'vllm=={want}' (vLLM without "
    "its CUDA build, as vllm-ascend installs it)",
    "torch": "pip install torch=={want} --extra-index-url https://download.pytorch.org/whl/cpu",
    "torch-npu": "pip install torch-npu=={want}",
    "CANN": "install CANN {want} and NNAL {want} (Huawei's installer), then source set_env.sh",
}


def _stack_row(component: str, have: str | None, want: str, vllm_ascend: str) -> Check:
    """One member of vllm-ascend's set: `have` (None: not found) against the release's `want`.
    Another major.minor fails; another patch or post release warns."""
    name = f"{component} for vllm-ascend"
    fix = _STACK_FIXES[component].format(want=want)
    others = [
        s.vllm_ascend
        for s in ASCEND_STACKS.values()
        if have is not None and _same_version(_stack_value(s, component), have)
    ]
    if others:
        fix += f", or vllm-ascend {others[-1]} (made for {component} {have})"
    needs = f"vllm-ascend {vllm_ascend} is released with {component} {want}"
    if have is None:
        status = FAIL if component == "vllm" else WARN
        return Check(name, status, f"{component} version not found; {needs}", fix)
    got, need = release(have, 4), release(want, 4)
    if got is None or got[:2] != need[:2]:
        return Check(name, FAIL, f"{component} {have} installed; {needs}", fix)
    if got[:3] != need[:3] or (component == "torch-npu" and _post(have) != _post(want)):
        return Check(name, WARN, f"{component} {have} installed; {needs}", fix)
    return Check(name, OK, f"{component} {have} ({needs})")


def _stack_value(stack: AscendStack, component: str) -> str:
    return {"vllm": stack.vllm, "torch": stack.torch, "torch-npu": stack.torch_npu}.get(
        component, stack.cann
    )


def _same_version(a: str, b: str) -> bool:
    """Equal public versions (``0.26.0+empty`` is ``0.26.0``); plain text where not PEP 440."""
    try:
        return Version(a).public == Version(b).public
    except InvalidVersion:
        return a.strip().lower() == b.strip().lower()


def _post(version: str) -> str:
    match = re.search(r"\.post(\d+)", version)
    return match.group(1) if match else ""


def ascend_stack_checks(
    vllm_ascend_version: str, installed: Mapping[str, str | None]
) -> list[Check]:
    """vllm-ascend's release set by name: one row per member (vllm, torch, torch-npu, CANN),
    `installed[member]` (None: not found) against the set of `vllm_ascend_version`
    (``hal.npu_versions.ASCEND_STACKS``); a mismatch names both versions and the fix. A release
    not in the table gets a WARN and the vllm-minor rule of ``vllm_ascend_pairing``."""
    try:
        stack = known_stack(vllm_ascend_version)
    except VllmAscendVersionError as err:
        return [Check("vllm-ascend set", FAIL, str(err).split(": reinstall")[0], INSTALL_HINT)]
    if stack is None:
        rows = [
            Check(
                "vllm-ascend set",
                WARN,
                f"vllm-ascend {vllm_ascend_version} is not in crossrl's table "
                f"(hal/npu_versions.py: {', '.join(ASCEND_STACKS)}); only vllm's minor is checked",
                f"install vllm-ascend {PINNED_VLLM_ASCEND}, the tested set ({INSTALL_HINT})",
            )
        ]
        if installed.get("vllm"):
            rows.append(vllm_ascend_pairing(installed["vllm"], vllm_ascend_version))
        return rows
    return [
        _stack_row(member, installed.get(member), _stack_value(stack, member), stack.vllm_ascend)
        for member in ("vllm", "torch", "torch-npu", "CANN")
    ]


def vllm_ascend_options_check(vllm_ascend_version: str) -> Check:
    """How crossrl spells the engine's sleep cleanup for this vllm-ascend, or FAIL when the
    release has no such option (``hal.npu_versions.ENGINE_OPTION_SPELLINGS``)."""
    name = "vllm-ascend options"
    try:
        spelling = engine_option_spelling(vllm_ascend_version)
    except VllmAscendVersionError as err:
        detail, _, _ = str(err).partition(": install")
        fix = f"install vllm-ascend {PINNED_VLLM_ASCEND} ({INSTALL_HINT})"
        return Check(name, FAIL, detail, fix)
    return Check(name, OK, f"{spelling.summary} (vllm-ascend >= {spelling.since})")


# ---- imports in a child process ---------------------------------------------------------------

_IMPORT_PROBE = """
import importlib, importlib.metadata, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        mod = importlib.import_module(name)
    except BaseException as err:
        out[name] = [False, (type(err).__name__ + ": " + str(err)).splitlines()[0][:200]]
        continue
    version = getattr(mod, "__version__", None)  # vllm_ascend may lack it: ask pip's records
    try:
        out[name] = [True, str(version or importlib.metadata.version(name))]
    except importlib.metadata.PackageNotFoundError:
        out[name] = [True, "?"]
print(json.dumps(out))
"""


def probe_imports(modules: list[str], timeout_s: float = IMPORT_TIMEOUT_S) -> dict:
    """Import each module in one child process; {module: (importable, version or error)}."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _IMPORT_PROBE, *modules],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        result = json.loads(done.stdout.strip().splitlines()[-1])
        return {name: tuple(result[name]) for name in modules}
    except subprocess.TimeoutExpired:
        why = f"import did not finish within {timeout_s:.0f} s"
    except (json.JSONDecodeError, IndexError, KeyError):
        why = f"the importing process died (exit {done.returncode}): {done.stderr.strip()[-200:]}"
    return {name: (False, why) for name in modules}


def rollout_engine_checks(
    device: str, rollout_engine: str, torch_version: str | None = None
) -> list[Check]:
    """vllm importable (and on npu vllm-ascend, the set it is released with: vllm, torch,
    torch-npu, CANN; the engine options crossrl spells for it; and its RL settings)."""
    from hal.cann import cann_version

    if rollout_engine != "vllm":
        return [Check("vllm", NOT_PRESENT, f"not needed (rollout.engine={rollout_engine})")]
    modules = ["vllm", "vllm_ascend"] if device == "npu" else ["vllm"]
    found = probe_imports(modules)
    rows = []
    for module in modules:
        ok, text = found[module]
        pip_name = module.replace("_", "-")
        rows.append(
            Check(pip_name, OK, text)
            if ok
            else Check(
                pip_name,
                FAIL,
                f"not importable: {text}",
                f"pip install {pip_name} (see docs/cluster.md), or set rollout.engine=hf",
            )
        )
    if device == "npu":
        if found["vllm_ascend"][0]:
            installed = {
                "vllm": found["vllm"][1] if found["vllm"][0] else None,
                "torch": torch_version,
                "torch-npu": dist_version("torch_npu"),
                "CANN": cann_version(os.environ),
            }
            rows += ascend_stack_checks(found["vllm_ascend"][1], installed)
            rows.append(vllm_ascend_options_check(found["vllm_ascend"][1]))
        rows.append(vllm_ascend_nz_check(os.environ, _engine_options(found["vllm_ascend"])))
    return rows


def _engine_options(found: tuple) -> dict | None:
    """The options crossrl's engine passes the importable vllm-ascend (None: none known)."""
    if not found[0]:
        return None
    try:
        return vllm_ascend_engine_options(found[1])
    except VllmAscendVersionError:
        return None


def vllm_ascend_nz_check(
    environ: Mapping[str, str], engine_options: Mapping | None = None
) -> Check:
    """vllm-ascend's NZ weight layout converts weights once at load; RL reloads them every step.
    No warning when crossrl's engine options (`engine_options`, ``vllm.LLM`` keyword arguments)
    turn NZ off: ``weight_nz_mode=0``, or ``rl_config.enabled`` (which sets it to 0)."""
    value = environ.get("VLLM_ASCEND_ENABLE_NZ")
    extra = dict((engine_options or {}).get("additional_config", {}))
    if extra.get("weight_nz_mode") == 0 or dict(extra.get("rl_config", {})).get("enabled"):
        shown = "unset" if value is None else repr(value)
        return Check("VLLM_ASCEND_ENABLE_NZ", OK, f"{shown}; crossrl's engine turns NZ off")
    if value == "0":
        return Check("VLLM_ASCEND_ENABLE_NZ", OK, "0 (ND weights: in-place weight reload works)")
    return Check(
        "VLLM_ASCEND_ENABLE_NZ",
        WARN,
        f"{'unset' if value is None else repr(value)}: NZ weights break the per-step weight sync",
        "export VLLM_ASCEND_ENABLE_NZ=0",
    )


# ---- per-device stacks ------------------------------------------------------------------------


def torch_npu_check(torch_version: str) -> Check:
    """torch_npu installed, and built for this torch (from metadata: importing it may crash)."""
    version = dist_version("torch_npu")
    if version is None:
        return Check(
            "torch_npu",
            FAIL,
            "not installed",
            f"pip install 'torch-npu=={'.'.join(map(str, release(torch_version)))}.*' "
            "(the release built for this torch; install CANN first)",
        )
    return torch_npu_pairing(torch_version, version)


def flash_attn_check() -> Check:
    """flash-attn is optional; one built against another torch/CUDA imports badly, and the HAL
    then falls back to torch's varlen kernel or SDPA: say so rather than fail."""
    version = dist_version("flash_attn")
    if version is None and importlib.util.find_spec("flash_attn") is None:
        return Check("flash-attn", ABSENT, "absent (SDPA/torch varlen used)")
    try:
        importlib.import_module("flash_attn")
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except (ImportError, OSError, RuntimeError) as err:
        why = f"{type(err).__name__}: {err}".splitlines()[0][:200]
        return Check(
            "flash-attn",
            WARN,
            f"{version or 'installed'} but broken ({why}); the HAL falls back",
            "pip uninstall flash-attn or rebuild it against this torch",
        )
    return Check("flash-attn", OK, f"{version or '?'} (varlen kernel loads)")


# ---- env settings -----------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvRule:
    """A collective-library env var and its legal values: an int range or a set of words."""

    var: str
    low: int | None = None
    high: int | None = None
    choices: tuple[str, ...] = ()
    meaning: str = ""
    clamp: int | None = None
    """Values above this are cut to it when ``clamp_when`` holds (a WARN, not a FAIL)."""
    clamp_when: tuple[str, str] = ("", "")
    """(env var, value, compared upper-case) under which ``clamp`` applies."""

    def check(self, environ: Mapping[str, str]) -> Check:
        """The row for this variable in `environ`: OK, WARN (clamped) or FAIL (not legal)."""
        value = environ.get(self.var)
        if value is None:
            return Check(self.var, OK, f"unset (library default; {self.meaning})")
        if self.choices:
            good = value.strip().upper() in self.choices
            allowed = f"one of {', '.join(self.choices)}"
        else:
            try:
                good = self.low <= int(value) <= self.high
            except ValueError:
                good = False
            allowed = f"an integer in [{self.low}, {self.high}]"
        if good and self.clamp is not None and int(value) > self.clamp:
            mode_var, mode = self.clamp_when
            if environ.get(mode_var, "").strip().upper() == mode:
                return Check(
                    self.var,
                    WARN,
                    f"{value}: {mode_var}={mode} clamps it to {self.clamp} ({self.meaning})",
                    f"use at most {self.clamp}, or unset {mode_var}",
                )
        if good:
            return Check(self.var, OK, f"{value} ({self.meaning})")
        return Check(
            self.var, FAIL, f"{value!r} is not {allowed}", f"unset {self.var} or use {allowed}"
        )


ENV_RULES: dict[str, tuple[EnvRule, ...]] = {
    "cpu": (),
    "cuda": (
        EnvRule("NCCL_DEBUG", choices=("VERSION", "WARN", "INFO", "TRACE"), meaning="log level"),
        EnvRule("NCCL_IB_DISABLE", choices=("0", "1"), meaning="1 turns InfiniBand off"),
    ),
    "npu": (
        EnvRule("HCCL_CONNECT_TIMEOUT", 120, 7200, meaning="seconds to build a group"),
        # CANN 9.1.0 on Atlas A2/A3: [0, 2^31-1], 0 = never time out; the [68, 17340] range
        # was an older training series'. AIV mode (HCCL_OP_EXPANSION_MODE=AIV) caps it at 1091.
        EnvRule(
            "HCCL_EXEC_TIMEOUT",
            0,
            2**31 - 1,
            meaning="seconds one collective may run; 0: never time out",
            clamp=1091,
            clamp_when=("HCCL_OP_EXPANSION_MODE", "AIV"),
        ),
    ),
}
"""Per device type, the env vars its collective library reads, with their documented ranges."""


def env_checks(device: str, environ: Mapping[str, str]) -> list[Check]:
    """One row per collective-library env var of `device`."""
    return [rule.check(environ) for rule in ENV_RULES[device]]


# ---- everything for one device type -----------------------------------------------------------


def device_checks(
    device: str, *, rollout_engine: str, torch_version: str, device_probes: bool = True
) -> list[Check]:
    """The rows specific to device type `device` (cpu, cuda, npu) for a job using
    `rollout_engine`. On cpu the accelerator stacks are reported as not present, status `-`,
    and the NPU's device probes as skipped with the reason. `device_probes` False (the doctor's
    --no-smoke): the npu probes that start processes on the devices are skipped."""
    from hal.cann import cann_check, ops_package_check
    from hal.npu_checks import a3_checks, skipped_probe_rows

    environ = os.environ
    if device == "npu":
        rows = [torch_npu_check(torch_version), cann_check(environ)]
        why = unavailable_reason("npu")
        rows += a3_checks(
            environ,
            no_npu_reason=why,
            device_count=None if why else _npu_count(),
            device_probes=device_probes,
            rollout_engine=rollout_engine,
        )
    elif device == "cuda":
        rows = [flash_attn_check()]
    else:
        rows = []
        for other in BACKEND_NAMES:
            if other in ("auto", "cpu"):
                continue
            why = unavailable_reason(other)
            detail = f"not present: {why}" if why else "present, not used (device=cpu)"
            rows.append(Check(other, NOT_PRESENT, detail))
            if other == "npu":
                reason = f"device=cpu; {why or 'npu not used'}"
                rows.append(ops_package_check(environ, None, reason))
                rows += skipped_probe_rows(reason)
    engine_rows = rollout_engine_checks(device, rollout_engine, torch_version)
    return rows + engine_rows + env_checks(device, environ)


def _npu_count() -> int | None:
    """Visible NPUs, from the HAL (None when it cannot say)."""
    try:
        from hal.registry import get_backend

        return get_backend("npu").device_count()
    except Exception:  # a half-configured driver: the probe rows say so
        return None
