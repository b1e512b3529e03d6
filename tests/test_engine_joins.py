"""Issue 57's engine loop: requests join a running engine call between decode steps
(``Engine.joinable``; the HF engine's step loop, ``rollout.engines.hf.steps``; the stream's
lanes through their engine server, ``rollout.engines.serving.server``) and each comes back as soon as
it ends. A joined request
draws the tokens it draws alone (its own seeded sampler), loads and aborts reach it as any
other request of the call."""

from __future__ import annotations

import threading
import time

import pytest

from rollout.engines import GenerationRequest, SamplingParams, make_engine
from rollout.models import load_model
from rollout.streaming import GroupAborted, VersionedEngine
from rollout.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin")


@pytest.fixture()
def model(tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSRL_CACHE", str(tmp_path / "cache"))
    return load_model("builtin:tiny", seed=0)


def _until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


def _alone(engine, request: GenerationRequest, sampling: SamplingParams):
    return engine.generate([request], sampling)[0]


def test_requests_join_the_hf_engine_s_running_call_and_draw_what_they_draw_alone(model, tok):
    """Requests admitted after the 2nd and the 8th decode step (one of a new prompt, two
    samples of a shared one, budgets of their own) join the batch; each samples, token for
    token, what it samples in a call of its own, and every request is reported as it ends,
    in the order they end, before the call returns."""
    engine = make_engine("hf", model, tok)
    sampling = SamplingParams(max_new_tokens=20)
    given = [
        GenerationRequest(tok.encode("a much longer prompt to force left padding here"), seed=1),
        GenerationRequest(tok.encode("x"), seed=2, max_new_tokens=6),
    ]
    late = [
        GenerationRequest(tok.encode("what is 3+4=? tell me now"), seed=3, max_new_tokens=8),
        GenerationRequest(tok.encode("say 42"), seed=4),
        GenerationRequest(tok.encode("say 42"), seed=5, max_new_tokens=15),
    ]
    polls, rooms, reported = [], [], []

    def admit(room):
        polls.append(1)
        rooms.append(room)
        return {3: late[:1], 9: late[1:]}.get(len(polls), [])

    out = engine.generate(
        given, sampling, admit=admit, on_result=lambda i, r: reported.append((i, len(r.token_ids)))
    )
    assert [len(r.token_ids) for r in out] == [20, 6, 8, 20, 15]
    assert reported == [(1, 6), (2, 8), (0, 20), (4, 15), (3, 20)]  # in the order they end
    assert rooms[0] == engine.max_batch_size - 2
    for request, result in zip(given + late, out):
        alone = _alone(engine, request, sampling)
        assert result.token_ids == alone.token_ids
        assert result.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
        assert result.finish_reason == "length"


def test_a_request_joining_an_emptied_batch_keeps_the_call_going(model, tok):
    """Every row ended and one request admitted at that moment: the call goes on with it
    alone (a fresh batch) instead of returning."""
    engine = make_engine("hf", model, tok)
    sampling = SamplingParams(max_new_tokens=4)
    late = GenerationRequest(tok.encode("say 42"), seed=9, max_new_tokens=7)
    polls = []

    def admit(room):
        polls.append(1)
        return [late] if len(polls) == 4 else []  # after the 4th token: the batch is done

    out = engine.generate([GenerationRequest(tok.encode("x"), seed=8)], sampling, admit=admit)
    assert [len(r.token_ids) for r in out] == [4, 7]
    assert out[1].token_ids == _alone(engine, late, sampling).token_ids


def _stream(model, tok, **kwargs):
    """The HF engine on ``model`` and a ``VersionedEngine`` over it (one joinable lane, which
    an engine server serves)."""
    engine = make_engine("hf", model, tok)
    versioned = VersionedEngine(engine, **kwargs)
    return engine, versioned


def _server(versioned):
    return versioned._lanes[0].server


def _asked(versioned) -> bool:
    """A request waits in the lane's server, or has joined its running batch."""
    server = _server(versioned)
    return bool(server.queued() or server.joined)


def _busy(versioned) -> bool:
    """The lane's server is in a decode batch."""
    server = _server(versioned)
    with server._cond:
        return bool(server._slots)


def _gate(model, forwards: int):
    """A hook that holds the model after ``forwards`` forwards until the returned event is
    set; the list counts forwards."""
    count, release = [], threading.Event()

    def hook(*_):
        count.append(1)
        if len(count) == forwards:
            assert release.wait(60)

    return model.register_forward_hook(hook), release, count


def _ask(versioned, requests, sampling, finished):
    out: dict = {}

    def run():
        try:
            out["value"] = versioned.generate(requests, sampling)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc
        finished.append(requests[0].group)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_turn_submitted_while_a_call_runs_joins_it_and_comes_back_first(model, tok):
    """A long request runs; a short one asked meanwhile joins the same engine call (one call,
    not two), comes back while the long one still decodes, and samples what it samples
    alone."""
    engine, versioned = _stream(model, tok)
    sampling = SamplingParams(max_new_tokens=40)
    long = [GenerationRequest(tok.encode("a long story please"), seed=1, group=0)]
    short = [GenerationRequest(tok.encode("say 42"), seed=2, group=1, max_new_tokens=5)]
    hook, release, _ = _gate(model, 3)
    finished: list[int] = []
    try:
        first = _ask(versioned, long, sampling, finished)
        _until(lambda: _busy(versioned))
        second = _ask(versioned, short, sampling, finished)
        _until(lambda: _asked(versioned))  # queued while the call runs (or joined already)
        release.set()
        for thread, _ in (first, second):
            thread.join(60)
        versioned.close(60)  # the servers' batches counted (on_batch) before they are read
    finally:
        hook.remove()
    assert finished == [1, 0]  # the short turn came back before the call's slowest request
    assert versioned.call_sizes == [2]  # one engine call carried both
    assert [len(r.token_ids) for r in first[1]["value"] + second[1]["value"]] == [40, 5]
    assert second[1]["value"][0].token_ids == _alone(engine, short[0], sampling).token_ids
    assert first[1]["value"][0].token_ids == _alone(engine, long[0], sampling).token_ids
    assert versioned.tokens_of(1) == {0: 5}


def test_an_abort_ends_a_joined_group_and_the_call_goes_on(model, tok):
    """Group 1 joins the call of group 0, then is aborted (too stale): its caller raises
    ``GroupAborted``, group 0 finishes its tokens in the same call."""
    engine, versioned = _stream(model, tok)
    sampling = SamplingParams(max_new_tokens=400)  # group 1 still runs when it is aborted
    versioned._tokens[1] = {0: 3}  # group 1 sampled under version 0 before
    hook, release, count = _gate(model, 3)
    finished: list[int] = []
    try:
        long = [GenerationRequest([5, 17, 33], 1, group=0, max_new_tokens=200)]
        first = _ask(versioned, long, sampling, finished)
        _until(lambda: _busy(versioned))
        second = _ask(versioned, [GenerationRequest([40, 41], 2, group=1)], sampling, finished)
        _until(lambda: _asked(versioned))
        release.set()
        _until(lambda: _server(versioned).joined)  # joined
        at = len(count)
        assert versioned.abort_older_than(1) == [1]
        for thread, _ in (first, second):
            thread.join(60)
        versioned.close(60)  # the servers' batches counted (on_batch) before they are read
    finally:
        hook.remove()
    assert isinstance(second[1].get("error"), GroupAborted)
    assert len(first[1]["value"][0].token_ids) == 200 and at < 200
    assert versioned.call_sizes == [2] and versioned.group_aborts == 1
    assert versioned.interruptions == 0


def test_a_load_with_partial_rollouts_ends_a_call_with_joined_requests(model, tok):
    """A load waits while a joined request runs: the call ends after its decode step (nothing
    joins meanwhile), the weights load, and both requests go on under the new version; every
    token carries the version that sampled it."""
    engine, versioned = _stream(model, tok, partial=True)
    sampling = SamplingParams(max_new_tokens=30)
    hook, release, count = _gate(model, 3)
    finished: list[int] = []
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        first = _ask(versioned, [GenerationRequest([5, 17, 33], 1, group=0)], sampling, finished)
        _until(lambda: _busy(versioned))
        second = _ask(versioned, [GenerationRequest([40, 41], 2, group=1)], sampling, finished)
        _until(lambda: _asked(versioned))
        release.set()
        _until(lambda: _server(versioned).joined and len(count) >= 8)
        versioned.load(lambda: model.load_state_dict(state), 1)
        for thread, _ in (first, second):
            thread.join(60)
        versioned.close(60)  # the servers' batches counted (on_batch) before they are read
    finally:
        hook.remove()
    for _, out in (first, second):
        result = out["value"][0]
        assert len(result.token_ids) == 30 and result.finish_reason == "length"
        versions = result.extra["versions"]
        assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    assert versioned.call_sizes[0] == 2 and versioned.interruptions == 1
