"""What the agent loop asks of environments: their calls, bounded, and their answers, checked.

``EnvCalls`` runs ``reset``/``step``: plain methods on a thread pool (or on the event loop for an
``inline`` environment, see ``rollout/envs/base.py``), ``async def`` ones on the event loop, at
most ``rollout.env_concurrency`` at once (rollouts that run at once share them through
``rollout.env_slots.EnvSlots``, a first-in-first-out queue), each within
``rollout.env_timeout_s``. ``check_step``
and ``first_messages`` turn an answer that breaks the contract into an ``EnvError``;
``fault_text`` and ``fault_summary`` put faults into one line each.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import numbers
import time
from collections.abc import Callable, Sequence

import numpy as np

from rollout.env_slots import EnvCallsClosed, EnvSlots
from rollout.envs import exception_line
from rollout.envs.base import runs_inline

__all__ = [
    "EnvCalls",
    "EnvCallsClosed",
    "EnvError",
    "EnvSlots",
    "EnvTimeout",
    "check_step",
    "fault_summary",
    "fault_text",
    "first_messages",
    "reward_extras",
    "shown",
]


class EnvError(ValueError):
    """An environment broke its contract (wrong type, bad reward); ends that trajectory."""


def shown(value: object) -> str:
    """A value and its type, short enough for one line of an error."""
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def check_step(out: object, reward_range: tuple[float, float]) -> tuple[str, float, bool, dict]:
    if not isinstance(out, tuple) or len(out) != 4:
        raise EnvError(f"step() must return (obs, reward, done, info), got {shown(out)}")
    obs, reward, done, info = out
    if not isinstance(obs, str):
        raise EnvError(f"step() observation must be a str, got {shown(obs)}")
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise EnvError(f"step() reward must be a real number, got {shown(reward)}")
    reward = float(reward)
    low, high = reward_range
    if not math.isfinite(reward) or not low <= reward <= high:
        raise EnvError(
            f"step() reward {reward!r} is outside the env's reward_range [{low:g}, {high:g}]"
            if math.isfinite(reward)
            else f"step() reward {reward!r} is not a finite number"
        )
    if not isinstance(done, bool | np.bool_):
        raise EnvError(f"step() done must be a bool, got {shown(done)}")
    return obs, reward, bool(done), info if isinstance(info, dict) else {}


def reward_extras(extra: object) -> dict[str, float]:
    """The finite numeric entries of a reward's extra keys (``info["reward_extra"]``)."""
    if not isinstance(extra, dict):
        return {}
    return {
        str(k): float(v)
        for k, v in extra.items()
        if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
    }


def first_messages(obs: object) -> list[dict]:
    """The chat a trajectory starts from: ``reset()`` returns the user's first message (str)
    or a whole chat (a list of ``{"role", "content"}`` messages, e.g. a verl dataset's prompt
    with its system message)."""
    if isinstance(obs, str):
        return [{"role": "user", "content": obs}]
    if (
        isinstance(obs, list)
        and obs
        and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in obs)
    ):
        return [{"role": m["role"], "content": m["content"]} for m in obs]
    raise EnvError(f"reset() must return str or a list of chat messages, got {obs!r:.80}")


def fault_text(where: str, exc: Exception) -> str:
    """``"<where>: <message>"``; an env's own exception keeps its type name."""
    message = " ".join(str(exc).split()) if isinstance(exc, EnvError) else exception_line(exc)
    return f"{where}: {message}"


def fault_summary(faults: Sequence[tuple[int, str]], total: int, *, limit: int = 3) -> str:
    """One line on a rollout's environment faults: how many of ``total`` trajectories, then up
    to ``limit`` distinct fault texts, each with the ids of the trajectories it ended."""
    by_text: dict[str, list[int]] = {}
    for trajectory_id, text in faults:
        by_text.setdefault(text, []).append(trajectory_id)
    parts = []
    for text, ids in list(by_text.items())[:limit]:
        shown = ", ".join(str(i) for i in ids[:4]) + (
            f" +{len(ids) - 4} more" if len(ids) > 4 else ""
        )
        parts.append(f"[trajector{'ies' if len(ids) > 1 else 'y'} {shown}] {text}")
    if len(by_text) > limit:
        parts.append(f"... {len(by_text) - limit} more distinct fault(s)")
    return f"{len(faults)} of {total} trajectories ended by an environment fault: " + "; ".join(
        parts
    )


class EnvTimeout(EnvError):
    """An environment call ran past ``rollout.env_timeout_s``; ends that trajectory."""


class EnvCalls:
    """Environment calls of one rollout: synchronous methods on a thread pool, ``async def``
    ones on the event loop; at most ``concurrency`` at once, each bounded by ``timeout_s``
    seconds (None: no bound). A call that overruns cannot be killed (a Python thread cannot
    be): it is abandoned with its thread, and later calls get a fresh pool. ``shared``: slots
    this rollout shares with others running at once on other threads (a streamed run's
    groups, each its own rollout): a call also takes one of them, waiting its turn in their
    first-in-first-out queue, so all of them together run at most that many calls; its time
    limit counts from when it runs. Once ``shared`` is closed, a call waiting for a slot or
    in flight ends with ``EnvCallsClosed`` (one in flight abandoned with its thread)."""

    def __init__(
        self,
        concurrency: int,
        timeout_s: float | None,
        shared: EnvSlots | None = None,
    ) -> None:
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self._slots = asyncio.Semaphore(concurrency)
        self._shared = shared
        self._pool = self._new_pool()

    def _new_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(self.concurrency, thread_name_prefix="env")

    async def __call__(self, method: Callable, *args: object) -> object:
        """``method(*args)``'s result; its exception, or ``EnvTimeout`` when it overruns."""
        owner = getattr(method, "__self__", None)
        if owner is not None and not inspect.iscoroutinefunction(method):
            if runs_inline(owner, method.__name__):  # a declared quick computation: no thread
                started = time.monotonic()
                result = method(*args)
                if self.timeout_s is not None and time.monotonic() - started > self.timeout_s:
                    raise EnvTimeout(
                        f"took longer than rollout.env_timeout_s={self.timeout_s:g} s (inline)"
                    )
                return result
        async with self._slots:
            if self._shared is None:
                return await self._run(method, args)
            await self._shared.acquire()  # in turn behind the other rollouts' calls
            try:
                return await self._run(method, args)
            finally:
                self._shared.release()

    async def _run(self, method: Callable, args: tuple) -> object:
        """``method(*args)`` on the pool or the loop, within ``timeout_s``."""
        if inspect.iscoroutinefunction(method):
            task = asyncio.ensure_future(method(*args))
        else:
            task = asyncio.get_running_loop().run_in_executor(self._pool, method, *args)
        watch = None if self._shared is None else self._shared.watch()
        try:
            waits = [task] if watch is None else [task, watch[1]]
            done, _ = await asyncio.wait(
                waits, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            if watch is not None:
                self._shared.unwatch(watch)
        if task not in done:
            task.cancel()
            if not inspect.iscoroutinefunction(method):
                # The stuck call keeps its worker thread; later calls get fresh ones.
                self._pool.shutdown(wait=False)
                self._pool = self._new_pool()
            if watch is not None and watch[1].done():  # the shared slots closed meanwhile
                raise EnvCallsClosed("abandoned in flight: the environment calls were closed")
            raise EnvTimeout(f"took longer than rollout.env_timeout_s={self.timeout_s:g} s")
        return task.result()

    def close(self) -> None:
        """Release the worker threads (an abandoned, still running call keeps its own)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
