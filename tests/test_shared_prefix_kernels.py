"""Shared prompts reach the fused varlen kernels (issue 24, item 4): the key layout with
separate query and key offsets computes what the SDPA reference computes, the cuda and npu
backends hand exactly that layout to their kernels (driven here through stand-in kernels that
compute it by SDPA), and where no fused kernel takes shared prompts the trainer leaves them
unshared, by a rule ``crossrl layout`` prints."""

from __future__ import annotations

import types

import pytest
import torch

import hal.cuda as hal_cuda
import hal.npu as hal_npu
from batching import StepBatch, share_prompts
from hal.cuda import CudaBackend, flash_attn_varlen_kwargs
from hal.npu import NpuBackend, npu_fusion_attention_args, split_shared_segments
from hal.sdpa import prefix_sdpa
from hal.shared_prefix import kv_varlen_sdpa, shared_kv_layout
from tests.test_prompt_sharing import _rows
from trainer.config import load_config
from trainer.loop.plan.layout import prompt_sharing_rule
from trainer.loop.ranks.policy import prompt_sharing, sharing_kernel

HEADS, KV_HEADS, DIM = 4, 2, 8


def _shared_row(seed: int = 0):
    batch = StepBatch.from_rows(_rows(seed=seed))
    sharing = share_prompts(
        batch.input_ids.numpy(), batch.cu_seqlens.numpy(), batch.prompt_len.numpy()
    )
    gen = torch.Generator().manual_seed(seed)
    tokens = sharing.num_tokens
    q = torch.randn(tokens, HEADS, DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(tokens, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(tokens, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
    return sharing, q, k, v


def test_key_layout_lists_each_roots_tokens_then_the_segments_own():
    layout = shared_kv_layout([0, 3, 5, 6, 8], [-1, 0, 0, -1])
    assert layout.kv_index == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7]
    assert layout.cu_k == [0, 3, 8, 12, 14]
    assert (layout.max_q, layout.max_k) == (3, 5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_separate_key_offsets_compute_the_shared_prefix_attention(seed):
    sharing, q, k, v = _shared_row(seed)
    offsets, parents = sharing.offsets, sharing.parents
    for x in (q, k, v):
        x.requires_grad_(True)
    want = prefix_sdpa(q, k, v, offsets, parents, scale=DIM**-0.5)
    layout = shared_kv_layout(offsets, parents)
    index = torch.tensor(layout.kv_index)
    got = kv_varlen_sdpa(
        q, k[index], v[index], offsets, layout.cu_k, scale=DIM**-0.5
    )  # the gather is differentiable: the root's keys get every child's gradient
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    upstream = torch.randn_like(want)
    grads_want = torch.autograd.grad(want, (q, k, v), upstream)
    grads_got = torch.autograd.grad(got, (q, k, v), upstream)
    for a, b in zip(grads_got, grads_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _varlen_by_sdpa(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size, scale, enable_gqa=False):
    """A stand-in for torch's ``varlen_attn`` (CUDA only): causal with the window (-1, 0),
    bottom-right aligned, as the flash kernel behind it."""
    assert window_size == (-1, 0)
    assert cu_q.dtype == cu_k.dtype == torch.int32 and max_k >= max_q
    return kv_varlen_sdpa(q, k, v, cu_q.tolist(), cu_k.tolist(), scale=scale)


def test_cuda_backend_hands_the_kernel_query_and_key_offsets(monkeypatch):
    sharing, q, k, v = _shared_row(3)
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    monkeypatch.setattr(hal_cuda, "flash_attn_installed", lambda: False)
    monkeypatch.setattr(hal_cuda, "_torch_varlen_fn", lambda: _varlen_by_sdpa)
    monkeypatch.setattr(
        hal_cuda, "_torch_varlen_params", lambda: frozenset({"window_size", "scale", "enable_gqa"})
    )
    backend = CudaBackend()
    assert backend.shared_prompt_kernel(torch.bfloat16, deterministic=False).startswith("torch")
    got = backend.shared_prefix_attention(q, k, v, sharing.offsets, sharing.parents, scale=0.3)
    want = prefix_sdpa(q, k, v, sharing.offsets, sharing.parents, scale=0.3)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_flash_attn_kwargs_carry_the_keys_own_offsets():
    cu_q, cu_k = torch.tensor([0, 3, 5]), torch.tensor([0, 3, 8])
    kwargs = flash_attn_varlen_kwargs(cu_q, 3, 0.5, cu_seqlens_k=cu_k, max_seqlen_k=5)
    assert kwargs["cu_seqlens_q"].tolist() == [0, 3, 5]
    assert kwargs["cu_seqlens_k"].tolist() == [0, 3, 8]
    assert (kwargs["max_seqlen_q"], kwargs["max_seqlen_k"], kwargs["causal"]) == (3, 5, True)
    plain = flash_attn_varlen_kwargs(cu_q, 3, 0.5)
    assert plain["cu_seqlens_k"].tolist() == [0, 3, 5] and plain["max_seqlen_k"] == 3


def _fake_torch_npu(calls: list):
    def npu_fusion_attention(q, k, v, **kw):
        assert kw["input_layout"] == "TND" and kw["sparse_mode"] == 3
        calls.append((kw["actual_seq_qlen"], kw["actual_seq_kvlen"]))
        cu_q, cu_k = [0, *kw["actual_seq_qlen"]], [0, *kw["actual_seq_kvlen"]]
        return (kv_varlen_sdpa(q, k, v, cu_q, cu_k, scale=kw["scale"]),)

    return types.SimpleNamespace(npu_fusion_attention=npu_fusion_attention)


def test_npu_backend_gives_actual_seq_kvlen_and_splits_long_rows(monkeypatch):
    sharing, q, k, v = _shared_row(4)
    calls: list = []
    monkeypatch.setattr(hal_npu, "import_torch_npu", lambda: _fake_torch_npu(calls))
    monkeypatch.setattr(hal_npu, "NPU_MAX_SEGMENTS_PER_CALL", 5)  # force several calls
    got = NpuBackend().shared_prefix_attention(q, k, v, sharing.offsets, sharing.parents, scale=0.4)
    want = prefix_sdpa(q, k, v, sharing.offsets, sharing.parents, scale=0.4)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    segments = len(sharing.offsets) - 1
    assert len(calls) == -(-segments // 5)
    assert all(qlen[-1] <= kvlen[-1] for qlen, kvlen in calls)  # keys include the roots


def test_npu_args_and_chunks_with_separate_key_offsets():
    kwargs = npu_fusion_attention_args([0, 3, 5], 4, 0.5, kv_seqlens=[0, 3, 8])
    assert kwargs["actual_seq_qlen"] == [3, 5] and kwargs["actual_seq_kvlen"] == [3, 8]
    with pytest.raises(ValueError, match="kv_seqlens"):
        npu_fusion_attention_args([0, 3, 5], 4, 0.5, kv_seqlens=[0, 8])
    chunks = split_shared_segments([0, 3, 5, 6, 8], [0, 3, 8, 12, 14], 2)
    assert chunks == [(0, 5, 0, 8, [0, 3, 5], [0, 3, 8]), (5, 8, 8, 14, [0, 1, 3], [0, 4, 6])]


def test_no_fused_kernel_leaves_prompts_unshared():
    """cuda in float32 (no fused kernel takes it): the trainer does not share prompts and
    ``crossrl layout`` says why; in bfloat16 or on the CPU it shares them."""
    batch = StepBatch.from_rows(_rows())
    cfg32 = load_config(None, ["train.param_dtype=float32"], check_environment=False)
    cfg16 = load_config(None, ["train.param_dtype=bfloat16"], check_environment=False)
    assert CudaBackend().shared_prompt_kernel(torch.float32) is None
    cuda_rule = prompt_sharing_rule(cfg32, "cuda")
    assert cuda_rule.startswith("prompt sharing: off on cuda at train.param_dtype=float32")
    assert prompt_sharing(batch, cfg32, torch.device("cpu")) is not None
    assert sharing_kernel(cfg16, torch.device("cpu")).startswith("sdpa reference")
    npu_rule = prompt_sharing_rule(cfg16, "npu")
    assert npu_rule.startswith("prompt sharing: on, npu_fusion_attention")
    off = load_config(None, ["train.share_prompts=false"], check_environment=False)
    assert prompt_sharing(batch, off, torch.device("cpu")) is None
    assert prompt_sharing_rule(off, "cpu") == "prompt sharing: off (train.share_prompts=false)"
    det = load_config(
        None, ["train.param_dtype=bfloat16", "run.deterministic=true"], check_environment=False
    )
    if not hal_cuda.flash_attn_installed():  # torch's varlen kernel is not deterministic
        assert "off on cuda" in prompt_sharing_rule(det, "cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_fused_kernel_matches_the_reference_on_the_device():
    sharing, q, k, v = _shared_row(5)
    q, k, v = (x.to("cuda", torch.bfloat16).requires_grad_(True) for x in (q, k, v))
    backend = CudaBackend()
    kernel = backend.shared_prompt_kernel(torch.bfloat16)
    if kernel is None:
        pytest.skip("neither flash-attn nor torch's varlen_attn here")
    got = backend.shared_prefix_attention(q, k, v, sharing.offsets, sharing.parents, scale=0.3)
    want = prefix_sdpa(q, k, v, sharing.offsets, sharing.parents, scale=0.3)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    upstream = torch.randn_like(want)
    for a, b in zip(
        torch.autograd.grad(got, (q, k, v), upstream),
        torch.autograd.grad(want, (q, k, v), upstream),
    ):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)
