"""Expert parallelism (``train.expert_parallel_size``, ``trainer.loop.ranks.expert_parallel``):
the tiny MoE's experts split over 2 and 4 gloo ranks give the update of the unsplit run, to
fp32 rounding: the loss, the gradient norm and every parameter after one optimizer step.

Each layout runs the real ``PolicyWorker`` (FSDP2 over gloo) in spawned processes on
``test_trainer_dp_invariance``'s recorded multi-turn batch, replayed routing and the
load-balancing loss on, so the all-to-all carries every gradient the job takes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from batching import StepBatch, plan_minibatches
from tests.gloo_ranks import report_and_finish
from tests.test_trainer_dp_invariance import JOB, _assert_same_params, _recorded_batch
from trainer.loop.cluster.group import free_port

MOE = [*(k for k in JOB if not k.startswith("model.path")), "model.path=builtin:tiny-moe"]
MOE += ["algorithm.router_aux_loss_coef=0.01", "train.grad_clip=1.0"]
#: LoRA targets a mixture takes (``rollout.lora.target_problem``): the attention's.
ATTENTION = "[q_proj,k_proj,v_proj,o_proj]"


def _npu_stand_in_kernels() -> None:
    """This rank's CPU backend offers the NPU's experts kernel (torch_npu's grouped GEMM and
    SwiGLU as ``tests.test_kernels``' stand-ins, which follow their rules) as the device's
    own ``moe_experts``."""
    import sys
    import types
    from dataclasses import replace

    from hal.cpu import CpuBackend
    from hal.kernels import TORCH_NPU
    from tests import test_kernels as stand

    module = types.ModuleType(stand.STAND_IN)
    module.npu_grouped_matmul = stand._npu_grouped_matmul
    module.npu_swiglu = stand._npu_swiglu
    sys.modules[stand.STAND_IN] = module
    CpuBackend.kernel_providers = {
        "moe_experts": replace(TORCH_NPU["moe_experts"], module=stand.STAND_IN)
    }


def _run_rank(
    rank: int, world: int, ep: int, port: int, arrays, queue, kernels: bool, extra: list
) -> None:
    from tests.test_kernels import SWIGLU_INPUTS
    from trainer.config import load_config
    from trainer.loop.ranks.fsdp_worker import WorkerSpec
    from trainer.loop.ranks.policy import PolicyWorker

    torch.set_num_threads(1)
    if kernels:
        _npu_stand_in_kernels()
    batch = StepBatch.from_numpy(arrays)
    plan = plan_minibatches(
        batch.row_fields["trajectory_id"].numpy(),
        batch.seq_lens,
        mini_batch_size=3,
        dp_size=world,
        group_ids=batch.row_fields["uid"].numpy(),
    )
    (mini,) = plan.mini_batches
    overrides = [*MOE, *extra, f"train.dp_size={world}", f"train.expert_parallel_size={ep}"]
    cfg = load_config(None, overrides, check_environment=False)
    worker = PolicyWorker(WorkerSpec(role="actor", rank=rank, cfg=cfg))
    worker.setup("127.0.0.1", port)
    worker.load_batch([arrays])
    worker.compute_advantages()
    report = worker.train_mini_batch(mini.micro_batches[rank], mini.rows.tolist())
    state = {k: v.numpy().copy() for k, v in worker.full_state_dict().items()}
    local = {  # where each experts weight lives: the (dp, ep) mesh, or the flat one
        n: p.device_mesh.mesh_dim_names
        for n, p in worker.model.named_parameters()
        if n.endswith("experts.gate_up_proj")
    }
    assert worker.kernels.report()["moe_experts"] == (
        "torch_npu.npu_grouped_matmul" if kernels else "reference"
    )
    metrics = dict(report.values, kernel_calls=len(SWIGLU_INPUTS))
    report_and_finish(queue, (rank, (state, metrics, local)))


def _train(
    world: int, ep: int, kernels: bool = False, extra: tuple[str, ...] = ()
) -> tuple[dict, dict, dict]:
    arrays = _recorded_batch().to_numpy()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_run_rank, args=(r, world, ep, port, arrays, queue, kernels, list(extra))
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    per_rank = dict(queue.get(timeout=300) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    state, metrics, local = per_rank[0]
    metrics = dict(metrics, loss=sum(per_rank[r][1]["loss"] for r in range(world)))
    return state, metrics, local


@pytest.mark.slow
@pytest.mark.parametrize(("world", "ep"), [(2, 2), (4, 4), (4, 2)])
def test_split_experts_train_as_the_unsplit_run(world, ep):
    base_state, base_metrics, base_local = _train(world, 1)
    state, metrics, local = _train(world, ep)
    _assert_same_params(base_state, state)
    for key in ("grad_norm", "loss", "router_aux_loss"):
        assert metrics[key] == pytest.approx(base_metrics[key], rel=1e-5, abs=1e-9), key
    assert set(local.values()) == {("dp", "ep")} and ("dp", "ep") not in base_local.values()
    from rollout.models import load_model

    initial = load_model("builtin:tiny-moe", dtype="float32", seed=1).state_dict()
    expert = "model.layers.1.mlp.experts.gate_up_proj"
    assert np.abs(state[expert] - initial[expert].numpy()).max() > 1e-4  # the experts moved


@pytest.mark.slow
def test_split_experts_through_the_device_s_grouped_gemm_train_as_the_unsplit_run():
    """EP 2 whose local experts run the NPU's experts kernel (the stand-ins; the kernel set's
    ``expert_rows``) against the unsplit run on the reference: same update."""
    base_state, base_metrics, _ = _train(2, 1)
    state, metrics, _ = _train(2, 2, kernels=True)
    assert metrics["kernel_calls"] > 0 and base_metrics["kernel_calls"] == 0
    _assert_same_params(base_state, state)
    for key in ("grad_norm", "loss", "router_aux_loss"):
        assert metrics[key] == pytest.approx(base_metrics[key], rel=1e-5, abs=1e-9), key


def test_expert_parallel_size_that_cannot_split_is_refused_by_key():
    from trainer.config import load_config
    from trainer.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train.expert_parallel_size: got 3; must divide"):
        load_config(None, ["train.dp_size=4", "train.expert_parallel_size=3"])
    keys = ["train.dp_size=2", "train.expert_parallel_size=2", "train.param_offload=true"]
    cfg = load_config(None, [*keys, "model.lora.rank=4"], check_environment=False)
    assert cfg.train.expert_parallel_size == 2 and cfg.model.lora.enabled


def test_adapters_on_a_mixture_s_experts_are_refused_before_start_up_naming_the_targets():
    """peft would put the default targets' ``gate_proj`` / ``up_proj`` / ``down_proj`` on the
    fused experts weights: refused in one line before start-up (preflight), naming the key
    and the targets that work; the other layers' adapters go."""
    from rollout.lora import target_problem
    from rollout.models import load_model
    from trainer.config import load_config
    from trainer.loop.start.preflight import PreflightError, _check_lora_targets

    model = load_model("builtin:tiny-moe", seed=1)
    assert target_problem(model, ["q_proj", "o_proj"]) is None
    keys = ["model.path=builtin:tiny-moe", "model.lora.rank=4"]
    with pytest.raises(PreflightError, match=r"'gate_proj' also names the experts") as err:
        _check_lora_targets(load_config(None, keys, check_environment=False))
    assert "model.lora.target_modules=" in str(err.value) and "\n" not in str(err.value)
    assert "['q_proj', 'k_proj', 'v_proj', 'o_proj']" in str(err.value)
    fine = load_config(
        None, [*keys, f"model.lora.target_modules={ATTENTION}"], check_environment=False
    )
    _check_lora_targets(fine)


def _job(run_dir, steps: int, ep: int, resume: str) -> list[dict]:
    from trainer.config import load_config
    from trainer.loop.start.run import run_training
    from trainer.records.jsonl_files import read_jsonl

    keys = [
        "model.path=builtin:tiny-moe",
        f"run.dir={run_dir}",
        "train.dp_size=2",
        f"train.total_steps={steps}",
        f"run.resume={resume}",
        f"train.expert_parallel_size={ep}",
        "algorithm.routing_replay=rollout",
    ]
    assert run_training(load_config(None, keys)) == 0
    return read_jsonl(run_dir / "metrics.jsonl")


@pytest.mark.slow
def test_a_split_run_resumes_unsplit_and_exports_whole_experts(tmp_path):
    """The default job on the tiny MoE at dp 2: two steps with the experts split over both
    ranks, resumed for a third unsplit, equal three unsplit steps (the checkpoint holds whole
    experts whatever the split); the export loads in transformers with the trained experts."""
    plain = _job(tmp_path / "plain", 3, 1, "never")
    _job(tmp_path / "split", 2, 2, "never")
    resumed = _job(tmp_path / "split", 3, 1, "auto")
    assert [m["step"] for m in resumed] == [1, 2, 3]
    for a, b in zip(plain, resumed, strict=True):
        for key in ("actor/loss", "actor/grad_norm", "rollout/score_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-9), (a["step"], key)
    from transformers import AutoModelForCausalLM

    from trainer.commands.export import export_run

    out = export_run(tmp_path / "split", tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    from rollout.models import load_model

    initial = load_model("builtin:tiny-moe", seed=1).state_dict()
    expert = "model.layers.1.mlp.experts.gate_up_proj"
    assert not torch.equal(exported[expert], initial[expert])


@pytest.mark.parametrize("device", ["cpu", "cuda", "npu"])
def test_engine_expert_parallelism_is_vllms_own_option_on_every_backend(device):
    """``rollout.expert_parallel``: the HAL hands vLLM (and vllm-ascend, which takes vLLM's
    argument) ``enable_expert_parallel``; nothing when off. Built without the device."""
    from hal.registry import backend_class

    backend = backend_class(device)()
    assert backend.vllm_expert_parallel_options(True) == {"enable_expert_parallel": True}
    assert backend.vllm_expert_parallel_options(False) == {}


def test_engine_expert_parallelism_needs_vllm_over_several_ranks():
    from trainer.config import load_config
    from trainer.config.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"rollout.expert_parallel: got true; .*engine=vllm \(now hf\)"
    ):
        load_config(None, ["rollout.expert_parallel=true"], check_environment=False)
    gpu = "configs/gpu/qwen3-30b-a3b-grpo.yaml"
    cfg = load_config(gpu, ["rollout.expert_parallel=true"], check_environment=False)
    assert cfg.rollout.expert_parallel and cfg.rollout.tensor_parallel_size == 4


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ("train.param_offload=true",),
        ("model.lora.rank=4", f"model.lora.target_modules={ATTENTION}"),
        ("train.param_offload=true", "model.lora.rank=4", f"model.lora.target_modules={ATTENTION}"),
    ],
    ids=["param_offload", "lora", "both"],
)
def test_split_experts_with_offload_or_adapters_train_as_the_unsplit_run(extra):
    """FSDP2's CPU offload of every shard (the experts' over the ``(dp, ep)`` mesh included),
    LoRA adapters on the attention (the experts frozen, sharded all the same), and both, with
    EP 2 against the same run unsplit."""
    base_state, base_metrics, _ = _train(2, 1, extra=extra)
    state, metrics, _ = _train(2, 2, extra=extra)
    _assert_same_params(base_state, state)
    for key in ("grad_norm", "loss", "router_aux_loss"):
        assert metrics[key] == pytest.approx(base_metrics[key], rel=1e-5, abs=1e-9), key
