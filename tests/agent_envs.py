"""Environments for the agent-worker tests (``rollout.agent_workers``), imported as
``tests.agent_envs:<Name>`` in the test process and in the worker processes alike."""

from __future__ import annotations

import os
import time

from rollout.envs.sleepy import SleepyEnv


class FaultyEnv(SleepyEnv):
    """``sleepy`` whose episode ``bad_seed`` raises at its second step, and whose episode
    ``slow_seed`` waits ``slow_s`` seconds at its first step (past ``rollout.env_timeout_s``);
    ``exit_seed``: that episode's first step ends the whole process (a crashing sandbox)."""

    def __init__(
        self,
        bad_seed: int = -1,
        slow_seed: int = -1,
        slow_s: float = 0.0,
        exit_seed: int = -1,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.bad_seed, self.slow_seed, self.slow_s = bad_seed, slow_seed, slow_s
        self.exit_seed = exit_seed

    def step(self, action_text: str):
        turn = len(self._credits)
        if self._seed == self.exit_seed:
            os._exit(3)
        if self._seed == self.slow_seed and turn == 0:
            time.sleep(self.slow_s)
        if self._seed == self.bad_seed and turn == 1:
            raise ConnectionError("the sandbox dropped the episode")
        return super().step(action_text)


class BrokenConstructor(SleepyEnv):
    """Refuses to build for the prompts whose ``seed`` is odd."""

    def __init__(self, seed: int = 0, **kwargs) -> None:
        if seed % 2:
            raise RuntimeError(f"no sandbox for seed {seed}")
        super().__init__(**kwargs)
