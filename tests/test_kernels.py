"""The HAL's kernel set (``hal.kernels``, ``train.kernels``), parity by construction on the CPU.

Liger-Kernel's functions are Triton and torch_npu's ops need an NPU, so each is stood in for
here by its documented formula behind its exact calling convention, in a module of the tests'
own loaded under the provider's names (Liger 0.8.5's
``LigerRMSNormFunction.apply(X, W, eps, offset, casting_mode, in_place)`` in Llama casting
mode and ``LigerSiLUMulFunction.apply(a, b)``; torch_npu 2.10's ``npu_rms_norm(input, gamma,
epsilon)`` returning ``(y, rstd)`` and ``npu_swiglu(input, dim)`` = Swish(first half) x second
half), installed where the shipped code imports them. The shipped patch then runs on a tiny
Qwen2 model, whose values and gradients must equal the reference model's in fp32: an argument
out of place (gate and up swapped, an offset, the wrong casting) shows. The conventions
themselves are read from the pinned wheels (``tests/fixtures/kernel_api.json``,
``scripts/record_kernel_api.py``).
"""

from __future__ import annotations

import json
import sys
import types
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import hal
from hal.kernels import (
    COMPILE,
    FUSED_HEAD,
    LIGER,
    OPS,
    REFERENCE,
    TORCH_NPU,
    Provider,
    choose_kernels,
)
from tests.gloo_ranks import finish_rank

ROOT = Path(__file__).resolve().parents[1]
API = json.loads((ROOT / "tests" / "fixtures" / "kernel_api.json").read_text())


def _llama_rms_norm(x, weight, eps):
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


class _LigerRMSNormFunction:
    @staticmethod
    def apply(X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None):
        assert offset == 0.0 and casting_mode == "llama" and in_place is False
        return _llama_rms_norm(X, W + offset, eps)


class _LigerSiLUMulFunction:
    @staticmethod
    def apply(a, b, gate_multiplier=1.0, down_multiplier=1.0):
        return torch.nn.functional.silu(a) * b


def _rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class _LigerRopeFunction:
    @staticmethod
    def apply(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
        assert position_ids is None and unsqueeze_dim == 1 and cos.dim() == 3
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):  # noqa: A002
    """torch_npu 2.10.0.post4's documented formula and layout: ``input`` BSND in its own
    storage (contiguous ``[b, s, n, d]``), ``r1``, ``r2`` BS1D, within [-1, 1]."""
    assert rotary_mode == "half" and input.dim() == 4 and input.is_contiguous()
    b, s, _, d = input.shape
    assert r1.shape == r2.shape == (b, s, 1, d), (input.shape, r1.shape)
    assert r1.abs().max() <= 1 and r2.abs().max() <= 1
    return input * r1 + _rotate_half(input) * r2


def _npu_rms_norm(input, gamma, epsilon=1e-6):  # noqa: A002 - torch_npu's own name
    rstd = torch.rsqrt(input.float().pow(2).mean(-1, keepdim=True) + epsilon)
    return gamma * (input.float() * rstd).to(input.dtype), rstd


#: What each ``_npu_swiglu`` call's input was made by (its ``grad_fn``'s class name).
SWIGLU_INPUTS: list[str] = []


def _npu_swiglu(input, dim=-1):  # noqa: A002
    SWIGLU_INPUTS.append(type(input.grad_fn).__name__)
    first, second = input.chunk(2, dim=dim)
    return torch.nn.functional.silu(first) * second


def _npu_grouped_matmul(x, weight, *, group_list, split_item, group_type, group_list_type=0):
    """torch_npu 2.10.0.post4's rule (``op_plugin/meta/_meta_registrations.py``; see
    ``hal.moe_experts``): lists in, one 3D weight ``[E, K, N]`` or one 2D ``[M, N]``; group
    ends (type 0) or sizes (type 1); ``group_type`` 0 groups the rows of ``x`` (output ``[M,
    N]``), 2 the columns of ``x`` ``[K, M]`` (output ``[E, K, N]``); one output (split_item
    2 or 3). No autograd (the real op has none)."""
    assert split_item in (2, 3) and group_type in (0, 2) and len(x) == len(weight) == 1
    ends = group_list if group_list_type == 0 else torch.cumsum(group_list, 0)
    ends = [0, *[int(e) for e in ends]]
    a, b = x[0].detach(), weight[0].detach()
    if group_type == 0:
        assert b.dim() == 3 and a.shape[1] == b.shape[1] and ends[-1] <= a.shape[0]
        out = a.new_zeros(a.shape[0], b.shape[2])
        for g in range(len(ends) - 1):
            out[ends[g] : ends[g + 1]] = a[ends[g] : ends[g + 1]] @ b[g]
        return [out]
    assert b.dim() == 2 and a.shape[1] == b.shape[0]
    return [
        torch.stack(
            [a[:, ends[g] : ends[g + 1]] @ b[ends[g] : ends[g + 1]] for g in range(len(ends) - 1)]
        )
    ]


#: How the permute stand-in's ``sorted_indices`` reads (``hal.moe_experts``: torch_npu's
#: documentation shows the argsort of the flattened indices, vllm-ascend 0.26 reads it as the
#: inverse); crossrl only hands it back to the unpermute, so both must give the same result.
PERMUTE_READING = {"now": "argsort"}
#: The torch_npu MoE ops the stand-ins ran, in call order.
NPU_MOE_CALLS: list[str] = []


def _npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    """torch_npu 2.10.0.post4's ``npu_moe_token_permute`` (its documentation: bf16 tokens
    ``[N, H]``, int64 indices ``[N, k]``; each slot's row, grouped by expert in ascending
    order; ``sorted_indices`` int32 ``[N*k]``), with autograd as the real op has."""
    assert tokens.dtype == torch.bfloat16 and indices.dtype == torch.int64 and not padded_mode
    assert tokens.dim() == 2 and num_out_tokens in (None, 0)
    NPU_MOE_CALLS.append("permute")
    k = indices.shape[1] if indices.dim() == 2 else 1
    order = torch.argsort(indices.reshape(-1), stable=True)
    mapping = order if PERMUTE_READING["now"] == "argsort" else torch.argsort(order)
    return tokens.index_select(0, order // k), mapping.int()


def _npu_moe_token_unpermute(
    permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None
):
    """torch_npu 2.10.0.post4's ``npu_moe_token_unpermute``: each slot's row back in token
    order, times ``probs`` (bf16 ``[N, k]``), summed over the k slots (in bf16)."""
    assert permuted_tokens.dtype == torch.bfloat16 and sorted_indices.dtype == torch.int32
    assert probs is None or probs.dtype == torch.bfloat16
    NPU_MOE_CALLS.append("unpermute")
    k = 1 if probs is None else probs.shape[1]
    index = sorted_indices.long()
    if PERMUTE_READING["now"] == "argsort":  # position i holds slot index[i]
        slots = torch.zeros_like(permuted_tokens).index_copy(0, index, permuted_tokens)
    else:  # slot s sits at position index[s]
        slots = permuted_tokens.index_select(0, index)
    slots = slots.view(-1, k, permuted_tokens.shape[-1])
    if probs is not None:
        slots = slots * probs.unsqueeze(-1)
    return slots.sum(dim=1)


#: Where the stand-ins live: a module name of their own (a fake ``torch_npu`` in
#: ``sys.modules`` would fool transformers' and accelerate's own NPU checks).
STAND_IN = "crossrl_test_kernel_stand_ins"


@pytest.fixture
def stand_ins(monkeypatch):
    """The providers' functions, as their documented formulas, in module ``STAND_IN``."""
    module = types.ModuleType(STAND_IN)
    module.__dict__.update(
        LigerRMSNormFunction=_LigerRMSNormFunction,
        LigerSiLUMulFunction=_LigerSiLUMulFunction,
        LigerRopeFunction=_LigerRopeFunction,
        npu_rms_norm=_npu_rms_norm,
        npu_swiglu=_npu_swiglu,
        npu_rotary_mul=_npu_rotary_mul,
        npu_grouped_matmul=_npu_grouped_matmul,
        npu_moe_token_permute=_npu_moe_token_permute,
        npu_moe_token_unpermute=_npu_moe_token_unpermute,
        grouped_mm=torch.nn.functional.grouped_mm,  # torch's own: it runs on the CPU too
    )
    monkeypatch.setitem(sys.modules, STAND_IN, module)


def _here(providers: dict[str, Provider]) -> dict[str, Provider]:
    """``providers`` with their functions loaded from the stand-ins (same names, same calling
    conventions); the fused head is crossrl's own torch code, run as it ships."""
    return {
        op: replace(p, module=STAND_IN) if p.module not in (None, FUSED_HEAD.module) else p
        for op, p in providers.items()
    }


def _fused(providers: dict[str, Provider]) -> dict[str, str]:
    """What ``auto`` chooses from ``providers`` with every kernel loading: each op's
    provider, but compilation only when asked for (``train.compile_blocks``)."""
    return {op: providers[op].name if op != "compile" else REFERENCE for op in OPS}


def _tiny(seed: int = 0) -> torch.nn.Module:
    from rollout.models import load_model

    hal.register_attention()
    model = load_model(
        "builtin:tiny", dtype=torch.float32, seed=1, attn_implementation=hal.ATTN_IMPLEMENTATION
    )
    with torch.no_grad():  # norms away from 1, so a wrong weight or offset shows
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
    return model


def _run(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The model's logits, and the lean path's log-probs and entropies (the LM head's op, at a
    temperature, chunks of 5 tokens over two packed rows), all in one loss; the outputs
    stacked, and every parameter's gradient."""
    from trainer.loop.ranks.forward import packed_token_logprobs

    device = next(model.parameters()).device
    ids = torch.arange(3, 19, device=device)[None]
    logits = model(input_ids=ids).logits
    cu_seqlens = torch.tensor([0, 7, 16], dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(7), torch.arange(9)]).to(device)
    logprobs, entropy = packed_token_logprobs(
        model, ids[0], positions, cu_seqlens, temperature=0.7, entropy_grad=True, chunk_tokens=5
    )
    weights = torch.linspace(-1, 1, 16, device=device)
    loss = logits.float().pow(2).mean() + (weights * logprobs).sum() + (weights * entropy).sum()
    loss.backward()
    out = torch.cat([logits.detach().flatten(), logprobs.detach(), entropy.detach()])
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("providers", [LIGER, TORCH_NPU], ids=["liger", "torch_npu"])
def test_each_fused_op_gives_the_references_values_and_gradients(stand_ins, providers):
    kernels = choose_kernels(_here(providers))
    assert kernels.chosen == _fused(providers)
    reference, fused = _tiny(), _tiny()
    patched = kernels.apply(fused)
    layers = fused.config.num_hidden_layers
    assert patched == {
        "rms_norm": 2 * layers + 1,
        "swiglu": layers,
        "rope": layers,
        "moe_experts": 0,
        "lm_head": 1,
    }
    want, want_grads = _run(reference)
    got, got_grads = _run(fused)
    assert kernels.chosen == _fused(providers), kernels.reasons  # none fell
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert fused.state_dict().keys() == reference.state_dict().keys()  # nothing added


def test_the_patch_is_the_instances_own(stand_ins):
    """Another model of the same classes, in the same process, keeps the eager forward."""
    kernels = choose_kernels(_here(LIGER))
    fused, other = _tiny(), _tiny()
    classes = {type(m): vars(type(m)).get("forward") for m in other.modules()}
    kernels.apply(fused)
    assert "forward" in vars(fused.model.norm) and "forward" not in vars(other.model.norm)
    attention = fused.model.layers[0].self_attn
    assert "forward" in vars(attention) and "forward" not in vars(other.model.layers[0].self_attn)
    assert {c: vars(c).get("forward") for c in classes} == classes  # no class is touched
    from transformers.models.qwen2 import modeling_qwen2

    assert modeling_qwen2.apply_rotary_pos_emb.__module__ == modeling_qwen2.__name__


def _run_twice_saying(model) -> tuple[tuple[torch.Tensor, dict], list[str]]:
    """``_run``'s first result, run twice, and the runtime warnings both runs said."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _run(model)
        _run(model)
    return first, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_a_kernel_that_fails_to_run_falls_back_once_reported(stand_ins, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("triton: no kernel for this GPU\nsecond line")

    monkeypatch.setattr(_LigerSiLUMulFunction, "apply", staticmethod(broken))
    kernels = choose_kernels(_here(LIGER))
    reference, fused = _tiny(), _tiny()
    kernels.apply(fused)
    (got, _), said = _run_twice_saying(fused)
    assert len(said) == 1 and "swiglu kernel liger failed" in said[0]
    torch.testing.assert_close(got, _run(reference)[0])
    assert kernels.chosen["swiglu"] == REFERENCE and kernels.chosen["rms_norm"] == "liger"
    assert kernels.report()["swiglu"].startswith("reference (liger failed: RuntimeError: triton")


@pytest.mark.parametrize("op", ["rms_norm", "swiglu", "rope", "lm_head"])
def test_each_patched_op_falls_back_alone_with_the_references_values(stand_ins, op):
    """Whichever op's kernel raises, that op alone runs the reference from then on, said once,
    and the model's values are the reference's (``KernelSet.guarded``)."""

    def broken(*args, **kwargs):
        raise RuntimeError(f"{op}: no kernel here")

    kernels = choose_kernels(_here(LIGER))
    kernels.calls[op] = broken
    reference, fused = _tiny(), _tiny()
    kernels.apply(fused)
    (got, got_grads), said = _run_twice_saying(fused)
    kernel = _fused(LIGER)[op]  # liger's, or crossrl's own fused head
    assert len(said) == 1 and f"the {op} kernel {kernel} failed" in said[0], said
    want, want_grads = _run(reference)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert kernels.chosen == {**_fused(LIGER), op: REFERENCE}


def test_a_kernel_that_does_not_load_is_never_chosen():
    missing = {"swiglu": Provider("liger", "crossrl_no_such_module", "X")}
    kernels = choose_kernels(missing)
    assert kernels.chosen["swiglu"] == REFERENCE
    assert "did not load: ModuleNotFoundError" in kernels.reasons["swiglu"]
    patched = kernels.apply(_tiny())
    assert patched == {"rms_norm": 0, "swiglu": 0, "rope": 0, "moe_experts": 0, "lm_head": 0}


def test_the_keys_and_settings_that_keep_the_reference(stand_ins):
    everything = choose_kernels(_here(TORCH_NPU), mode="reference")
    assert set(everything.chosen.values()) == {REFERENCE}
    assert everything.reasons == dict.fromkeys(OPS, "train.kernels")
    some = choose_kernels(_here(LIGER), reference_ops=("rms_norm",))
    assert some.chosen == {
        "rms_norm": REFERENCE,
        "swiglu": "liger",
        "rope": "liger",
        "moe_experts": "torch.grouped_mm",
        "lm_head": "crossrl-fused-head",
        "optimizer": "fused-adamw",
        "compile": REFERENCE,
    }
    # aclnnRmsNorm documents no fixed reduction order: run.deterministic keeps the reference
    fixed = choose_kernels(_here(TORCH_NPU), deterministic=True)
    assert (
        fixed.chosen["rms_norm"] == REFERENCE and "run.deterministic" in fixed.reasons["rms_norm"]
    )
    assert fixed.chosen["swiglu"] == "torch_npu.npu_swiglu"  # element-wise: deterministic
    offloaded = choose_kernels(_here(LIGER), optimizer_offload=True)
    assert offloaded.optimizer_options() == {"foreach": True}
    assert choose_kernels(_here(LIGER)).optimizer_options() == {"fused": True}


def test_the_cpu_runs_the_reference_and_the_accelerators_name_their_kernels():
    assert hal.get_backend("cpu").kernel_providers == {"compile": COMPILE}
    assert hal.backend_class("cuda").kernel_providers is LIGER
    assert hal.backend_class("npu").kernel_providers is TORCH_NPU
    cpu = choose_kernels(hal.get_backend("cpu").kernel_providers)
    assert set(cpu.chosen.values()) == {REFERENCE}
    assert cpu.reasons == {"compile": "train.compile_blocks=false"}
    asked = choose_kernels(hal.get_backend("cpu").kernel_providers, compile_blocks=True)
    assert asked.chosen["compile"] == "torch.compile"
    # inductor is not deterministic by default: run.deterministic keeps every layer eager
    fixed = choose_kernels(LIGER, compile_blocks=True, deterministic=True)
    assert fixed.chosen["compile"] == REFERENCE and "run.deterministic" in fixed.reasons["compile"]


def test_the_fused_optimizer_step_is_adamws():
    """torch's fused AdamW (what the accelerators take) against foreach (the reference) on the
    same parameters and gradients, several steps: equal within rounding."""
    torch.manual_seed(0)
    params = [torch.randn(33, 7), torch.randn(5)]
    grads = [[torch.randn_like(p) for p in params] for _ in range(4)]
    out = {}
    for options in ({"foreach": True}, {"fused": True}):
        copies = [p.clone().requires_grad_() for p in params]
        opt = torch.optim.AdamW(copies, lr=1e-2, weight_decay=0.1, **options)
        for step in grads:
            for p, g in zip(copies, step):
                p.grad = g.clone()
            opt.step()
        out[next(iter(options))] = [p.detach() for p in copies]
    for a, b in zip(out["foreach"], out["fused"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- pinned wheels


def test_the_calls_match_the_pinned_wheels():
    """Liger 0.8.5's function arguments in the order crossrl passes them, and torch_npu
    2.10.0.post4's op schemas (read from its library)."""
    for provider in (LIGER["rms_norm"], LIGER["swiglu"], LIGER["rope"]):  # the HAL's imports
        assert f"{provider.module}.{provider.attr}.forward" in API
    for provider in (TORCH_NPU["rms_norm"], TORCH_NPU["swiglu"], TORCH_NPU["rope"]):
        assert API[f"{provider.module}.{provider.attr}"] is not None
    rms = API["liger_kernel.ops.rms_norm.LigerRMSNormFunction.forward"]
    assert rms[1:7] == ["X", "W", "eps", "offset", "casting_mode", "in_place"]
    silu = API["liger_kernel.ops.swiglu.LigerSiLUMulFunction.forward"]
    assert silu[1:3] == ["a", "b"]
    rope = API["liger_kernel.ops.rope.LigerRopeFunction.forward"]
    assert rope[1:5] == ["q", "k", "cos", "sin"]
    assert API["torch_npu.npu_rotary_mul"] == (
        "npu_rotary_mul(Tensor input, Tensor r1, Tensor r2, str rotary_mode='half', "
        "Tensor? rotate=None) -> Tensor"
    )
    assert API["torch_npu.npu_rms_norm"] == (
        "npu_rms_norm(Tensor input, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)"
    )
    assert API["torch_npu.npu_swiglu"] == "npu_swiglu(Tensor input, int dim=-1) -> Tensor"
    assert API["torch_npu._fused_adamw_"] is True  # the NPU's fused AdamW kernel
    # the experts (hal.moe_experts): the keywords crossrl passes, the permute pair's arguments
    gmm = API["torch_npu.npu_grouped_matmul"]
    assert gmm.startswith("npu_grouped_matmul(Tensor[] x, Tensor[] weight, *,")
    for keyword in ("Tensor? group_list=None", "int? split_item=0", "int? group_type=None"):
        assert keyword in gmm
    assert API["torch_npu.npu_moe_token_permute"] == (
        "npu_moe_token_permute(Tensor tokens, Tensor indices, int? num_out_tokens=None, "
        "bool padded_mode=False) -> (Tensor, Tensor)"
    )
    assert API["torch_npu.npu_moe_token_unpermute"] == (
        "npu_moe_token_unpermute(Tensor permuted_tokens, Tensor sorted_indices, "
        "Tensor? probs=None, bool padded_mode=False, int[]? restore_shape=None) -> Tensor"
    )
    from hal.moe_experts import NPU_MOE_OPS

    for name in NPU_MOE_OPS.values():
        assert API[f"torch_npu.{name}"] is not None, name


@pytest.mark.parametrize(
    "path", sorted((ROOT / "configs").glob("[gn]pu/*.yaml")), ids=lambda p: p.parent.name + p.stem
)
def test_the_shipped_device_configs_take_their_devices_fused_set(path):
    """Every GPU and NPU config runs ``train.kernels=auto`` (device files set only layout keys;
    the kernel set is the device's own), the optimizer kernel fused unless it is offloaded."""
    from trainer.config import load_config

    cfg = load_config(str(path), [], check_environment=False)
    assert cfg.train.kernels == "auto" and cfg.train.reference_kernels == []
    device = path.parent.name.replace("gpu", "cuda")
    providers = hal.backend_class(device).kernel_providers
    assert providers is (LIGER if device == "cuda" else TORCH_NPU)
    offloaded = cfg.train.optimizer_offload or cfg.train.param_offload
    chosen = choose_kernels({"optimizer": providers["optimizer"]}, optimizer_offload=offloaded)
    assert chosen.optimizer_options() == ({"foreach": True} if offloaded else {"fused": True})


def _sharded_pair(rank: int, port: int, checkpointing: bool) -> None:
    """One rank of two: the patched model and the reference, each through FSDP2 (layers, then
    the root) and optionally activation checkpointing, as ``FSDPWorker.setup`` builds them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer.loop.ranks.model_loading import enable_activation_checkpointing

    module = types.ModuleType(STAND_IN)
    module.__dict__.update(
        LigerRMSNormFunction=_LigerRMSNormFunction,
        LigerSiLUMulFunction=_LigerSiLUMulFunction,
        LigerRopeFunction=_LigerRopeFunction,
    )
    sys.modules[STAND_IN] = module
    backend = hal.get_backend("cpu")
    backend.init_process_group(rank, 2, master_addr="127.0.0.1", master_port=port, timeout_s=60)
    try:
        mesh = init_device_mesh("cpu", (2,))
        kernels = choose_kernels(_here(LIGER))
        out = {}
        for name, patch in (("reference", False), ("fused", True)):
            model = _tiny()
            if patch:
                kernels.apply(model)
            if checkpointing:
                enable_activation_checkpointing(model)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            logits, grads = _run(model)
            out[name] = logits, {n: g.full_tensor() for n, g in grads.items()}
        assert kernels.chosen["rope"] == "liger", kernels.reasons  # nothing fell back
        assert kernels.chosen["lm_head"] == FUSED_HEAD.name, kernels.reasons
        torch.testing.assert_close(out["fused"][0], out["reference"][0], rtol=1e-5, atol=1e-6)
        for name, grad in out["reference"][1].items():
            torch.testing.assert_close(out["fused"][1][name], grad, rtol=1e-5, atol=1e-6)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    finish_rank()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "checkpointing"])
def test_the_patch_holds_under_fsdp2_and_activation_checkpointing(checkpointing):
    import torch.multiprocessing as mp

    from trainer.loop.cluster.group import free_port

    mp.spawn(_sharded_pair, args=(free_port(), checkpointing), nprocs=2, join=True)


# ----------------------------------------------------------------------------- on a device


def _on_device(device: str, providers: dict[str, Provider]) -> None:
    """The real fused set on ``device`` against the reference, fp32: the same values and
    gradients up to the kernels' own summation order, and no op fell back."""
    kernels = choose_kernels(providers)
    assert kernels.chosen == _fused(providers), kernels.reasons
    reference, fused = _tiny().to(device), _tiny().to(device)
    kernels.apply(fused)
    want, want_grads = _run(reference)
    got, got_grads = _run(fused)
    assert kernels.chosen == _fused(providers), kernels.reasons
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_liger_on_cuda_gives_the_references_values_and_gradients():
    pytest.importorskip("liger_kernel", reason="pip install -c constraints-gpu.txt -e '.[gpu]'")
    _on_device("cuda", LIGER)


@pytest.mark.npu
def test_torch_npu_ops_give_the_references_values_and_gradients():
    if "npu" not in hal.available_backends():
        pytest.skip("needs an Ascend NPU and torch_npu")
    _on_device(str(hal.get_backend("npu").device(0)), TORCH_NPU)
