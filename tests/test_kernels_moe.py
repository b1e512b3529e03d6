"""The experts op (``hal.kernels`` ``moe_experts``, ``hal.moe_experts``): the float32 reference
against transformers' own eager experts, each device's grouped GEMM against the reference
behind its library's calling convention (torch's ``F.grouped_mm``, which runs on the CPU for
aligned shapes; torch_npu's ``npu_grouped_matmul``, ``npu_swiglu`` and token permute /
unpermute as stand-ins that follow their rules), values and every gradient, the kernel set
patching the tiny MoE's experts, and expert parallelism's local experts through the kernel."""

from __future__ import annotations

import copy

import pytest
import torch

from hal import moe_experts
from hal.kernels import LIGER, REFERENCE, TORCH_NPU, choose_kernels
from tests.test_kernels import (  # noqa: F401 - stand_ins: the fixture
    NPU_MOE_CALLS,
    PERMUTE_READING,
    SWIGLU_INPUTS,
    _here,
    _npu_grouped_matmul,
    _npu_moe_token_permute,
    _npu_moe_token_unpermute,
    _npu_swiglu,
    stand_ins,
)


def _experts(seed: int = 0):
    """The tiny MoE's experts module (8 experts, width 32, hidden 64), weights away from
    zero so every expert's contribution shows; its config set to transformers' eager loop."""
    from rollout.models import load_model

    model = load_model("builtin:tiny-moe", seed=1)
    experts = model.model.layers[1].mlp.experts
    experts.config._experts_implementation = "eager"
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in experts.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return experts


def _routing(tokens: int = 13, k: int = 2, experts: int = 8, seed: int = 0):
    """Hidden states, each token's k distinct experts (expert 7 never chosen: an idle one)
    and their weights."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 64, generator=gen)
    scores = torch.rand(tokens, experts - 1, generator=gen)
    weights, index = scores.topk(k, dim=-1)
    return hidden, index, torch.softmax(weights, dim=-1)


def _run(experts, forward, hidden, index, weights):
    """``forward``'s output and the gradients of a weighted sum of it: the hidden states',
    the routing weights' and each expert weight's."""
    experts = copy.deepcopy(experts)
    hidden = hidden.clone().requires_grad_(True)
    weights = weights.clone().requires_grad_(True)
    out = forward(experts, hidden, index, weights)
    probe = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
    (out * probe).sum().backward()
    grads = {"hidden": hidden.grad, "routing": weights.grad}
    grads.update({n: p.grad for n, p in experts.named_parameters()})
    return out.detach().cpu(), {n: g.cpu() for n, g in grads.items()}


def _assert_same(got, want, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(got[0].to(want[0].dtype), want[0], rtol=rtol, atol=atol)
    for name, grad in want[1].items():
        torch.testing.assert_close(
            got[1][name].to(grad.dtype), grad, rtol=rtol, atol=atol, msg=name
        )


def _npu_kernel() -> moe_experts.ExpertsKernel:
    """The NPU's experts kernel as the kernel set builds it, on the stand-ins."""
    ops = moe_experts.NpuOps(_npu_moe_token_permute, _npu_moe_token_unpermute, _npu_swiglu)
    return moe_experts.npu_experts(_npu_grouped_matmul, ops)


def test_the_reference_is_transformers_eager_experts_values_and_gradients():
    experts, (hidden, index, weights) = _experts(), _routing()
    want = _run(experts, lambda m, *a: m(*a), hidden, index, weights)  # transformers' eager
    got = _run(experts, moe_experts.reference_experts, hidden, index, weights)
    _assert_same(got, want)
    assert torch.count_nonzero(got[1]["gate_up_proj"][7]) == 0  # the idle expert: no gradient
    assert torch.count_nonzero(got[1]["gate_up_proj"][0]) > 0


@pytest.mark.parametrize("convention", ["torch", "torch_npu"])
def test_each_grouped_gemm_gives_the_references_values_and_gradients(convention):
    calls = []

    def npu(x, weight, **kwargs):
        calls.append(kwargs["group_type"])
        return _npu_grouped_matmul(x, weight, **kwargs)

    gmm = (
        moe_experts.torch_gmm(torch.nn.functional.grouped_mm)
        if convention == "torch"
        else moe_experts.npu_gmm(npu)
    )
    experts, (hidden, index, weights) = _experts(), _routing()
    want = _run(experts, moe_experts.reference_experts, hidden, index, weights)
    got = _run(
        experts, lambda m, *a: moe_experts.grouped_experts(m, *a, gmm), hidden, index, weights
    )
    _assert_same(got, want)
    if convention == "torch_npu":  # two projections forward; each: dx (rows), dw (type 2)
        assert sorted(calls) == [0, 0, 0, 0, 2, 2]


def test_a_slot_routed_to_no_expert_here_adds_nothing():
    """An id past this module's experts (expert parallelism's placeholder) is dropped by both."""
    experts, (hidden, index, weights) = _experts(), _routing()
    index = index.clone()
    index[3, 1] = 8
    kept = weights.clone()
    kept[3, 1] = 0.0
    index_kept = index.clone()
    index_kept[3, 1] = 0
    want = moe_experts.reference_experts(experts, hidden, index_kept, kept)
    gmm = moe_experts.npu_gmm(_npu_grouped_matmul)
    for got in (
        moe_experts.reference_experts(experts, hidden, index, weights),
        moe_experts.grouped_experts(experts, hidden, index, weights, gmm),
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("stand_ins")
@pytest.mark.parametrize("providers", [LIGER, TORCH_NPU], ids=["cuda", "npu"])
def test_the_kernel_set_patches_the_tiny_moe_s_experts_and_keeps_its_values(providers):
    """The whole tiny MoE, patched by each device's kernel set (stand-ins), against the CPU's
    (transformers' own experts): same logits and gradients. CUDA's grouped GEMM takes bf16
    only, so in float32 its experts run the reference; the NPU's runs."""
    from rollout.models import load_model

    def run(kernels):
        model = load_model("builtin:tiny-moe", seed=2)
        patched = kernels.apply(model)
        ids = torch.arange(3, 40)[None]
        out = model(input_ids=ids).logits
        out.float().pow(2).mean().backward()
        return patched, out.detach(), {n: p.grad for n, p in model.named_parameters()}

    cpu = choose_kernels({})
    assert cpu.chosen["moe_experts"] == REFERENCE
    want_patched, want, want_grads = run(cpu)
    assert want_patched["moe_experts"] == 0  # transformers' own experts
    kernels = choose_kernels(_here(providers))
    assert kernels.chosen["moe_experts"] == providers["moe_experts"].name
    patched, got, got_grads = run(kernels)
    assert patched["moe_experts"] == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, grad in want_grads.items():
        if grad is not None:
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def test_the_grouped_path_runs_on_fake_tensors():
    """No shape depends on the routing: the memory tracker's fake-tensor forward takes the
    grouped path (bf16, what torch's kernel takes) as it is."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    experts, (hidden, index, weights) = _experts(), _routing()
    mode = FakeTensorMode()

    class _Fake(torch.nn.Module):
        act_fn = experts.act_fn

    fake = _Fake()
    fake.gate_up_proj = mode.from_tensor(experts.gate_up_proj.detach().bfloat16())
    fake.down_proj = mode.from_tensor(experts.down_proj.detach().bfloat16())
    args = [mode.from_tensor(t) for t in (hidden.bfloat16(), index, weights.bfloat16())]
    gmm = moe_experts.torch_gmm(torch.nn.functional.grouped_mm)
    with mode:
        out = moe_experts.grouped_experts(fake, *args, gmm)
    assert isinstance(out, FakeTensor) and tuple(out.shape) == (13, 64)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("reading", ["argsort", "inverse"])
def test_the_npu_experts_permute_and_unpermute_in_bf16_give_the_references_values_and_gradients(
    reading, monkeypatch
):
    """bf16 (the dtype torch_npu's permute pair takes): the permute, both grouped GEMMs, one
    ``npu_swiglu`` and the unpermute, against the float32 reference to bf16 rounding, the
    idle expert and a slot routed to no expert here included; the same result whichever way
    ``sorted_indices`` reads (``hal.moe_experts``: crossrl only hands it back)."""
    monkeypatch.setitem(PERMUTE_READING, "now", reading)
    experts, (hidden, index, weights) = _experts(), _routing()
    index = index.clone()
    index[3, 1] = 8  # expert parallelism's placeholder: adds nothing
    dropped = weights.clone()
    dropped[3, 1] = 0.0
    want = _run(experts, moe_experts.reference_experts, hidden, index.clamp(max=7), dropped)
    want[1]["routing"][3, 1] = 0.0  # the output does not depend on a slot routed nowhere
    NPU_MOE_CALLS.clear()
    SWIGLU_INPUTS.clear()
    low = copy.deepcopy(experts).bfloat16()
    got = _run(low, _npu_kernel(), hidden.bfloat16(), index, weights.bfloat16())
    assert NPU_MOE_CALLS == ["permute", "unpermute"] and len(SWIGLU_INPUTS) == 1
    assert got[0].dtype == torch.bfloat16
    _assert_same(got, want, rtol=4e-2, atol=4e-2)
    assert torch.count_nonzero(got[1]["gate_up_proj"][7]) == 0  # the idle expert


def test_the_npu_experts_in_float32_sort_themselves_and_still_take_npu_swiglu():
    """The permute pair takes bf16 only: float32 takes the sort and the float32 combine,
    still with torch_npu's grouped GEMM and SwiGLU, equal to the reference."""
    experts, (hidden, index, weights) = _experts(), _routing()
    want = _run(experts, moe_experts.reference_experts, hidden, index, weights)
    NPU_MOE_CALLS.clear()
    SWIGLU_INPUTS.clear()
    got = _run(experts, _npu_kernel(), hidden, index, weights)
    assert NPU_MOE_CALLS == [] and len(SWIGLU_INPUTS) == 1
    _assert_same(got, want)


def _grouped_rows(dtype, seed: int = 3):
    """Rows grouped by expert as expert parallelism hands them to a rank (8 local experts,
    two without rows), with the experts' weights."""
    experts = _experts()
    counts = torch.tensor([3, 0, 5, 2, 4, 0, 1, 1])
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(int(counts.sum()), 64, generator=gen).to(dtype)
    return experts, rows, counts


def _run_rows(call, experts, rows, counts, dtype):
    """``call``'s output over the grouped rows and the gradients of a weighted sum of it."""
    gate_up = experts.gate_up_proj.detach().to(dtype).requires_grad_(True)
    down = experts.down_proj.detach().to(dtype).requires_grad_(True)
    rows = rows.clone().requires_grad_(True)
    out = call(rows, gate_up, down, counts, experts.act_fn)
    probe = torch.linspace(-1, 1, out.numel()).view_as(out).to(dtype)
    (out * probe).sum().backward()
    return out.detach(), {"rows": rows.grad, "gate_up": gate_up.grad, "down": down.grad}


@pytest.mark.usefixtures("stand_ins")
@pytest.mark.parametrize(
    ("providers", "dtype", "fused"),
    [
        (LIGER, torch.bfloat16, True),
        (LIGER, torch.float32, False),
        (TORCH_NPU, torch.float32, True),
    ],
    ids=["cuda-bf16", "cuda-fp32", "npu-fp32"],
)
def test_expert_parallel_local_experts_take_the_chosen_kernel(providers, dtype, fused):
    """``KernelSet.expert_rows`` (expert parallelism's local experts): the device's grouped
    GEMM where it suits the rows (torch's takes bf16 only), the per-expert loop otherwise;
    values and gradients equal the loop's; the CPU's set is the loop itself."""
    assert choose_kernels({}).expert_rows() is moe_experts.looped_rows
    kernels = choose_kernels(_here(providers))
    experts, rows, counts = _grouped_rows(dtype)
    want = _run_rows(moe_experts.looped_rows, experts, rows, counts, dtype)
    SWIGLU_INPUTS.clear()
    calls = []
    kernel = kernels.calls["moe_experts"]
    gmm = kernel.gmm
    traced = moe_experts.ExpertsKernel(
        lambda *a: calls.append(1) or gmm(*a), dtypes=kernel.dtypes, npu=kernel.npu
    )
    kernels.calls["moe_experts"] = traced
    got = _run_rows(kernels.expert_rows(), experts, rows, counts, dtype)
    assert bool(calls) == fused
    if providers is TORCH_NPU:
        assert len(SWIGLU_INPUTS) == 1  # torch_npu's SwiGLU between the two GEMMs
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got[0], want[0], **tol)
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, msg=name, **tol)


def _experts_on_device(device: str, providers) -> None:
    """The device's experts kernel, for real, in bf16 (what training computes in) against the
    float32 reference on the CPU: values and every gradient to bf16 rounding."""
    kernels = choose_kernels(providers)
    assert kernels.chosen["moe_experts"] == providers["moe_experts"].name, kernels.reasons
    experts, (hidden, index, weights) = _experts(), _routing(tokens=256)
    want = _run(experts, moe_experts.reference_experts, hidden, index, weights)
    on = copy.deepcopy(experts).to(device).bfloat16()
    args = (hidden.to(device).bfloat16(), index.to(device), weights.to(device).bfloat16())
    got = _run(on, kernels.calls["moe_experts"], *args)
    assert kernels.chosen["moe_experts"] == providers["moe_experts"].name, kernels.reasons
    _assert_same(got, want, rtol=4e-2, atol=4e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_torch_grouped_mm_on_cuda_gives_the_references_values_and_gradients():
    _experts_on_device("cuda", LIGER)


@pytest.mark.npu
def test_torch_npu_experts_give_the_references_values_and_gradients():
    import hal

    if "npu" not in hal.available_backends():
        pytest.skip("needs an Ascend NPU and torch_npu")
    _experts_on_device(str(hal.get_backend("npu").device(0)), TORCH_NPU)
