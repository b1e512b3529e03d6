"""Atomic file writes: a reader sees the old file or the whole new one, never half of it.

The one owner of "write to a temp name next to the target, fsync, ``os.replace``, fsync the
directory". Checkpoint pieces, ``latest``, ``config.yaml``, ``metrics.jsonl``, plots, parity
records and benchmark results are all written through it, and the builtin-model cache takes
its temp directory names from ``temp_sibling``.

Why in rollout/: it is the lowest layer that writes files (the builtin-model cache in
``rollout/models.py``), and trainer/ and bench/ sit above it. hal/ holds device backends only
and batching/ is pure, file-free planning logic, so neither is a home for file I/O.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

# Temp names look like ".<name>.tmp.<32 hex>": hidden, so a crashed write never shadows a real
# file, and recognisable (``is_temp_name``), so a later pass can drop what a crash left.
_TEMP_NAME_RE = re.compile(r"^\..+\.tmp\.[0-9a-f]{32}$")


def temp_sibling(path: str | os.PathLike) -> Path:
    """A fresh temp path in ``path``'s directory, to be renamed onto ``path`` when whole."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp.{uuid.uuid4().hex}")


def is_temp_name(name: str) -> bool:
    """Whether a file name is one ``temp_sibling`` makes (a write that has not finished)."""
    return _TEMP_NAME_RE.match(name) is not None


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file's bytes to disk."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename/creation inside ``path`` durable (no-op where dirs cannot be opened)."""
    if os.name == "nt":  # Windows cannot open a directory for fsync; NTFS renames are journaled
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path next to ``path``; on success fsync it and rename it onto ``path``.

    For writers that want a file name rather than bytes (``torch.save``, safetensors,
    matplotlib). On an exception the temp file is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (parent dirs are created). Returns ``path``."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """``atomic_write_bytes`` for UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def undecodable(path: str | os.PathLike, err: UnicodeDecodeError) -> str:
    """One line for a file that is not UTF-8 text: the first bad byte, its line and the fix.

    ``err`` is what decoding the file's bytes (from its start) raised; the line number counts
    the newlines before the bad byte.
    """
    line = err.object[: err.start].count(b"\n") + 1
    byte = err.object[err.start : err.start + 1].hex()
    return f"not UTF-8 text (byte 0x{byte} on line {line}); save {Path(path).name} as UTF-8"
