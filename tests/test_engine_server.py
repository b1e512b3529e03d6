"""Issue 57: one replica's engine as a server (``rollout.engines.serving.server.EngineServer``) over the
HF engine's step loop: requests at any moment from any thread, abort by request id, weights
taken between decode steps with every token's policy version exact."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rollout.engines import GenerationRequest, GenerationResult, SamplingParams, make_engine
from rollout.engines.serving.requests import ServerClosed, continued
from rollout.engines.serving.server import EngineServer
from rollout.models import load_model
from rollout.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin")


@pytest.fixture()
def engine(tmp_path, monkeypatch, tok):
    monkeypatch.setenv("CROSSRL_CACHE", str(tmp_path / "cache"))
    return make_engine("hf", load_model("builtin:tiny", seed=0), tok)


@pytest.fixture()
def server(engine):
    srv = EngineServer(engine)
    yield srv
    srv.close(timeout_s=30)


def _until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.002)


def _alone(engine, request, sampling):
    return engine.generate([request], sampling)[0]


def _running(server) -> int:
    with server._cond:
        return sum(not p.done.is_set() for p in server._slots)


def test_requests_submitted_at_any_moment_join_the_running_batch_and_draw_what_they_draw_alone(
    server, engine, tok
):
    """One long request runs; others are submitted from their own threads while it decodes.
    They join its batch (no second batch begins while it runs) and each samples, token for
    token, what it samples in a call of its own, every token under version 0."""
    sampling = SamplingParams(max_new_tokens=240)  # the first runs while the others join
    first = GenerationRequest(tok.encode("a much longer prompt to force left padding"), seed=1)
    late = [
        GenerationRequest(tok.encode("x"), seed=2, max_new_tokens=6),
        GenerationRequest(tok.encode("what is 3+4=?"), seed=3, max_new_tokens=9),
        GenerationRequest(tok.encode("what is 3+4=?"), seed=4, max_new_tokens=30),
    ]
    head = server.submit(first, sampling, request_id="head")
    _until(lambda: _running(server) == 1)
    got: dict[int, object] = {}

    def ask(i: int) -> None:
        time.sleep(0.003 * i)
        got[i] = server.submit(late[i], sampling).result(timeout=120)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(late))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = head.result(timeout=120)
    assert server.batches == 1 and server.joined == len(late)
    assert out.extra["request_id"] == "head"
    for request, result in zip([first, *late], [out, *(got[i] for i in range(len(late)))]):
        alone = _alone(engine, request, sampling)
        assert result.token_ids == alone.token_ids
        assert result.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
        assert result.extra["versions"] == [0] * len(alone.token_ids)
        assert result.finish_reason == "length"


def test_an_abort_by_id_ends_that_request_alone_queued_or_running(server, engine, tok):
    """Aborting a running request ends it after the current decode step with the tokens it has;
    the other request of its batch goes on to its full budget, as alone. A queued request
    aborted while the server is paused comes back at once with none."""
    sampling = SamplingParams(max_new_tokens=400)
    keep = GenerationRequest(tok.encode("keep going"), seed=5, max_new_tokens=60)
    long = GenerationRequest(tok.encode("stop me"), seed=6)
    kept, cut = server.submit(keep, sampling), server.submit(long, sampling, request_id="cut")
    _until(lambda: _running(server) == 2)
    assert server.abort(["cut"]) == 1
    result = cut.result(timeout=120)
    assert result.extra["aborted"] and result.finish_reason == "interrupted"
    assert 0 < len(result.token_ids) < 400
    assert result.token_ids == _alone(engine, long, sampling).token_ids[: len(result.token_ids)]
    assert kept.result(timeout=120).token_ids == _alone(engine, keep, sampling).token_ids

    server.pause()
    queued = server.submit(keep, sampling, request_id="queued")
    assert server.abort(["queued", "unknown"]) == 1
    out = queued.result(timeout=5)
    assert out.token_ids == [] and out.extra["aborted"]
    server.resume()


def test_weights_taken_mid_request_tag_every_token_with_the_version_that_sampled_it(
    server, engine, tok
):
    """A pause between decode steps puts the running request back at the head of the queue;
    new weights load; on resume it goes on from its prefix. Its first k tokens are what the old
    weights sample, the rest what the new ones sample continuing that prefix (the continued
    request), and ``versions`` says so token for token."""
    sampling = SamplingParams(max_new_tokens=300)
    request = GenerationRequest(tok.encode("a prompt that runs long"), seed=7)
    before = _alone(engine, request, sampling)
    pending = server.submit(request, sampling)
    _until(lambda: _running(server) == 1)
    time.sleep(0.05)
    server.pause()
    assert server.queued() == 1 and _running(server) == 0
    k = len(pending.tokens)
    assert 0 < k < 300
    new = load_model("builtin:tiny", seed=1).state_dict()
    with torch.no_grad():
        engine.model.load_state_dict(new)
    server.resume(version=1)
    out = pending.result(timeout=120)
    assert out.token_ids[:k] == before.token_ids[:k]
    rest = _alone(engine, continued(request, out.token_ids[:k], sampling), sampling)
    assert out.token_ids[k:] == rest.token_ids
    assert out.extra["versions"] == [0] * k + [1] * (300 - k)
    assert len(out.logprobs) == 300


def test_a_failed_batch_raises_in_its_callers_and_the_server_goes_on(server, engine, tok):
    """The engine raising (a prompt beyond the model's positions) reaches the callers of that
    batch; the next request is served."""
    sampling = SamplingParams(max_new_tokens=8)
    limit = engine.model.config.max_position_embeddings
    bad = server.submit(GenerationRequest([5] * limit, seed=1), sampling)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        bad.result(timeout=60)
    ok = GenerationRequest(tok.encode("fine"), seed=2)
    assert server.generate([ok], sampling)[0].token_ids == _alone(engine, ok, sampling).token_ids


def test_close_fails_every_waiting_caller_and_takes_no_more(engine, tok):
    """Closing ends the loop: a request queued (the server paused) raises ServerClosed in its
    caller, and a submit after the close raises at once."""
    server = EngineServer(engine)
    server.pause()
    waiting = server.submit(GenerationRequest(tok.encode("x"), seed=1), SamplingParams())
    assert server.close(timeout_s=30)
    with pytest.raises(ServerClosed):
        waiting.result(timeout=5)
    with pytest.raises(ServerClosed):
        server.submit(GenerationRequest(tok.encode("x"), seed=1), SamplingParams())


def test_a_continuous_rollout_s_turns_join_the_running_batch(engine, tok):
    """The agent loop's front in continuous mode (``RequestBatcher(waves=False)``) on the HF
    engine: a turn asked while another decodes joins its batch (one batch for both) and comes
    back first, with what it samples alone and none of the server's own keys."""
    import asyncio

    from rollout.engines.serving.batcher import RequestBatcher

    sampling = SamplingParams(max_new_tokens=200)
    long = GenerationRequest(tok.encode("a long story please"), seed=1, group=0)
    short = GenerationRequest(tok.encode("say 42"), seed=2, group=1, max_new_tokens=5)

    async def both():
        batcher = RequestBatcher(engine, sampling, waves=False)
        order: list[str] = []

        async def ask(name, request, key, delay):
            await asyncio.sleep(delay)
            out = await batcher.generate(request, key)
            order.append(name)
            return out

        try:
            outs = await asyncio.gather(ask("long", long, 0, 0.0), ask("short", short, 1, 0.05))
        finally:
            batcher.close()
        return outs, order, batcher.calls

    (long_out, short_out), order, calls = asyncio.run(both())
    assert order == ["short", "long"] and calls == [2]
    assert short_out.token_ids == _alone(engine, short, sampling).token_ids
    assert long_out.token_ids == _alone(engine, long, sampling).token_ids
    assert "versions" not in short_out.extra and "request_id" not in long_out.extra


class _Recorder:
    """A plain engine (not joinable): records each call's requests (by seed) and answers each
    with its seed as one token, plus a key of its own in ``extra``."""

    max_batch_size = 2

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.gate = threading.Event()

    def generate(self, requests, sampling):
        self.calls.append([r.seed for r in requests])
        assert self.gate.wait(30)
        return [GenerationResult([r.seed], [0.0], "stop", {"engine_key": r.seed}) for r in requests]


def test_a_wave_is_one_engine_call_of_exactly_its_requests_whatever_else_waits(engine, tok):
    """``submit_wave``: the wave's requests, more than the engine's batch holds, go in one
    call, in the order given, as the caller's own ``generate`` would send them; requests
    submitted one by one meanwhile wait for the next batch; a wave's results equal the
    engine's own call on the same list, bit for bit (what identical runs rest on)."""
    recorder = _Recorder()
    server = EngineServer(recorder)
    try:
        sampling = SamplingParams(max_new_tokens=1)
        wave = server.submit_wave([GenerationRequest([1], seed=s) for s in (5, 3, 9)], sampling)
        _until(lambda: len(recorder.calls) == 1)
        single = server.submit(GenerationRequest([1], seed=7), sampling)
        recorder.gate.set()
        assert [p.result(30).token_ids for p in wave] == [[5], [3], [9]]
        assert single.result(30).token_ids == [7]
        assert recorder.calls == [[5, 3, 9], [7]]
        # the engine's own keys come back; the server's stay out of what the engine returned
        assert wave[0].outcome(0).extra == {"engine_key": 5}
        assert set(wave[0].result(0).extra) == {"engine_key", "versions", "request_id"}
    finally:
        server.close(timeout_s=30)

    sampling = SamplingParams(max_new_tokens=6)
    requests = [GenerationRequest(tok.encode("x" * (1 + k)), seed=40 + k) for k in range(3)]
    server = EngineServer(engine)
    try:
        served = [p.result(60) for p in server.submit_wave(requests, sampling)]
    finally:
        server.close(timeout_s=30)
    direct = engine.generate(requests, sampling)
    assert [r.token_ids for r in served] == [r.token_ids for r in direct]
    assert [r.logprobs for r in served] == [r.logprobs for r in direct]


class _GroupRecorder(_Recorder):
    """``_Recorder`` that records the group of every request it is sent; ``abortable`` as
    given (an engine that ends one request alone by ``abort_groups``)."""

    def __init__(self, abortable: bool) -> None:
        super().__init__()
        self.abortable, self.groups = abortable, []
        self.gate.set()

    def generate(self, requests, sampling, **_):
        self.groups.append([r.group for r in requests])
        return super().generate(requests, sampling)


@pytest.mark.parametrize("abortable", [False, True])
def test_an_engine_below_the_server_sees_each_prompt_s_own_group_unless_it_aborts_by_slot(
    abortable,
):
    """A stream's engine (``VersionedEngine``, not abortable) counts tokens, routes and aborts
    by the prompt's group, so the server must hand each request on with its own group; the
    server renumbered them by batch slot, and a continuous stream (``run.deterministic=false``)
    then aborted the wrong prompts: once prompts 0..7 were aborted for staleness, every new
    group's first request (slots 0..7) was aborted too, for ever. An engine that ends one
    request alone (``abort_groups``) gets the slot, which is how the server names it."""
    recorder = _GroupRecorder(abortable)
    server = EngineServer(recorder)
    try:
        sampling = SamplingParams(max_new_tokens=1)
        pending = [
            server.submit(GenerationRequest([1], seed=s, group=40 + s), sampling) for s in (1, 2)
        ]
        assert [p.result(30).token_ids for p in pending] == [[1], [2]]
    finally:
        server.close(timeout_s=30)
    if abortable:  # each call's slots, from 0
        assert all(call == list(range(len(call))) for call in recorder.groups)
    else:
        assert [g for call in recorder.groups for g in call] == [41, 42]


@pytest.mark.parametrize("deterministic", [False, True], ids=["continuous", "waves"])
def test_a_stream_counts_each_prompt_s_tokens_under_that_prompt(engine, tok, deterministic):
    """Through the agent loop's servers, a stream's engine counts what a prompt sampled under
    that prompt (what the staleness bound and its aborts read), in both admission orders."""
    from rollout.agent_loop import run_rollouts
    from rollout.envs import make_env
    from rollout.envs.prompts import PromptItem
    from rollout.versioned import VersionedEngine

    versioned = VersionedEngine(engine, version=3, partial=True)
    try:
        out = run_rollouts(
            versioned,
            tok,
            make_env("recall"),
            [PromptItem(42, 7)],
            n=4,
            max_turns=2,
            step_wise=True,
            merge_stepwise=False,
            max_input_len=128,
            max_new_tokens=4,
            deterministic=deterministic,
        )
        sampled = sum(sum(r.response_mask) for r in out.rows)
        assert sampled > 0
        assert all(versioned.tokens_of(g) == {} for g in range(4))  # no slot counted as a prompt
        counted = versioned.tokens_of(42)
        assert set(counted) == {3} and counted[3] >= sampled
    finally:
        versioned.close(timeout_s=30)
