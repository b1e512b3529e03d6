"""scripts/carry.py: a large archive travels to the GPU machine in parts and comes back whole,
and a missing or damaged part is refused in one line naming it."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("carry", ROOT / "scripts" / "carry.py")
carry = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(carry)


@pytest.fixture
def archive(tmp_path) -> Path:
    path = tmp_path / "wheels.tar"
    path.write_bytes(os.urandom(10_000))
    return path


def test_split_then_join_gives_the_archive_back(archive, tmp_path):
    manifest = carry.split(archive, tmp_path / "parts", 3_000)
    assert [p["bytes"] for p in manifest["parts"]] == [3000, 3000, 3000, 1000]
    out = carry.join(tmp_path / "parts", tmp_path / "back.tar")
    assert out.read_bytes() == archive.read_bytes()
    assert not list((tmp_path / "parts").glob("*.tmp"))  # nothing half-written left


@pytest.mark.parametrize("fault", ["missing", "damaged"])
def test_a_bad_part_is_named_and_nothing_is_joined(archive, tmp_path, capsys, fault):
    carry.split(archive, tmp_path / "parts", 4_000)
    part = tmp_path / "parts" / "part-001"
    if fault == "missing":
        part.unlink()
    else:
        part.write_bytes(b"x" + part.read_bytes()[1:])
    code = carry.main(["join", str(tmp_path / "parts"), str(tmp_path / "back.tar")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "part-001" in err and fault in err
    assert not (tmp_path / "back.tar").exists() and not (tmp_path / "back.tar.tmp").exists()


def test_missing_lists_requirements_neither_carried_nor_in_the_image(tmp_path):
    import zipfile

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl", "w") as zf:
        zf.writestr(
            "vllm-0.24.0.dist-info/METADATA",
            "Name: vllm\nRequires-Dist: torch==2.11.0\nRequires-Dist: msgspec\n"
            "Requires-Dist: blake3\nRequires-Dist: pytest; extra == 'test'\n",
        )
    with zipfile.ZipFile(wheels / "msgspec-0.19.0-cp312-cp312-manylinux.whl", "w") as zf:
        zf.writestr("msgspec-0.19.0.dist-info/METADATA", "Name: msgspec\n")
    image = tmp_path / "image.txt"
    image.write_text("torch\nnumpy\n")
    assert carry.missing(wheels, image) == [
        "blake3 (needed by vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl)"
    ]


def _wheel(folder, name, version, requires=()):
    import zipfile

    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        meta = f"Name: {name}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
        zf.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def test_requirements_apply_markers_for_the_gpu_machine(tmp_path):
    wheel = _wheel(
        tmp_path,
        "pyzmq",
        "27.3.0",
        [
            'cffi; implementation_name == "pypy"',
            'importlib-metadata; python_version < "3.10"',
            'llguidance<1.8,>=1.7; platform_machine == "x86_64"',
            "pytest; extra == 'test'",
            "msgspec",
        ],
    )
    assert carry._requirements(wheel) == ["llguidance<1.8,>=1.7", "msgspec"]


def test_fetch_relaxed_relaxes_a_pin_the_index_cannot_meet(tmp_path, monkeypatch):
    import re
    import subprocess

    # A fake index: vllm needs llguidance>=1.7 (the index has 1.6.1), torch (never carried)
    # and numpy (in the image); llguidance needs nothing.
    index = {
        "vllm": ("0.24.0", ["llguidance<1.8,>=1.7", "torch==2.11.0", "numpy"]),
        "llguidance": ("1.6.1", []),
        "trl": ("1.16.0", ["accelerate"]),
        "accelerate": ("1.0.0", []),
    }
    asked = []

    def fake_pip(cmd, **kwargs):
        spec = cmd[-1]
        asked.append(spec)
        name = re.split(r"[<>=!~]", spec, maxsplit=1)[0]
        version, requires = index[name]
        if ">=1.7" in spec and name == "llguidance":
            return subprocess.CompletedProcess(cmd, 1)
        _wheel(Path(cmd[cmd.index("-d") + 1]), name, version, requires)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_pip)
    image = tmp_path / "image.txt"
    image.write_text("numpy\n")
    wheels = tmp_path / "wheels"
    relaxed = carry.fetch_relaxed(wheels, ["vllm==0.24.0", "trl==1.16.0"], image)
    assert relaxed == ["llguidance<1.8,>=1.7 -> the index's newest"]
    assert sorted(p.name.split("-")[0] for p in wheels.glob("*.whl")) == [
        "accelerate",
        "llguidance",
        "trl",
        "vllm",
    ]
    assert "torch==2.11.0" not in asked and "numpy" not in asked
    assert carry.missing(wheels, image) == []
