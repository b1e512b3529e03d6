"""Non-finite training is never committed (issue 18): a non-finite loss or grad norm skips the
optimizer step and is counted, ``run.max_nonfinite_steps`` of them in a row stop the run, and
non-finite weights are caught before a checkpoint."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from batching import Row, StepBatch, plan_minibatches
from trainer.config import load_config
from trainer.loop.cluster.group import free_port
from trainer.loop.ranks.fsdp_worker import WorkerSpec
from trainer.loop.ranks.policy import PolicyWorker
from trainer.loop.ranks.step_stats import StepStats
from trainer.loop.schedule.health import (
    HealthError,
    NonfiniteStreak,
    check_finite_weights,
    checkpoint_veto,
)


def _batch() -> StepBatch:
    rows = []
    for uid in range(2):
        for sample in range(2):
            rows.append(
                Row(
                    prompt_ids=[5, 6, 7, 8],
                    response_ids=[9, 10, 11],
                    response_mask=[1, 1, 1],
                    response_logprobs=[-2.0] * 3,
                    uid=uid,
                    trajectory_id=uid * 2 + sample,
                    step_index=0,
                    is_last_step=True,
                    score=float(sample),
                )
            )
    return StepBatch.from_rows(rows)


@pytest.fixture(scope="module")
def actor():
    cfg = load_config(None, ["device=cpu", "train.dp_size=1", "train.lr=1e-2"])
    worker = PolicyWorker(WorkerSpec(role="actor", rank=0, cfg=cfg))
    worker.setup("127.0.0.1", free_port())
    yield worker
    worker.shutdown()


def _train_once(worker, old_logprobs_scale: float) -> StepStats:
    batch = _batch()
    worker.load_batch([batch.to_numpy()])
    plan = plan_minibatches(
        batch.row_fields["trajectory_id"].numpy(),
        batch.seq_lens,
        mini_batch_size=2,
        dp_size=1,
        group_ids=batch.row_fields["uid"].numpy(),
    )
    (mini,) = plan.mini_batches
    rows, values = worker.compute_logprobs(mini.micro_batches[0])
    worker.set_token_field("old_logprobs", [(rows, np.asarray(values) * old_logprobs_scale)])
    worker.compute_advantages()
    return worker.train_mini_batch(mini.micro_batches[0], mini.rows.tolist())


def _weights(worker) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in worker.full_state_dict().items()}


def test_a_non_finite_loss_skips_the_optimizer_step_and_is_counted(actor):
    before = _weights(actor)
    report = _train_once(actor, math.nan)  # nan old logprobs: a nan ratio, a nan loss
    assert report.values["skipped"] == 1.0
    assert not math.isfinite(report.values["loss"])
    after = _weights(actor)
    assert all(torch.equal(after[k], before[k]) for k in before), "a skipped step moved weights"
    assert actor.weights_finite()

    total = StepStats("actor")
    total.add_update([report])
    total.add_update([report])
    assert total.metrics()["actor/skipped_updates"] == 2.0

    healthy = _train_once(actor, 1.0)
    assert healthy.values["skipped"] == 0.0
    assert any(not torch.equal(v, before[k]) for k, v in _weights(actor).items())


def test_non_finite_weights_are_reported(actor):
    param = next(actor.model.parameters())
    local = param.to_local() if hasattr(param, "to_local") else param
    saved = local.detach().clone()
    try:
        with torch.no_grad():
            local.view(-1)[0] = math.inf
        assert actor.weights_finite() is False
    finally:
        with torch.no_grad():
            local.copy_(saved)
    assert actor.weights_finite() is True
    with pytest.raises(
        HealthError, match=r"actor's weights are no longer finite .*rank 1.*train\.lr"
    ):
        check_finite_weights("actor", [True, False], step=4)
    check_finite_weights("actor", [True, True], step=4)


def _report(skipped: bool) -> StepStats:
    loss = math.nan if skipped else 0.5
    sums = {"loss": loss, "skipped": float(skipped)}
    return StepStats.of_update("actor", sums, grad_norm=math.nan if skipped else 1.0, lr=1e-3)


def test_max_nonfinite_steps_in_a_row_stop_the_run():
    streak = NonfiniteStreak(limit=3)
    for skipped in (True, True, False, True, True):  # a finite step resets the count
        streak.observe("actor", _report(skipped), step=1)
    with pytest.raises(HealthError) as info:
        streak.observe("actor", _report(True), step=2)
    message = str(info.value)
    assert "step 2: the actor's last 3 optimizer steps" in message
    assert "run.max_nonfinite_steps=3" in message and "loss nan" in message
    streak.observe("critic", _report(True), step=2)  # roles count separately


def test_a_step_with_a_skipped_update_is_not_checkpointed():
    healthy = {"step": 5, "actor/skipped_updates": 0.0, "actor/loss": 0.1}
    assert checkpoint_veto(healthy) is None
    veto = checkpoint_veto({"step": 6, "actor/skipped_updates": 2.0, "critic/skipped_updates": 0})
    assert veto.startswith("step 6: not checkpointed: 2 actor updates skipped")
