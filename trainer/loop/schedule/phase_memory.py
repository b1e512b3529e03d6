"""The device memory each phase of a step really takes: the peak, over the phase, of the
bytes in use on the busiest device, every process on it counted (engine, ranks, contexts,
allocator caches), sampled from a thread of the controller.

``memory/device_<phase>_gb`` per step (``rollout``, ``prepare``, ``update``, ``sync``: the
controller's ``StepTimer`` sections; ``push`` inside ``sync``: the colocated weight push, after
the ranks have released their update's memory) are what ``crossrl layout``'s budget estimates
per phase (rollout, update, weight push), measured the way a device runs out: as the driver
counts it. Phases nest: a reading counts towards every phase open at the time.
Only where the HAL has such a reading (``hal.device_used_reader``: NVML on NVIDIA devices); on the CPU,
whose memory the host shares out, there is none and no metric is written.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

__all__ = ["PhaseMemory", "measured"]


class PhaseMemory:
    """Peak bytes in use per named phase, sampled every ``interval_s`` seconds by ``read``
    (and at every phase's start and end, so that a phase shorter than the interval still has
    a reading). A ``StepTimer``'s ``watch``."""

    def __init__(self, read: Callable[[], int], interval_s: float = 0.02) -> None:
        self.read = read
        self.interval_s = interval_s
        self.peaks: dict[str, int] = {}
        self._open: list[str] = []  # the phases open now, outermost first
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="phase-memory", daemon=True)
        self._thread.start()

    @classmethod
    def for_device(cls, device: str) -> PhaseMemory | None:
        """A sampler for backend ``device``'s devices, or None where the HAL cannot read
        device-wide use (``hal.device_used_reader``)."""
        import hal

        if device == "auto":
            device = hal.available_backends()[0]
        read = hal.device_used_reader(device)
        return None if read is None else cls(read)

    def _note(self) -> None:
        value = self.read()
        with self._lock:
            for phase in self._open:
                self.peaks[phase] = max(self.peaks.get(phase, 0), value)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._note()
            except Exception:  # a driver that stops answering costs the metric, not the run
                return

    def enter(self, phase: str) -> None:
        """``phase`` starts: readings count towards it until ``leave``."""
        with self._lock:
            self._open.append(phase)
        self._note()

    def leave(self, phase: str) -> None:
        """``phase`` ends (its last reading taken now)."""
        self._note()
        with self._lock:
            if phase in self._open:
                del self._open[len(self._open) - 1 - self._open[::-1].index(phase)]

    def metrics(self) -> dict[str, float]:
        """``memory/device_<phase>_gb`` (GB = 1e9 bytes) of the phases since the last call,
        then starts afresh."""
        with self._lock:
            peaks, self.peaks = self.peaks, {}
        return {f"memory/device_{name}_gb": value / 1e9 for name, value in peaks.items()}

    def stop(self) -> None:
        """End the sampling thread."""
        self._stop.set()
        self._thread.join(timeout=1.0)


@contextlib.contextmanager
def measured(memory: PhaseMemory | None, phase: str) -> Iterator[None]:
    """The ``with`` body as phase ``phase`` of ``memory`` (nothing when ``memory`` is None)."""
    if memory is None:
        yield
        return
    memory.enter(phase)
    try:
        yield
    finally:
        memory.leave(phase)
