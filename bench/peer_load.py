"""CPU used outside this benchmark while it runs: which timed steps a shared machine disturbed.

``OutsideLoad`` samples, a few times a second on a background thread, the machine's busy CPU
time (/proc/stat) and the CPU time of this process and all its descendants (the trainers under
test, their Ray workers included). The difference over a step's wall interval is the CPU that
other jobs took meanwhile, in cores; ``bench peer`` drops steps above ``LOADED_CORES`` from its
medians and reports how many. Linux only; elsewhere every answer is None (nothing is dropped).
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections import defaultdict

__all__ = ["LOADED_CORES", "OutsideLoad"]

#: A step during which other processes used more than this many cores on average is "loaded".
LOADED_CORES = 0.25


def _busy_ticks() -> int | None:
    """Clock ticks all CPUs spent busy since boot (user, nice, system, irq, softirq, steal)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return user + nice + system + irq + softirq + steal


def _tree_ticks(root: int) -> int:
    """Clock ticks of ``root`` and its descendants (their own and their reaped children's)."""
    children: dict[int, list[int]] = defaultdict(list)
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                text = f.read()
        except OSError:  # the process ended meanwhile
            continue
        rest = text[text.rfind(")") + 2 :].split()  # fields after "pid (comm) "
        pid = int(name)
        children[int(rest[1])].append(pid)
        ticks[pid] = sum(int(x) for x in rest[11:15])  # utime stime cutime cstime
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total


class OutsideLoad:
    """Background sampler; use as a context manager, then ask ``cores(start, end)``."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.samples: list[tuple[float, int, int]] = []  # (wall time, busy ticks, own ticks)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="outside-load", daemon=True)
        self.available = _busy_ticks() is not None

    def _sample(self) -> None:
        busy = _busy_ticks()
        if busy is not None:
            self.samples.append((time.time(), busy, _tree_ticks(os.getpid())))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> OutsideLoad:
        if self.available:
            self._sample()
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def cores(self, start: float, end: float) -> float | None:
        """Mean cores other processes used between wall times ``start`` and ``end`` (the
        samples around the interval), or None without samples on both sides."""
        times = [s[0] for s in self.samples]
        i = bisect.bisect_right(times, start) - 1
        j = bisect.bisect_left(times, end)
        if i < 0 or j >= len(self.samples) or j <= i:
            return None
        (t0, busy0, own0), (t1, busy1, own1) = self.samples[i], self.samples[j]
        outside = (busy1 - busy0) - (own1 - own0)
        return max(0.0, outside / self.hz / (t1 - t0))
