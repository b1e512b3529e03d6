"""The engine interface every rollout engine implements.

An engine turns token-id prompts into sampled token ids with the log-probability of each
sampled token. Log-probabilities are taken from ``log_softmax(logits / temperature)`` before
top-p / top-k filtering, the same distribution the trainer evaluates, so rollout and
training logprobs are comparable.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # torch is imported by the engines themselves, not by who only plans with them
    import torch

    from rollout.engines.weights.buckets import TensorSpec

#: What ``Engine.wake_up`` can retake, in the order the weight sync wakes them.
WAKE_TAGS = ("weights", "kv_cache")

#: ``interrupted``: the caller's ``interrupt`` ended the call before the request did (an
#: ``interruptible`` engine only; ``rollout.streaming.VersionedEngine`` continues it).
FinishReason = Literal["stop", "length", "interrupted"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings shared by every request of one ``generate`` call.

    ``max_new_tokens`` counts tokens. ``top_k = 0`` and ``top_p = 1.0`` switch those filters off.
    ``stop_token_ids`` end a sequence when sampled (the stop token is kept in the output).
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1 token")
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature}: must be > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 switches it off)")


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to continue. ``seed`` seeds this request's own sampler, so what it samples
    does not depend on which other requests share the batch. ``group``: the prompt's index in
    the run's prompt stream; engine replicas are dealt requests by it, so every sample and turn
    of one prompt goes to the same replica (``rollout.engines.serving.router``). ``max_new_tokens``:
    this request's own budget of new tokens (None: the call's ``SamplingParams``), so one call
    can carry requests with different budgets left (a stream's continued requests)."""

    prompt_ids: list[int]
    seed: int
    group: int = 0
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens}: a request's budget must be >= 1 token "
                "(or None for the call's)"
            )

    def budget(self, sampling: SamplingParams) -> int:
        """New tokens this request may sample: its own ``max_new_tokens``, else the call's."""
        return sampling.max_new_tokens if self.max_new_tokens is None else self.max_new_tokens


@dataclass
class GenerationResult:
    """Sampled continuation: ``token_ids`` (stop token included when one was sampled),
    ``logprobs`` (one per token) and why generation ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    extra: dict = field(default_factory=dict)


#: ``Engine.generate``'s ``admit(room)`` (a ``joinable`` engine): requests that join the call.
Admit = Callable[[int], list[GenerationRequest]]
#: ``Engine.generate``'s ``on_result(index, result)``: request ``index`` has ended.
OnResult = Callable[[int, GenerationResult], None]


class Engine(ABC):
    """A generation engine (HF transformers, vLLM, vllm-ascend).

    ``interruptible``: ``generate`` takes ``interrupt`` (a callable polled between decode
    steps; once it returns True the call ends, every request still running with the tokens it
    has and finish reason ``interrupted``), so new weights can land mid-sequence.
    ``abortable``: ``generate`` also takes ``abort_groups`` (a callable polled likewise,
    returning a frozenset of ``GenerationRequest.group``s: their running requests end there as
    interrupted, the rest of the call goes on), so a stale group is stopped alone.
    ``joinable``: ``generate`` also takes ``admit`` (a callable polled likewise with the room
    left in the batch, in requests, returning requests that join the running call; their
    results follow the given ones', in the order admitted) and ``on_result(index, result)``
    (called as each request ends, before the call returns), so a call runs for as long as it
    has work (``rollout.engines.serving.server``)."""

    interruptible = False
    abortable = False
    joinable = False

    @abstractmethod
    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingParams
    ) -> list[GenerationResult]:
        """Continue every request; results are in request order."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights (HF parameter names), possibly in several buckets."""

    def sleep(self, discard_weights: bool = False) -> None:  # noqa: B027 - default no-op
        """Release device memory (weights and KV cache) while the trainer uses the device
        (colocated mode). ``discard_weights``: the next wake is followed by a full weight
        update, so the weights need not be kept anywhere (vLLM's sleep level 2) and the
        engine refuses to generate until that update has been loaded."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:  # noqa: B027 - default no-op
        """Retake device memory released by ``sleep``: ``tags`` among ``WAKE_TAGS`` (None: all).
        The weight sync wakes ``weights`` first and ``kv_cache`` after, to keep the peak low."""

    def load_shared_bucket(self, open_bucket, handles: Sequence, specs: Sequence[TensorSpec]):
        """Load one bucket of new weights handed over in shared memory (``rollout.engines.
        buckets``): ``handles[k]`` is tp rank k's copy, ``open_bucket(handle)`` maps one as a
        flat uint8 tensor on this process's device. An engine in one process reads tp rank 0's;
        engines with a worker per device (vLLM tp > 1) let each worker read its own.
        Returns once the bucket's memory has been read (device copies finished included);
        nothing of it may be kept past the call: the writer refills the slot with a later
        bucket (an engine that holds tensors until a layer is complete must copy them)."""
        from rollout.engines.weights.buckets import unpack_bucket

        self.update_weights(unpack_bucket(open_bucket(handles[0]), specs))
        wait_for_device()  # the writer may reuse the memory once this returns

    def init_weight_transfer(self, init_info: dict) -> None:
        """Join the transfer group a trainer's pushes come through (``rollout.engines.
        transfer``; blocks until every member has): an engine in one process is one member,
        ``init_info["rank_offset"]``, on its own device's collective library. vLLM's engine
        instead has each of its workers join through vLLM's API (``VLLMTransfer``)."""
        import torch

        import hal
        from rollout.engines.weights.transfer import TransferInitInfo, TransferReceiver

        device = getattr(self, "device", torch.device("cpu"))
        self._receiver = TransferReceiver(hal.get_backend(torch.device(device).type))
        self._receiver.join(TransferInitInfo(**init_info), 0)

    def receive_weights(self, update_info: dict) -> int:
        """Take one whole push (``update_info``: names, dtype names, shapes, packing) from
        the transfer group, loading each chunk by name as it arrives (``update_weights``);
        returns the tensor count."""
        from rollout.engines.weights.transfer import TransferUpdateInfo

        count = self._receiver.receive(TransferUpdateInfo(**update_info), self.update_weights)
        self.finish_weight_update()
        return count

    def finish_weight_update(self) -> None:  # noqa: B027 - optional hook, default no-op
        """Complete a weight update loaded in buckets (an engine that defers per-layer work
        until every bucket has arrived does it here); after it, the engine holds no view of
        the memory the buckets came in."""

    def lanes(self) -> list[Engine]:
        """The engines that serve this one's requests independently of each other, in lane
        order: a replica router's replicas, else this engine alone. A caller that batches
        requests (``rollout.engines.serving.batcher``) keeps one call in flight per lane, so a slow
        replica holds up only the requests dealt to it."""
        return [self]

    def lane_of(self, group: int) -> int:
        """The lane (index into ``lanes()``) that serves the requests of prompt ``group``
        (``GenerationRequest.group``); decided by the prompt alone, never by timing."""
        return 0

    def shutdown(self) -> None:  # noqa: B027 - optional hook, default no-op
        """Free every resource the engine holds."""


def wait_for_device() -> None:
    """Wait for every copy queued on this process's accelerator, if it has one: a shared
    bucket is handed back to its writer only once nothing reads it any more."""
    import torch

    if torch.accelerator.is_available():
        torch.accelerator.synchronize()
