"""Backend selection, per-device facts, determinism, offload and `crossrl devices` output.

The cuda and npu backends are checked as plain objects: nothing here needs their devices, and
nothing imports torch_npu.
"""

from __future__ import annotations

import os
import random
import sys
import warnings

import numpy as np
import pytest
import torch

import hal
from hal.cuda import flash_attn_installed
from hal.npu import NPU_MAX_SEGMENTS_PER_CALL, split_segments, torch_npu_installed
from hal.registry import _STATUS

# ---- selection ---------------------------------------------------------------------------------


def test_unknown_backend_name_is_a_value_error_listing_choices():
    with pytest.raises(ValueError, match=r"'bogus'.*auto.*cpu.*cuda.*npu"):
        hal.get_backend("bogus")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_absent_cuda_raises_clear_error():
    with pytest.raises(hal.DeviceNotAvailableError, match=r"asked for 'cuda'.*found: cpu.*Fix"):
        hal.get_backend("cuda")


@pytest.mark.skipif(torch_npu_installed(), reason="torch_npu is installed here")
def test_absent_npu_raises_clear_error_without_importing_torch_npu():
    with pytest.raises(hal.DeviceNotAvailableError) as info:
        hal.get_backend("npu")
    message = str(info.value)
    assert "asked for 'npu' but torch_npu is not installed" in message
    assert "found: " in message and "cpu" in message and "Fix" in message
    assert isinstance(info.value, RuntimeError)
    assert "torch_npu" not in sys.modules


def test_available_backends_and_auto():
    names = hal.available_backends()
    assert names[-1] == "cpu"
    assert set(names) <= {"cpu", "cuda", "npu"}
    assert hal.get_backend("auto").name == names[0]
    assert hal.get_backend("cpu") is hal.get_backend("cpu")  # one instance per process


@pytest.mark.parametrize("name", ["cuda", "npu"])
def test_status_reasons_agree_with_availability(name):
    assert (_STATUS[name]() is None) == (name in hal.available_backends())


# ---- per-device facts (device-free) ------------------------------------------------------------

FACTS = {
    # name: device_type, process group, visible-devices env, ray resource, ray no-set env var
    "cpu": ("cpu", "gloo", None, "CPU", None),
    "cuda": (
        "cuda",
        "nccl",
        "CUDA_VISIBLE_DEVICES",
        "GPU",
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
    ),
    "npu": (
        "npu",
        "hccl",
        "ASCEND_RT_VISIBLE_DEVICES",
        "NPU",
        "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES",
    ),
}


@pytest.mark.parametrize("name", sorted(FACTS))
def test_backend_class_facts(name):
    backend = hal.backend_class(name)()
    got = (
        backend.device_type,
        backend.process_group_backend,
        backend.visible_devices_env,
        backend.ray_resource,
        backend.ray_noset_env_var,
    )
    assert backend.name == name
    assert got == FACTS[name]
    assert isinstance(backend.attention_impl_name, str) and backend.attention_impl_name
    if name == "cuda" or (name == "npu" and torch_npu_installed()):
        assert backend.device(3) == torch.device(name, 3)


def test_npu_backend_object_does_not_import_torch_npu():
    backend = hal.NpuBackend()
    assert "npu_fusion_attention" in backend.attention_impl_name
    assert backend.deterministic_env()["HCCL_DETERMINISTIC"] == "true"
    assert backend.deterministic_env()["CLOSE_MATMUL_K_SHIFT"] == "1"
    if not torch_npu_installed():
        assert "torch_npu" not in sys.modules


def test_cuda_deterministic_env_sets_cublas_workspace():
    assert hal.CudaBackend().deterministic_env() == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def test_cuda_attention_name_says_which_kernel():
    name = hal.CudaBackend().attention_impl_name
    assert ("flash-attn" in name.split(" (")[0]) == flash_attn_installed()


def test_npu_fusion_attention_args_from_cu_seqlens():
    cu = torch.tensor([0, 3, 3, 10, 12], dtype=torch.int32)
    args = hal.npu_fusion_attention_args(cu, num_heads=8, scale=0.125)
    assert args["input_layout"] == "TND"
    assert args["head_num"] == 8
    assert args["scale"] == 0.125
    assert args["keep_prob"] == 1.0
    assert args["sparse_mode"] == 3  # right-down causal
    # cumulative END offsets as python ints, no leading zero, same for q and kv
    assert args["actual_seq_qlen"] == [3, 3, 10, 12]
    assert args["actual_seq_kvlen"] == [3, 3, 10, 12]
    assert all(type(x) is int for x in args["actual_seq_qlen"])
    mask = args["atten_mask"]
    assert mask.shape == (2048, 2048) and mask.dtype == torch.bool
    # True = masked out: exactly the strictly upper triangle
    assert not mask.diagonal().any()
    assert mask[0, 1] and not mask[1, 0]
    assert int(mask.sum()) == 2048 * 2047 // 2
    assert hal.npu_fusion_attention_args([0, 4], 2, 1.0, dropout=0.1)["keep_prob"] == 0.9


def test_npu_fusion_attention_args_rejects_bad_offsets():
    with pytest.raises(ValueError, match="start at 0"):
        hal.npu_fusion_attention_args([2, 5], num_heads=2, scale=1.0)
    too_many = list(range(NPU_MAX_SEGMENTS_PER_CALL + 2))
    with pytest.raises(ValueError, match="at most"):
        hal.npu_fusion_attention_args(too_many, num_heads=2, scale=1.0)


def test_split_segments_covers_the_row_in_order():
    lens = [3, 1, 4, 1, 5, 9, 2]
    offsets = [0, *np.cumsum(lens).tolist()]
    chunks = split_segments(offsets, max_segments=3)
    bounds = [sum(lens[:i]) for i in (0, 3, 6, 7)]  # three segments per chunk, then the rest
    assert [c[:2] for c in chunks] == list(zip(bounds[:-1], bounds[1:]))
    rebuilt = []
    for start, _, local in chunks:
        assert local[0] == 0 and len(local) - 1 <= 3
        rebuilt += [start + x for x in local[1:]]
    assert [0, *rebuilt] == offsets


def test_flash_attn_varlen_kwargs():
    cu = torch.tensor([0, 5, 16, 19], dtype=torch.int64)
    kw = hal.flash_attn_varlen_kwargs(cu, max_seqlen=11, scale=0.25, deterministic=True)
    assert kw["cu_seqlens_q"].dtype == torch.int32 and kw["cu_seqlens_k"].dtype == torch.int32
    assert kw["cu_seqlens_q"].tolist() == [0, 5, 16, 19]
    assert kw["max_seqlen_q"] == kw["max_seqlen_k"] == 11
    assert kw["causal"] is True
    assert kw["softmax_scale"] == 0.25 and kw["dropout_p"] == 0.0
    assert kw["deterministic"] is True


# ---- cpu backend behaviour ---------------------------------------------------------------------


def test_cpu_backend_basics():
    cpu = hal.get_backend("cpu")
    assert cpu.device(5) == torch.device("cpu")
    assert cpu.device_count() == 1
    assert cpu.memory_stats() == {"allocated": 0, "reserved": 0, "max_allocated": 0}
    cpu.set_device(0)
    cpu.synchronize()
    cpu.empty_cache()


def test_manual_seed_seeds_python_numpy_and_torch():
    cpu = hal.get_backend("cpu")

    def draw():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    cpu.manual_seed(123)
    first = draw()
    cpu.manual_seed(123)
    assert draw() == first
    cpu.manual_seed(124)
    assert draw() != first


def test_set_deterministic_applies_and_reports_settings():
    was = torch.are_deterministic_algorithms_enabled()
    try:
        applied = hal.get_backend("cpu").set_deterministic(9)
        assert torch.are_deterministic_algorithms_enabled()
        assert applied["torch.use_deterministic_algorithms"] == "True"
        assert applied["seed"] == "9"
        # deterministic kernels, but new tensors are not NaN-filled (it costs, changes nothing)
        assert (
            torch.empty(4).numel() == 4 and not torch.utils.deterministic.fill_uninitialized_memory
        )
        assert applied["torch.utils.deterministic.fill_uninitialized_memory"] == "False"
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in applied.items())
    finally:
        torch.use_deterministic_algorithms(was)


def test_init_process_group_rejects_bad_rank():
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        hal.get_backend("cpu").init_process_group(2, 2, master_addr="127.0.0.1", master_port=1)


# ---- offload / onload --------------------------------------------------------------------------


def _trained_model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2)
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def _snapshot(model, opt):
    tensors = {f"p.{n}": t.detach().clone() for n, t in model.state_dict().items()}
    for i, state in enumerate(opt.state.values()):
        tensors.update({f"s{i}.{k}": v.clone() for k, v in state.items()})
    return tensors


def test_walk_tensors_reaches_params_grads_buffers_and_optimizer_state():
    model, opt = _trained_model_and_optimizer()
    before = _snapshot(model, opt)
    n_params = len(list(model.parameters()))
    n_buffers = len(list(model.buffers()))

    # a stand-in "device move": a dtype change shows which tensors the walk touched
    assert hal.walk_tensors(model, lambda t: t.to(torch.float64)) == 2 * n_params + n_buffers
    assert all(
        p.dtype == torch.float64 and p.grad.dtype == torch.float64 for p in model.parameters()
    )
    assert model[1].running_mean.dtype == torch.float64
    moved = hal.walk_tensors(opt, lambda t: t.to(torch.float64))
    assert moved == 2 * n_params  # exp_avg and exp_avg_sq per parameter
    for state in opt.state.values():
        assert state["exp_avg"].dtype == torch.float64
        assert state["step"].dtype == torch.float32  # 0-d step counters stay put

    hal.walk_tensors(model, lambda t: t.to(torch.float32) if t.is_floating_point() else t)
    hal.walk_tensors(opt, lambda t: t.to(torch.float32))
    after = _snapshot(model, opt)
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key


def test_cpu_offload_onload_is_a_value_preserving_no_op():
    model, opt = _trained_model_and_optimizer()
    before = _snapshot(model, opt)
    ptrs = [p.data_ptr() for p in model.parameters()]
    cpu = hal.get_backend("cpu")
    for obj in (model, opt):
        cpu.offload(obj)
        cpu.onload(obj)
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    after = _snapshot(model, opt)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_offload_rejects_other_objects():
    with pytest.raises(ValueError, match="nn.Module or a torch.optim.Optimizer"):
        hal.walk_tensors({"not": "a module"}, lambda t: t)


@pytest.mark.skipif(hal.available_backends()[0] == "cpu", reason="no accelerator here")
def test_accelerator_offload_round_trip():
    acc = hal.get_backend("auto")
    acc.set_device(0)
    model, opt = _trained_model_and_optimizer()
    model.to(acc.device(0))
    for state in opt.state.values():
        for k, v in state.items():
            if v.dim() > 0:
                state[k] = v.to(acc.device(0))
    before = {k: v.cpu() for k, v in _snapshot(model, opt).items()}
    acc.offload(model)
    acc.offload(opt)
    assert all(p.device.type == "cpu" and p.is_pinned() for p in model.parameters())
    acc.onload(model, 0)
    acc.onload(opt, 0)
    assert all(p.device == acc.device(0) for p in model.parameters())
    after = {k: v.cpu() for k, v in _snapshot(model, opt).items()}
    assert all(torch.equal(before[k], after[k]) for k in before)


# ---- describe / crossrl devices ----------------------------------------------------------------


def test_describe_and_format_devices():
    from hal.cli_devices import format_devices

    info = hal.describe()
    assert info["backend"] == hal.available_backends()[0]
    assert info["device_count"] >= 1 and len(info["device_names"]) >= 1
    assert info["process_group_backend"] in {"gloo", "nccl", "hccl"}
    for pkg in ("torch", "torch_npu", "vllm", "vllm_ascend", "transformers", "ray"):
        assert pkg in info["versions"]
    assert info["versions"]["torch"] == torch.__version__
    if not torch_npu_installed():
        assert info["versions"]["torch_npu"] == "not installed"
        assert "torch_npu" not in sys.modules

    text = format_devices(info)
    assert info["backend"] in text and info["attention_impl"] in text
    assert info["versions"]["torch"] in text
    assert len(text.splitlines()) >= 10


# ---- cuda varlen kernel choice: device-free logic ----------------------------------------------


def test_torch_varlen_kwargs_follow_the_installed_signature():
    from hal.cuda import torch_varlen_kwargs

    scale = 0.125  # head_dim 64's default
    old = ["query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal"]
    assert torch_varlen_kwargs(old, scale=scale, head_dim=64, gqa=False) == {"is_causal": True}
    # torch 2.9 has no scale argument: a non-default scale cannot be expressed
    assert torch_varlen_kwargs(old, scale=0.3, head_dim=64, gqa=False) is None
    mid = ["query", "key", "value", "return_aux", "scale", "window_size"]
    assert torch_varlen_kwargs(mid, scale=0.3, head_dim=64, gqa=True) == {
        "window_size": (-1, 0),
        "scale": 0.3,
    }
    new = [*mid, "enable_gqa"]
    assert torch_varlen_kwargs(new, scale=0.3, head_dim=64, gqa=True)["enable_gqa"] is True
    assert torch_varlen_kwargs(["query", "key"], scale=scale, head_dim=64, gqa=False) is None


def _packed_qkv(dtype=torch.bfloat16, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, h, 8, generator=gen).to(device, dtype) for h in (4, 2, 2))
    return q, k, v, [0, 5, 5, 12]


def test_cuda_varlen_falls_back_once_with_a_warning_when_a_kernel_fails(monkeypatch, request):
    """A kernel that cannot run (here: torch's flash varlen on CPU tensors; on a GPU, a
    flash-attn built against another CUDA) is reported once and SDPA per segment takes over."""
    import hal.cuda
    from hal.sdpa import segmented_sdpa

    monkeypatch.setattr(hal.cuda, "_BROKEN", {})
    monkeypatch.setattr(hal.cuda, "flash_attn_installed", lambda: True)
    # A deterministic run skips torch's varlen kernel; an earlier in-process worker setup may
    # have left the global switch on, so this test sets it itself.
    was = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    request.addfinalizer(lambda: torch.use_deterministic_algorithms(was, warn_only=warn_only))
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import raises ImportError
    q, k, v, offsets = _packed_qkv()
    backend = hal.CudaBackend()
    with pytest.warns(RuntimeWarning, match="falls back to SDPA") as caught:
        out = backend.varlen_attention(q, k, v, torch.tensor(offsets), max_seqlen=7, scale=8**-0.5)
    expected_broken = {"flash-attn"} | ({"torch varlen_attn"} if _torch_has_varlen() else set())
    assert set(hal.cuda._BROKEN) == expected_broken
    assert len(caught) == len(expected_broken)
    torch.testing.assert_close(out, segmented_sdpa(q, k, v, offsets, scale=8**-0.5))
    assert backend.attention_impl_name.startswith("sdpa-segmented")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call neither retries nor warns again
        backend.varlen_attention(q, k, v, torch.tensor(offsets), max_seqlen=7, scale=8**-0.5)


def _torch_has_varlen() -> bool:
    from hal.cuda import _torch_varlen_fn

    return _torch_varlen_fn() is not None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_precision_varlen_matches_reference_forward_and_backward(dtype):
    import hal.cuda
    from hal.sdpa import segmented_sdpa

    q, k, v, offsets = _packed_qkv(dtype, "cuda")
    for t in (q, k, v):
        t.requires_grad_(True)
    cu = torch.tensor(offsets, device="cuda")
    out = hal.CudaBackend().varlen_attention(q, k, v, cu, max_seqlen=7, scale=8**-0.5)
    assert "torch varlen_attn" not in hal.cuda._BROKEN, hal.cuda._BROKEN
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref = segmented_sdpa(q, k, v, offsets, scale=8**-0.5)
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)


# ---- hardening: determinism, device RNG, NPU layout (device-free) ------------------------------


def test_accelerators_run_deterministic_in_warn_only_mode_cpu_stays_strict():
    """An op without a deterministic kernel must not kill an accelerator parity run (it warns,
    naming the op); the CPU reference keeps raising."""
    assert hal.CpuBackend().deterministic_warn_only is False
    assert hal.CudaBackend().deterministic_warn_only is True
    assert hal.NpuBackend().deterministic_warn_only is True
    was = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    backend = hal.CudaBackend()
    try:
        # seeding the absent device is lazy in torch.cuda; only the torch switches are checked
        applied = backend.set_deterministic(3)
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert applied["torch.use_deterministic_algorithms"] == "warn_only"
        # SDPA never picks cuDNN attention, whose backward is not deterministic
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert applied["torch.backends.cuda.enable_cudnn_sdp"] == "False"
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        torch.backends.cudnn.deterministic = False
        torch.backends.cuda.enable_cudnn_sdp(True)
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


class _FakeDeviceModule:
    def __init__(self):
        self.states = [torch.tensor([1, 2, 3], dtype=torch.uint8)]

    def get_rng_state_all(self):
        return self.states

    def set_rng_state_all(self, states):
        self.states = [s.clone() for s in states]


def test_device_rng_state_round_trips_through_a_checkpoint_file(tmp_path, monkeypatch):
    from trainer.records.checkpoint import load_torch, rng_state, save_torch, set_rng_state

    assert hal.CpuBackend().device_rng_state() is None
    fake = _FakeDeviceModule()
    backend = hal.CudaBackend()
    monkeypatch.setattr(backend, "device_module", lambda: fake)
    save_torch(rng_state(backend.device_rng_state), tmp_path / "rng.pt")
    fake.states = [torch.tensor([9, 9, 9], dtype=torch.uint8)]  # the device drew on
    set_rng_state(load_torch(tmp_path / "rng.pt"), backend.set_device_rng_state)
    assert fake.states[0].tolist() == [1, 2, 3]


def test_npu_kernel_gets_contiguous_q_k_v(monkeypatch):
    """The attention interface passes [T, H, D] views of [1, H, T, D] tensors; the fused
    kernel must see dense TND tensors (checked with a stand-in for torch_npu)."""
    import types

    import hal.npu

    seen = []

    def fake_fusion_attention(q, k, v, **kwargs):
        seen.append((q.is_contiguous(), k.is_contiguous(), v.is_contiguous(), kwargs["head_num"]))
        return (q.clone(),)

    fake = types.SimpleNamespace(npu_fusion_attention=fake_fusion_attention)
    monkeypatch.setattr(hal.npu, "import_torch_npu", lambda: fake)
    heads = torch.randn(1, 4, 10, 8)  # [1, H, T, D]
    q = k = v = heads[0].transpose(0, 1)  # [T, H, D] view, as crossrl_attention_forward makes
    assert not q.is_contiguous()
    out = hal.NpuBackend().varlen_attention(
        q, k, v, torch.tensor([0, 4, 10]), max_seqlen=6, scale=8**-0.5
    )
    assert seen == [(True, True, True, 4)]
    torch.testing.assert_close(out, q)


def test_local_device_index_follows_rays_assignment_in_any_rank_order():
    """With Ray's no-set variable exported every rank sees all devices and Ray's ids may come
    out of rank order; the process group and the model must both use the assigned device,
    not rank % device_count."""
    cuda, npu = hal.CudaBackend(), hal.NpuBackend()
    # rank 0 was given device 1 and rank 1 device 0
    assert [cuda.local_device_index([i], environ={}) for i in ("1", "0")] == [1, 0]
    # the node exposes a subset: Ray's ids are node ids, the index is their position
    env = {"CUDA_VISIBLE_DEVICES": "4,6"}
    assert cuda.local_device_index(["6"], environ=env) == 1
    assert npu.local_device_index(["3"], environ={"ASCEND_RT_VISIBLE_DEVICES": "2, 3"}) == 1
    # without Ray's ids (Ray narrowed the visible devices, or no Ray): LOCAL_RANK, else 0
    assert cuda.local_device_index(None, environ={"LOCAL_RANK": "2"}) == 2
    assert cuda.local_device_index([], environ={}) == 0
    assert hal.CpuBackend().local_device_index(None, environ={}) == 0


@pytest.mark.parametrize(
    "engine, name, deterministic, on",
    [
        ("vllm", "cuda", True, True),
        ("vllm", "npu", True, True),
        ("vllm", "cpu", True, False),  # vLLM's CPU platform has no batch-invariant kernels
        ("vllm", "cuda", False, False),  # the shipped agent configs: speed, not identical tokens
        ("hf", "cuda", True, False),  # seeded per request already
    ],
)
def test_a_deterministic_vllm_run_turns_on_the_engines_batch_invariant_mode(
    engine, name, deterministic, on
):
    """Issue 45 item 10: a restart or resume repeats a vLLM run's tokens only where vLLM's
    batch-invariant mode is on; the rollout host turns it on exactly where the pinned engine
    has it (vLLM 0.24 on CUDA, vllm-ascend 0.26.0rc1 on Ascend)."""
    from trainer.config import load_config
    from trainer.loop.engines.engine_host import engine_batch_invariance

    keys = [f"rollout.engine={engine}", f"run.deterministic={str(deterministic).lower()}"]
    cfg = load_config(None, keys, check_environment=False)
    backend = {"cuda": hal.CudaBackend, "npu": hal.NpuBackend, "cpu": hal.CpuBackend}[name]()
    assert engine_batch_invariance(cfg, backend) == ({"VLLM_BATCH_INVARIANT": "1"} if on else {})
