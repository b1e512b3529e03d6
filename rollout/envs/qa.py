"""``qa``: a single-turn environment for prompt files (``{"prompt": ..., "answer": ...}`` records).

The first observation is the record's prompt; the reply is scored with ``match_credit`` against
the record's answer, or with ``reward.function`` when one is set (then the reward's scale is
the function's own).
"""

from __future__ import annotations

import math

from rollout.envs.base import Env, match_credit


class QAEnv(Env):
    """``prompt``: the question text; ``answer``: the expected answer string; ``reward_fn``:
    optional ``rollout.rewards.RewardFunction`` for the final (only) turn."""

    inline = True  # string work; an instance with a user's reward function opts out

    def __init__(
        self,
        prompt: str = "",
        answer: str = "",
        reward_fn=None,
        data_source: str | None = None,
        extra_info: dict | None = None,
        **_ignored,
    ) -> None:
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"qa env prompt={prompt!r}: give a non-empty string")
        if not isinstance(answer, str) or not answer:
            raise ValueError(f"qa env answer={answer!r}: give a non-empty string")
        self.prompt, self.answer = prompt, answer
        self.reward_fn, self.data_source, self.extra_info = reward_fn, data_source, extra_info
        if reward_fn is not None:
            self.reward_range = (-math.inf, math.inf)  # the reward function's own scale
        # match_credit and the built-in scorers are quick; a user's function may block
        self.inline = reward_fn is None or getattr(reward_fn, "inline", False) is True

    def reset(self, seed: int) -> str:
        return self.prompt

    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        info: dict = {"answer": self.answer}
        if self.reward_fn is None:
            return "", match_credit(action_text, self.answer), True, info
        result = self.reward_fn(
            self.data_source or "", action_text, self.answer, dict(self.extra_info or {})
        )
        return "", result.score, True, {**info, "reward_extra": result.extras}
