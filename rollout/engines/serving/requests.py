"""What an engine server (``rollout.engines.serving.server.EngineServer``) hands its callers: one
submitted request and what it has sampled so far (``Pending``), a request continued after a
pause (``continued``), one decode batch's figures (``BatchStats``), and the error of a closed
server (``ServerClosed``)."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field

from rollout.engines.base import GenerationRequest, GenerationResult, SamplingParams

__all__ = ["SERVER_KEYS", "BatchStats", "Pending", "ServerClosed", "continued"]

#: What a server adds to a result's ``extra`` for itself (its callers' own results drop them).
SERVER_KEYS = ("versions", "request_id", "aborted")


class ServerClosed(RuntimeError):
    """The engine server was closed (``EngineServer.close``): no request is taken any more."""


def continued(
    request: GenerationRequest, sampled: list[int], sampling: SamplingParams
) -> GenerationRequest:
    """``request`` continued after the tokens ``sampled`` so far: their prefix joins the prompt,
    its budget is what is left of it (its own ``max_new_tokens``, so one batch carries requests
    with different budgets left) and the seed moves on (the continuation draws fresh numbers,
    not the first ones again)."""
    if not sampled:
        return request
    return dataclasses.replace(
        request,
        prompt_ids=[*request.prompt_ids, *sampled],
        seed=(int(request.seed) * 1_000_003 + len(sampled)) % (2**63),
        max_new_tokens=request.budget(sampling) - len(sampled),
    )


@dataclass(frozen=True)
class BatchStats:
    """One decode batch of an ``EngineServer``: ``requests`` it served (those it began with and
    those that joined), ``seconds`` it ran, ``tokens`` it sampled, and ``cut``: requests a pause
    ended after a decode step, to go on in a later batch."""

    requests: int
    seconds: float
    tokens: int
    cut: int


@dataclass(eq=False)
class Pending:
    """One submitted request (``request_id``), what it has sampled so far (tokens, log-probs,
    the policy version of each token) and, once it ends, its finish reason."""

    request_id: str
    request: GenerationRequest
    sampling: SamplingParams
    submitted_at: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    aborted: bool = False
    error: BaseException | None = None
    first_step_at: float | None = None  # when a decode batch first took it (its turn's wait)
    extra: dict = field(default_factory=dict)  # what the engine added to its results
    wave: int | None = None  # submitted in this wave (``submit_wave``): one call, alone
    done: threading.Event = field(default_factory=threading.Event)
    _callbacks: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add_done_callback(self, fn) -> None:
        """Call ``fn(self)`` once the request has ended (at once if it has), on the thread
        that ended it."""
        with self._lock:
            if not self.done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _end(self) -> None:
        with self._lock:
            self.done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def left(self) -> int:
        """New tokens it may still sample."""
        return self.request.budget(self.sampling) - len(self.tokens)

    def outcome(self, timeout: float | None = None) -> GenerationResult:
        """Wait (at most ``timeout`` seconds) for the request to end; what its engine returned,
        over every batch it ran in (tokens, log-probs, finish reason and the engine's own
        ``extra``, none of the server's keys), or the error its batch raised. TimeoutError if
        it is still running."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} still running after {timeout} s")
        if self.error is not None:
            raise self.error
        return GenerationResult(
            list(self.tokens), list(self.logprobs), self.finish_reason or "length", dict(self.extra)
        )

    def result(self, timeout: float | None = None) -> GenerationResult:
        """``outcome``, with the server's keys in its ``extra`` (``SERVER_KEYS``): the policy
        version of each token, the request id and, if it was, ``aborted``."""
        out = self.outcome(timeout)
        out.extra.update(versions=list(self.versions), request_id=self.request_id)
        if self.aborted:
            out.extra["aborted"] = True
        return out
