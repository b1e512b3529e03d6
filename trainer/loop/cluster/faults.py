"""What happened when a worker call failed, read from the error and every error it wraps, not
from its class's name: the restart path (``trainer.loop.start.restarts``) decides by it.

- ``died``: a process of the job is gone. Ray says so (``RayActorError``: ``ActorDiedError``,
  ``ActorUnavailableError``; ``WorkerCrashedError``, ``NodeDiedError``,
  ``LocalRayletDiedError``), for the worker called or for one it called itself (an engine
  replica lost during a weight push); or a worker's own error came while another of the
  job's processes is found dead (``dead_workers``): the error is the loss's consequence.
- ``lost``: an object the call read went with the process or node that held it
  (``ObjectLostError``: ``OwnerDiedError``, ``ObjectReconstructionFailedError``, ...), e.g. a
  node lost while the ranks fetch the step's batch.
- ``collective``: a collective broke, as the device's library says
  (``hal.is_collective_error``: torch.distributed's errors, gloo's, NCCL's and HCCL's words).
- ``hung``: no answer within the call's time limit (``wait_all``'s own, or a ``GetTimeoutError``
  of a wait the worker made).
- ``raised``: anything else the worker's own code raised; a restart would repeat it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

#: Kinds a restart may get past (``run.max_restarts``).
RESTARTABLE_KINDS = ("died", "lost", "collective", "hung")

#: Words for each restartable kind, for the restart's line and the end-of-run summary.
WHAT_HAPPENED = {
    "died": "a process died",
    "lost": "an object was lost with its process or node",
    "collective": "a collective broke",
    "hung": "a call passed its time limit",
}

#: Ray's errors for each kind (looked up by name in ``ray.exceptions``; a release that lacks
#: one simply has no such error).
RAY_ERRORS = {
    "died": (
        "RayActorError",
        "WorkerCrashedError",
        "NodeDiedError",
        "LocalRayletDiedError",
    ),
    "lost": ("ObjectLostError",),
    "hung": ("GetTimeoutError",),
}

#: Seconds ``dead_workers`` waits for the job's processes to answer.
PROBE_S = 3.0


def chain(err: BaseException, limit: int = 16) -> Iterator[BaseException]:
    """``err`` and every error it wraps: Ray's ``cause`` (a task's own error), then
    ``__cause__`` and ``__context__``, each once, at most ``limit``."""
    seen: set[int] = set()
    todo = [err]
    while todo and len(seen) < limit:
        link = todo.pop(0)
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        yield link
        todo += [getattr(link, "cause", None), link.__cause__, link.__context__]


def _ray_classes(kind: str) -> tuple[type, ...]:
    ray = sys.modules.get("ray")  # no Ray imported: no Ray error exists
    if ray is None:
        return ()
    found = (getattr(ray.exceptions, name, None) for name in RAY_ERRORS[kind])
    return tuple(cls for cls in found if isinstance(cls, type))


def fault_kind(err: BaseException) -> str:
    """What happened, from ``err`` and the errors it wraps (the module docstring's kinds; a
    loss found only by asking the other processes is ``dead_workers``'): a lost process
    first, then a lost object, a broken collective, a nested time limit; else ``raised``."""
    import hal

    links = list(chain(err))
    for kind in ("died", "lost"):
        classes = _ray_classes(kind)
        if classes and any(isinstance(link, classes) for link in links):
            return kind
    if any(hal.is_collective_error(link) for link in links):
        return "collective"
    timeouts = _ray_classes("hung")
    if timeouts and any(isinstance(link, timeouts) for link in links):
        return "hung"
    return "raised"


def describe(what: str, name: str, err: BaseException, kind: str) -> str:
    """The line of a failed call ``what`` of worker ``name`` that raised ``err`` (of
    ``kind``, ``fault_kind``): what happened in words, then Ray's last line or the worker's
    own error's class and first line."""
    called_died = kind == "died" and not _is_task_error(err)
    if called_died:  # the worker's own process is gone
        return f"{what}: worker {name} died ({_last_line(err)})"
    if kind == "died":
        return f"{what}: worker {name} lost a process it called ({_last_line(_own(err))})"
    if kind == "lost":
        link = _own(err)
        return (
            f"{what}: worker {name} lost an object it read ({type(link).__name__}: the process "
            "or node that held it is gone)"
        )
    link = _own(err)
    text = str(link).strip().splitlines()
    return f"{what}: worker {name} raised {type(link).__name__}: {text[0] if text else ''}"


def _is_task_error(err: BaseException) -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and isinstance(err, ray.exceptions.RayTaskError)


def _own(err: BaseException) -> BaseException:
    """The worker's own error: the one Ray's task error wraps with its traceback, else
    ``err`` itself."""
    return getattr(err, "cause", None) or err


def _last_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[-1] if text else type(err).__name__


def dead_workers(handles: Mapping[str, Any], timeout_s: float = PROBE_S) -> list[str]:
    """Names of the Ray actors among ``handles`` (name -> handle) whose process is gone: each
    is asked a no-op (``__ray_ready__``); one whose answer is Ray's ``RayActorError`` is
    dead. An actor busy with a long call does not answer within ``timeout_s`` seconds and
    counts as alive (a busy process is not a lost one)."""
    import ray

    pings, dead = {}, []
    for name, handle in handles.items():
        try:
            pings[handle.__ray_ready__.remote()] = name
        except ray.exceptions.RayActorError:  # refused at once: known dead
            dead.append(name)
    refs = list(pings)
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:
            dead.append(pings[ref])
        except Exception:  # noqa: BLE001 - answered otherwise: the process is there
            pass
    return dead
