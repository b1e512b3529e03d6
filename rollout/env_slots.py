"""The environment-call slots that rollouts running at once share (a streamed run's groups,
each its own rollout on its own thread and event loop): ``rollout.env_concurrency`` of them,
handed out first come, first served.

A call that finds no slot free joins one queue and sleeps on a future of its own event loop;
a slot freed goes straight to the oldest waiter (woken through its loop's
``call_soon_threadsafe``), never to a call that came later, so the long episodes that call an
environment most wait their turn like every other, and no waiter polls (hundreds of polling
loops compete for the GIL with the local engine's decode steps). ``close`` (the stream's
shutdown) refuses new calls and wakes every waiter and every call in flight with
``EnvCallsClosed``.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

__all__ = ["EnvCallsClosed", "EnvSlots"]


class EnvCallsClosed(RuntimeError):
    """The shared slots were closed (the stream shuts down): no environment call starts, and
    one in flight is abandoned with its thread, as one past its time limit is."""


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


class EnvSlots:
    """``size`` slots for environment calls, shared across threads and event loops, granted in
    arrival order (module docstring). ``acquire`` / ``release`` around each call; ``watch``
    gives a call in flight a future that ``close`` settles."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"rollout.env_concurrency={size}: must be >= 1 env call")
        self.size = size
        self._lock = threading.Lock()
        self._free = size
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = deque()
        self._watched: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()
        self._closed = False

    @property
    def waiting(self) -> int:
        """Calls queued for a slot now."""
        with self._lock:
            return len(self._waiters)

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue behind the calls that asked before.
        ``EnvCallsClosed`` once ``close`` was called."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                raise EnvCallsClosed("the environment calls are closed (the stream shuts down)")
            if self._free and not self._waiters:
                self._free -= 1
                return
            entry = (loop, loop.create_future())
            self._waiters.append(entry)
        future = entry[1]
        try:
            await future
        except asyncio.CancelledError:
            with self._lock:
                queued = entry in self._waiters
                if queued:
                    self._waiters.remove(entry)
            if not queued and future.done() and not future.cancelled():
                if future.exception() is None:  # granted just before the cancel: pass it on
                    self.release()
            raise  # a grant still on its way to a cancelled future is passed on by _grant

    def release(self) -> None:
        """Give a slot back: to the oldest waiter, else to the free ones."""
        with self._lock:
            while self._waiters:
                loop, future = self._waiters.popleft()
                try:
                    loop.call_soon_threadsafe(self._grant, future)
                    return
                except RuntimeError:  # its event loop is closed: that waiter is gone
                    continue
            self._free = min(self.size, self._free + 1)

    def _grant(self, future: asyncio.Future) -> None:
        """On the waiter's loop: the slot is its own, unless it stopped waiting meanwhile."""
        if future.done():  # cancelled (or closed) before the grant landed: the next one's
            if future.cancelled():
                self.release()
            return
        future.set_result(None)

    def watch(self) -> tuple[asyncio.AbstractEventLoop, asyncio.Future]:
        """A future of the running loop that ``close`` settles: a call in flight waits on it
        beside its own task. Hand it back with ``unwatch``."""
        loop = asyncio.get_running_loop()
        entry = (loop, loop.create_future())
        with self._lock:
            if self._closed:
                entry[1].set_result(None)
            else:
                self._watched.add(entry)
        return entry

    def unwatch(self, entry: tuple[asyncio.AbstractEventLoop, asyncio.Future]) -> None:
        """The call watched by ``entry`` ended."""
        with self._lock:
            self._watched.discard(entry)

    def close(self) -> None:
        """Refuse new calls; wake every queued call (``EnvCallsClosed``) and every call in
        flight (``watch``: it is abandoned)."""
        with self._lock:
            self._closed = True
            waiters, self._waiters = list(self._waiters), deque()
            watched, self._watched = list(self._watched), set()
        closed = EnvCallsClosed("the environment calls are closed (the stream shuts down)")
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_settle, future, closed)
            except RuntimeError:  # its loop is closed: nothing waits there
                pass
        for loop, future in watched:
            try:
                loop.call_soon_threadsafe(_settle, future, None)
            except RuntimeError:
                pass
