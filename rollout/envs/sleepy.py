"""``sleepy``: the ``recall`` task with a tool latency, for the async agent loop's tests and bench.

Each ``step`` first waits a seeded random delay in ``[0, max_delay_s]`` seconds (what a search,
a sandbox or a web request costs a real agent environment), then answers as ``recall`` does.
The delay depends only on the episode seed, the turn and the reply text, so a rerun waits the
same, and the samples of one prompt (different replies) wait differently. ``SleepyEnv`` blocks
its thread (a synchronous tool); ``AsyncSleepyEnv`` is the same with ``async def`` reset/step.

Not registered as a built-in name: use ``rollout.env=rollout.envs.sleepy:SleepyEnv``.
"""

from __future__ import annotations

import asyncio
import random
import time
import zlib

from rollout.envs.recall import RecallEnv


class SleepyEnv(RecallEnv):
    """``recall`` with ``turns`` turns whose steps each wait up to ``max_delay_s`` seconds."""

    def __init__(self, turns: int = 4, length: int = 2, max_delay_s: float = 0.2) -> None:
        super().__init__(turns=turns, length=length)
        if not 0 <= max_delay_s <= 3600:
            raise ValueError(f"sleepy env max_delay_s={max_delay_s!r}: must be in 0..3600 seconds")
        self.max_delay_s = float(max_delay_s)
        self._seed = 0

    def reset(self, seed: int) -> str:
        self._seed = int(seed)
        return super().reset(seed)

    def delay_s(self, action_text: str) -> float:
        """Seconds the next step waits: seeded by (episode seed, turn, reply text)."""
        key = f"{self._seed}/{len(self._credits)}/{zlib.crc32(action_text.encode())}"
        return random.Random(key).uniform(0.0, self.max_delay_s)

    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        time.sleep(self.delay_s(action_text))
        return super().step(action_text)


class AsyncSleepyEnv(SleepyEnv):
    """``SleepyEnv`` with ``async def`` reset/step (waits with ``asyncio.sleep``)."""

    async def reset(self, seed: int) -> str:  # type: ignore[override]
        return SleepyEnv.reset(self, seed)

    async def step(self, action_text: str) -> tuple[str, float, bool, dict]:  # type: ignore[override]
        await asyncio.sleep(self.delay_s(action_text))
        return RecallEnv.step(self, action_text)
