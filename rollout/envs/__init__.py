"""Environments: built-ins by name and user classes by ``module:Class``.

``make_env(spec)`` returns a factory: call it with the env's keyword arguments (from the config or
a prompt-file record) to get a fresh ``Env``. See ``base.py`` for the interface.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

from rollout.envs.base import DEFAULT_REWARD_RANGE, Env, match_credit
from rollout.envs.calc import CalcEnv, calculator
from rollout.envs.qa import QAEnv
from rollout.envs.recall import RecallEnv
from rollout.envs.single_turn import SingleTurnEnv

__all__ = [
    "BUILTIN_ENVS",
    "CalcEnv",
    "Env",
    "QAEnv",
    "RecallEnv",
    "SingleTurnEnv",
    "calculator",
    "exception_line",
    "bind_env",
    "make_env",
    "takes_reward_fn",
    "match_credit",
    "reward_range_of",
]

#: Built-in environments by the name used in ``rollout.env``.
BUILTIN_ENVS: dict[str, type[Env]] = {
    "recall": RecallEnv,
    "calc": CalcEnv,
    "qa": QAEnv,
    "single_turn": SingleTurnEnv,
}

EnvFactory = Callable[..., Env]


def make_env(spec: str) -> EnvFactory:
    """Factory for ``spec``: a built-in name (``recall``, ``calc``, ``qa``) or ``module:Class``.

    The class is imported and checked now, so a typo fails at start-up, not mid-rollout.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(
            f"rollout.env={spec!r}: give a built-in name {sorted(BUILTIN_ENVS)} or module:Class"
        )
    if spec in BUILTIN_ENVS:
        return BUILTIN_ENVS[spec]
    if ":" not in spec:
        raise ValueError(
            f"rollout.env={spec!r}: not a built-in environment {sorted(BUILTIN_ENVS)}; "
            "for your own class write module:Class (e.g. my_pkg.envs:MyEnv)"
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"rollout.env={spec!r}: cannot import module {module_name!r} ({exc}); "
            "check the module is on PYTHONPATH"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - the user's module raised while importing
        raise ValueError(
            f"rollout.env={spec!r}: importing module {module_name!r} raised "
            f"{exception_line(exc)}; fix that module (run `python -c 'import {module_name}'`)"
        ) from exc
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(f"rollout.env={spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(cls) or not (hasattr(cls, "reset") and hasattr(cls, "step")):
        raise ValueError(
            f"rollout.env={spec!r}: {attr!r} is not an environment class "
            "(needs reset(seed) -> str and step(text) -> (obs, reward, done, info))"
        )
    reward_range_of(cls, spec)
    return cls


def reward_range_of(env: object, spec: str = "") -> tuple[float, float]:
    """The inclusive ``(low, high)`` reward range an environment (class or instance) declares
    in ``reward_range``; ``DEFAULT_REWARD_RANGE`` when it declares none; ``(-inf, inf)``
    accepts any finite reward. A declaration that is not two numbers with low < high raises
    ValueError naming it."""
    declared = getattr(env, "reward_range", DEFAULT_REWARD_RANGE)
    try:
        low, high = (float(x) for x in declared)
        ok = low < high  # False with a NaN; infinite bounds: any finite reward
    except (TypeError, ValueError):
        ok = False
    if not ok:
        name = spec or getattr(env, "__name__", type(env).__name__)
        raise ValueError(
            f"rollout.env={name!r}: reward_range={declared!r} must be (low, high), two numbers "
            "with low < high (math.inf for no bound): the rewards step() may return"
        )
    return low, high


def exception_line(exc: BaseException) -> str:
    """``"TypeName: message"`` of an exception, on one line (an environment's error text)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def takes_reward_fn(factory: EnvFactory) -> bool:
    """Whether an environment class accepts ``reward_fn=`` (by name or ``**kwargs``): then the
    trainer hands it ``reward.function`` to score its final turn."""
    import inspect

    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "reward_fn" or p.kind is p.VAR_KEYWORD for p in params)


def bind_env(spec: str, env_kwargs: dict, reward_fn=None) -> EnvFactory:
    """The env factory a rollout uses: ``make_env(spec)`` with the config's ``env_kwargs``
    and, when given, ``reward_fn`` (a prompt-file row's fields still override the kwargs)."""
    kwargs = dict(env_kwargs)
    if reward_fn is not None:
        kwargs["reward_fn"] = reward_fn
    return functools.partial(make_env(spec), **kwargs)
