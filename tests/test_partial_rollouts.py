"""Partial rollouts at decode-step granularity (``rollout.partial_rollout``): a weight load
interrupts the engine call in flight after its current decode step, and the requests still
running go on from their prefix under the new weights, their KV cache recomputed; every token
records the policy version that sampled it, and its log-prob is that policy's own."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from batching.rows import Row, pack_rows
from rollout.engines import GenerationRequest, SamplingParams, make_engine
from rollout.engines.base import GenerationResult
from rollout.models import load_model
from rollout.streaming import VersionedEngine
from rollout.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin")


@pytest.fixture()
def model(tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSRL_CACHE", str(tmp_path / "cache"))
    return load_model("builtin:tiny", seed=0)


def _teacher_forced(model, prompt, tokens):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(tokens)]


def _load_after_forwards(model, versioned, count, new_state):
    """A thread that asks for a weight load once ``model`` has run ``count`` forwards."""
    forwards = []
    hook = model.register_forward_hook(lambda *_: forwards.append(1))

    def load():
        while len(forwards) < count:
            time.sleep(0.001)
        versioned.load(lambda: model.load_state_dict(new_state), 1)

    thread = threading.Thread(target=load)
    thread.start()
    return thread, hook


@pytest.mark.parametrize("partial", [True, False])
def test_a_load_lands_mid_call_with_partial_rollouts_and_after_it_without(model, tok, partial):
    engine = make_engine("hf", model, tok)
    versioned = VersionedEngine(engine, version=0, partial=partial)
    old = {k: v.clone() for k, v in model.state_dict().items()}
    new = {
        k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in old.items()
    }
    requests = [
        GenerationRequest(prompt_ids=tok.encode(text), seed=3 + i, group=i)
        for i, text in enumerate(["say 42", "what is 3+4=?"])
    ]
    sampling = SamplingParams(max_new_tokens=24)
    thread, hook = _load_after_forwards(model, versioned, 6, new)
    try:
        results = versioned.generate(requests, sampling)
    finally:
        thread.join(10)
        hook.remove()
    assert versioned.version == 1
    for request, out in zip(requests, results):
        versions = out.extra["versions"]
        assert len(out.token_ids) == len(out.logprobs) == len(versions) == 24
        assert out.finish_reason == "length" and versions == sorted(versions)
        if not partial:  # the load waited for the call: every token from the old weights
            assert set(versions) == {0}
            continue
        cut = versions.index(1)  # a few decode steps in, the rest under the new weights
        assert 0 < cut < 24
        model.load_state_dict(old)
        before = _teacher_forced(model, request.prompt_ids, out.token_ids[:cut])
        model.load_state_dict(new)
        after = _teacher_forced(model, request.prompt_ids, out.token_ids)[cut:]
        # each token's log-prob is the policy's that sampled it: the prefix was prefilled
        # again under the new weights, no KV cache kept from the old ones
        assert max(abs(a - b) for a, b in zip(before + after, out.logprobs)) < 1e-4
    assert versioned.interruptions == (1 if partial else 0)
    counts = {0: 0, 1: 0}
    for i in range(2):
        for version, n in versioned.tokens_of(i).items():
            counts[version] += n
    assert sum(counts.values()) == 48 and (counts[1] > 0) == partial


class _Plain:
    """An engine without ``interrupt``: one token per call, slowly; ``called`` once in one."""

    def __init__(self) -> None:
        self.called = threading.Event()

    def generate(self, requests, sampling):
        self.called.set()
        time.sleep(0.05)
        return [GenerationResult([5] * sampling.max_new_tokens, [0.0] * 3, "length")] * len(
            requests
        )


def test_an_engine_that_cannot_be_interrupted_keeps_its_call_whole():
    engine = _Plain()
    versioned = VersionedEngine(engine, version=0, partial=True)
    assert not versioned.partial  # partial asked, but the engine cannot stop mid-call
    request = [GenerationRequest(prompt_ids=[1], seed=0, group=0)]
    # the load is asked while the call runs
    loader = threading.Thread(target=lambda: (engine.called.wait(5), versioned.load(lambda: 0, 1)))
    loader.start()
    (out,) = versioned.generate(request, SamplingParams(max_new_tokens=3))
    loader.join(5)
    assert out.extra["versions"] == [0, 0, 0] and versioned.version == 1


def test_a_batch_carries_each_tokens_policy_version_where_rows_have_one():
    rows = [
        Row([1, 2], [3, 4, 5], [1, 0, 1], [-0.1, 0.0, -0.2], 0, 0, response_versions=[2, -1, 3]),
        Row([1], [6], [1], [-0.3], 1, 1),
    ]
    tokens, _, _ = pack_rows(rows)
    assert tokens["policy_version"].tolist() == [-1, -1, 2, -1, 3, -1, -1]
    assert "policy_version" not in pack_rows(rows[1:])[0]  # not streamed: no such column
    with pytest.raises(ValueError, match=r"rows\[0\].response_versions has 2 entries"):
        pack_rows([Row([1], [3, 4, 5], [1, 1, 1], [0.0] * 3, 0, 0, response_versions=[1, 2])])
