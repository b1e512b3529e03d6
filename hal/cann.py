"""CANN, the Ascend toolkit torch_npu links against, as `crossrl doctor` finds it: through its
environment (``set_env.sh``) or at a default install path, with its version held to the tested
set's (``hal.npu_versions``). Reads files only; never imports torch_npu."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from hal.doctor_facts import FAIL, OK, WARN, Check
from hal.npu_versions import ASCEND_STACKS, PINNED_VLLM_ASCEND

CANN_DEFAULT_HOMES = (
    Path("/usr/local/Ascend/cann"),
    Path("/usr/local/Ascend/ascend-toolkit/latest"),
)
"""Where CANN installs without ``--install-path``, newest layout first: ``/usr/local/Ascend/cann``
since CANN 8.5 (its ``<arch>-linux/ascend_toolkit_install.info``), ``ascend-toolkit/latest``
before (CANN 8.5's and 8.0's "File Paths" pages)."""
CANN_HOME_ENVS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
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


def cann_version(environ: Mapping[str, str]) -> str | None:
    """The CANN toolkit's version (its ``ascend_toolkit_install.info``), found as `cann_check`
    finds the toolkit; None when there is none or it names no version."""
    for var in CANN_HOME_ENVS:
        if environ.get(var):
            home = Path(environ[var])
            return _cann_version_in(home) if home.is_dir() else None
    home = _cann_default_home()
    return None if home is None else _cann_version_in(home)
