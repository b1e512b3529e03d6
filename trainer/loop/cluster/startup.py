"""Start-up timing: wall seconds from the process start to the first training step, by phase.

The driver keeps one ``StartupClock`` (``CLOCK``): ``crossrl``'s entry point dates it from the
process start (``/proc/self/stat``), a run started in-process (tests, the parity probe) from
``run_training``'s entry. Each ``CLOCK.done(phase)`` closes the phase that ran since the last
one. Worker processes time their own set-up with ``Phases`` and return it in their setup
answer; ``launch.start`` hands those to the clock as ``<role>_<phase>``.

The first metrics line a process writes carries ``timing/startup_s`` (process start -> start
of its first step) and one ``timing/startup_<phase>_s`` per phase. The driver's phases add up
to ``timing/startup_s``; a worker's phases overlap them (they ran in other processes).

Light on purpose: imported by the CLI before anything heavy.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from collections.abc import Sequence


def process_start_time() -> float | None:
    """This process's start as a ``time.time()`` value (Linux ``/proc``; about 10 ms
    resolution), or None where it cannot be read."""
    try:
        with open("/proc/self/stat", encoding="ascii") as handle:
            stat = handle.read()
        # Field 22, starttime, in clock ticks since boot; the name in field 2 may hold spaces.
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - age_s if age_s >= 0 else None


class Phases:
    """Wall seconds of consecutive named phases of one process, in order.

    >>> p = Phases()
    >>> p.done("imports"); p.done("model")
    >>> sorted(p.seconds)
    ['imports', 'model']
    """

    def __init__(self, origin: float | None = None) -> None:
        """``origin``: a ``time.time()`` value the first phase starts at (default: now)."""
        self.origin = time.time() if origin is None else origin
        self._last = self.origin
        self.seconds: dict[str, float] = {}

    def done(self, phase: str, at: float | None = None) -> float:
        """Close ``phase`` (it ran since the previous ``done``, or since the origin) now, or at
        ``at`` (a ``time.time()`` value); repeated phases add up. Returns its seconds."""
        now = time.time() if at is None else at
        spent = max(0.0, now - self._last)
        self.seconds[phase] = self.seconds.get(phase, 0.0) + spent
        self._last = now
        return spent

    @property
    def total_s(self) -> float:
        """Seconds from the origin to the last ``done``."""
        return self._last - self.origin


class StartupClock(Phases):
    """The driver's start-up phases, plus the phases workers report (``add_worker``)."""

    def __init__(self) -> None:
        super().__init__()
        self.workers: dict[str, float] = {}
        self.reported = False
        self.fresh = False

    def begin(self, origin: float | None) -> None:
        """Start counting afresh at ``origin`` (a ``time.time()`` value; None: now)."""
        Phases.__init__(self, origin)
        self.workers = {}
        self.reported = False
        self.fresh = True

    def start_run(self) -> None:
        """A run begins: keep the origin the CLI just set, else (a run started in-process,
        or a second run in one process) count from now."""
        if not self.fresh:
            self.begin(None)
        self.fresh = False

    def add_worker(self, who: str, seconds: dict[str, float]) -> None:
        """Phases another process reported (``Phases.seconds``), kept as ``<who>_<phase>``."""
        for phase, value in seconds.items():
            self.workers[f"{who}_{phase}"] = float(value)

    def metrics(self) -> dict[str, float]:
        """``timing/startup_s`` and ``timing/startup_<phase>_s``, once per clock: the second call
        (a later step) returns nothing."""
        if self.reported:
            return {}
        self.reported = True
        out = {"timing/startup_s": self.total_s}
        for phase, value in {**self.seconds, **self.workers}.items():
            out[f"timing/startup_{phase}_s"] = value
        return out

    def summary(self) -> str:
        """One line for the log: the total and the driver's phases."""
        parts = ", ".join(f"{k} {v:.2f}" for k, v in self.seconds.items())
        return f"start-up {self.total_s:.2f} s to the first step ({parts})"


#: The driver's clock: ``trainer.cli.main`` dates it from the process start.
CLOCK = StartupClock()


def begin_at_process_start() -> None:
    """Date ``CLOCK`` from this process's start and close the ``python`` phase (interpreter
    and CLI imports) now."""
    CLOCK.begin(process_start_time())
    CLOCK.done("python")


def log_summary() -> None:
    """Print ``CLOCK.summary()`` to stderr."""
    print(f"crossrl: {CLOCK.summary()}", file=sys.stderr)


def import_in_background(modules: Sequence[str]) -> threading.Thread:
    """Import ``modules`` in a daemon thread, e.g. while ``ray.init`` waits for Ray's
    processes; ``join()`` it before using them. A module that fails to import is left for the
    caller's own import to report."""

    def run() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001, S112 - the caller's import raises it again
                continue

    thread = threading.Thread(target=run, name="crossrl-imports", daemon=True)
    thread.start()
    return thread
