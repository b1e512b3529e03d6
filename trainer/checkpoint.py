"""Atomic, verifiable checkpoints in ``<run.dir>/checkpoints/``.

Layout (a contract, see DESIGN.md "Run directory")::

    checkpoints/
      .tmp_step_<N>_<uuid>/   staging: workers write their pieces here
      step_<N>/               a whole checkpoint: pieces + manifest.json
      latest                  text file "step_<N>": the newest whole checkpoint

Commit protocol. Several processes write one checkpoint (rank 0 the model, each rank its
optimizer shard and RNG, the controller ``trainer_state.json``), so no single file write can
be the commit point. Instead:

1. ``begin_checkpoint`` makes a fresh staging dir; workers write into it (with the atomic
   helpers below, so a piece is either whole or absent).
2. Once every writer has returned, the controller calls ``commit_checkpoint``: it fsyncs every
   file, writes ``manifest.json`` (size + sha256 per file), renames the staging dir to
   ``step_<N>`` and only then rewrites ``latest``.

``latest`` is the single commit point: a crash at any moment leaves it naming the previous
whole checkpoint. A ``step_<N>`` newer than ``latest`` (crash between rename and ``latest``)
is ignored and replaced when the resumed run saves that step again; stale ``.tmp_*`` dirs are
ignored and deleted by a later commit.

Multi-node: the run dir must be on a filesystem every writer sees (shared storage), since
workers write straight into the staging dir.

``latest`` is a text file rather than a symlink so the layout works on every filesystem
(object-store mounts and some network filesystems lack symlinks).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
LATEST_NAME = "latest"
MANIFEST_NAME = "manifest.json"
MODEL_FILE = "model.safetensors"
TRAINER_STATE_FILE = "trainer_state.json"
MANIFEST_FORMAT = 1

_STEP_RE = re.compile(r"^step_(\d+)$")
_STAGING_RE = re.compile(r"^\.tmp_step_(\d+)_[0-9a-f]+$")
_TMP_PREFIX = ".tmp_"
# Temp files of atomic writes look like ".<name>.tmp.<hex>": hidden, so a crashed write never
# shadows a real piece, and recognisable, so commit can drop them.
_ATOMIC_TMP_RE = re.compile(r"^\..+\.tmp\.[0-9a-f]{32}$")
_HASH_CHUNK_BYTES = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint (or a file in it) is missing, incomplete or corrupt.

    The message names the checkpoint dir or file, what is wrong and how to go on.
    """


def optim_file(rank: int) -> str:
    """File name of data-parallel rank ``rank``'s optimizer state inside a checkpoint."""
    return f"optim_rank{int(rank)}.pt"


def rng_file(rank: int) -> str:
    """File name of data-parallel rank ``rank``'s RNG state inside a checkpoint."""
    return f"rng_rank{int(rank)}.pt"


# --------------------------------------------------------------------------- atomic writes


def _fsync_dir(path: Path) -> None:
    """Make a rename/creation inside ``path`` durable (no-op where dirs cannot be opened)."""
    if os.name == "nt":  # Windows cannot open a directory for fsync; NTFS renames are journaled
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path next to ``path``; on success fsync it and rename it onto ``path``.

    For writers that want a file name rather than bytes (``torch.save``, safetensors,
    matplotlib). On an exception the temp file is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{uuid.uuid4().hex}")
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically: readers see the old file or the whole new one.

    Temp file in the same dir, flush, fsync, rename, fsync the dir. Returns ``path``.
    """
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """``atomic_write_bytes`` for UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def save_json(obj: Any, path: str | os.PathLike) -> Path:
    """Write ``obj`` as pretty JSON atomically (e.g. ``trainer_state.json``)."""
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def load_json(path: str | os.PathLike) -> Any:
    """Read a JSON file; a missing or malformed file raises CheckpointError naming it."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: file is missing; the checkpoint is incomplete, resume from another one"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(
            f"{path}: cannot read JSON ({err}); the file is corrupt, resume from another checkpoint"
        ) from None


# --------------------------------------------------------------------------- tensors / objects


def save_safetensors(
    state_dict: dict[str, torch.Tensor],
    path: str | os.PathLike,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Save a flat ``{name: tensor}`` dict as safetensors, atomically.

    Tensors are detached, moved to CPU and made contiguous. Tensors that share storage (tied
    embeddings) or are views into a larger buffer are cloned, since safetensors refuses
    shared storage; loading gives independent copies, and re-tying is the model's job.
    Sharded (DTensor) parameters must be gathered to full tensors by the caller first.
    """
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"save_safetensors: state_dict[{name!r}] is a {type(value).__name__}, not a "
                "tensor; save non-tensor state with save_torch or save_json instead"
            )
        t = value.detach().to("cpu")
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        whole = t.is_contiguous() and t.storage_offset() == 0
        whole = whole and t.numel() * t.element_size() == storage.nbytes()
        if not whole or (ptr in seen_storages and t.numel() > 0):
            t = t.clone(memory_format=torch.contiguous_format)
        else:
            seen_storages.add(ptr)
        tensors[name] = t
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=metadata)
    return Path(path)


def load_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load a safetensors file onto the CPU; errors are CheckpointErrors naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"{path}: file is missing; the checkpoint is incomplete, resume from another one"
        )
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({err}); the file is corrupt, "
            "resume from another checkpoint"
        ) from None


def save_torch(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` atomically. Keep ``obj`` to tensors, dicts, lists, tuples, numbers,
    strings and None so ``load_torch`` (``weights_only=True``) can read it back."""
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
    return Path(path)


def load_torch(path: str | os.PathLike) -> Any:
    """``torch.load(weights_only=True)`` onto the CPU; errors name the file (no deep traceback)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"{path}: file is missing; the checkpoint is incomplete, resume from another one"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types (UnpicklingError, RuntimeError, EOFError)
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"{path}: cannot load ({type(err).__name__}: {first_line}); the file is corrupt or "
            "holds objects other than tensors/containers, resume from another checkpoint"
        ) from None


# --------------------------------------------------------------------------- RNG state


def rng_state(device_get_state: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Capture Python ``random``, numpy's global RNG and torch's CPU generator.

    ``device_get_state`` (from the HAL backend) returns the accelerator generator state;
    it is stored under ``"device"``. Everything is plain lists/ints/tensors so the dict
    survives ``save_torch`` -> ``load_torch`` with ``weights_only=True``.
    """
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if device_get_state is not None:
        state["device"] = device_get_state()
    return state


def set_rng_state(
    state: dict[str, Any], device_set_state: Callable[[Any], None] | None = None
) -> None:
    """Restore what ``rng_state`` captured; ``device_set_state`` restores ``state["device"]``.

    A device state without a setter (a run resumed on another device type) is skipped with a
    warning: host draws still reproduce, device sampling will not.
    """
    for key in ("python", "numpy", "torch"):
        if key not in state:
            raise CheckpointError(
                f"rng state has no {key!r} entry (keys: {sorted(state)}); it was not made by "
                "rng_state(), resume from another checkpoint"
            )
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]))
    npst = state["numpy"]
    keys = npst["keys"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state(
        (
            npst["kind"],
            keys.astype(np.uint32),
            int(npst["pos"]),
            int(npst["has_gauss"]),
            float(npst["cached_gaussian"]),
        )
    )
    torch.set_rng_state(state["torch"])
    if "device" in state:
        if device_set_state is None:
            log.warning("rng state holds a device generator but no setter was given: skipped")
        else:
            device_set_state(state["device"])


# --------------------------------------------------------------------------- checkpoint dirs


def _checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


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
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f"{_TMP_PREFIX}step_{step}_{uuid.uuid4().hex}"
    staging.mkdir()
    _fsync_dir(root)
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
        if _ATOMIC_TMP_RE.match(path.name):
            # A writer died mid-write and left its temp file; the real piece is checked below.
            log.warning("checkpoint: dropping leftover temp file %s", path)
            path.unlink()
            continue
        if path.relative_to(staging).as_posix() == MANIFEST_NAME:
            continue
        files.append(path)
    return files


def _write_latest(root: Path, name: str) -> None:
    atomic_write_text(root / LATEST_NAME, name + "\n")


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
    ``expect_files``: relative paths that must be present (e.g. one ``optim_rank<k>.pt``
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
        _fsync_file(path)
        manifest["files"][path.relative_to(staging).as_posix()] = {
            "size": path.stat().st_size,
            "sha256": _sha256(path),
        }
    for sub in sorted({p.parent for p in files}, key=lambda p: len(p.parts), reverse=True):
        _fsync_dir(sub)
    save_json(manifest, staging / MANIFEST_NAME)

    final = root / step_dir_name(step)
    # A directory rename cannot replace a non-empty dir, so an existing step_<N> is moved
    # aside first and deleted only once the new one is in place.
    replaced = _move_aside(root, final, "replaced") if final.exists() else None
    os.replace(staging, final)
    _fsync_dir(root)
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
        name = (root / LATEST_NAME).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    if not _STEP_RE.match(name):
        raise CheckpointError(
            f"{root / LATEST_NAME}: holds {name!r}, expected 'step_<N>'; fix it by hand to name "
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
    if (target / MANIFEST_NAME).is_file():
        return target
    limit = checkpoint_step(target)
    fallback = [
        p
        for p in list_checkpoints(run_dir)
        if checkpoint_step(p) < limit and (p / MANIFEST_NAME).is_file()
    ]
    if not fallback:
        raise CheckpointError(
            f"{root / LATEST_NAME} names {name}, but {target} is missing or has no manifest and "
            "no older checkpoint exists; start fresh (delete the checkpoints dir) or point "
            "run.resume at a copy of a checkpoint"
        )
    log.warning(
        "checkpoint: %s names missing %s; falling back to %s", LATEST_NAME, name, fallback[-1]
    )
    return fallback[-1]


def verify_checkpoint(path: str | os.PathLike, *, check_hashes: bool = True) -> dict[str, Any]:
    """Check a ``step_<N>`` dir against its manifest; return the manifest.

    Every listed file must be present with the recorded size in bytes and (when
    ``check_hashes``) sha256, else ``CheckpointError`` naming the checkpoint, the file,
    what is wrong and the fix. Files not in the manifest are ignored.
    """
    path = Path(path)
    fix = "delete it or point run.resume at an older step_<N>"
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint {path} does not exist; point run.resume at an existing step_<N>"
        )
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST_NAME} is missing, so it was never committed; {fix}"
        )
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        entries = manifest["files"]
        if not isinstance(entries, dict):
            raise TypeError("'files' is not an object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST_NAME} is unreadable ({err}); {fix}"
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


def resolve_resume(run_dir: str | os.PathLike, resume: Any) -> Path | None:
    """Turn a ``run.resume`` value into a verified checkpoint dir, or None to start fresh.

    Accepted: ``None``/``False``/``"never"`` (fresh), ``True``/``"auto"``/``"latest"`` (the
    ``latest`` checkpoint if any, else fresh), a step (int or digits) or ``"step_<N>"`` (that checkpoint
    in ``run_dir``), or a path to a ``step_<N>`` dir.
    """
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
        checkpoint_step(found)  # a path must name a step_<N> dir
    else:
        raise ValueError(
            f"run.resume={resume!r} is not understood; use null, auto, latest, a step number, "
            "step_<N> or a path to a step_<N> dir"
        )
    if found is None:
        return None
    verify_checkpoint(found)
    return found
