"""Where the training worker's sharded parameters and optimizer state actually live.

``train.param_offload`` goes through FSDP2's CPU-offload policy: the sharded parameters, their
gradients and the optimizer step stay in host memory (pinned on an accelerator) and are
gathered onto the device per use. ``train.optimizer_offload`` parks the optimizer's DTensor
state in pinned host memory between optimizer steps. One rank that needs none of FSDP2's
policies trains the plain module. On the CPU backend the tests check the policy FSDP2 holds and
that offloading changes no number; what needs a device is skipped.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor

import hal
from batching import Row, StepBatch, plan_minibatches
from trainer.config import load_config
from trainer.loop.cluster.group import free_port
from trainer.loop.ranks.fsdp_worker import WorkerSpec
from trainer.loop.ranks.policy import PolicyWorker

ACCELERATOR = hal.available_backends()[0] != "cpu"
needs_accelerator = pytest.mark.skipif(
    not ACCELERATOR, reason="host vs device placement needs an accelerator (cuda or npu)"
)


def _batch() -> StepBatch:
    """One GRPO group of 4 short rows with mixed scores."""
    rows = [
        Row(
            prompt_ids=[5, 6, 7, 8],
            response_ids=[10 + i, 20 + i, 30, 40 + i],
            response_mask=[1, 1, 1, 1],
            response_logprobs=[-2.0] * 4,
            uid=0,
            trajectory_id=i,
            step_index=0,
            is_last_step=True,
            score=float(i % 2),
        )
        for i in range(4)
    ]
    return StepBatch.from_rows(rows)


def _actor(device: str, *overrides: str) -> PolicyWorker:
    cfg = load_config(
        None,
        [
            f"device={device}",
            "train.dp_size=1",
            "model.path=builtin:tiny",
            "train.lr=1e-3",
            "run.deterministic=false",
            *overrides,
        ],
    )
    worker = PolicyWorker(WorkerSpec(role="actor", rank=0, cfg=cfg))
    worker.setup("127.0.0.1", free_port())
    return worker


def _update(worker: PolicyWorker) -> None:
    """One step's training work: log-probs, advantages, one optimizer step."""
    batch = _batch()
    worker.load_batch([batch.to_numpy()])
    (mini,) = plan_minibatches(
        batch.row_fields["trajectory_id"].numpy(),
        batch.seq_lens,
        mini_batch_size=1,
        dp_size=1,
        group_ids=batch.row_fields["uid"].numpy(),
    ).mini_batches
    worker.set_token_field("old_logprobs", [worker.compute_logprobs(mini.micro_batches[0])])
    worker.compute_advantages()
    worker.train_mini_batch(mini.micro_batches[0], mini.rows.tolist())


def _param_groups(model: torch.nn.Module) -> list:
    # FSDP2 has no public getter for a module's parameter group; the policy is read there.
    return [
        m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)
    ]


def _optimizer_states(worker: PolicyWorker) -> list[torch.Tensor]:
    return [
        value
        for state in worker.optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    ]


def test_param_offload_is_fsdp2_cpu_offload_and_changes_no_number():
    plain = _actor("cpu")
    try:
        _update(plain)
        expected = {k: v.clone() for k, v in plain.full_state_dict().items()}
        plain_groups = len(_param_groups(plain.model))
    finally:
        plain.shutdown()
    worker = _actor("cpu", "train.param_offload=true")
    try:
        groups = _param_groups(worker.model)
        # One rank with no FSDP2 policy trains the plain module; with the offload policy, one
        # group per decoder layer and the root, each under it; a CPU run asks for no
        # page-locked memory.
        assert plain_groups == 0
        assert len(groups) == len(worker.model.model.layers) + 1
        for group in groups:
            assert isinstance(group.offload_policy, CPUOffloadPolicy)
            assert group.offload_policy.pin_memory is False
        for name, param in worker.model.named_parameters():
            assert isinstance(param, DTensor), name
            assert param.to_local().device.type == "cpu" and not param.to_local().is_pinned()
        _update(worker)
        state = worker.full_state_dict()
        assert state.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
    finally:
        worker.shutdown()


def test_offload_refuses_fsdp2_parameters_and_walks_dtensor_optimizer_state():
    worker = _actor("cpu", "train.param_offload=true")  # FSDP2 even at one rank
    try:
        # Assigning .data on an FSDP2 parameter would leave FSDP2's own shard in place.
        with pytest.raises(ValueError, match="sharded \\(DTensor\\).*CPU-offload policy"):
            hal.walk_tensors(worker.model, lambda t: t)
        _update(worker)
        states = _optimizer_states(worker)
        assert states and all(isinstance(s, DTensor) for s in states)
        # A dtype change stands in for the move: every DTensor state entry is replaced, its
        # local shard included, and Adam's 0-d step counters stay put.
        moved = hal.walk_tensors(worker.optimizer, lambda t: t.to(torch.float64))
        assert moved == len(states)
        for value in _optimizer_states(worker):
            assert isinstance(value, DTensor) and value.to_local().dtype == torch.float64
        for state in worker.optimizer.state.values():
            assert state["step"].dtype == torch.float32
    finally:
        worker.shutdown()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@needs_accelerator
@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "fsdp2"])
def test_optimizer_offload_parks_state_in_pinned_host_memory(sharded):
    # bfloat16 compute needs FSDP2's mixed-precision policy: the sharded case at one rank.
    dtype = "bfloat16" if sharded else "float32"
    worker = _actor("auto", "train.optimizer_offload=true", f"train.param_dtype={dtype}")
    try:
        assert isinstance(worker.model, FSDPModule) is sharded
        _update(worker)
        worker.offload_states()
        states = _optimizer_states(worker)
        assert states
        for value in states:
            assert isinstance(value, DTensor) is sharded
            assert _local(value).device.type == "cpu" and _local(value).is_pinned()
        before = [_local(v).clone() for v in states]
        _update(worker)  # the optimizer step brings the state back beside its parameter
        params = dict(worker.optimizer.state)
        for param, state in params.items():
            assert _local(state["exp_avg"]).device == _local(param).device
        after = [_local(v).cpu() for v in _optimizer_states(worker)]
        assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    finally:
        worker.shutdown()


@needs_accelerator
def test_param_offload_keeps_shards_grads_and_optimizer_state_in_pinned_host_memory():
    plain = _actor("auto")
    try:
        _update(plain)
        expected = {k: v.clone() for k, v in plain.full_state_dict().items()}
    finally:
        plain.shutdown()
    worker = _actor("auto", "train.param_offload=true")
    try:
        for group in _param_groups(worker.model):
            assert isinstance(group.offload_policy, CPUOffloadPolicy)
            assert group.offload_policy.pin_memory is True
        _update(worker)  # gradient clipping reduces host-resident grads: gloo beside nccl/hccl
        worker.offload_states()
        for name, param in worker.model.named_parameters():
            local = param.to_local()
            assert local.device.type == "cpu" and local.is_pinned(), name
        for value in _optimizer_states(worker):
            assert value.to_local().device.type == "cpu"
        state = worker.full_state_dict()
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
    finally:
        worker.shutdown()


@pytest.mark.parametrize(
    ("overrides", "sharded"),
    [
        ((), False),
        (("train.param_offload=true",), True),
        (("train.param_dtype=bfloat16",), True),
        (("train.reduce_dtype=bfloat16",), True),
        (("train.dp_size=2",), True),
    ],
)
def test_one_rank_shards_only_when_an_fsdp2_policy_is_needed(overrides, sharded):
    from trainer.loop.ranks.spec import WorkerSpec

    cfg = load_config(None, ["device=cpu", "model.path=builtin:tiny", *overrides])
    assert WorkerSpec(role="actor", rank=0, cfg=cfg).sharded is sharded


def test_plain_module_at_one_rank_keeps_tied_embeddings_tied():
    worker = _actor("cpu")
    try:
        assert not isinstance(worker.model, FSDPModule)
        _update(worker)
        state = worker.full_state_dict()
        # One tensor under both names: the update moved the input embedding and the LM head
        # together, as the checkpoint's tie promises.
        assert worker.model.config.tie_word_embeddings
        torch.testing.assert_close(
            state["lm_head.weight"], state["model.embed_tokens.weight"], rtol=0, atol=0
        )
    finally:
        worker.shutdown()
