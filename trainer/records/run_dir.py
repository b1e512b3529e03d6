"""Who owns a run directory, and what may be done to one that already holds a run.

- ``RunDirLock``: ``<run.dir>/crossrl.lock`` names the process that owns the directory (host,
  pid, command, start time). A second ``crossrl train`` / ``probe`` on the same directory is
  refused naming the holder. The lock is an ``flock`` on that file too, so it dies with its
  process; a lock file left by a dead process on this host is taken over, one from another host
  is only reported (its process cannot be checked from here).
- ``usable_problem``: a ``run.dir`` that is a file or cannot be created or written.
- ``overwrite_problem``: with ``run.resume=never``, a ``run.dir`` that already holds a run,
  which starting afresh would overwrite. Nothing is replaced without ``run.overwrite=true``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
from pathlib import Path
from typing import Any

LOCK_FILE = "crossrl.lock"
#: What makes a directory hold a run (DESIGN.md "Run directory").
RUN_FILES = ("config.yaml", "metrics.jsonl", "fingerprint.jsonl", "checkpoints")

try:  # POSIX: the lock dies with its process
    import fcntl
except ImportError:  # pragma: no cover - Windows: the host/pid check alone
    fcntl = None  # type: ignore[assignment]


class RunDirError(ValueError):
    """The run directory cannot be used as asked; one line naming it, why, and the fix.
    The CLI exits 2 on it."""


def run_contents(run_dir: str | os.PathLike) -> list[str]:
    """The names in ``run_dir`` that show it holds a run (empty ``checkpoints/`` ignored)."""
    root = Path(run_dir)
    found = []
    for name in RUN_FILES:
        path = root / name
        if path.is_dir():
            if any(path.iterdir()):
                found.append(f"{name}/")
        elif path.exists():
            found.append(name)
    return found


def usable_problem(run_dir: str | os.PathLike, *, command: str = "train") -> str | None:
    """Why ``run_dir`` cannot hold a run, or None: it (or a parent) is a file, or it (or the
    nearest parent that exists, where it would be created) is not writable. Creates nothing."""
    root = Path(run_dir).absolute()
    key = "--out" if command == "probe" else "run.dir"
    shown = str(Path(run_dir))
    for parent in (root, *root.parents):
        if parent.exists() and not parent.is_dir():
            return f"{key}={shown!r}: {parent} is a file, not a directory; choose another {key}"
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        made = "write to it" if existing == root else f"create it in {existing}"
        return f"{key}={shown!r}: cannot {made} (permission denied); choose a {key} you can write"
    return None


def overwrite_problem(
    run_dir: str | os.PathLike, *, resume: str, overwrite: bool, command: str = "train"
) -> str | None:
    """Why starting afresh in ``run_dir`` is refused, or None: with ``resume=never`` a run
    already there would lose its metrics, fingerprints, config.yaml and newer checkpoints,
    which only ``overwrite`` (``run.overwrite=true``) allows."""
    held = run_contents(run_dir)
    if resume != "never" or not held or overwrite:
        return None
    root, what = str(Path(run_dir)), ", ".join(held)
    if command == "probe":
        return (
            f"--out {root!r} already holds a run ({what}); a probe would replace its metrics, "
            "fingerprints and config.yaml: choose an empty --out, or pass run.overwrite=true"
        )
    return (
        f"run.resume=never: run.dir={root!r} already holds a run ({what}), which a fresh start "
        "would overwrite; choose another run.dir, resume it with run.resume=auto, or pass "
        "run.overwrite=true to replace it"
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _describe(holder: dict[str, Any]) -> str:
    return (
        f"crossrl {holder.get('command', '?')} (pid {holder.get('pid', '?')} on host "
        f"{holder.get('host', '?')}, since {holder.get('since', '?')})"
    )


class RunDirLock:
    """``with RunDirLock(run_dir, command):`` owns ``run_dir`` for the block, or raises
    ``RunDirError`` naming the process that owns it."""

    def __init__(self, run_dir: str | os.PathLike, command: str = "train") -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.command = command
        self._fd: int | None = None
        self.took_over: dict[str, Any] | None = None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _read(self, fd: int) -> dict[str, Any]:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 1 << 16)
        try:
            holder = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return {}
        return holder if isinstance(holder, dict) else {}

    def _busy(self, holder: dict[str, Any], why: str = "") -> RunDirError:
        return RunDirError(
            f"run.dir={str(self.path.parent)!r} is in use by {_describe(holder)}{why}; wait for "
            f"it to finish or choose another run.dir (if that process is gone, delete {self.path})"
        )

    def acquire(self) -> None:
        """Take the lock or raise ``RunDirError``."""
        host, pid = socket.gethostname(), os.getpid()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RunDirError(
                f"run.dir={str(self.path.parent)!r}: cannot create it ({err.strerror or err}); "
                "choose a run.dir you can write"
            ) from None
        for _attempt in range(5):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if fcntl is not None:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        raise self._busy(self._read(fd)) from None
                    # The file may have been removed and recreated between open and flock.
                    if os.fstat(fd).st_ino != os.stat(self.path).st_ino:
                        os.close(fd)
                        continue
                holder = self._read(fd)
                if holder and holder.get("pid") != pid:
                    if holder.get("host") != host:
                        raise self._busy(holder, " (another host: its process cannot be checked)")
                    if _pid_alive(int(holder.get("pid", 0))) and fcntl is None:
                        raise self._busy(holder)
                    self.took_over = holder  # dead process on this host: a stale lock
                record = {
                    "host": host,
                    "pid": pid,
                    "command": self.command,
                    "since": datetime.datetime.now().isoformat(timespec="seconds"),
                }
                os.ftruncate(fd, 0)
                os.lseek(fd, 0, os.SEEK_SET)
                os.write(fd, (json.dumps(record) + "\n").encode("utf-8"))
                os.fsync(fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
            self._fd = fd
            return
        raise RunDirError(f"{self.path}: kept changing while being locked; try again")

    def release(self) -> None:
        """Give the directory up: remove the lock file, then drop the flock."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = None
