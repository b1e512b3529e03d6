"""Issue 57's defects 1-4 of the stream's engine side (``rollout.versioned.VersionedEngine``,
``rollout.engines.router``, ``trainer.loop.engines.remote_engine``): a replacement replica
serves the stream and a lost replica's requests go to live lanes, counted (1); continued
requests with different budgets left share one engine call (2); an abort ends only its own
group's requests, and a group aborted while queued is never sent (3); a load with partial
rollouts ends a remote replica's call too (4)."""

from __future__ import annotations

import threading
import time

import pytest

from rollout.engines.base import GenerationRequest, GenerationResult, SamplingParams
from rollout.streaming import VersionedEngine


def _until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def _in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    """``fn(*args)`` on a thread of its own; ``out["value"]`` or ``out["error"]`` after."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


class _Budgeted:
    """An interruptible replica: its first call runs until interrupted (a long decode) and
    gives request k ``1 + 2k`` tokens; later calls answer each request with its own budget
    (``GenerationRequest.budget``) of tokens. Records every call's requests."""

    interruptible = True

    def __init__(self) -> None:
        self.calls: list[list[GenerationRequest]] = []

    def generate(self, requests, sampling, interrupt=None):
        self.calls.append(list(requests))
        if len(self.calls) == 1:
            _until(lambda: interrupt is not None and interrupt())
            return [
                GenerationResult([7] * (1 + 2 * k), [0.0] * (1 + 2 * k), "interrupted")
                for k in range(len(requests))
            ]
        budgets = [getattr(r, "max_new_tokens", None) or sampling.max_new_tokens for r in requests]
        return [GenerationResult([8] * b, [0.0] * b, "length") for b in budgets]


# ---------------------------------------------------------------- 2: one call, many budgets


def test_continued_requests_with_different_budgets_left_go_in_one_engine_call():
    """A load (partial rollouts) cuts a call whose requests had sampled 1 and 3 tokens. Before
    issue 57 they went on in two calls, one per remaining budget (15 and 13 tokens written into
    the call's SamplingParams); now in one call, each request carrying its own budget left."""
    replica = _Budgeted()
    versioned = VersionedEngine(replica, partial=True)
    requests = [GenerationRequest([1, 2], seed=s, group=0) for s in (0, 1)]
    thread, out = _in_thread(versioned.generate, requests, SamplingParams(max_new_tokens=16))
    _until(lambda: len(replica.calls) == 1)
    versioned.load(lambda: None, 1)
    thread.join(30)
    assert "error" not in out
    assert len(replica.calls) == 2  # the cut call, then one call for both continuations
    assert [r.max_new_tokens for r in replica.calls[1]] == [15, 13]
    assert [len(r.prompt_ids) for r in replica.calls[1]] == [3, 5]
    for result in out["value"]:
        assert len(result.token_ids) == 16 and result.finish_reason == "length"
        assert set(result.extra["versions"][:1]) == {0} and result.extra["versions"][-1] == 1


def _hf_engine():
    from rollout.engines import make_engine
    from rollout.tokenizer import load_tokenizer

    return make_engine("hf", "builtin:tiny", load_tokenizer("builtin"), seed=1)


def test_the_hf_engine_honours_each_request_s_own_budget():
    """One call, three budgets: each request samples what it would alone under a call of its
    own budget (its own seeded sampler), and no more."""
    engine = _hf_engine()
    sampling = SamplingParams(max_new_tokens=5)
    requests = [
        GenerationRequest([5, 17, 33], seed=11, max_new_tokens=3),
        GenerationRequest([40, 41], seed=12, max_new_tokens=9),
        GenerationRequest([9, 9, 9, 9], seed=13),  # the call's 5
    ]
    together = engine.generate(requests, sampling)
    assert [len(r.token_ids) for r in together] == [3, 9, 5]
    assert all(r.finish_reason == "length" for r in together)
    for request, result in zip(requests, together):
        alone = engine.generate(
            [GenerationRequest(request.prompt_ids, request.seed)],
            SamplingParams(max_new_tokens=request.budget(sampling)),
        )[0]
        assert result.token_ids == alone.token_ids
        assert result.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        GenerationRequest([1], seed=0, max_new_tokens=0)
