"""Dependency ranges are tested, not floating: every library whose releases break us has an
upper bound in setup.cfg, and each lane's constraints file pins versions inside those ranges."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
BOUNDED = {"torch", "transformers", "vllm"}  # their releases have broken us before


def _requirements() -> dict[str, Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    for extra in cfg["options.extras_require"].values():
        lines += extra.splitlines()
    reqs = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    return {r.name: r for r in reqs}


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            package, version = line.split("==")
            pins[package.strip()] = version.strip()
    return pins


def test_the_libraries_that_break_us_have_upper_bounds():
    reqs = _requirements()
    for name in BOUNDED:
        specs = reqs[name].specifier
        assert any(s.operator in ("<", "<=", "==") for s in specs), (name, str(specs))


@pytest.mark.parametrize(
    "lane", ["constraints-cpu.txt", "constraints-gpu.txt", "constraints-npu.txt"]
)
def test_each_lanes_pins_lie_inside_the_ranges(lane):
    reqs = _requirements()
    pins = _pins(lane)
    assert "torch" in pins  # every lane pins torch: an unpinned one pulls the wrong build
    for package, version in pins.items():
        if package in reqs:
            assert Version(version) in reqs[package].specifier, (lane, package, version)
