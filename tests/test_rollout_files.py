"""Atomic file writes (rollout/files.py): readers see the old file or the whole new one."""

from __future__ import annotations

import os

import pytest

from rollout.files import (
    atomic_path,
    atomic_write_bytes,
    atomic_write_text,
    is_temp_name,
    temp_sibling,
)


def test_atomic_write_replaces_whole_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "sub" / "f.txt"
    atomic_write_text(target, "old")
    atomic_write_bytes(target, b"new contents")
    assert target.read_bytes() == b"new contents"
    assert sorted(p.name for p in target.parent.iterdir()) == ["f.txt"]


def test_atomic_write_failure_keeps_old_file(tmp_path, monkeypatch):
    target = tmp_path / "f.txt"
    atomic_write_text(target, "old")

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(target, "new")
    monkeypatch.undo()
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]


def test_writer_exception_inside_atomic_path_leaves_target_untouched(tmp_path):
    target = tmp_path / "f.bin"
    atomic_write_bytes(target, b"old")
    with pytest.raises(RuntimeError, match="writer died"), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("writer died")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_temp_names_are_hidden_siblings_and_recognised(tmp_path):
    a, b = temp_sibling(tmp_path / "step_3"), temp_sibling(tmp_path / "step_3")
    assert a != b and a.parent == tmp_path and a.name.startswith(".step_3.")
    assert is_temp_name(a.name)
    assert not is_temp_name("step_3") and not is_temp_name(".step_3.tmp.xyz")
