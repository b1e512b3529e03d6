"""What the stream's engine (``rollout.versioned.VersionedEngine``) hands its callers: one
caller's requests for one lane (``Job``) and the two ways a call of the stream ends without
results (``GroupAborted``, ``EngineClosed``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout.engines.base import GenerationRequest, GenerationResult, SamplingParams
from rollout.engines.serving.requests import Pending
from rollout.stream_lanes import Lane

__all__ = ["EngineClosed", "GroupAborted", "Job"]


class GroupAborted(Exception):
    """Group ``group``'s generation was stopped: it can no longer be trained within the
    staleness bound (``VersionedEngine.abort_older_than``)."""

    def __init__(self, group: int) -> None:
        super().__init__(f"group {group} aborted: too stale for any later step to train on")
        self.group = group

    def __reduce__(self):  # crosses processes as itself (rollout.agent_workers' relay)
        return type(self), (self.group,)


class EngineClosed(RuntimeError):
    """The stream's engine was closed (``VersionedEngine.close``, the stream shuts down): no
    call starts, and the callers waiting for one stop."""


@dataclass(eq=False)
class Job:
    """One caller's requests for one lane (each with its own budget left), and what came
    back."""

    requests: list[GenerationRequest]
    sampling: SamplingParams
    lane: Lane
    groups: frozenset = frozenset()  # tracked prompts among them (abortable)
    outs: list[GenerationResult] | None = None
    version: int = 0
    error: BaseException | None = None
    done: bool = False
    redo: bool = False  # never answered (its lane's replica lost, or followed away): route again
    pending: list[Pending] = field(default_factory=list)  # a served lane's requests in flight
