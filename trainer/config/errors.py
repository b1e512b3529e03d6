"""``ConfigError`` and the one-line problem messages every config check builds.

A problem is ``(key, value, message)``: the dotted key to fix, the offending value and one line
naming both and what is allowed. Loading and the checks collect problems and raise the first
as a ``ConfigError`` that carries them all.
"""

from __future__ import annotations

from typing import Any

import yaml

Problem = tuple[str, Any, str]


class ConfigError(ValueError):
    """A bad job config. ``key`` is the dotted key to fix (e.g. ``"train.lr"``), ``value`` the
    offending value, ``str(err)`` one line naming both and what is allowed. ``problems`` lists
    every ``(key, value, message)`` found when several keys were wrong at once."""

    def __init__(
        self,
        key: str,
        value: Any,
        message: str,
        problems: list[Problem] | None = None,
    ) -> None:
        self.key = key
        self.value = value
        self.problems = problems or [(key, value, message)]
        more = len(self.problems) - 1
        suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more > 0 else ""
        super().__init__(message + suffix)


def problem(key: str, value: Any, allowed: str) -> Problem:
    """``(key, value, "key: got VALUE; ALLOWED")``."""
    return (key, value, f"{key}: got {show(value)}; {allowed}")


def show(value: Any) -> str:
    """A value as the user would write it in YAML (``null``, ``true``, ``[1, 2]``, ``'x'``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list):
        return " ".join(yaml.safe_dump(value, default_flow_style=True).split())
    return repr(value)


def raise_first(problems: list[Problem]) -> None:
    """Raise a ``ConfigError`` for the first problem (carrying all of them); no-op if none."""
    if problems:
        key, value, message = problems[0]
        raise ConfigError(key, value, message, problems)
