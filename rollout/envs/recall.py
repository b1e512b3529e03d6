"""``recall``: a multi-turn memory task for a tiny model.

Turn 1 shows a number and asks to repeat it; each later turn shows a new number to repeat; the
final turn asks for the FIRST number again, which is only in the chat history. Each turn is
scored with ``match_credit``; the final step's reward (the trajectory score) is the mean credit
over all turns.
"""

from __future__ import annotations

import random

from rollout.envs.base import Env, match_credit


class RecallEnv(Env):
    """``turns`` >= 1 turns (the last one recalls the first number); numbers of ``length`` digits."""

    inline = True  # string work only

    def __init__(self, turns: int = 2, length: int = 2) -> None:
        if int(turns) != turns or turns < 1:
            raise ValueError(f"recall env turns={turns!r}: must be an integer >= 1")
        if int(length) != length or not 1 <= length <= 9:
            raise ValueError(f"recall env length={length!r}: must be an integer in 1..9 digits")
        self.turns, self.length = int(turns), int(length)
        self._targets: list[str] = []
        self._credits: list[float] = []

    def reset(self, seed: int) -> str:
        rng = random.Random(int(seed))
        numbers = [
            "".join(rng.choice("0123456789") for _ in range(self.length)) for _ in range(self.turns)
        ]
        # Turns before the last repeat a fresh number; the last recalls the first one.
        self._shown = numbers
        self._targets = numbers[:-1] + [numbers[0]] if self.turns > 1 else numbers
        self._credits = []
        return f"say {numbers[0]}"

    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        turn = len(self._credits)
        if turn >= self.turns:
            raise RuntimeError("recall env stepped after the episode ended; call reset()")
        credit = match_credit(action_text, self._targets[turn])
        self._credits.append(credit)
        info = {"target": self._targets[turn], "credit": credit}
        if turn + 1 == self.turns:
            return "", sum(self._credits) / len(self._credits), True, info
        nxt = turn + 1
        obs = "first?" if nxt == self.turns - 1 else f"say {self._shown[nxt]}"
        return obs, credit, False, info
