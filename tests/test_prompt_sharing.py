"""Shared prompts (``train.share_prompts``): a prompt several rows of a micro-batch share runs
through the model once and every row's rest attends to it. The layout (``batching.sharing``)
keeps every row's meaning, the attention (``hal.sdpa.prefix_sdpa``) computes what separate
sequences would, and the log-probs, entropies and gradients the trainer gets back in the usual
layout are those of the unshared forward up to float rounding."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hal
from batching import Row, StepBatch, share_prompts
from hal.attention import packed_forward
from hal.sdpa import prefix_sdpa, segmented_sdpa
from trainer.loop.ranks.forward import packed_token_logprobs


def _rows(groups: int = 5, samples: int = 4, seed: int = 0) -> list[Row]:
    """GRPO-like rows: ``samples`` rows per prompt, responses of 1-6 tokens, plus a row whose
    prompt nobody shares."""
    rnd = random.Random(seed)
    rows = []
    for uid in range(groups):
        prompt = [rnd.randrange(3, 100) for _ in range(rnd.randint(4, 12))]
        for s in range(samples):
            resp = [rnd.randrange(3, 100) for _ in range(rnd.randint(1, 6))]
            rows.append(_row(prompt, resp, uid, uid * samples + s))
    rows.append(_row([5, 6, 7], [8, 9], 99, 999))
    rnd.shuffle(rows)  # a group's rows need not be next to each other
    return rows


def _row(prompt: list[int], response: list[int], uid: int, traj: int) -> Row:
    return Row(
        prompt_ids=prompt,
        response_ids=response,
        response_mask=[1] * len(response),
        response_logprobs=[-1.0] * len(response),
        uid=uid,
        trajectory_id=traj,
        step_index=0,
        is_last_step=True,
        score=0.0,
    )


def _sharing(batch: StepBatch):
    return share_prompts(
        batch.input_ids.numpy(), batch.cu_seqlens.numpy(), batch.prompt_len.numpy()
    )


def test_layout_keeps_one_copy_of_each_shared_prompt_and_every_prediction():
    batch = StepBatch.from_rows(_rows())
    sharing = _sharing(batch)
    ids, pos = batch.input_ids.numpy(), batch.position_ids.numpy()
    prompt_lens, cu = batch.prompt_len.numpy(), batch.cu_seqlens.numpy()
    distinct = {tuple(ids[cu[r] : cu[r] + prompt_lens[r]]) for r in range(len(prompt_lens))}
    responses = int((cu[1:] - cu[:-1] - prompt_lens).sum())
    # one copy of each distinct prompt (the unshared row is whole) plus every row's rest
    assert sharing.num_tokens == sum(len(p) for p in distinct) + responses
    assert sorted(set(sharing.token_index.tolist())) == sorted(sharing.token_index.tolist())
    # a continuation continues a root whose tokens end at the position before its own
    for s, parent in enumerate(sharing.parents):
        if parent >= 0:
            assert sharing.parents[parent] == -1
            first = sharing.token_index[sharing.offsets[s]]
            last_of_root = sharing.token_index[sharing.offsets[parent + 1] - 1]
            assert pos[first] == pos[last_of_root] + 1
    # every token but a row's first is predicted by a position holding its predecessor's
    # token and position, with itself as the target
    for t in np.flatnonzero(~sharing.row_starts):
        e = sharing.eval_of_token[t]
        assert sharing.eval_targets[e] == ids[t]
        before = sharing.token_index[sharing.eval_hidden[e]]
        assert (ids[before], pos[before]) == (ids[t - 1], pos[t - 1])
    assert sharing.row_starts.sum() == len(prompt_lens)


def test_no_layout_when_no_prompt_is_shared():
    rows = [_row([3 + i, 4], [5], i, i) for i in range(4)]
    batch = StepBatch.from_rows(rows)
    assert _sharing(batch) is None


def _reference(q, k, v, offsets, parents, scale):
    """Each root alone, each continuation as its root's tokens + its own, sliced back."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1])
    for s, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        p = parents[s]
        kv = list(range(offsets[p], offsets[p + 1])) if p >= 0 else []
        kv += list(range(start, end))
        qs, ks, vs = (x[kv].transpose(0, 1)[None] for x in (q, k, v))
        full = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        out[start:end] = full[0].transpose(0, 1)[len(kv) - (end - start) :]
    return out


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (2, 2)])
def test_prefix_attention_equals_separate_sequences(heads, kv_heads):
    # root 0 (5 tokens) with continuations 1, 3 (3 tokens each) and 4 (1 token); 2 alone
    offsets = [0, 5, 8, 15, 18, 19]
    parents = [-1, 0, -1, 0, 0]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(19, heads, 8, generator=gen).requires_grad_()
    k, v = (torch.randn(19, kv_heads, 8, generator=gen).requires_grad_() for _ in range(2))
    grad_out = torch.randn(19, heads, 8, generator=gen)

    want = _reference(q, k, v, offsets, parents, 0.3)
    got = prefix_sdpa(q, k, v, offsets, parents, scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(
        torch.autograd.grad(got, (q, k, v), grad_out),
        torch.autograd.grad(want, (q, k, v), grad_out),
    ):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # no parents: what the plain segmented path computes
    alone = prefix_sdpa(q, k, v, offsets, [-1] * 5, scale=0.3)
    torch.testing.assert_close(alone, segmented_sdpa(q, k, v, offsets, scale=0.3))


def test_packed_forward_rejects_parents_that_do_not_name_an_earlier_root():
    model = _model()
    ids = torch.tensor([5, 6, 7, 8])
    with pytest.raises(ValueError, match=r"parents\[1\]=1"):
        packed_forward(
            model, ids, torch.tensor([0, 1, 2, 3]), torch.tensor([0, 2, 4]), parents=[-1, 1]
        )


def _model():
    from transformers import AutoModelForCausalLM

    from rollout.models import model_directory

    hal.register_attention()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(
        model_directory("builtin:tiny", 1),
        attn_implementation=hal.ATTN_IMPLEMENTATION,
        dtype=torch.float32,
    )


@pytest.mark.parametrize("lean", [True, False])
def test_shared_logprobs_entropy_and_gradients_match_the_unshared_forward(lean):
    model = _model()
    batch = StepBatch.from_rows(_rows(seed=1))
    sharing = _sharing(batch)
    assert sharing.num_tokens < 0.6 * batch.input_ids.numel()
    mask = batch.loss_mask.float()
    results = []
    for layout in (None, sharing):
        model.zero_grad()
        logprobs, entropy = packed_token_logprobs(
            model,
            batch.input_ids,
            batch.position_ids,
            batch.cu_seqlens,
            lean=lean,
            entropy_grad=True,
            temperature=0.7,
            sharing=layout,
        )
        ((logprobs * mask).sum() + 0.1 * (entropy * mask).sum()).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        results.append((logprobs.detach(), entropy.detach(), grads))
    (lp, ent, grad), (lp_s, ent_s, grad_s) = results
    # every position, prompt tokens included, and 0 at each row's first token
    torch.testing.assert_close(lp_s, lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_s, ent, rtol=1e-5, atol=1e-5)
    assert (lp_s[batch.cu_seqlens[:-1].long()] == 0).all()
    # summed in another order (a shared prompt's gradient is one sum over its rows)
    assert float((grad_s - grad).norm() / grad.norm()) < 1e-5
    torch.testing.assert_close(grad_s, grad, rtol=1e-3, atol=1e-5)
