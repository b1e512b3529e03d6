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
