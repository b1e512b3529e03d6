"""``calc``: small arithmetic with a calculator tool.

The question is ``a+b`` (or ``-``, ``*``) with small operands. The model may first call the tool
by replying ``calc A+B`` (at most ``max_calls`` times); the tool answers ``= R``. Any other reply
is the final answer, scored with ``match_credit`` against the true result (x0.9) plus 0.1 when the
tool was used correctly. The calculator parses ``A op B`` itself: no eval, no exec.
"""

from __future__ import annotations

import random
import re

from rollout.envs.base import Env, match_credit

_CALL = re.compile(r"^\s*calc\s*(-?\d{1,6})\s*([+\-*])\s*(-?\d{1,6})\s*$")


def calculator(expression: str) -> int | None:
    """Evaluate ``"A op B"`` (integers up to 6 digits, op in + - *); None if it does not parse."""
    m = re.fullmatch(r"\s*(-?\d{1,6})\s*([+\-*])\s*(-?\d{1,6})\s*", expression)
    if m is None:
        return None
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return a + b if op == "+" else a - b if op == "-" else a * b


class CalcEnv(Env):
    """Operands in ``0..max_operand``; ``ops`` a string of allowed operators; ``max_calls`` tool calls."""

    inline = True  # string work only

    def __init__(self, max_operand: int = 9, ops: str = "+", max_calls: int = 1) -> None:
        if int(max_operand) != max_operand or not 1 <= max_operand <= 999:
            raise ValueError(f"calc env max_operand={max_operand!r}: must be an integer in 1..999")
        if not ops or any(o not in "+-*" for o in ops):
            raise ValueError(f"calc env ops={ops!r}: use a non-empty string of + - *")
        if int(max_calls) != max_calls or max_calls < 0:
            raise ValueError(f"calc env max_calls={max_calls!r}: must be an integer >= 0")
        self.max_operand, self.ops, self.max_calls = int(max_operand), ops, int(max_calls)

    def reset(self, seed: int) -> str:
        rng = random.Random(int(seed))
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice(self.ops)
        self._question = f"{a}{op}{b}"
        self._answer = str(calculator(self._question))
        self._calls = 0
        self._used_tool = False
        return f"{self._question}=?"

    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        call = _CALL.match(action_text)
        if call is not None and self._calls < self.max_calls:
            self._calls += 1
            result = calculator(f"{call.group(1)}{call.group(2)}{call.group(3)}")
            self._used_tool = self._used_tool or result == int(self._answer)
            return f"= {result}", 0.0, False, {"tool": "calc", "result": result}
        credit = match_credit(action_text, self._answer)
        reward = 0.9 * credit + (0.1 if self._used_tool else 0.0)
        return "", reward, True, {"answer": self._answer, "credit": credit}
