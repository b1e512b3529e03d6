"""``rollout.moe_routing``: the controlled router returns what each supported family's own
forward returns, to the bit; replay routes as told and counts the layers that would have
routed otherwise; a checkpointed layer's recompute routes as its forward did."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from rollout.models import load_model
from rollout.moe_routing import (
    ROUTE_DTYPE,
    RouterPass,
    checkpoint_contexts,
    control_routers,
    moe_routers,
    recording,
    replaying,
)


def _router(family: str, norm: bool) -> torch.nn.Module:
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = {
        "qwen3_moe": "Qwen3MoeTopKRouter",
        "qwen2_moe": "Qwen2MoeTopKRouter",
        "olmoe": "OlmoeTopKRouter",
    }[family]
    config = types.SimpleNamespace(
        num_experts_per_tok=3, num_experts=16, norm_topk_prob=norm, hidden_size=24
    )
    router = getattr(module, cls)(config)
    with torch.no_grad():
        router.weight.normal_(generator=torch.Generator().manual_seed(0))
    return router


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "olmoe"])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_controlled_router_equals_the_familys_own_forward(family, norm, dtype):
    router = _router(family, norm).to(dtype)
    x = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(1)).to(dtype)
    x_own, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    own = router(x_own)
    grads_own = torch.autograd.grad(own[1].float().square().sum(), [x_own, router.weight])
    router.crossrl_moe_layer = 0
    router.forward = types.MethodType(
        __import__("rollout.moe_routing", fromlist=["_routed_forward"])._routed_forward, router
    )
    ours = router(x_ours)
    grads_ours = torch.autograd.grad(ours[1].float().square().sum(), [x_ours, router.weight])
    for a, b in zip(own, ours, strict=True):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)
    for a, b in zip(grads_own, grads_ours, strict=True):
        assert torch.equal(a, b)


def _tiny_moe():
    model = load_model("builtin:tiny-moe", seed=0)
    assert control_routers(model) == len(moe_routers(model)) == model.config.num_hidden_layers - 1
    return model


def _ids(tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 100, (1, tokens), generator=torch.Generator().manual_seed(seed))


def test_recording_gives_each_moe_layers_choice_and_replaying_them_changes_nothing():
    model = _tiny_moe()
    ids = _ids(13)
    sink: list[torch.Tensor] = []
    with torch.no_grad(), recording(sink):
        plain = model(input_ids=ids).logits
    assert len(sink) == len(moe_routers(model))
    routes = torch.stack([c.transpose(0, 1) for c in sink]).to(ROUTE_DTYPE) + 1  # [L, K, N]
    with torch.no_grad(), replaying(RouterPass(routes)) as flips:
        again = model(input_ids=ids).logits
    assert torch.equal(plain, again)
    assert torch.equal(flips.flip_share(13, torch.device("cpu")), torch.zeros(13))


def test_replay_routes_as_told_counts_flips_and_leaves_unrouted_tokens_alone():
    model = _tiny_moe()
    ids = _ids(11, seed=3)
    sink: list[torch.Tensor] = []
    with torch.no_grad(), recording(sink):
        plain = model(input_ids=ids).logits
    routes = torch.stack([c.transpose(0, 1) for c in sink]).to(ROUTE_DTYPE) + 1
    told = routes.clone()
    experts = model.config.num_experts
    told[0, :, 4] = (told[0, :, 4] % experts) + 1  # token 4, first MoE layer: other experts
    told[:, :, 9] = 0  # token 9 routes itself
    seen: list[torch.Tensor] = []
    with torch.no_grad(), replaying(RouterPass(told)) as flips, recording(seen):
        replayed = model(input_ids=ids).logits
    assert torch.equal(seen[0][4], told[0, :, 4].long() - 1)  # the layer took the experts given
    share = flips.flip_share(11, torch.device("cpu"))
    assert share[4] > 0 and share[9] == 0  # flipped at 4; 9 had no route to differ from
    assert torch.equal(share[:4], torch.zeros(4))
    assert torch.equal(replayed[0, :4], plain[0, :4])  # causal: earlier tokens unchanged
    assert not torch.allclose(replayed[0, 4:], plain[0, 4:])


def _checkpointed(reference, context: bool):
    model = _tiny_moe()
    model.load_state_dict(reference.state_dict())
    kwargs = {"use_reentrant": False, **({"context_fn": checkpoint_contexts} if context else {})}
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    return model.train()


def test_a_checkpointed_recompute_routes_as_its_forward_did(monkeypatch):
    """The recompute takes the forward's choice back instead of routing anew. Between forward
    and backward, top-k is made to pick other experts (what a non-deterministic kernel can do
    to a near tie): the gradients still equal the plain backward's, while transformers' own
    checkpointing (no context) routes anew: torch refuses the recompute (other experts save
    other tensors) or the gradients differ."""
    reference = _tiny_moe().train()
    ours, theirs = _checkpointed(reference, True), _checkpointed(reference, False)
    ids = _ids(17, seed=5)
    reference(input_ids=ids).logits.square().mean().backward()
    losses = [m(input_ids=ids).logits.square().mean() for m in (ours, theirs)]
    real_topk, experts = torch.topk, reference.config.num_experts

    def other_experts(*args, **kwargs):
        out = real_topk(*args, **kwargs)
        return types.SimpleNamespace(values=out.values, indices=(out.indices + 1) % experts)

    monkeypatch.setattr(torch, "topk", other_experts)
    losses[0].backward()
    for name, a in reference.named_parameters():
        assert torch.allclose(a.grad, ours.get_parameter(name).grad, atol=1e-6, rtol=1e-5), name
    try:  # the test's teeth: routing anew in the recompute goes wrong
        losses[1].backward()
    except torch.utils.checkpoint.CheckpointError:
        return
    assert any(
        not torch.allclose(a.grad, theirs.get_parameter(name).grad, atol=1e-6, rtol=1e-5)
        for name, a in reference.named_parameters()
    )


# ---------------------------------------------------------------- the HF engine's routing


def test_the_hf_engine_returns_each_requests_routing_as_the_model_routes_its_tokens():
    """Prompts with a shared head (prefilled once), rows that end at different steps and
    requests that join the running batch: each result's routes (prompt and every fed token,
    not the last sampled one, as vLLM's) equal the model's own routing of those tokens."""
    from rollout.engines import GenerationRequest, SamplingParams, make_engine

    engine = make_engine("hf", load_model("builtin:tiny-moe", seed=1), None, routed_experts=True)
    head = list(range(3, 40))  # 37 shared tokens x 11 more prompts: the head is prefilled once
    requests = [GenerationRequest(prompt_ids=head + [50 + i] * (i + 1), seed=i) for i in range(12)]
    late = [GenerationRequest(prompt_ids=[7, 8, 9, 60 + i], seed=100 + i) for i in range(3)]
    waiting = list(late)

    def admit(room: int):
        taken, waiting[:] = waiting[:room], waiting[room:]
        return taken

    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=[5])
    results = engine.generate(requests, sampling, admit=admit)
    assert len(results) == len(requests) + len(late)
    reference = _tiny_moe_seeded(1)
    for request, out in zip([*requests, *late], results, strict=True):
        fed = request.prompt_ids + out.token_ids[:-1]
        routes = out.extra["routed_experts"]
        assert routes.shape == (len(fed), 1, 2) and routes.dtype == np.int16
        sink: list[torch.Tensor] = []
        with torch.no_grad(), recording(sink):
            reference(input_ids=torch.tensor([fed]))
        own = torch.stack(sink, dim=1).to(ROUTE_DTYPE).numpy() + 1
        np.testing.assert_array_equal(routes, own)


def _tiny_moe_seeded(seed: int):
    model = load_model("builtin:tiny-moe", seed=seed)
    control_routers(model)
    return model


def test_an_engine_not_asked_for_routing_returns_none_and_a_dense_model_has_none():
    from rollout.engines import GenerationRequest, SamplingParams, make_engine

    request = [GenerationRequest(prompt_ids=[3, 4, 5], seed=0)]
    sampling = SamplingParams(max_new_tokens=3)
    plain = make_engine("hf", load_model("builtin:tiny-moe", seed=1), None)
    assert "routed_experts" not in plain.generate(request, sampling)[0].extra
    dense = make_engine("hf", load_model("builtin:tiny", seed=1), None, routed_experts=True)
    assert "routed_experts" not in dense.generate(request, sampling)[0].extra


def test_a_mixture_whose_routers_crossrl_cannot_replay_is_refused_by_name():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    model = MixtralForCausalLM(config)
    assert control_routers(model) == 0  # not replayed, not touched
    with pytest.raises(ValueError, match=r"algorithm.routing_replay=rollout: .*MixtralTopKRouter"):
        control_routers(model, required="algorithm.routing_replay=rollout")


# ---------------------------------------------------------------- rows and the batch


def _turn(prompt, response, routes, start=0):
    from rollout.trajectories import Turn

    return Turn(
        prompt_ids=prompt,
        response_ids=response,
        mask=[1] * len(response),
        logprobs=[0.0] * len(response),
        routes=None if routes is None else np.asarray(routes, dtype=np.int16)[:, None, None],
        routes_from=start,
    )


def test_a_rows_routes_come_from_the_first_turn_that_routed_each_token():
    from rollout.trajectories import stitched_routes

    # turn 1 read [1, 2] and sampled [3, 4]; turn 2's request re-read all of it (other routes:
    # a prefill, not the decode that sampled 3) and the observation [9], then sampled [5, 6]
    first = _turn([1, 2], [3, 4], [11, 12, 13])  # no route for its last token (never fed)
    second = _turn([1, 2, 3, 4, 9], [5, 6], [21, 22, 23, 24, 25, 26])
    row = [1, 2, 3, 4, 9, 5, 6]
    got = stitched_routes([first, second], row)[:, 0, 0].tolist()
    assert got == [11, 12, 13, 24, 25, 26, 0]
    # whole mode keeps only what a turn adds (rollout.agent_loop): the same row
    trimmed = _turn([1, 2, 3, 4, 9], [5, 6], [23, 24, 25, 26], start=2)
    assert stitched_routes([first, trimmed], row)[:, 0, 0].tolist() == got
    # a turn counts only where its request agrees with the row (a stop string cut 4 off)
    cut = stitched_routes([first], [1, 2, 3, 8, 8])[:, 0, 0].tolist()
    assert cut == [11, 12, 13, 0, 0]
    assert stitched_routes([_turn([1], [2], None)], [1, 2]) is None


def test_packed_rows_carry_routes_token_axis_last_and_padding_routes_nothing():
    from batching import Row, StepBatch

    def row(n_prompt, n_resp, routes):
        return Row(
            prompt_ids=[1] * n_prompt,
            response_ids=[2] * n_resp,
            response_mask=[1] * n_resp,
            response_logprobs=[0.0] * n_resp,
            uid=0,
            trajectory_id=0,
            routed_experts=routes,
        )

    a = np.arange(1, 1 + 5 * 3 * 2, dtype=np.int16).reshape(5, 3, 2)
    batch = StepBatch.from_rows([row(2, 3, a), row(1, 1, None)])
    routes = batch.token_fields["routed_experts"]
    assert tuple(routes.shape) == (3, 2, 7)
    np.testing.assert_array_equal(routes[..., :5].numpy(), a.transpose(1, 2, 0))
    assert not routes[..., 5:].any()  # a row without routes: the trainer routes it
    padded = batch.select([0, -1])
    assert not padded.token_fields["routed_experts"][..., 5:].any()
    with pytest.raises(ValueError, match=r"rows\[0\].routed_experts has shape \(4, 3, 2\)"):
        StepBatch.from_rows([row(2, 3, a[:4])])


# ---------------------------------------------------------------- vLLM's routing


class _Completion:
    """A vLLM ``CompletionOutput`` as ``result_from_vllm_completion`` reads one."""

    def __init__(self, tokens, routes):
        self.token_ids = tokens
        self.logprobs = [{t: -0.5} for t in tokens]
        self.finish_reason = "length"
        self.stop_reason = None
        self.routed_experts = routes


def test_vllms_routing_becomes_crossrls_the_moe_layers_rows_expert_id_plus_one():
    from rollout.engines.vllm.io import result_from_vllm_completion

    # vLLM 0.24: one row per decoder layer (layer 0 dense: its row unused), uint8 ids
    routes = np.array([[[0, 0], [3, 7], [1, 2]], [[0, 0], [4, 5], [6, 0]]], dtype=np.uint8)
    out = result_from_vllm_completion(_Completion([9, 9], routes), moe_layers=[1, 2])
    got = out.extra["routed_experts"]
    assert got.dtype == np.int16
    np.testing.assert_array_equal(got, [[[4, 8], [2, 3]], [[5, 6], [7, 1]]])
    plain = result_from_vllm_completion(_Completion([9, 9], routes))  # not asked for it
    assert "routed_experts" not in plain.extra
    with pytest.raises(RuntimeError, match=r"routed_experts of shape \(2, 3, 2\)"):
        result_from_vllm_completion(_Completion([9, 9], routes), moe_layers=[1, 3])


def test_asyncllms_delta_outputs_keep_the_routing_of_the_finishing_one():
    from rollout.engines.vllm.async_steps import Sampled

    routes = np.ones((3, 2, 2), dtype=np.uint8)
    sampled = Sampled()
    for tokens, finished, given in (([4], False, None), ([5], True, routes)):
        sampled.add(types.SimpleNamespace(outputs=[_Completion(tokens, given)], finished=finished))
    assert sampled.token_ids == [4, 5] and sampled.routed_experts is routes


def test_the_moe_layers_are_the_decoder_layers_with_routers():
    from rollout.models import build_empty_model
    from rollout.moe_routing import moe_layer_indices

    assert moe_layer_indices(build_empty_model("builtin:tiny-moe")) == [1]
    assert moe_layer_indices(build_empty_model("builtin:tiny")) == []


def test_routing_replay_with_vllm_on_the_cpu_is_refused_before_start_up():
    from trainer.config import load_config
    from trainer.config.errors import ConfigError

    keys = ["device=cpu", "rollout.engine=vllm", "algorithm.routing_replay=rollout"]
    with pytest.raises(ConfigError, match="algorithm.routing_replay: got 'rollout'; vLLM's CPU"):
        load_config(None, keys, check_environment=False)


# ---------------------------------------------------------------- the load-balancing loss


def _router_output(assignments: list[list[int]], probs: list[float]) -> RouterPass:
    """A pass whose one MoE layer sent token i to ``assignments[i]`` with ``probs`` each."""
    router = RouterPass(weights=torch.ones(len(assignments)))
    chosen = torch.tensor(assignments)
    router.add_loads(torch.tensor([probs] * len(assignments)), chosen)
    return router


def test_the_load_balancing_loss_is_the_coefficient_under_uniform_routing_and_grows_with_skew():
    from trainer.loop.ranks.policy import load_balance_loss

    uniform = _router_output([[0, 1], [2, 3], [4, 5], [6, 7]], [1 / 8] * 8)  # one slot each
    assert load_balance_loss(uniform, 4, 0.01).item() == pytest.approx(0.01)
    skewed = _router_output([[0, 1]] * 4, [0.5, 0.5, 0, 0, 0, 0, 0, 0])  # two experts take all
    assert load_balance_loss(skewed, 4, 0.01).item() == pytest.approx(0.01 * 8 * 0.5)
    assert load_balance_loss(RouterPass(weights=torch.ones(4)), 4, 0.01) is None  # dense


def test_the_loads_leave_padding_out_and_count_a_shared_prompt_for_each_of_its_rows():
    """Three rows, two of them sharing a prompt, and a padding row: the loads of the usual
    layout (padding weighted 0) equal the shared layout's (the shared prompt run once,
    weighted by its two rows), and the padding row moves nothing."""
    import hal
    from batching import share_prompts
    from trainer.loop.ranks.forward import packed_token_logprobs

    hal.register_attention()
    model = load_model("builtin:tiny-moe", seed=2, attn_implementation=hal.ATTN_IMPLEMENTATION)
    control_routers(model)
    prompt = [5, 6, 7, 8, 9, 10]
    rows = [prompt + [20, 21, 22], prompt + [30, 31], [40, 41, 42, 43], [1, 1]]  # last: padding
    ids = torch.tensor([t for r in rows for t in r])
    pos = torch.cat([torch.arange(len(r)) for r in rows])
    cu = torch.tensor([0, 9, 17, 21, 23], dtype=torch.int32)
    weights = torch.cat([torch.ones(21), torch.zeros(2)])
    prompt_lens = np.array([6, 6, 2, 1])
    sharing = share_prompts(ids.numpy(), cu.numpy(), prompt_lens)
    assert sharing is not None and sharing.num_tokens == 23 - 6
    passes = []
    for layout in (None, sharing):
        router = RouterPass(weights=weights.clone())
        with torch.no_grad():
            packed_token_logprobs(model, ids, pos, cu, sharing=layout, replay=router)
        passes.append(router)
    (usual_counts, usual_probs), (shared_counts, shared_probs) = (p.loads() for p in passes)
    for a, b in zip(usual_counts + usual_probs, shared_counts + shared_probs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert usual_counts[0].sum().item() == 21 * model.config.num_experts_per_tok  # real slots
