"""Mixed precision and activation checkpointing in the shipped training worker.

Parameters and optimizer state are fp32 master weights whatever ``train.param_dtype`` says;
bf16 is only the compute dtype. Stored in bf16, AdamW's lr-1e-6 updates round away.
"""

from __future__ import annotations

import random

import pytest
import torch

import hal
from batching import Row, StepBatch, plan_minibatches
from rollout.models import load_model
from trainer.config import load_config
from trainer.loop.cluster.group import free_port
from trainer.loop.ranks.fsdp_worker import WorkerSpec
from trainer.loop.ranks.model_loading import enable_activation_checkpointing
from trainer.loop.ranks.policy import PolicyWorker


def _batch(vocab: int, seed: int = 0) -> StepBatch:
    """2 prompts x 4 samples of random tokens, one turn each, mixed scores."""
    rnd = random.Random(seed)
    rows = []
    for uid in range(2):
        for sample in range(4):
            resp = [rnd.randrange(3, vocab) for _ in range(rnd.randint(4, 12))]
            rows.append(
                Row(
                    prompt_ids=[rnd.randrange(3, vocab) for _ in range(rnd.randint(4, 12))],
                    response_ids=resp,
                    response_mask=[1] * len(resp),
                    response_logprobs=[-2.0] * len(resp),
                    uid=uid,
                    trajectory_id=uid * 4 + sample,
                    step_index=0,
                    is_last_step=True,
                    score=float(sample % 2),
                )
            )
    return StepBatch.from_rows(rows)


def _cpu_actor(model_path: str, *overrides: str) -> PolicyWorker:
    """A set-up dp-1 actor of the default job on the CPU with ``model_path``."""
    cfg = load_config(
        None, ["device=cpu", "train.dp_size=1", f"model.path={model_path}", *overrides]
    )
    worker = PolicyWorker(WorkerSpec(role="actor", rank=0, cfg=cfg))
    worker.setup("127.0.0.1", free_port())
    return worker


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_master_weights_that_move_at_lr_1e6():
    worker = _cpu_actor(
        "builtin:small", "train.lr=1e-6", "train.param_dtype=bfloat16", "train.reduce_dtype=float32"
    )
    try:
        before = {k: v.clone() for k, v in worker.full_state_dict().items()}
        batch = _batch(vocab=100)
        worker.load_batch([batch.to_numpy()])
        plan = plan_minibatches(
            batch.row_fields["trajectory_id"].numpy(),
            batch.seq_lens,
            mini_batch_size=2,
            dp_size=1,
            group_ids=batch.row_fields["uid"].numpy(),
        )
        (mini,) = plan.mini_batches
        old = worker.compute_logprobs(mini.micro_batches[0])
        worker.set_token_field("old_logprobs", [old])
        worker.compute_advantages()
        for _ in range(3):
            worker.train_mini_batch(mini.micro_batches[0], mini.rows.tolist())
        after = worker.full_state_dict()
        assert all(p.dtype == torch.float32 for p in worker.model.parameters())
        changed = sum(int((after[k] != before[k]).sum()) for k in before)
        total = sum(v.numel() for v in before.values())
        assert changed / total > 0.9, f"only {changed / total:.1%} of the weights moved"
    finally:
        worker.shutdown()


def test_activation_checkpointing_leaves_gradients_unchanged():
    hal.register_attention()
    batch = _batch(vocab=100, seed=3)
    ids, pos, cu = batch.input_ids, batch.position_ids, batch.cu_seqlens
    weights = torch.randn(batch.num_tokens, 102, generator=torch.Generator().manual_seed(0))
    grads = []
    for checkpointing in (False, True):
        model = load_model("builtin:tiny", seed=2, attn_implementation=hal.ATTN_IMPLEMENTATION)
        if checkpointing:
            assert enable_activation_checkpointing(model) == len(model.model.layers)
        model.train()
        logits = hal.packed_forward(model, ids, pos, cu)
        (logits[:, : weights.shape[1]] * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    plain, recomputed = grads
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, atol=1e-6, rtol=1e-6, msg=name)


def test_activation_checkpointing_on_a_model_without_support_names_the_key():
    with pytest.raises(ValueError, match="train.activation_checkpointing=false"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("sharded", [True, False], ids=["fsdp2", "plain"])
def test_fsdp2_shards_on_the_hal_device_mesh(sharded):
    """FSDP2's default mesh is the machine's accelerator: on a GPU node a ``device: cpu`` run
    sharded onto the GPU while its batches stayed on the CPU (seen on an H100). The worker
    names the HAL's device; on a GPU node this test is what catches a regression. At one rank
    FSDP2 is used only for a policy (here bf16 gradient reduction); else the plain module
    stays on the HAL's device too."""
    worker = _cpu_actor(
        "builtin:tiny", f"train.reduce_dtype={'bfloat16' if sharded else 'float32'}"
    )
    try:
        params = list(worker.model.parameters())
        assert params and all(hasattr(p, "device_mesh") is sharded for p in params)
        if sharded:
            assert all(p.device_mesh.device_type == "cpu" for p in params)
        assert all(getattr(p, "to_local", lambda p=p: p)().device.type == "cpu" for p in params)
    finally:
        worker.shutdown()


@pytest.mark.parametrize("deterministic", [True, False])
def test_rollout_engine_process_gets_the_deterministic_settings(deterministic):
    """The rollout host applies the same switches as the training workers, before its engine
    starts; the controller then checks that every process applied the same."""
    from trainer.config import load_config
    from trainer.loop.engines.rollout_host import RolloutHost

    cfg = load_config(None, [f"run.deterministic={str(deterministic).lower()}"])
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        info = RolloutHost(cfg, threads=1).setup()
        if deterministic:
            assert torch.are_deterministic_algorithms_enabled()
            expected = hal.get_backend("cpu").set_deterministic(cfg.seed)
            assert info["deterministic"] == expected
        else:
            assert info["deterministic"] == {}
            assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(was)
