"""Varlen attention: packed rows never attend across sequences, on every backend present."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

import hal

LENS = [5, 11, 3]  # three sequences of different lengths, packed into one row of 19 tokens
VOCAB = 128

HAS_CUDA = torch.cuda.is_available()
HAS_NPU = "npu" in hal.available_backends()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device here")),
    pytest.param("npu", marks=pytest.mark.skipif(not HAS_NPU, reason="no Ascend NPU here")),
]
# fp32 everywhere; the NPU's fused kernel accumulates in a different order than SDPA
TOLERANCE = {"cpu": 1e-5, "cuda": 1e-5, "npu": 1e-4}


def tiny_qwen(attn: str, device: str = "cpu", seed: int = 0) -> torch.nn.Module:
    """A random 2-layer Qwen2 with grouped-query attention (4 heads, 2 kv heads)."""
    hal.register_attention()
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(device=device, dtype=torch.float32)


def packed_inputs(device: str = "cpu", lens=LENS, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).to(device) for n in lens]
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(n) for n in lens]).to(device)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return seqs, ids, pos, cu


def logit_weights(total: int, device: str) -> torch.Tensor:
    """Fixed random weights so that the loss touches every logit differently."""
    return torch.randn(total, VOCAB, generator=torch.Generator().manual_seed(3)).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_logits_and_grads_match_separate_sequences(device):
    model = tiny_qwen(hal.ATTN_IMPLEMENTATION, device)
    seqs, ids, pos, cu = packed_inputs(device)
    w = logit_weights(ids.numel(), device)

    packed = hal.packed_forward(model, ids, pos, cu)
    (packed * w).sum().backward()
    grads_packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    separate = torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
    (separate * w).sum().backward()

    tol = TOLERANCE[device]
    assert packed.shape == (sum(LENS), VOCAB)
    torch.testing.assert_close(packed, separate, atol=tol, rtol=tol)
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads_packed[name], param.grad, atol=tol, rtol=tol, msg=name)


@pytest.mark.skipif(
    not (HAS_CUDA and importlib.util.find_spec("flash_attn")), reason="needs CUDA and flash-attn"
)
def test_flash_attn_bf16_packed_matches_separate():
    model = tiny_qwen(hal.ATTN_IMPLEMENTATION, "cuda").to(torch.bfloat16)
    seqs, ids, pos, cu = packed_inputs("cuda")
    packed = hal.packed_forward(model, ids, pos, cu).float()
    separate = torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
    torch.testing.assert_close(packed, separate.float(), atol=3e-2, rtol=3e-2)


def test_restarting_position_ids_alone_keep_sequences_apart():
    """No cu_seqlens, default use_cache: the position-id fallback still separates sequences."""
    model = tiny_qwen(hal.ATTN_IMPLEMENTATION)
    seqs, ids, pos, _ = packed_inputs()
    with torch.no_grad():
        packed = model(input_ids=ids[None], position_ids=pos[None]).logits[0]
        separate = torch.cat([model(input_ids=s[None]).logits[0] for s in seqs])
    torch.testing.assert_close(packed, separate, atol=1e-5, rtol=1e-5)


def test_transformers_sdpa_packing_leaks_across_sequences_with_cache():
    """Documents the bug we avoid: transformers' own packed-row detection is skipped when
    use_cache=True (the default), so sequences attend to each other."""
    model = tiny_qwen("sdpa")
    seqs, ids, pos, _ = packed_inputs()
    with torch.no_grad():
        separate = torch.cat([model(input_ids=s[None]).logits[0] for s in seqs])
        leaky = model(input_ids=ids[None], position_ids=pos[None], use_cache=True).logits[0]
        detected = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]
    first = LENS[0]
    # the first sequence sees nothing before it, so it agrees; the later ones do not
    torch.testing.assert_close(leaky[:first], separate[:first], atol=1e-5, rtol=1e-5)
    assert (leaky[first:] - separate[first:]).abs().max() > 1e-2
    torch.testing.assert_close(detected, separate, atol=1e-5, rtol=1e-5)


def test_padded_batch_and_generation_match_sdpa():
    """Unpacked [B, S] input with left padding behaves like plain causal attention."""
    ours = tiny_qwen(hal.ATTN_IMPLEMENTATION)
    ref = tiny_qwen("sdpa")
    ref.load_state_dict(ours.state_dict())
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (2, 7), generator=gen)
    mask = torch.ones(2, 7, dtype=torch.long)
    ids[1, :3], mask[1, :3] = 0, 0  # second row: 3 left-padding tokens
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask).logits
        b = ref(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=1e-5)

    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    out_ours = ours.generate(input_ids=ids, **kwargs)
    out_ref = ref.generate(input_ids=ids, **kwargs)
    assert torch.equal(out_ours, out_ref)
    alone = ours.generate(input_ids=ids[1:, 3:], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out_ours[1, 7:], alone[0, 4:])  # padding does not change what row 1 says


def reference_block_causal(q, k, v, lens, scale):
    """Independent oracle: one dense softmax with an explicit block-diagonal causal mask."""
    total, heads, _ = q.shape
    rep = heads // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    idx = torch.arange(total)
    allowed = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


@pytest.mark.parametrize("lens", [[4, 1, 7], [9], [2, 0, 3]])
def test_varlen_attention_matches_block_diagonal_oracle(lens):
    gen = torch.Generator().manual_seed(2)
    total = sum(lens)
    q = torch.randn(total, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(total, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(total, 2, 8, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    out = hal.varlen_attention(q, k, v, cu, scale=0.3)
    nonempty = [n for n in lens if n]
    torch.testing.assert_close(out, reference_block_causal(q, k, v, nonempty, 0.3))


def test_cu_seqlens_from_position_ids_finds_restarts():
    pos = torch.tensor([0, 1, 2, 0, 1, 0, 5, 6, 7])  # a jump (0 -> 5) also starts a sequence
    assert hal.cu_seqlens_from_position_ids(pos).tolist() == [0, 3, 5, 6, 9]
    assert hal.cu_seqlens_from_position_ids(torch.arange(4)).tolist() == [0, 4]


@pytest.mark.parametrize(
    "cu, fix",
    [
        ([0, 3, 18], "end at the row length 19"),
        ([1, 5, 19], "start at 0"),
        ([0, 9, 5, 19], "non-decreasing"),
    ],
)
def test_packed_forward_rejects_bad_cu_seqlens(cu, fix):
    model = tiny_qwen(hal.ATTN_IMPLEMENTATION)
    _, ids, pos, _ = packed_inputs()
    with pytest.raises(ValueError, match=fix):
        hal.packed_forward(model, ids, pos, torch.tensor(cu))


def test_packed_forward_refuses_a_model_that_would_leak():
    model = tiny_qwen("sdpa")
    _, ids, pos, cu = packed_inputs()
    with pytest.raises(ValueError, match="crossrl_varlen"):
        hal.packed_forward(model, ids, pos, cu)


def test_register_attention_is_idempotent():
    from transformers import AttentionInterface

    assert hal.register_attention() == hal.register_attention() == hal.ATTN_IMPLEMENTATION
    assert AttentionInterface._global_mapping[hal.ATTN_IMPLEMENTATION] is (
        hal.crossrl_attention_forward
    )


def test_varlen_attention_rejects_offsets_that_do_not_cover_the_row():
    q = torch.randn(6, 2, 4)
    with pytest.raises(ValueError, match="end at the row length 6"):
        hal.varlen_attention(q, q, q, torch.tensor([0, 2, 5]))
