"""Environments: built-ins by name and user classes by ``module:Class``.

``make_env(spec)`` returns a factory: call it with the env's keyword arguments (from the config or
a prompt-file record) to get a fresh ``Env``. See ``base.py`` for the interface.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from rollout.envs.base import Env, match_credit
from rollout.envs.calc import CalcEnv, calculator
from rollout.envs.qa import QAEnv
from rollout.envs.recall import RecallEnv

__all__ = [
    "BUILTIN_ENVS",
    "CalcEnv",
    "Env",
    "QAEnv",
    "RecallEnv",
    "calculator",
    "make_env",
    "match_credit",
]

#: Built-in environments by the name used in ``rollout.env``.
BUILTIN_ENVS: dict[str, type[Env]] = {"recall": RecallEnv, "calc": CalcEnv, "qa": QAEnv}

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
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(f"rollout.env={spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(cls) or not (hasattr(cls, "reset") and hasattr(cls, "step")):
        raise ValueError(
            f"rollout.env={spec!r}: {attr!r} is not an environment class "
            "(needs reset(seed) -> str and step(text) -> (obs, reward, done, info))"
        )
    return cls
