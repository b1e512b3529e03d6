"""Workers in the driver's own process (``ray.in_process``): the controller's Ray calls, run
as plain method calls.

A one-rank CPU job needs no cluster: Ray's processes, each importing torch and transformers,
are most of its start-up, and a round trip per call is most of a small step's overhead.
``LocalHandle`` stands in for a Ray actor handle (``handle.method.remote(...)``,
``.options(num_returns=n)``) and ``LocalRef`` for an object ref, so the controller, the
worker classes and their call order are the same code in both modes. A call runs when it is
submitted, in submission order (what Ray guarantees per actor); an exception it raises is kept
in its ref and raised where the controller waits for it (``trainer.loop.cluster.group.wait_all``),
as Ray's task errors are.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["LocalHandle", "LocalRef", "fetch", "is_ref", "put"]


class LocalRef:
    """The outcome of one in-process call: its value, or the exception it raised."""

    __slots__ = ("_error", "_value")

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value = value
        self._error = error

    def result(self) -> Any:
        """The value, or raise the call's exception."""
        if self._error is not None:
            raise self._error
        return self._value

    @property
    def error(self) -> BaseException | None:
        """The exception the call raised, or None."""
        return self._error


class _LocalMethod:
    """``handle.method`` of a ``LocalHandle``: ``.remote(*args)`` calls it now."""

    def __init__(self, target: Any, name: str, num_returns: int = 1) -> None:
        self._target = target
        self._name = name
        self._num_returns = num_returns

    def options(self, *, num_returns: int = 1, **_ignored) -> _LocalMethod:
        """Ray's per-call options; only ``num_returns`` means anything in one process."""
        return _LocalMethod(self._target, self._name, num_returns)

    def remote(self, *args, **kwargs) -> LocalRef | list[LocalRef]:
        """Call the method with ``args`` (refs among them resolved, as Ray resolves top-level
        refs); returns its ref, or ``num_returns`` refs."""
        args = tuple(a.result() if isinstance(a, LocalRef) else a for a in args)
        try:
            value = getattr(self._target, self._name)(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - kept for the waiter, as Ray keeps task errors
            ref = LocalRef(error=err)
            return ref if self._num_returns == 1 else [ref] * self._num_returns
        if self._num_returns == 1:
            return LocalRef(value)
        return [LocalRef(v) for v in value]


class LocalHandle:
    """An object in this process, called like a Ray actor handle."""

    def __init__(self, target: Any) -> None:
        self._target = target

    @property
    def target(self) -> Any:
        """The object itself."""
        return self._target

    def __getattr__(self, name: str) -> _LocalMethod:
        if name.startswith("__"):
            raise AttributeError(name)
        return _LocalMethod(self._target, name)


def is_ref(value: Any) -> bool:
    """Whether ``value`` is a Ray object ref or a ``LocalRef``."""
    if isinstance(value, LocalRef):
        return True
    ray = sys.modules.get("ray")  # no Ray imported: no Ray ref exists
    return ray is not None and isinstance(value, ray.ObjectRef)


def fetch(ref: Any) -> Any:
    """The value behind a Ray object ref or a ``LocalRef`` (``ray.get`` for the former)."""
    if isinstance(ref, LocalRef):
        return ref.result()
    import ray

    return ray.get(ref)


def put(value: dict[str, np.ndarray]) -> Any:
    """A ref to ``value`` (a dict of numpy arrays) that ``fetch`` reads: Ray's object store
    when Ray runs in this process, else the arrays themselves, made read-only as the object
    store's are, so no reader can change another's."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.put(value)
    for array in value.values():
        if isinstance(array, np.ndarray):
            array.setflags(write=False)
    return LocalRef(value)
