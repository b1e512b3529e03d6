"""``qa``: a single-turn environment for prompt files (``{"prompt": ..., "answer": ...}`` records).

The first observation is the record's prompt; the reply is scored with ``match_credit`` against
the record's answer.
"""

from __future__ import annotations

from rollout.envs.base import Env, match_credit


class QAEnv(Env):
    """``prompt``: the question text; ``answer``: the expected answer string."""

    def __init__(self, prompt: str = "", answer: str = "", **_ignored) -> None:
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"qa env prompt={prompt!r}: give a non-empty string")
        if not isinstance(answer, str) or not answer:
            raise ValueError(f"qa env answer={answer!r}: give a non-empty string")
        self.prompt, self.answer = prompt, answer

    def reset(self, seed: int) -> str:
        return self.prompt

    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        return "", match_credit(action_text, self.answer), True, {"answer": self.answer}
