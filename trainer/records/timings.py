"""Where a step's time went: ``StepTimer`` collects wall seconds per named section of a step
and ``summarize_timings`` turns them into ``timing/<section>_s`` and ``_share`` metrics.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping


def summarize_timings(
    sections: Mapping[str, float], total_s: float | None = None
) -> dict[str, float]:
    """Metrics for where a step's time went.

    ``sections`` maps a section name (e.g. ``rollout``) to seconds. Returns
    ``timing/<section>_s`` and ``timing/<section>_share`` (fraction of the total) per
    section. ``total_s``: the step's wall time in seconds; when given it is also returned as
    ``timing/step_s``, with the unaccounted rest as ``timing/other_s``/``timing/other_share``;
    when omitted, shares are of the sections' sum.
    """
    secs: dict[str, float] = {}
    for name, value in sections.items():
        if not isinstance(name, str) or not name or "/" in name or name.strip() != name:
            raise ValueError(f"timing section name {name!r} must be a non-empty str without '/'")
        if total_s is not None and name in ("step", "other"):
            raise ValueError(
                f"timing section name {name!r} is reserved when total_s is given; rename it"
            )
        value = float(value)
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"timing section {name!r} has {value} s; seconds must be finite and >= 0"
            )
        secs[name] = value
    out: dict[str, float] = {}
    if total_s is not None:
        total = float(total_s)
        if not math.isfinite(total) or total < 0:
            raise ValueError(f"total_s={total_s!r} must be finite and >= 0 (seconds)")
        secs["other"] = max(0.0, total - sum(secs.values()))
        out["timing/step_s"] = total
    else:
        total = sum(secs.values())
    for name, value in secs.items():
        out[f"timing/{name}_s"] = value
        out[f"timing/{name}_share"] = value / total if total > 0 else 0.0
    return out


class StepTimer:
    """Collects wall seconds per named section of one step.

    >>> timer = StepTimer()
    >>> with timer.section("rollout"):
    ...     pass
    >>> sorted(timer.metrics())[:2]
    ['timing/other_s', 'timing/other_share']
    """

    def __init__(self, watch=None) -> None:
        self.sections: dict[str, float] = {}
        self._start = time.perf_counter()
        # name -> a context manager around each section
        # (``trainer.loop.schedule.phase_memory.measured``)
        self.watch = watch

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Time the ``with`` body; repeated sections add up."""
        t0 = time.perf_counter()
        with self.watch(name) if self.watch is not None else contextlib.nullcontext():
            try:
                yield
            finally:
                self.sections[name] = self.sections.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        """``summarize_timings`` of the sections, with the wall time since creation as total."""
        return summarize_timings(self.sections, time.perf_counter() - self._start)
