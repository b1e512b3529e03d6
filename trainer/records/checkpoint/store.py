"""The ``checkpoints/`` directory: staging, the atomic commit, ``latest``, verify, resume.

See ``trainer/records/checkpoint/__init__.py`` for the commit protocol; names come from ``LAYOUT``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from rollout.files import atomic_write_text, fsync_dir, fsync_file, is_temp_name
from trainer.records.checkpoint.layout import LAYOUT
from trainer.records.checkpoint.pieces import CheckpointError, save_json

log = logging.getLogger("trainer.records.checkpoint")

MANIFEST_FORMAT = 1

_STEP_RE = re.compile(r"^step_(\d+)$")
_STAGING_RE = re.compile(r"^\.tmp_step_(\d+)_[0-9a-f]+$")
_TMP_PREFIX = ".tmp_"
_HASH_CHUNK_BYTES = 1 << 20


def _checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / LAYOUT.checkpoints_dir


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise ValueError(
            f"checkpoint step must be an int >= 0 (optimizer steps done), got {step!r}"
        )
    return int(step)


def step_dir_name(step: int) -> str:
    """``step_<N>``: the directory name of the checkpoint taken after ``step`` optimizer steps."""
    return f"step_{_check_step(step)}"


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step number of a ``step_<N>`` checkpoint dir."""
    m = _STEP_RE.match(Path(path).name)
    if not m:
        raise ValueError(f"{path}: not a checkpoint dir; its name must be step_<N>")
    return int(m.group(1))


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Every ``step_<N>`` dir under ``run_dir/checkpoints`` (committed or not), by step."""
    root = _checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_RE.match(p.name)]
    return sorted(found, key=checkpoint_step)


def begin_checkpoint(run_dir: str | os.PathLike, step: int) -> Path:
    """Create and return a fresh staging dir ``checkpoints/.tmp_step_<N>_<uuid>/``.

    Every writer puts its pieces there (``save_safetensors``/``save_torch``/``save_json``);
    nothing in it counts until ``commit_checkpoint``.
    """
    step = _check_step(step)
    root = _checkpoints_dir(run_dir)
    staging = root / f"{_TMP_PREFIX}step_{step}_{uuid.uuid4().hex}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        fsync_dir(root)
    except OSError as err:  # a file in its place, no permission, a full or read-only disk
        raise CheckpointError(
            f"step {step}: cannot write a checkpoint under {root} ({err.strerror or err}); "
            "make that directory writable (or point run.dir at one that is); the last whole "
            "checkpoint stays `latest`"
        ) from None
    return staging


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _staged_files(staging: Path) -> list[Path]:
    files = []
    for path in sorted(staging.rglob("*")):
        if path.is_dir():
            continue
        if is_temp_name(path.name):
            # A writer died mid-write and left its temp file; the real piece is checked below.
            log.warning("checkpoint: dropping leftover temp file %s", path)
            path.unlink()
            continue
        if path.relative_to(staging).as_posix() == LAYOUT.manifest:
            continue
        files.append(path)
    return files


def _write_latest(root: Path, name: str) -> None:
    atomic_write_text(root / LAYOUT.latest, name + "\n")


def _move_aside(root: Path, path: Path, why: str) -> Path:
    """Rename ``path`` to a ``.tmp_`` name that every reader ignores, so deleting it
    afterwards can never leave a half-deleted ``step_<N>`` behind."""
    doomed = root / f"{_TMP_PREFIX}{why}_{path.name}_{uuid.uuid4().hex}"
    os.replace(path, doomed)
    return doomed


def commit_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    staging_dir: str | os.PathLike,
    *,
    keep_last: int | None = 2,
    expect_files: Iterable[str] = (),
) -> Path:
    """Make the pieces in ``staging_dir`` the checkpoint ``step_<N>`` and point ``latest`` at it.

    Call only after every writer has returned. Order: fsync files, write ``manifest.json``
    (size in bytes + sha256 per file), fsync, rename to ``step_<N>`` (an existing
    ``step_<N>`` is replaced), fsync, write ``latest`` LAST, then prune. ``keep_last``
    keeps that many newest checkpoints (None keeps all); the one ``latest`` names is never
    pruned, and ``step_<M>`` dirs with M > N (left by a run that was resumed from an
    earlier step) are removed, like the metrics lines the resumed run rewrites.
    ``expect_files``: relative paths that must be present (e.g. one ``LAYOUT.rng(role, k)``
    per rank), so a writer that silently wrote nothing fails the commit.
    Returns the committed ``step_<N>`` path.
    """
    step = _check_step(step)
    if keep_last is not None and (isinstance(keep_last, bool) or int(keep_last) < 1):
        raise ValueError(f"keep_last must be None (keep all) or an int >= 1, got {keep_last!r}")
    root = _checkpoints_dir(run_dir)
    staging = Path(staging_dir)
    if not staging.is_dir() or staging.resolve().parent != root.resolve():
        raise ValueError(
            f"staging_dir {staging} is not a staging dir under {root}; "
            "get one from begin_checkpoint(run_dir, step)"
        )
    m = _STAGING_RE.match(staging.name)
    if not m or int(m.group(1)) != step:
        raise ValueError(
            f"staging_dir {staging.name} was not made for step {step}; "
            f"use the dir begin_checkpoint(run_dir, {step}) returned"
        )

    files = _staged_files(staging)
    if not files:
        raise CheckpointError(
            f"{staging}: nothing was written; refusing to commit an empty checkpoint"
        )
    rel_names = {p.relative_to(staging).as_posix() for p in files}
    missing = sorted(set(expect_files) - rel_names)
    if missing:
        raise CheckpointError(
            f"{staging}: expected files {missing} were not written (found {sorted(rel_names)}); "
            "a writer failed, check the worker logs before committing"
        )

    manifest: dict[str, Any] = {"format": MANIFEST_FORMAT, "step": step, "files": {}}
    for path in files:
        fsync_file(path)
        manifest["files"][path.relative_to(staging).as_posix()] = {
            "size": path.stat().st_size,
            "sha256": _sha256(path),
        }
    for sub in sorted({p.parent for p in files}, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(sub)
    save_json(manifest, staging / LAYOUT.manifest)

    final = root / step_dir_name(step)
    # A directory rename cannot replace a non-empty dir, so an existing step_<N> is moved
    # aside first and deleted only once the new one is in place.
    replaced = _move_aside(root, final, "replaced") if final.exists() else None
    os.replace(staging, final)
    fsync_dir(root)
    _write_latest(root, final.name)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)

    _prune(root, step, keep_last)
    _clean_stale(root, step)
    return final


def _prune(root: Path, committed_step: int, keep_last: int | None) -> None:
    latest = _read_latest_name(root)
    steps = list_checkpoints(root.parent)
    newer = [p for p in steps if checkpoint_step(p) > committed_step]
    older = [p for p in steps if checkpoint_step(p) <= committed_step]
    doomed = list(newer)
    if keep_last is not None:
        doomed += older[: max(0, len(older) - keep_last)]
    for path in doomed:
        if path.name == latest:
            continue
        log.info("checkpoint: pruning %s", path)
        shutil.rmtree(_move_aside(root, path, "pruned"), ignore_errors=True)


def _clean_stale(root: Path, committed_step: int) -> None:
    """Delete leftovers of crashed commits/writers.

    Staging dirs for steps after the committed one are kept: an asynchronous writer may be
    filling one right now. A crashed one is deleted once a commit reaches its step.
    """
    for path in root.iterdir():
        if not path.is_dir() or not path.name.startswith(_TMP_PREFIX):
            continue
        m = _STAGING_RE.match(path.name)
        if m and int(m.group(1)) > committed_step:
            continue
        shutil.rmtree(path, ignore_errors=True)


def _read_latest_name(root: Path) -> str | None:
    try:
        name = (root / LAYOUT.latest).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    if not _STEP_RE.match(name):
        raise CheckpointError(
            f"{root / LAYOUT.latest}: holds {name!r}, expected 'step_<N>'; fix it by hand to name "
            "a checkpoint dir next to it, or delete it to start fresh"
        )
    return name


def find_latest(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint ``checkpoints/latest`` names, or None when nothing was ever committed.

    ``latest`` is the commit point, so a newer ``step_<N>`` it does not name is ignored.
    If the dir it names is gone (crash while an existing step was being replaced), the
    newest older ``step_<N>`` holding a manifest is returned, with a warning.
    """
    root = _checkpoints_dir(run_dir)
    name = _read_latest_name(root)
    if name is None:
        return None
    target = root / name
    if (target / LAYOUT.manifest).is_file():
        return target
    limit = checkpoint_step(target)
    fallback = [
        p
        for p in list_checkpoints(run_dir)
        if checkpoint_step(p) < limit and (p / LAYOUT.manifest).is_file()
    ]
    if not fallback:
        raise CheckpointError(
            f"{root / LAYOUT.latest} names {name}, but {target} is missing or has no manifest and "
            "no older checkpoint exists; start fresh (delete the checkpoints dir) or point "
            "run.resume at a copy of a checkpoint"
        )
    log.warning(
        "checkpoint: %s names missing %s; falling back to %s", LAYOUT.latest, name, fallback[-1]
    )
    return fallback[-1]


def verify_checkpoint(path: str | os.PathLike, *, check_hashes: bool = True) -> dict[str, Any]:
    """Check a ``step_<N>`` dir against its manifest; return the manifest.

    Every listed file must be present with the recorded size in bytes and (when
    ``check_hashes``) sha256, else ``CheckpointError`` naming the checkpoint, the file,
    what is wrong and the fix. Files not in the manifest are ignored.
    """
    path = Path(path)
    fix = "move it away, or set run.resume to another checkpoint (step_<N> or its path)"
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint {path} does not exist; set run.resume to an existing checkpoint "
            "(step_<N> or its path)"
        )
    manifest_path = path / LAYOUT.manifest
    if not manifest_path.is_file():
        raise CheckpointError(
            f"checkpoint {path}: {LAYOUT.manifest} is missing, so it was never committed; {fix}"
        )
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        entries = manifest["files"]
        if not isinstance(entries, dict):
            raise TypeError("'files' is not an object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"checkpoint {path}: {LAYOUT.manifest} is unreadable ({err}); {fix}"
        ) from None
    for rel, info in sorted(entries.items()):
        file = path / rel
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: file {rel} is missing; {fix}")
        size = file.stat().st_size
        if size != info["size"]:
            raise CheckpointError(
                f"checkpoint {path}: file {rel} has {size} bytes, manifest says {info['size']} "
                f"(truncated or overwritten); {fix}"
            )
        if check_hashes and _sha256(file) != info["sha256"]:
            raise CheckpointError(
                f"checkpoint {path}: file {rel} fails its sha256 check (corrupted on disk); {fix}"
            )
    return manifest


def resolve_resume(
    run_dir: str | os.PathLike, resume: Any, *, check_hashes: bool = True
) -> Path | None:
    """Turn a ``run.resume`` value into a verified checkpoint dir, or None to start fresh.

    Accepted: ``None``/``False``/``"never"`` (fresh), ``True``/``"auto"``/``"latest"`` (the
    ``latest`` checkpoint if any, else fresh), a step (int or digits) or ``"step_<N>"`` (that checkpoint
    in ``run_dir``), or a path to a ``step_<N>`` dir. A checkpoint that is missing or fails
    verification raises ``CheckpointError`` ending with the checkpoints ``run_dir`` holds.
    ``check_hashes=False`` verifies presence and sizes only (``verify_checkpoint``).
    """
    try:
        return _resolve_resume(run_dir, resume, check_hashes)
    except CheckpointError as err:
        raise CheckpointError(f"run.resume={resume}: {err} ({_committed_here(run_dir)})") from None


def _committed_here(run_dir: str | os.PathLike) -> str:
    """Which committed checkpoints ``run_dir`` holds, as advice for ``run.resume``."""
    names = [p.name for p in list_checkpoints(run_dir) if (p / LAYOUT.manifest).is_file()]
    if not names:
        return f"{run_dir} holds no committed checkpoint: run.resume=never starts afresh"
    return f"committed in {run_dir}: {', '.join(names)}"


def _resolve_resume(run_dir: str | os.PathLike, resume: Any, check_hashes: bool) -> Path | None:
    if resume is None or resume is False or resume == "never":
        return None
    if resume is True or resume in ("auto", "latest"):
        found = find_latest(run_dir)
    elif isinstance(resume, int) and not isinstance(resume, bool):
        found = _checkpoints_dir(run_dir) / step_dir_name(resume)
    elif isinstance(resume, str | os.PathLike):
        text = os.fspath(resume)
        if text.isdigit():
            text = f"step_{int(text)}"
        found = _checkpoints_dir(run_dir) / text if _STEP_RE.match(text) else Path(text)
        if not _STEP_RE.match(found.name):
            raise CheckpointError(f"{found} is not a checkpoint: its name must be step_<N>")
    else:
        raise ValueError(
            f"run.resume={resume!r} is not understood; use null, auto, latest, a step number, "
            "step_<N> or a path to a step_<N> dir"
        )
    if found is None:
        return None
    verify_checkpoint(found, check_hashes=check_hashes)
    return found
