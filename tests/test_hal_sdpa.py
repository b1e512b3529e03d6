"""The reference varlen attention (``hal.sdpa.segmented_sdpa``): segments of equal length share
one batched SDPA call, and the numbers are bit for bit those of one SDPA call per segment,
forward and backward, whatever the order, gaps and lengths of the segments."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hal.sdpa import segment_groups, segmented_sdpa


def _one_call_per_segment(q, k, v, offsets, scale):
    outs = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        if end <= start:
            continue
        qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize(
    "lengths",
    [
        [5, 5, 5, 0, 7, 7, 3, 5],  # repeats out of order, an empty segment
        [3, 4, 5, 6],  # all different, already in order
        [10] * 8,  # one group
        [1, 1, 2],  # one-token segments
        [200, 300, 200, 300],  # lengths where SDPA's CPU kernel tiles differently
    ],
)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (2, 2)])
def test_grouped_calls_equal_one_call_per_segment_bit_for_bit(lengths, heads, kv_heads):
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    gen = torch.Generator().manual_seed(sum(lengths))
    tokens = offsets[-1]
    q = torch.randn(tokens, heads, 16, generator=gen).requires_grad_()
    k, v = (torch.randn(tokens, kv_heads, 16, generator=gen).requires_grad_() for _ in range(2))
    grad_out = torch.randn(tokens, heads, 16, generator=gen)

    want = _one_call_per_segment(q, k, v, offsets, 0.25)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    got = segmented_sdpa(q, k, v, offsets, scale=0.25)
    got_grads = torch.autograd.grad(got, (q, k, v), grad_out)

    assert torch.equal(got, want)
    for g, w in zip(got_grads, want_grads):
        assert torch.equal(g, w)


def test_segments_are_grouped_by_length_and_reordered_only_when_needed():
    in_order = segment_groups([0, 3, 6, 10], torch.device("cpu"))
    assert in_order.order is None  # lengths 3, 3, 4 along the row: no reordering
    assert in_order.groups == ((0, 2, 3), (6, 1, 4))

    mixed = segment_groups([0, 4, 7, 7, 11], torch.device("cpu"))  # 4, 3, empty, 4
    assert mixed.groups == ((0, 1, 3), (3, 2, 4))
    assert mixed.order.tolist() == [4, 5, 6, 0, 1, 2, 3, 7, 8, 9, 10]
    assert mixed.order[mixed.inverse].tolist() == list(range(11))


def test_a_row_of_empty_segments_gives_zeros():
    q = torch.randn(0, 2, 8)
    assert segmented_sdpa(q, q[:, :1], q[:, :1], [0, 0, 0], scale=1.0).shape == (0, 2, 8)
