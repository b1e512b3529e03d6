"""Reward functions with verl's signature (``reward.function``) and reward shaping.

A reward function is called as ``f(data_source, solution_str, ground_truth, extra_info)`` and
returns a number, or a dict with a ``score`` number whose other numeric keys become
``reward/extra/<key>`` metrics; a verl user's existing function works unchanged. It is named by
``module:function`` or is a built-in scorer written here: ``builtin:gsm8k`` (``#### answer``)
and ``builtin:math`` (the last ``\\boxed{...}``).

``RewardFunction`` runs it off the caller's thread with a time limit (``reward.timeout_s``): an
exception, a timeout, NaN/inf or a wrong type raises ``RewardError``, which the agent loop counts
like any environment fault (``rollout/env_errors`` and ``reward/errors``); the batch goes on.
A call that overruns cannot be killed (Python threads cannot be): it is abandoned, and the
next call gets a fresh pool, so one stuck call does not stall the rest.

Also here: DAPO's overlong reward shaping, on rows (``overlong_penalty``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import math
import numbers
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from batching import Row

#: The verl signature: (data_source, solution_str, ground_truth, extra_info) -> float | dict.
RewardFn = Callable[[str, str, object, dict], object]


class RewardError(ValueError):
    """A reward function failed: raised, timed out, or returned something not a finite score."""


@dataclass(frozen=True)
class RewardResult:
    """A checked reward: ``score`` and the other numeric keys the function returned."""

    score: float
    extras: dict[str, float] = field(default_factory=dict)


# ----------------------------------------------------------------------------- built-ins

_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").strip().rstrip(".")


def _same_number(a: str, b: str) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=0, abs_tol=1e-6)
    except ValueError:
        return a == b


def gsm8k_answer(text: str) -> str | None:
    """The answer after the last ``####`` (GSM8K's format), commas and ``$`` removed; None
    when there is no ``####`` followed by a number."""
    found = re.findall(r"####\s*\$?\s*(-?[\d,]*\.?\d+)", text)
    return _clean_number(found[-1]) if found else None


def gsm8k_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
    """1.0 when the answer after the response's last ``#### `` equals ``ground_truth``
    (a number, or a GSM8K solution ending in ``#### N``), else 0.0 (strict format, as verl)."""
    truth = str(ground_truth)
    truth = gsm8k_answer(truth) or _clean_number(truth)
    answer = gsm8k_answer(solution_str)
    return 1.0 if answer is not None and _same_number(answer, truth) else 0.0


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if
    there is none or it is not closed."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    name_end = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    tail = text[name_end:]
    if not tail.lstrip().startswith("{"):  # "\boxed 5": the next word
        words = tail.split()
        return words[0].rstrip("$.") if words else None
    brace = name_end + (len(tail) - len(tail.lstrip()))
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : i]
    return None


_MATH_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "$", "\\%", "%")


def normalize_math(answer: str) -> str:
    """A canonical string for comparing MATH answers: spacing, ``\\left``/``\\right``,
    ``\\text{}``, degrees, ``dfrac``/``tfrac``, ``\\frac12``-style shorthand and a leading
    ``x =`` are normalised away."""
    s = answer.strip()
    s = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\mbox\{\s*([^{}]*)\}", r"\1", s)
    for token in _MATH_DROP:
        s = s.replace(token, "")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\circ", "")
    s = s.replace("dfrac", "frac").replace("tfrac", "frac")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    s = re.sub(r"^[a-zA-Z]\s*=", "", s)
    s = s.replace(" ", "").rstrip(".")
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    if s.startswith("."):
        s = "0" + s
    return s


def _math_value(s: str) -> float | None:
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    if m:
        den = int(m.group(3))
        return None if den == 0 else (-1 if m.group(1) else 1) * int(m.group(2)) / den
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if m:
        return None if int(m.group(2)) == 0 else int(m.group(1)) / int(m.group(2))
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def math_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
    """1.0 when the response's last ``\\boxed{}`` equals ``ground_truth`` (itself boxed or
    not) after ``normalize_math``, or both are the same number (``\\frac{1}{2}`` = ``0.5``);
    else 0.0."""
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth
    a, b = normalize_math(answer), normalize_math(truth)
    if a == b:
        return 1.0
    va, vb = _math_value(a), _math_value(b)
    return 1.0 if va is not None and vb is not None and math.isclose(va, vb, abs_tol=1e-6) else 0.0


#: Built-in scorers by the name after ``builtin:`` in ``reward.function``.
BUILTIN_REWARDS: dict[str, RewardFn] = {"gsm8k": gsm8k_score, "math": math_score}


# ----------------------------------------------------------------------------- loading


def load_reward_function(spec: str) -> RewardFn:
    """The function ``spec`` names: ``builtin:<name>`` or ``module:function``; imported now,
    so a typo fails at start-up. ValueError naming ``reward.function`` otherwise."""
    key = f"reward.function={spec!r}"
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"{key}: write module:function or builtin:{{{','.join(BUILTIN_REWARDS)}}}")
    module_name, _, attr = spec.partition(":")
    if module_name == "builtin":
        if attr not in BUILTIN_REWARDS:
            raise ValueError(
                f"{key}: no such built-in scorer; use one of "
                f"{', '.join('builtin:' + n for n in BUILTIN_REWARDS)}"
            )
        return BUILTIN_REWARDS[attr]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"{key}: cannot import module {module_name!r} ({exc}); check it is on PYTHONPATH"
        ) from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{key}: module {module_name!r} has no function {attr!r}")
    return fn


def check_reward(value: object, spec: str) -> RewardResult:
    """A reward function's return value as a ``RewardResult``; ``RewardError`` (naming the
    function) for anything but a finite number or a dict with a finite number ``score``."""
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardError(f"{spec} returned a dict without 'score' (keys: {sorted(value)})")
        extras = {
            str(k): float(v)
            for k, v in value.items()
            if k != "score" and isinstance(v, numbers.Real) and math.isfinite(float(v))
        }
        value = value["score"]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(f"{spec} returned {type(value).__name__} {value!r:.60}, not a number")
    score = float(value)
    if not math.isfinite(score):
        raise RewardError(f"{spec} returned {score}, not a finite number")
    return RewardResult(score, extras)


class RewardFunction:
    """``reward.function`` ready to call: ``fn(data_source, solution_str, ground_truth,
    extra_info) -> RewardResult``, run on a worker thread, at most ``timeout_s`` seconds.
    A built-in scorer (``inline``: a quick regex) runs on the caller's thread instead.
    ``score`` is the same for a caller on an event loop: it awaits the worker thread."""

    def __init__(self, spec: str, *, timeout_s: float, max_workers: int = 4) -> None:
        if not timeout_s > 0:
            raise ValueError(f"reward.timeout_s={timeout_s!r}: must be > 0 seconds")
        self.spec, self.timeout_s, self.max_workers = spec, float(timeout_s), max_workers
        self.fn = load_reward_function(spec)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # the agent loop steps environments on several threads

    @property
    def inline(self) -> bool:
        """Whether calls run on the caller's thread (the built-in scorers: quick, pure)."""
        return self.spec.startswith("builtin:")

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: object, extra_info: dict
    ) -> RewardResult:
        """Score one response; ``RewardError`` on an exception, timeout or bad value."""
        args = (data_source, solution_str, ground_truth, extra_info)
        if self.inline:
            return self._checked(lambda: self.fn(*args))
        pool, future = self._submit(args)
        return self._checked(lambda: future.result(timeout=self.timeout_s), pool)

    async def score(
        self, data_source: str, solution_str: str, ground_truth: object, extra_info: dict
    ) -> RewardResult:
        """``self(...)`` for a caller on an event loop: the loop runs on while the function
        does (on the worker thread, at most ``timeout_s`` seconds)."""
        args = (data_source, solution_str, ground_truth, extra_info)
        if self.inline:
            return self._checked(lambda: self.fn(*args))
        pool, future = self._submit(args)
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except Exception:  # noqa: BLE001 - an overrun or the function's error: _checked says which
            pass
        return self._checked(lambda: future.result(timeout=0), pool)

    def _submit(self, args: tuple):
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.max_workers, thread_name_prefix="reward"
                )
            pool = self._pool
            return pool, pool.submit(self.fn, *args)

    def _checked(self, get_value: Callable[[], object], pool=None) -> RewardResult:
        """``get_value()``'s reward, or ``RewardError`` for an exception, overrun or bad value."""
        try:
            value = get_value()
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            # The stuck call keeps its thread; later calls get a fresh pool. Calls already
            # queued on the old pool (other environments' steps) still run there.
            with self._lock:
                if pool is not None and self._pool is pool:
                    pool.shutdown(wait=False)
                    self._pool = None
            raise RewardError(
                f"{self.spec} took longer than reward.timeout_s={self.timeout_s:g} s"
            ) from None
        except Exception as exc:  # noqa: BLE001 - a user function may raise anything
            raise RewardError(f"{self.spec} raised {type(exc).__name__}: {exc}") from exc
        return check_reward(value, self.spec)

    def __getstate__(self) -> dict:  # a pool does not pickle; a fresh one starts lazily
        return {**self.__dict__, "_pool": None, "_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())


# ----------------------------------------------------------------------------- shaping


def overlong_penalty(length: int, horizon: int, buffer_len: int, factor: float) -> float:
    """DAPO's overlong penalty for a response of ``length`` tokens when at most ``horizon``
    can be generated: 0 up to ``horizon - buffer_len``, then falling linearly to ``-factor``
    at ``horizon``."""
    if buffer_len <= 0:
        return 0.0
    expected = horizon - buffer_len
    return min(0.0, -(length - expected) / buffer_len * factor)


def _longest_trained_run(mask: list[int]) -> int:
    best = run = 0
    for m in mask:
        run = run + 1 if m else 0
        best = max(best, run)
    return best


def apply_overlong_penalty(
    rows: list[Row], *, horizon: int, buffer_len: int, factor: float
) -> tuple[list[Row], dict[str, float]]:
    """Rows with DAPO's overlong penalty added to each trajectory's score (and to the token
    reward that carries it).

    A trajectory's length is its longest turn's generated tokens (the longest run of trained
    tokens in its rows; one turn for single-turn data, as in DAPO); ``horizon`` is the most a
    turn can generate (``rollout.max_new_tokens - 1``). Returns the new rows and
    ``reward/overlong_penalty_mean`` (per trajectory) and ``reward/overlong_fraction``.
    """
    if buffer_len <= 0 or not rows:
        return rows, {}
    length: dict[int, int] = {}
    for row in rows:
        tid = row.trajectory_id
        length[tid] = max(length.get(tid, 0), _longest_trained_run(row.response_mask))
    penalty = {tid: overlong_penalty(n, horizon, buffer_len, factor) for tid, n in length.items()}
    out = []
    for row in rows:
        p = penalty[row.trajectory_id]
        if p == 0.0:
            out.append(row)
            continue
        token_rewards = list(row.token_rewards) if row.token_rewards is not None else None
        if row.is_last_step and token_rewards is not None:
            where = max(
                (i for i, m in enumerate(row.response_mask) if m), default=len(token_rewards) - 1
            )
            token_rewards[where] += p
        out.append(replace(row, score=row.score + p, token_rewards=token_rewards))
    values = list(penalty.values())
    return out, {
        "reward/overlong_penalty_mean": sum(values) / len(values),
        "reward/overlong_fraction": sum(v < 0 for v in values) / len(values),
    }
