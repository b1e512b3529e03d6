"""One row of `crossrl doctor`'s table and its statuses, shared by the modules that check
(``hal.doctor_facts``, ``hal.cann``, ``hal.npu_checks``), which import nothing from each other
for it."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

OK, WARN, FAIL, ABSENT, NOT_PRESENT = "ok", "WARN", "FAIL", "absent", "-"
"""Statuses of a check row; only FAIL makes `crossrl doctor` exit 1."""


@dataclass(frozen=True)
class Check:
    """One row of the doctor's table: what was checked, ok/WARN/FAIL/absent/-, what was found,
    and on a WARN or FAIL the command or setting that fixes it."""

    name: str
    status: str
    detail: str
    fix: str = ""


def dist_version(name: str) -> str | None:
    """Installed version of a distribution (`torch_npu`, `flash_attn`, ...) or None; no import."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
