"""CANN, the Ascend toolkit torch_npu links against, as `crossrl doctor` finds it: through its
environment (``set_env.sh``) or at a default install path, with its version held to the tested
set's (``hal.npu_versions``), and the chip's ops package beside it. Reads files only; never
imports torch_npu.

The ops package: since CANN 8.5 the toolkit ships no operator kernels; each chip has its own
ops package, installed at the toolkit's path and version from Huawei's installer, a run file
(not on PyPI): ``Ascend-cann-A3-ops_<version>_linux-<arch>.run`` for Atlas A3,
``Ascend-cann-910b-ops_<version>_linux-<arch>.run`` for Atlas A2, run with ``--install`` (and
``--install-path`` when the toolkit has one); vllm-ascend 0.26.0rc1's installation.md installs
``Ascend-cann-910b-ops_9.1.0_linux-"$(uname -i)".run --install``; one chip's package per path. Its binary kernels land in ``<opp>/built-in/op_impl/ai_core/tbe/kernel/
<soc>/`` (``ascend910_93`` on A3, ``ascend910b`` on A2; vllm-ascend's A3 operator-patch guide
writes into ``$ASCEND_TOOLKIT_HOME/opp/built-in/op_impl/ai_core/tbe/kernel/ascend910_93``).
A toolkit without it holds only ``ops_oam`` there, and every aclnn operator fails at its first
call (error 561103)."""

from __future__ import annotations

import platform
from collections.abc import Mapping
from pathlib import Path

from hal.check_row import FAIL, NOT_PRESENT, OK, WARN, Check
from hal.npu_versions import ASCEND_STACKS, PINNED_VLLM_ASCEND

CANN_DEFAULT_HOMES = (
    Path("/usr/local/Ascend/cann"),
    Path("/usr/local/Ascend/ascend-toolkit/latest"),
)
"""Where CANN installs without ``--install-path``, newest layout first: ``/usr/local/Ascend/cann``
since CANN 8.5 (its ``<arch>-linux/ascend_toolkit_install.info``), ``ascend-toolkit/latest``
before (CANN 8.5's and 8.0's "File Paths" pages)."""
CANN_HOME_ENVS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
OPP_KERNELS = Path("built-in/op_impl/ai_core/tbe/kernel")
"""Where, under the operator root (``ASCEND_OPP_PATH``, else ``<toolkit>/opp``), the ops
package puts each chip's binary kernels."""
CHIP_KERNEL_DIRS = {"A2": "ascend910b", "A3": "ascend910_93"}
"""The kernel directory of each device type (as ``hal.npu_checks.chip_type`` names them)."""
OPS_PACKAGE_CHIPS = {"A2": "910b", "A3": "A3"}
"""How each device type's ops package file names its chip (``ops_run_file``)."""
CANN_DOWNLOAD = "https://www.hiascend.com/cann/download"
"""Where Huawei's CANN run files (toolkit, ops, NNAL) are downloaded."""
TOOLKIT_ONLY_KERNELS = frozenset({"ops_oam"})
"""What the kernel directory holds from the toolkit alone, without the chip's ops package."""
CANN_SET_ENV_FIX = (
    "source its set_env.sh (/usr/local/Ascend/cann/set_env.sh since CANN 8.5, "
    "/usr/local/Ascend/ascend-toolkit/set_env.sh before)"
)


def cann_check(environ: Mapping[str, str]) -> Check:
    """CANN, the Ascend toolkit torch_npu links against: found through its env or a default
    path (``CANN_DEFAULT_HOMES``), and its version against the tested set's (the CANN of
    vllm-ascend ``PINNED_VLLM_ASCEND``, ``constraints-npu.txt``): another version WARNs."""
    fix = f"install CANN {_tested_cann()}, then {CANN_SET_ENV_FIX}"
    for var in CANN_HOME_ENVS:
        if environ.get(var):
            home = Path(environ[var])
            if not home.is_dir():
                return Check("CANN", FAIL, f"{var}={home} is not a directory", fix)
            return _cann_version_row(f"{var}={home}", home)
    home = _cann_default_home()
    if home is not None:
        row = _cann_version_row(f"{home}", home)
        return Check("CANN", WARN, f"{row.detail}, but its env is not set", CANN_SET_ENV_FIX)
    return Check("CANN", FAIL, f"not found ({', '.join(CANN_HOME_ENVS)} unset)", fix)


def _tested_cann() -> str:
    return ASCEND_STACKS[PINNED_VLLM_ASCEND].cann


def _cann_default_home() -> Path | None:
    return next((home for home in CANN_DEFAULT_HOMES if home.is_dir()), None)


def _cann_version_row(where: str, home: Path) -> Check:
    """The CANN row for the toolkit at ``home`` (``where`` says how it was found): OK at the
    tested version, WARN at another or when its version cannot be read."""
    version, tested = _cann_version_in(home), _tested_cann()
    if version is None:
        return Check(
            "CANN",
            WARN,
            f"{where} (no version in */ascend_toolkit_install.info)",
            f"use CANN {tested}",
        )
    if version != tested:
        return Check(
            "CANN",
            WARN,
            f"{where} (version {version}; the tested set has {tested})",
            f"install CANN {tested} and NNAL {tested}, the set constraints-npu.txt pins",
        )
    return Check("CANN", OK, f"{where} (version {version})")


def _cann_version_in(home: Path) -> str | None:
    for info in sorted(home.glob("*/ascend_toolkit_install.info")):
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("version="):
                return line.split("=", 1)[1].strip()
    return None


def cann_home(environ: Mapping[str, str]) -> Path | None:
    """The CANN toolkit's directory, found as `cann_check` finds it (its env first, then the
    default paths); None when there is none."""
    for var in CANN_HOME_ENVS:
        if environ.get(var):
            home = Path(environ[var])
            return home if home.is_dir() else None
    return _cann_default_home()


def cann_version(environ: Mapping[str, str]) -> str | None:
    """The CANN toolkit's version (its ``ascend_toolkit_install.info``), found as `cann_check`
    finds the toolkit; None when there is none or it names no version."""
    home = cann_home(environ)
    return None if home is None else _cann_version_in(home)


def chips_with_kernels(opp: Path) -> list[str]:
    """The device types whose ops package has put kernels under the operator root ``opp``."""
    found = []
    for chip, name in CHIP_KERNEL_DIRS.items():
        folder = opp / OPP_KERNELS / name
        if folder.is_dir() and {p.name for p in folder.iterdir()} - TOOLKIT_ONLY_KERNELS:
            found.append(chip)
    return found


def ops_run_file(chip: str, version: str, arch: str | None = None) -> str:
    """The file name of device type ``chip``'s ops package for CANN ``version`` on CPU
    architecture ``arch`` (None: this machine's, ``uname -m``), as Huawei publishes it."""
    arch = arch or platform.machine() or "<arch>"
    return f"Ascend-cann-{OPS_PACKAGE_CHIPS[chip]}-ops_{version}_linux-{arch}.run"


def ops_package_check(
    environ: Mapping[str, str], chip: str | None, no_npu_reason: str | None = None
) -> Check:
    """The chip's ops package (its operator kernels) beside the toolkit: FAIL, naming the
    package to install, when this node's chip (``chip``, a device type) has none; skipped with
    the reason where there is no NPU to name the chip."""
    name = "CANN ops package"
    if no_npu_reason:
        return Check(name, NOT_PRESENT, f"skipped: {no_npu_reason}")
    opp_env = environ.get("ASCEND_OPP_PATH")
    home = cann_home(environ)
    opp = Path(opp_env) if opp_env else (home / "opp" if home else None)
    if opp is None:
        return Check(name, FAIL, "no CANN toolkit, so no operator root", CANN_SET_ENV_FIX)
    found = chips_with_kernels(opp)
    version = cann_version(environ) or _tested_cann()
    where = f"{opp / OPP_KERNELS}"
    if chip not in CHIP_KERNEL_DIRS:
        kinds = ", ".join(found) or "none"
        return Check(name, WARN, f"chip not read ({chip or 'unknown'}); kernels for: {kinds}")
    if chip not in found:
        other = f" (only {', '.join(found)}'s)" if found else ""
        return Check(
            name,
            FAIL,
            f"no {chip} kernels in {where}/{CHIP_KERNEL_DIRS[chip]}{other}: every operator "
            "would fail at its first call (aclnn error 561103)",
            f"install the {chip} ops package at the toolkit's version and path: "
            f"./{ops_run_file(chip, version)} --install [--install-path=<the toolkit's>] "
            f"(Huawei's run file from {CANN_DOWNLOAD}; not on PyPI)",
        )
    return Check(name, OK, f"{chip} kernels in {where}/{CHIP_KERNEL_DIRS[chip]}")
