"""A stream's engine side (``rollout.versioned.VersionedEngine``): every live group's turns in
one engine call per replica, a group that no step can take any more aborted mid-call and at
its next call, and its prompt dropped or sampled again (``train.stale_prompts``)."""

from __future__ import annotations

import threading

import pytest

from rollout.engines.base import GenerationRequest, GenerationResult, SamplingParams
from rollout.streaming import StreamSampler, VersionedEngine
from tests.test_streaming import _Engine, _until


class _Replica:
    """Holds each call until ``gate`` opens (so callers pile up), records every call's
    prompts (by seed: ``_ask`` seeds a group's requests with its number, and an engine server
    numbers its batch's requests in ``group``); with ``interruptible``, polls ``interrupt``
    while held."""

    def __init__(self, name: str, gate: threading.Event, interruptible: bool = False) -> None:
        self.name, self.gate, self.interruptible = name, gate, interruptible
        self.first_gate = gate  # the first call's
        self.calls: list[list[int]] = []

    def generate(self, requests, sampling, interrupt=None):
        self.calls.append([r.seed for r in requests])
        gate = self.first_gate if len(self.calls) == 1 else self.gate
        while not gate.wait(0.01):
            if interrupt is not None and interrupt():
                return [GenerationResult([4], [0.0], "interrupted") for _ in requests]
        return [GenerationResult([1, 2, 3], [0.0] * 3, "length") for _ in requests]


class _Replicas:
    """Two replicas behind one engine, prompt g on lane g % 2 (as the router deals them)."""

    def __init__(self, replicas) -> None:
        self.replicas = replicas

    def lanes(self):
        return self.replicas

    def lane_of(self, group: int) -> int:
        return group % len(self.replicas)


def _ask(engine, group: int, out: dict) -> threading.Thread:
    def run():
        try:
            out[group] = engine.generate(
                [GenerationRequest([1], seed=group, group=group)] * 2, SamplingParams()
            )
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out[group] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_every_live_groups_turns_go_in_one_call_per_replica():
    """Groups asking at once while a replica is busy are sent together in its next call, each
    replica (lane) on its own; every caller gets its own results back."""
    gate = threading.Event()
    a, b = _Replica("a", gate), _Replica("b", gate)
    versioned = VersionedEngine(_Replicas([a, b]))
    out: dict = {}
    first = [_ask(versioned, 0, out), _ask(versioned, 1, out)]
    _until(lambda: len(a.calls) == 1 and len(b.calls) == 1)  # both lanes busy at once
    rest = [_ask(versioned, g, out) for g in (2, 3, 4, 5, 6)]
    _until(lambda: sum(lane.server.queued() for lane in versioned._lanes) == 10)  # 5 x 2
    gate.set()
    for thread in first + rest:
        thread.join(5)
    assert a.calls == [[0, 0], [2, 2, 4, 4, 6, 6]] and b.calls == [[1, 1], [3, 3, 5, 5]]
    assert versioned.call_sizes == [2, 2, 6, 4] or sorted(versioned.call_sizes) == [2, 2, 4, 6]
    assert all(len(out[g]) == 2 and out[g][0].token_ids == [1, 2, 3] for g in range(7))
    assert versioned.tokens_of(4) == {0: 6} and versioned.generated_tokens == 42


def test_a_group_too_stale_for_any_step_is_aborted_mid_call_and_at_its_next_call():
    """``abort_older_than``: the call holding an aborted group ends after its decode step
    (an interruptible replica), the group's caller gets GroupAborted, the other group of that
    call goes on; a later call of the aborted group raises at once."""
    from rollout.streaming import GroupAborted

    gate = threading.Event()
    replica = _Replica("a", gate, interruptible=True)
    replica.first_gate = threading.Event()
    versioned = VersionedEngine(replica, version=0)
    versioned._tokens[3] = {0: 5}  # group 3 sampled under version 0 before
    out: dict = {}
    threads = [_ask(versioned, 9, out)]  # the replica busy: the next two wait together
    _until(lambda: len(replica.calls) == 1)
    threads += [_ask(versioned, 3, out), _ask(versioned, 8, out)]
    _until(lambda: versioned._lanes[0].server.queued() == 4)  # two groups, two each
    replica.first_gate.set()
    _until(lambda: len(replica.calls) == 2)
    assert sorted(replica.calls[1]) == [3, 3, 8, 8]  # one call for both groups
    threads[0].join(5)
    assert versioned.tokens_of(9) == {0: 6}  # finished: its sampler took its counts
    assert versioned.abort_older_than(1) == [3]
    _until(lambda: len(replica.calls) == 3)  # ended early; group 8 goes on, 3 does not
    gate.set()
    for thread in threads:
        thread.join(5)
    assert isinstance(out[3], GroupAborted) and out[3].group == 3
    assert [r.token_ids for r in out[8]] == [[4, 1, 2, 3]] * 2  # continued after the cut
    from rollout.engines.serving.requests import continued

    after_cut = continued(GenerationRequest([1], seed=8, group=8), [4], SamplingParams())
    assert replica.calls[2] == [after_cut.seed] * 2 and versioned.interruptions == 1
    with pytest.raises(GroupAborted):
        versioned.generate([GenerationRequest([1], seed=0, group=3)], SamplingParams())
    # its tokens, the cut call's two included, are what its sampler discards
    assert versioned.tokens_of(3) == {0: 7} and versioned.tokens_of(8) == {0: 8}
    assert versioned.abort_older_than(1) == []  # nothing in flight any more


@pytest.mark.parametrize("retry", [False, True], ids=["drop", "retry"])
def test_an_aborted_group_frees_its_slot_and_its_prompt_is_dropped_or_sampled_again(retry):
    engine = VersionedEngine(_Engine())
    stale = threading.Event()
    attempts: list[int] = []

    def sample_group(ordinal):
        attempts.append(ordinal)
        request = [GenerationRequest(prompt_ids=[1], seed=0, group=ordinal)]
        engine.generate(request, SamplingParams())
        if ordinal == 0 and attempts.count(0) == 1:
            stale.wait(5)  # sampled under version 0, still running when version 2 is due
            engine.generate(request, SamplingParams())
        return f"group {ordinal}"

    sampler = StreamSampler(sample_group, engine, workers=2, allowed=lambda: 2, retry=retry)
    try:
        taken, _, _ = sampler.take(1, min_version=0, timeout_s=10)
        assert taken[0].ordinal == 1
        engine.load(lambda: None, 2)  # a weight load, nothing to load
        _until(lambda: engine._tokens.get(0) == {0: 3})
        threading.Timer(0.2, stale.set).start()
        taken, dropped, _ = sampler.take(1, min_version=2, timeout_s=10)
        aborted = sampler.take_aborted()
        assert [g.ordinal for g in aborted] == [0] and aborted[0].tokens == {0: 3}
        assert aborted[0].output is None and not dropped
        assert taken[0].ordinal == (0 if retry else 2)  # the prompt again, or the next one
        assert attempts.count(0) == (2 if retry else 1)
    finally:
        sampler.stop()
