"""HF engine: logprobs match a teacher-forced forward, sampling is per-request deterministic."""

from __future__ import annotations

import pytest
import torch

from rollout.engines import GenerationRequest, SamplingParams, make_engine
from rollout.engines.hf.engine import filter_logits, sample_inverse_cdf
from rollout.models import load_model
from rollout.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("CROSSRL_CACHE", str(tmp_path_factory.mktemp("cache")))
    try:
        yield load_model("builtin:tiny", seed=0)
    finally:
        mp.undo()


def _requests(tok):
    texts = ["say 42", "what is 3+4=?", "a much longer prompt to force left padding here", "x"]
    return [GenerationRequest(prompt_ids=tok.encode(t), seed=11 + i) for i, t in enumerate(texts)]


def _teacher_forced(model, prompt, tokens, temperature):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(tokens)]


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 20)])
def test_logprobs_match_teacher_forcing(model, tok, temperature, top_p, top_k):
    engine = make_engine("hf", model, tok)
    sampling = SamplingParams(max_new_tokens=10, temperature=temperature, top_p=top_p, top_k=top_k)
    reqs = _requests(tok)
    for req, out in zip(reqs, engine.generate(reqs, sampling)):
        assert len(out.token_ids) == len(out.logprobs) == 10
        assert out.finish_reason == "length"
        expected = _teacher_forced(model, req.prompt_ids, out.token_ids, temperature)
        assert max(abs(a - b) for a, b in zip(expected, out.logprobs)) < 1e-4


def test_samples_do_not_depend_on_batch_composition(model, tok):
    engine = make_engine("hf", model, tok)
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0)
    reqs = _requests(tok)
    together = engine.generate(reqs, sampling)
    alone = [engine.generate([r], sampling)[0] for r in reqs]
    reordered = engine.generate(reqs[::-1], sampling)[::-1]
    small_batches = make_engine("hf", model, tok, max_batch_size=1).generate(reqs, sampling)
    for a, b, c, d in zip(together, alone, reordered, small_batches):
        assert a.token_ids == b.token_ids == c.token_ids == d.token_ids
    # Different seeds sample differently (12 tokens from ~100: a collision would be a bug).
    other = engine.generate([GenerationRequest(reqs[0].prompt_ids, seed=999)], sampling)[0]
    assert other.token_ids != together[0].token_ids


def test_stop_tokens_end_generation(model, tok):
    engine = make_engine("hf", model, tok)
    reqs = _requests(tok)
    free = engine.generate(reqs, SamplingParams(max_new_tokens=12))
    # Stop on the 3rd sampled token of request 0: it ends there with reason "stop".
    stop_tok = free[0].token_ids[2]
    out = engine.generate(reqs, SamplingParams(max_new_tokens=12, stop_token_ids=(stop_tok,)))
    first = free[0].token_ids.index(stop_tok)
    assert out[0].token_ids == free[0].token_ids[: first + 1]
    assert out[0].finish_reason == "stop"
    for res in out:
        if stop_tok in res.token_ids:
            assert res.token_ids[-1] == stop_tok and res.token_ids.count(stop_tok) == 1
        else:
            assert res.finish_reason == "length" and len(res.token_ids) == 12


def test_top_k_one_is_greedy(model, tok):
    engine = make_engine("hf", model, tok)
    req = _requests(tok)[1]
    out = engine.generate([req], SamplingParams(max_new_tokens=6, top_k=1))[0]
    ids = list(req.prompt_ids)
    for t in out.token_ids:
        with torch.no_grad():
            assert t == int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(t)


def test_update_weights_switches_policy(model, tok, tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSRL_CACHE", str(tmp_path))
    policy = load_model("builtin:tiny", seed=0)
    target = load_model("builtin:tiny", seed=5)
    engine = make_engine("hf", policy, tok)
    # Two buckets, as a trainer streaming weights would send them.
    items = list(target.state_dict().items())
    engine.update_weights(items[: len(items) // 2])
    engine.update_weights(items[len(items) // 2 :])
    req = _requests(tok)[0]
    out = engine.generate([req], SamplingParams(max_new_tokens=8))[0]
    expected = _teacher_forced(target, req.prompt_ids, out.token_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(expected, out.logprobs)) < 1e-4
    with pytest.raises(ValueError, match="not.a.param"):
        engine.update_weights([("not.a.param", torch.zeros(1))])


def test_sleep_wake_and_errors(model, tok):
    engine = make_engine("hf", model, tok)
    engine.sleep()
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.generate(_requests(tok), SamplingParams())
    engine.wake_up()
    assert len(engine.generate(_requests(tok)[:1], SamplingParams(max_new_tokens=2))) == 1
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        engine.generate([GenerationRequest(prompt_ids=[], seed=0)], SamplingParams())
    with pytest.raises(ValueError, match="rollout.engine"):
        make_engine("nope", model, tok)


def test_filters_and_inverse_cdf():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    assert torch.isinf(filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [
        [False, False, True, True, True]
    ]
    probs = torch.softmax(logits, -1)
    # top_p just above the top token's mass keeps exactly two tokens.
    kept = ~torch.isinf(filter_logits(logits, top_k=0, top_p=float(probs[0, 0]) + 1e-3))
    assert kept.tolist() == [[True, True, False, False, False]]
    masked = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]])
    draws = sample_inverse_cdf(masked.expand(5, -1), torch.tensor([0.0, 0.25, 0.49, 0.5, 0.9999]))
    assert draws.tolist() == [1, 1, 1, 3, 3]


def _grouped_requests(tok, samples=4):
    """GRPO-shaped requests: each prompt continued by ``samples`` requests with their own seeds;
    prompts of different lengths, so the shared prefill is left-padded too."""
    texts = ["say 42", "what is 3+4=?", "a much longer prompt to force left padding here"]
    return [
        GenerationRequest(prompt_ids=tok.encode(t), seed=100 * p + k, group=p)
        for p, t in enumerate(texts)
        for k in range(samples)
    ]


def test_samples_of_a_prompt_share_one_prefill(model, tok):
    """The samples of a prompt are prefilled once (the first forward sees each distinct prompt
    once) and still sample, token for token, what each would sample alone; logprobs agree
    within float tolerance and match a teacher-forced forward."""
    engine = make_engine("hf", model, tok)
    reqs = _grouped_requests(tok)
    prefill_rows = []
    hook = model.register_forward_hook(
        lambda module, args, kwargs, out: prefill_rows.append(kwargs["input_ids"].shape),
        with_kwargs=True,
    )
    try:
        sampling = SamplingParams(max_new_tokens=10)
        together = engine.generate(reqs, sampling)
    finally:
        hook.remove()
    assert prefill_rows[0][0] == 3 and all(rows == 12 for rows, _ in prefill_rows[1:])
    alone = [engine.generate([r], sampling)[0] for r in reqs]
    for req, a, b in zip(reqs, together, alone):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
        expected = _teacher_forced(model, req.prompt_ids, a.token_ids, 1.0)
        assert max(abs(x - y) for x, y in zip(expected, a.logprobs)) < 1e-4
    # The samples of one prompt differ from each other (their own seeds, not a shared stream).
    assert len({tuple(r.token_ids) for r in together[:4]}) > 1


def test_finished_rows_leave_the_batch_without_changing_the_rest(model, tok):
    """Many stop tokens end most rows early (they leave the decode batch); the rows that go
    on sample what they sample alone, and their logprobs match a teacher-forced forward."""
    engine = make_engine("hf", model, tok)
    reqs = _grouped_requests(tok, samples=6)
    free = engine.generate(reqs, SamplingParams(max_new_tokens=12))
    # Stop on a third of the vocabulary: rows end at many different steps.
    stops = tuple(range(0, model.config.vocab_size, 3))
    sampling = SamplingParams(max_new_tokens=12, stop_token_ids=stops)
    rows = []
    hook = model.register_forward_hook(
        lambda module, args, kwargs, out: rows.append(kwargs["input_ids"].shape[0]),
        with_kwargs=True,
    )
    try:
        out = engine.generate(reqs, sampling)
    finally:
        hook.remove()
    assert rows[0] == 3 and rows[-1] < rows[1] <= 18  # decode forwards shrink as rows finish
    lengths = {len(r.token_ids) for r in out}
    assert len(lengths) >= 3 and min(lengths) < 12
    for req, res, full in zip(reqs, out, free):
        assert res.token_ids == full.token_ids[: len(res.token_ids)]
        if res.finish_reason == "stop":
            assert res.token_ids[-1] in stops
        assert res.token_ids == engine.generate([req], sampling)[0].token_ids
        expected = _teacher_forced(model, req.prompt_ids, res.token_ids, 1.0)
        assert max(abs(x - y) for x, y in zip(expected, res.logprobs)) < 1e-4


def test_a_common_head_of_the_prompts_is_prefilled_once(model, tok):
    """Distinct prompts that open alike (a long system prompt) share one forward of that
    head; each still samples what it samples alone, with logprobs that match a teacher-forced
    forward, whatever the length of the rest (its padding sits between head and rest)."""
    system = "You are a careful assistant. Answer with the number only, no words. " * 2
    questions = ["say 42", "what is 3+4=?", "x", "a longer question to pad the others"]
    reqs = [
        GenerationRequest(prompt_ids=tok.encode(system + q), seed=7 + i, group=i)
        for i, q in enumerate(questions)
        for _ in range(2)
    ]
    head = len(tok.encode(system))
    assert head * (len(questions) - 1) >= 256  # enough to share (hf_engine's threshold)
    engine = make_engine("hf", model, tok)
    shapes = []
    hook = model.register_forward_hook(
        lambda module, args, kwargs, out: shapes.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    sampling = SamplingParams(max_new_tokens=8)
    try:
        together = engine.generate(reqs, sampling)
    finally:
        hook.remove()
    assert shapes[0][0] == 1 and shapes[0][1] >= head - 2  # the head, once
    assert shapes[1][0] == len(questions)  # then each distinct rest
    for req, res in zip(reqs, together):
        assert res.token_ids == engine.generate([req], sampling)[0].token_ids
        expected = _teacher_forced(model, req.prompt_ids, res.token_ids, 1.0)
        assert max(abs(x - y) for x, y in zip(expected, res.logprobs)) < 1e-4
