"""``longtail``: an agent workload whose slowest trajectory sets a step's length.

The ``recall`` task (repeat the numbers shown, then recall the first), with what makes agent
rollouts uneven drawn per episode from heavy-tailed distributions, all seeded by the episode
seed so a rerun waits and answers the same:

- turns: ``1 + floor(Pareto(turn_alpha))``, at most ``max_turns`` (most episodes take one or two
  turns, a few take all);
- tool latency: every ``step`` first waits ``median_delay_s x LogNormal(0, delay_sigma)``
  seconds, at most ``max_delay_s`` (a search or a sandbox: mostly quick, now and then very
  slow), drawn per step or, with ``delay_per="episode"``, once per episode (a slow sandbox
  stays slow for every call of its episode); the wait is ``time.sleep``
  (``AsyncLongTailEnv``: ``asyncio.sleep``), so it costs no CPU and a 2-core machine can
  overlap it with generation and training;
- answer length: the numbers have ``1 + floor(Pareto(length_alpha))`` digits, at most
  ``max_length``, so a few episodes need long answers.

For the streaming-rollout work (issue 36) and its bench; not registered as a built-in name:
``rollout.env=rollout.envs.longtail:LongTailEnv`` (set ``rollout.max_turns`` >= ``max_turns``).
"""

from __future__ import annotations

import asyncio
import math
import random
import zlib

from rollout.envs.recall import RecallEnv
from rollout.envs.sleepy import SleepyEnv


def pareto_count(rng: random.Random, alpha: float, cap: int) -> int:
    """``1 + floor(X)``, X ~ Pareto(``alpha``) - 1 (so 0 is the most likely), at most ``cap``."""
    return min(cap, 1 + int(rng.paretovariate(alpha) - 1.0))


class LongTailEnv(SleepyEnv):
    """``recall`` with heavy-tailed turn counts, answer lengths and tool latencies (see the
    module docstring); every draw comes from the episode seed. ``SleepyEnv``'s step: wait
    ``delay_s``, then answer as ``recall``."""

    def __init__(
        self,
        max_turns: int = 6,
        turn_alpha: float = 1.2,
        max_length: int = 6,
        length_alpha: float = 2.0,
        median_delay_s: float = 0.02,
        delay_sigma: float = 1.5,
        max_delay_s: float = 2.0,
        delay_per: str = "step",
    ) -> None:
        if delay_per not in ("step", "episode"):
            raise ValueError(f"longtail env delay_per={delay_per!r}: must be step or episode")
        checks = {
            "max_turns": (max_turns, 1, 64),
            "max_length": (max_length, 1, 9),
        }
        for key, (value, low, high) in checks.items():
            if int(value) != value or not low <= value <= high:
                raise ValueError(
                    f"longtail env {key}={value!r}: must be an integer in {low}..{high}"
                )
        for key, value in {"turn_alpha": turn_alpha, "length_alpha": length_alpha}.items():
            if not 0.1 <= value <= 100:
                raise ValueError(f"longtail env {key}={value!r}: must be in 0.1..100")
        if not 0 <= median_delay_s <= max_delay_s <= 3600:
            raise ValueError(
                f"longtail env median_delay_s={median_delay_s!r}, max_delay_s={max_delay_s!r}: "
                "need 0 <= median_delay_s <= max_delay_s <= 3600 seconds"
            )
        if not 0 <= delay_sigma <= 10:
            raise ValueError(f"longtail env delay_sigma={delay_sigma!r}: must be in 0..10")
        super().__init__(turns=1, length=1, max_delay_s=max_delay_s)
        self.max_turns, self.turn_alpha = int(max_turns), float(turn_alpha)
        self.max_length, self.length_alpha = int(max_length), float(length_alpha)
        self.median_delay_s, self.delay_sigma = float(median_delay_s), float(delay_sigma)
        self.delay_per = delay_per

    def reset(self, seed: int) -> str:
        """Draw this episode's turns and answer length, then start it as ``recall`` does."""
        rng = random.Random(f"longtail/{int(seed)}")
        self.turns = pareto_count(rng, self.turn_alpha, self.max_turns)
        self.length = pareto_count(rng, self.length_alpha, self.max_length)
        return super().reset(seed)

    def delay_s(self, action_text: str) -> float:
        """Seconds the next step waits: seeded by (episode seed, turn, reply text), or by the
        episode seed alone with ``delay_per="episode"``."""
        key = f"{self._seed}/{len(self._credits)}/{zlib.crc32(action_text.encode())}"
        if self.delay_per == "episode":
            key = f"{self._seed}/episode"
        draw = random.Random(key).lognormvariate(0.0, self.delay_sigma)
        return min(self.max_delay_s, self.median_delay_s * draw) if math.isfinite(draw) else 0.0


class AsyncLongTailEnv(LongTailEnv):
    """``LongTailEnv`` with ``async def`` reset/step (waits with ``asyncio.sleep``)."""

    async def reset(self, seed: int) -> str:  # type: ignore[override]
        return LongTailEnv.reset(self, seed)

    async def step(self, action_text: str) -> tuple[str, float, bool, dict]:  # type: ignore[override]
        await asyncio.sleep(self.delay_s(action_text))
        return RecallEnv.step(self, action_text)
