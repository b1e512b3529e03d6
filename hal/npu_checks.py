"""Ascend checks an Atlas A3 node needs beyond versions: the chip the installed vllm-ascend was
built for, the driver (HDK), the chip's ops package (``hal.cann``), NNAL/ATB, triton-ascend, HCCL's port ranges, and two device checks
(an HCCL collective across two dies, an IPC transfer between two processes on one die).

Sources, read from the pinned releases (not from a main branch):

- vllm-ascend 0.26.0rc1 wheel: ``vllm_ascend/_build_info.py`` holds ``__device_type__ = 'A2'``;
  ``vllm_ascend/utils.py`` ``_init_ascend_device_type`` reads it (an old build without it:
  ``__soc_version__``, ``_310P`` when it names a 310P, else A2) and ``check_ascend_device_type``,
  called by ``worker/worker.py`` at start-up, maps ``torch_npu.npu.get_soc_version()`` to a
  type (220-225 A2, 250-255 A3, 200-205 310P, 260 A5) and asserts that the two match.
- its sdist: ``setup.py`` ``gen_build_info`` writes ``_build_info.py`` from the ``SOC_VERSION``
  env var (``ascend910_9391`` ... ``ascend910_9362``: A3); ``Dockerfile.a3`` and
  ``docs/source/installation.md`` give ``SOC_VERSION=ascend910_9391`` for Atlas A3;
  ``requirements.txt`` pins ``triton-ascend==3.2.2``; installation.md installs NNAL
  (``source /usr/local/Ascend/nnal/atb/set_env.sh``) and the chip's ops package.
- its ``docs/source/developer_guide/performance_and_debug/optimization_and_tuning.md``: HCCL's
  AIV mode is ``HCCL_OP_EXPANSION_MODE=AIV``.
- CANN 9.1.0's release notes (``hicann/release-management``, ``9.1.0/release-notes_en.md``,
  "Version Compatibility"): CANN 9.1.X runs on Ascend HDK 25.2.X, 25.3.X, 25.5.X,
  26.0.RC1/25.7.RC1 and 26.1.0, **not on 25.0.X**; its matching driver is 26.0.RC1. CANN 8.5.2
  and 9.0.X run on all of them, 25.0.X included.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from hal.cann import cann_version, ops_package_check
from hal.check_row import FAIL, NOT_PRESENT, OK, WARN, Check, dist_version
from hal.npu_versions import ASCEND_STACKS, PINNED_VLLM_ASCEND

BUILD_INFO_FILE = "vllm_ascend/_build_info.py"
"""Where a vllm-ascend build records the chip it was compiled for (written by its setup.py)."""
A3_SOC_VERSION = "ascend910_9391"
"""The ``SOC_VERSION`` vllm-ascend's Dockerfile.a3 and installation.md build Atlas A3 with."""
SOC_VERSION_FOR = {"A2": "ascend910b1", "A3": A3_SOC_VERSION, "_310P": "ascend310p1"}
"""The ``SOC_VERSION`` to build vllm-ascend with, per device type (its Dockerfiles' defaults)."""
IMAGE_SUFFIX_FOR = {"A2": "", "A3": "-a3", "_310P": "-310p"}
"""vllm-ascend's image per device type: ``quay.io/ascend/vllm-ascend:v<release><suffix>`` (its
installation.md's image table; the A3 one is built by ``Dockerfile.a3``)."""
TRITON_ASCEND = "3.2.2"
"""The triton-ascend vllm-ascend 0.26.0rc1 requires (its requirements.txt)."""
MIN_HDK = (25, 0, 0, 1)
"""HDK 25.0.RC1 as (major, minor, patch, rc): multi-process HCCP needs at least this driver."""
HDK_FOR_CANN = {"9.1": ((25, 2, 0, 0), "25.2", "26.0.RC1")}
"""Per CANN release line (major.minor): the oldest driver it runs on as (major, minor, patch,
rc), that driver's name, and the driver its release notes pair it with. Lines not listed run on
every HDK from ``MIN_HDK`` (CANN 8.5.2 and 9.0.X: 25.0.X included)."""
DRIVER_VERSION_FILE = Path("/usr/local/Ascend/driver/version.info")
NNAL_SET_ENV = Path("/usr/local/Ascend/nnal/atb/set_env.sh")
PORT_RANGE_ENVS = ("HCCL_HOST_SOCKET_PORT_RANGE", "HCCL_NPU_SOCKET_PORT_RANGE")
DEVICE_CHECK_TIMEOUT_S = 240.0


class EngineBuildMismatchError(RuntimeError):
    """The installed vllm-ascend was built for another chip than this node's: its worker would
    assert at start-up in every engine replica."""


# ---- the chip vllm-ascend was built for --------------------------------------------------------


def parse_build_info(text: str) -> str:
    """The device type in a ``_build_info.py`` text, as vllm-ascend 0.26.0rc1's
    ``_init_ascend_device_type`` reads it: ``__device_type__``, else from ``__soc_version__``
    (``_310P`` when it names a 310P), else A2."""
    match = re.search(r"^__device_type__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    if match:
        return match.group(1)
    match = re.search(r"^__soc_version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    soc = (match.group(1) if match else "ASCEND910B1").upper()
    return "_310P" if "310P" in soc else "A2"


def vllm_ascend_build_type(distribution: str = "vllm-ascend") -> str | None:
    """The device type (A2, A3, _310P, A5) the installed vllm-ascend was built for, read from
    its ``_build_info.py`` through the distribution's file list, without importing it (the
    import loads vllm); None when vllm-ascend or the file is absent."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if str(file).replace("\\", "/") == BUILD_INFO_FILE:
            try:
                return parse_build_info(Path(dist.locate_file(file)).read_text())
            except OSError:
                return None
    return None


def chip_type(soc: int | str) -> str | None:
    """The device type of a chip, as vllm-ascend 0.26.0rc1's ``check_ascend_device_type`` maps
    ``torch_npu.npu.get_soc_version()`` (220-225 A2, 250-255 A3, 200-205 _310P, 260 A5); a SoC
    name (``torch.npu.get_device_name``: ``Ascend910B3``, ``Ascend910_9391``, ``Ascend310P3``)
    is mapped as its setup.py maps ``SOC_VERSION``. None when unknown."""
    if isinstance(soc, int):
        if 220 <= soc <= 225:
            return "A2"
        if 250 <= soc <= 255:
            return "A3"
        if 200 <= soc <= 205:
            return "_310P"
        return "A5" if soc == 260 else None
    name = soc.strip().lower()
    if name.startswith("ascend910b") or name == "910b":
        return "A2"
    if name.startswith("ascend910_93") or name == "910c":
        return "A3"
    if name.startswith("ascend310p") or name == "310p":
        return "_310P"
    return "A5" if name.startswith("ascend950") else None


def vllm_ascend_image(chip: str) -> str | None:
    """vllm-ascend's image of the pinned release for device type ``chip``; None when it has
    none in ``IMAGE_SUFFIX_FOR``."""
    suffix = IMAGE_SUFFIX_FOR.get(chip)
    return None if suffix is None else f"quay.io/ascend/vllm-ascend:v{PINNED_VLLM_ASCEND}{suffix}"


def engine_build_fix(chip: str) -> str:
    """How to get vllm-ascend built for device type ``chip``: a source build of the pinned
    release with the chip's ``SOC_VERSION`` (as vllm-ascend's Dockerfiles build it), or its
    image for the chip."""
    soc = SOC_VERSION_FOR.get(chip, "<the chip's SOC_VERSION, see vllm-ascend setup.py>")
    image = vllm_ascend_image(chip)
    return (
        f"SOC_VERSION={soc} pip install -e ./vllm-ascend (a checkout of v{PINNED_VLLM_ASCEND} "
        "with its submodules; README, Running on an Ascend A3 node)"
        + (f", or run the image {image}" if image else "")
    )


def engine_build_mismatch(build: str | None, chip: str | None) -> str | None:
    """One line naming the build's and the chip's device types and the fix, or None when they
    match or either is unknown (nothing to compare)."""
    if build is None or chip is None or build == chip:
        return None
    return (
        f"vllm-ascend is built for {build} ({BUILD_INFO_FILE}: __device_type__={build!r}) but "
        f"this chip is {chip}: every vLLM engine replica would fail at start-up; build it for "
        f"{chip}: {engine_build_fix(chip)}"
    )


def require_engine_build(read_soc: Callable[[], int]) -> None:
    """Raise EngineBuildMismatchError with ``engine_build_mismatch``'s line when the installed
    vllm-ascend was built for another chip than the one ``read_soc`` reports (torch_npu's SoC
    number, as vllm-ascend's own check reads it); nothing to do, and no SoC read, when no
    vllm-ascend build is installed."""
    build = vllm_ascend_build_type()
    if build is None:
        return
    line = engine_build_mismatch(build, chip_type(int(read_soc())))
    if line:
        raise EngineBuildMismatchError(line)


def engine_build_check(
    build: str | None, chip: str | None, soc: str = "", npu: bool = True
) -> Check:
    """The doctor row: FAIL with the fix when the build and the chip differ; `soc` says what
    the chip was read as; `npu` False: no NPU here, so the chip cannot be compared."""
    name = "vllm-ascend build"
    if build is None:
        return Check(name, NOT_PRESENT, f"no {BUILD_INFO_FILE} (vllm-ascend not installed)")
    line = engine_build_mismatch(build, chip)
    if line:
        detail, _, fix = line.partition("; build it for ")
        return Check(name, FAIL, detail, f"build it for {fix}")
    if chip is None:
        detail = f"built for {build}; chip not compared ({soc or 'chip type unknown'})"
        if not npu:
            return Check(name, NOT_PRESENT, detail)
        return Check(name, WARN, detail, "check `npu-smi info` and that torch_npu imports")
    return Check(name, OK, f"built for {build}, chip {chip} ({soc})")


_SOC_PROBE = """
import json, torch, torch_npu
print(json.dumps([torch_npu.npu.get_soc_version(), torch.npu.get_device_name(0)]))
"""


def probe_soc(timeout_s: float = 120.0) -> tuple[int | None, str]:
    """torch_npu's SoC number and chip name of device 0, read in a child process (importing
    torch_npu with a broken CANN breaks the importer); (None, why) when it cannot be read."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _SOC_PROBE], capture_output=True, text=True, timeout=timeout_s
        )
        soc, name = json.loads(done.stdout.strip().splitlines()[-1])
        return int(soc), str(name)
    except subprocess.TimeoutExpired:
        return None, f"torch_npu did not answer within {timeout_s:.0f} s"
    except (json.JSONDecodeError, IndexError, ValueError, TypeError):
        return None, f"torch_npu cannot read the SoC ({done.stderr.strip()[-160:]})"


# ---- driver, NNAL, triton-ascend, port ranges ------------------------------------------------


def parse_hdk_version(text: str) -> tuple[int, int, int, int] | None:
    """A driver ``version.info``'s ``Version=`` as (major, minor, patch, rc): ``25.0.rc1`` ->
    (25, 0, 0, 1), ``25.2.0`` -> (25, 2, 0, 99) (a release sorts after its RCs); None when
    absent or unreadable."""
    match = re.search(r"^\s*Version\s*=\s*(\d+)\.(\d+)\.(?:rc(\d+)|(\d+))", text, re.M | re.I)
    if not match:
        return None
    major, minor, rc, patch = match.groups()
    if rc is not None:
        return int(major), int(minor), 0, int(rc)
    return int(major), int(minor), int(patch), 99


def hdk_requirement(cann: str | None) -> tuple[tuple[int, int, int, int], str, str]:
    """What CANN ``cann`` (None: the tested set's, ``constraints-npu.txt``) needs of the driver:
    (the oldest HDK as (major, minor, patch, rc), its name, the fix naming the HDK to install)."""
    cann = cann or ASCEND_STACKS[PINNED_VLLM_ASCEND].cann
    match = re.match(r"\s*(\d+)\.(\d+)", cann)
    line = f"{match.group(1)}.{match.group(2)}" if match else cann
    if line not in HDK_FOR_CANN:
        fix = "install Ascend HDK >= 25.0.RC1 (driver and firmware; multi-process HCCP needs it)"
        return MIN_HDK, "25.0.RC1", fix
    floor, floor_name, paired = HDK_FOR_CANN[line]
    fix = (
        f"install Ascend HDK {paired} (driver and firmware), the one CANN {cann}'s release "
        f"notes pair with it; it runs on >= {floor_name}, not on 25.0.X"
    )
    return floor, floor_name, fix


def hdk_check(version_file: Path | None = None, cann: str | None = None) -> Check:
    """The Ascend driver (HDK) in ``version_file`` (None: ``DRIVER_VERSION_FILE``) against what
    runs here: multi-process HCCP, which colocated engines and training ranks use, needs HDK >=
    25.0.RC1, and CANN ``cann`` (None: the tested set's, 9.1.0) its own oldest driver
    (``HDK_FOR_CANN``: 9.1 refuses 25.0.X)."""
    name = "Ascend HDK"
    version_file = DRIVER_VERSION_FILE if version_file is None else version_file
    cann = cann or ASCEND_STACKS[PINNED_VLLM_ASCEND].cann
    floor, floor_name, fix = hdk_requirement(cann)
    try:
        text = version_file.read_text(errors="replace")
    except OSError:
        return Check(name, FAIL, f"{version_file} not found (no Ascend driver)", fix)
    version = parse_hdk_version(text)
    shown = next((ln.strip() for ln in text.splitlines() if "version=" in ln.lower()), "?")
    if version is None:
        return Check(name, WARN, f"{version_file}: cannot read the version ({shown})", fix)
    if version < MIN_HDK:
        return Check(name, FAIL, f"{shown}: multi-process HCCP needs >= 25.0.RC1", fix)
    if version < floor:
        why = f"{shown}: CANN {cann} does not run on it (its release notes: >= {floor_name})"
        return Check(name, FAIL, why, fix)
    return Check(name, OK, f"{shown} (CANN {cann} runs on >= {floor_name})")


def nnal_check(environ: Mapping[str, str], set_env: Path = NNAL_SET_ENV) -> Check:
    """NNAL's ATB library (vllm-ascend's fused operators): installed and its env sourced."""
    name = "NNAL/ATB"
    fix = f"install Ascend-cann-nnal 9.1.0, then `source {NNAL_SET_ENV}`"
    if environ.get("ATB_HOME_PATH"):
        return Check(name, OK, f"ATB_HOME_PATH={environ['ATB_HOME_PATH']}")
    if set_env.is_file():
        return Check(
            name, WARN, f"{set_env} exists but ATB_HOME_PATH is unset", f"source {set_env}"
        )
    return Check(name, FAIL, f"not found (ATB_HOME_PATH unset, no {set_env})", fix)


def triton_ascend_check(version: str | None) -> Check:
    """triton-ascend, vllm-ascend's Triton backend, at the version vllm-ascend requires."""
    name = "triton-ascend"
    fix = (
        f"pip install triton-ascend=={TRITON_ASCEND} "
        "--extra-index-url https://mirrors.huaweicloud.com/ascend/repos/pypi"
    )
    if version is None:
        return Check(name, WARN, f"not installed; vllm-ascend {PINNED_VLLM_ASCEND} needs it", fix)
    if version.split("+")[0] != TRITON_ASCEND:
        return Check(name, WARN, f"{version}; vllm-ascend {PINNED_VLLM_ASCEND} pins it", fix)
    return Check(name, OK, version)


def port_range_checks(environ: Mapping[str, str]) -> list[Check]:
    """HCCL's socket port ranges: crossrl gives each process its own range, so unset is fine;
    a value set here is the user's and is reported as such (never a failure)."""
    rows = []
    for var in PORT_RANGE_ENVS:
        value = environ.get(var)
        if value is None:
            rows.append(Check(var, OK, "unset: crossrl sets a range per process"))
        else:
            rows.append(Check(var, OK, f"{value} (set by the user; crossrl keeps it)"))
    return rows


# ---- checks on the device ---------------------------------------------------------------------

_HCCL_PROBE = """
import os, sys, torch, torch_npu, torch.distributed as dist, torch.multiprocessing as mp

def rank(r, port):
    torch.npu.set_device(r)
    dist.init_process_group("hccl", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
    t = torch.full((1024,), float(r + 1), device=f"npu:{r}")
    dist.all_reduce(t)
    torch.npu.synchronize()
    assert float(t[0]) == 3.0 and float(t[-1]) == 3.0, float(t[0])
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(rank, args=(int(sys.argv[1]),), nprocs=2)
    print("ok")
"""

_IPC_PROBE = """
import torch, torch_npu, torch.multiprocessing as mp

def reader(q, done):
    t = q.get()
    done.put(float(t.sum()))

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=reader, args=(q, done), daemon=True)
    p.start()
    t = torch.arange(4096, dtype=torch.float32, device="npu:0")
    q.put(t)
    got = done.get(timeout=180)
    p.join()
    assert got == float(t.sum()), (got, float(t.sum()))
    print("ok")
"""


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_probe(name: str, script: str, args: list[str], fix: str, timeout_s: float) -> Check:
    """Run a device probe script in a child process: OK when it prints ``ok``, else FAIL with
    its last error line and ``fix``. The script runs from a file, not ``-c``: the processes it
    spawns re-import its main module to find their target functions."""
    with tempfile.TemporaryDirectory(prefix="crossrl-probe-") as tmp:
        path = Path(tmp) / "probe.py"
        path.write_text(script)
        try:
            done = subprocess.run(
                [sys.executable, str(path), *args],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env=dict(os.environ),
            )
        except subprocess.TimeoutExpired:
            return Check(name, FAIL, f"no answer within {timeout_s:.0f} s", fix)
    if done.returncode == 0 and done.stdout.strip().endswith("ok"):
        return Check(name, OK, "passed")
    lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
    return Check(name, FAIL, lines[-1][:200], fix)


def hccl_two_die_check(
    device_count: int | None, no_npu_reason: str | None, timeout_s: float = DEVICE_CHECK_TIMEOUT_S
) -> Check:
    """An HCCL all-reduce between two ranks on devices 0 and 1 (the two dies of an A3 chip);
    skipped with the reason where there is no NPU or only one device."""
    name = "HCCL across dies"
    if no_npu_reason:
        return Check(name, NOT_PRESENT, f"skipped: {no_npu_reason}")
    if (device_count or 0) < 2:
        return Check(name, NOT_PRESENT, f"skipped: {device_count or 0} visible NPU, needs 2")
    fix = (
        "check the driver (the Ascend HDK row), `npu-smi info`, ASCEND_RT_VISIBLE_DEVICES and the "
        "HCCL port ranges (HCCL_HOST_SOCKET_PORT_RANGE)"
    )
    return run_probe(name, _HCCL_PROBE, [str(_free_port())], fix, timeout_s)


def ipc_one_die_check(
    no_npu_reason: str | None, timeout_s: float = DEVICE_CHECK_TIMEOUT_S
) -> Check:
    """A tensor on device 0 handed to a second process through IPC (how crossrl pushes weights
    to a colocated engine); skipped with the reason where there is no NPU."""
    name = "IPC on one die"
    if no_npu_reason:
        return Check(name, NOT_PRESENT, f"skipped: {no_npu_reason}")
    fix = "install the HDK the Ascend HDK row names (multi-process HCCP and IPC memory sharing)"
    return run_probe(name, _IPC_PROBE, [], fix, timeout_s)


PROBE_NAMES = ("HCCL across dies", "IPC on one die")
"""The doctor rows that run collectives and IPC on the NPU."""


def skipped_probe_rows(reason: str) -> list[Check]:
    """The device probes' rows, skipped with ``reason`` (no NPU here, or smoke tests off)."""
    return [Check(name, NOT_PRESENT, f"skipped: {reason}") for name in PROBE_NAMES]


def a3_checks(
    environ: Mapping[str, str],
    *,
    no_npu_reason: str | None,
    device_count: int | None,
    device_probes: bool = True,
    rollout_engine: str = "vllm",
) -> list[Check]:
    """The rows an A3 node needs beyond versions: driver, the chip's ops package, NNAL/ATB,
    triton-ascend, the vllm-ascend build against the chip, HCCL port ranges, then the two device probes (skipped
    with the reason where no NPU exists, or when ``device_probes`` is False)."""
    chip, soc_name = (None, "") if no_npu_reason else _probed_chip()
    rows = [hdk_check(cann=cann_version(environ)), ops_package_check(environ, chip, no_npu_reason)]
    if rollout_engine != "vllm":
        why = f"not needed (rollout.engine={rollout_engine})"
        rows += [Check(n, NOT_PRESENT, why) for n in ("NNAL/ATB", "triton-ascend")]
        rows.append(Check("vllm-ascend build", NOT_PRESENT, why))
    else:
        rows += [nnal_check(environ), triton_ascend_check(dist_version("triton-ascend"))]
        rows.append(_build_row(no_npu_reason, chip, soc_name))
    rows += port_range_checks(environ)
    if no_npu_reason:
        rows += skipped_probe_rows(no_npu_reason)
    elif not device_probes:
        rows += skipped_probe_rows("smoke tests off (--no-smoke)")
    else:
        rows.append(hccl_two_die_check(device_count, None))
        rows.append(ipc_one_die_check(None))
    return rows


def _probed_chip() -> tuple[str | None, str]:
    """This node's device type and chip name, read once in a child (torch_npu's SoC number)."""
    soc, soc_name = probe_soc()
    return (chip_type(soc) if soc is not None else None), soc_name


def _build_row(no_npu_reason: str | None, chip: str | None, soc_name: str) -> Check:
    """The vllm-ascend build's device type against this node's chip."""
    build = vllm_ascend_build_type()
    if no_npu_reason:
        return engine_build_check(build, None, f"no NPU: {no_npu_reason}", npu=False)
    if build is None:
        return engine_build_check(None, None)
    return engine_build_check(build, chip, soc_name)


__all__ = [
    "EngineBuildMismatchError",
    "a3_checks",
    "chip_type",
    "engine_build_check",
    "engine_build_fix",
    "engine_build_mismatch",
    "hdk_check",
    "hdk_requirement",
    "skipped_probe_rows",
    "parse_build_info",
    "require_engine_build",
    "vllm_ascend_build_type",
    "vllm_ascend_image",
]
