"""``single_turn``: one dataset row, one reply, scored by ``reward.function``.

The row is a prompt-file record (plain or verl format, see ``rollout/envs/prompts.py``): the
first observation is its ``prompt`` (a string, or the chat messages as they are), the model
answers once, and the reward function scores the reply against ``reward_model.ground_truth``
(or a plain row's ``answer``) with the row's ``data_source`` and ``extra_info``. The reward's
scale is the function's own (``reward_range`` unbounded); its extra keys ride in ``info``.
"""

from __future__ import annotations

import inspect
import math

from rollout.envs.base import Env


class SingleTurnEnv(Env):
    """``prompt``: str or chat messages; ``reward_fn``: a ``rollout.rewards.RewardFunction``
    (given by the trainer from ``reward.function``); the other fields come from the row."""

    reward_range = (-math.inf, math.inf)  # any finite reward
    inline = True  # reset returns the row's prompt; step awaits the reward function

    def __init__(
        self,
        prompt: str | list | None = None,
        data_source: str | None = None,
        reward_model: dict | None = None,
        extra_info: dict | None = None,
        answer: str | None = None,
        reward_fn=None,
        **_other_columns,
    ) -> None:
        if reward_fn is None:
            raise ValueError(
                "single_turn env needs a reward function; set reward.function "
                "(module:function, builtin:gsm8k or builtin:math)"
            )
        if not prompt:
            raise ValueError(
                "single_turn env got no prompt; it reads prompt-file rows, so set data.source "
                "to a .jsonl/.parquet file"
            )
        truth = (reward_model or {}).get("ground_truth", answer)
        if truth is None:
            raise ValueError(
                "single_turn env: the row has neither reward_model.ground_truth nor answer"
            )
        self.prompt, self.truth, self.reward_fn = prompt, truth, reward_fn
        self.data_source = data_source or ""
        self.extra_info = dict(extra_info or {})

    def reset(self, seed: int) -> str | list[dict]:
        return self.prompt

    async def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        """Score the reply (the reward function runs off the event loop, see
        ``RewardFunction.score``); the episode ends."""
        result = await self._score(action_text)
        return "", result.score, True, {"reward_extra": result.extras}

    async def _score(self, action_text: str):
        args = (self.data_source, action_text, self.truth, self.extra_info)
        score = getattr(self.reward_fn, "score", None)
        if score is not None and inspect.iscoroutinefunction(score):
            return await score(*args)
        return self.reward_fn(*args)  # a plain callable returning a RewardResult
