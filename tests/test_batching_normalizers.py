"""Loss normalizers: the mini-batch loss must not depend on dp_size, budgets or padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batching import (
    LOSS_AGG_MODES,
    LossNormalizers,
    Row,
    StepBatch,
    aggregate_loss,
    loss_normalizers,
    plan_minibatches,
)

HORIZON = 7


def make_rows(rng, num_prompts=6, n=3, max_turns=4):
    rows = []
    t = 0
    for p in range(num_prompts):
        for _ in range(n):
            turns = int(rng.integers(1, max_turns + 1))
            for s in range(turns):
                r = int(rng.integers(0, 7))
                mask = rng.integers(0, 2, r).tolist()
                rows.append(
                    Row(
                        prompt_ids=[1] * int(rng.integers(1, 5)),
                        response_ids=[2] * r,
                        response_mask=mask,
                        response_logprobs=[0.0] * r,
                        uid=p,
                        trajectory_id=t,
                        step_index=s,
                        is_last_step=s == turns - 1,
                    )
                )
            t += 1
    perm = rng.permutation(len(rows))
    return [rows[i] for i in perm]


def reference_loss(rows, row_ids, token_loss_of_row, mode):
    """The mini-batch loss straight from the formulas, one row at a time."""
    sums, counts = [], []
    for i in row_ids:
        p = len(rows[i].prompt_ids)
        vals = [token_loss_of_row[i][p + j] for j, m in enumerate(rows[i].response_mask) if m]
        sums.append(sum(vals))
        counts.append(len(vals))
    num_rows = max(1, len(row_ids))
    if mode == "token-mean":
        return sum(sums) / max(1, sum(counts))
    if mode == "seq-mean-token-sum":
        return sum(sums) / num_rows
    if mode == "seq-mean-token-mean":
        return sum(s / max(1, c) for s, c in zip(sums, counts)) / num_rows
    return sum(sums) / (num_rows * HORIZON)


def mini_batch_losses(batch, plan, modes, extra_padding=False):
    """Per mode, per mini-batch: the sum of all micro-batch contributions of all ranks."""
    losses = {mode: [] for mode in modes}
    for mb in plan.mini_batches:
        norms = loss_normalizers(batch, mb)
        totals = dict.fromkeys(modes, 0.0)
        for rank in mb.micro_batches:
            for micro in rank:
                sub = batch.select(micro + [-1] * extra_padding)
                for mode in modes:
                    totals[mode] = totals[mode] + aggregate_loss(
                        sub.token_fields["token_loss"],
                        sub.loss_mask,
                        sub.cu_seqlens,
                        norms,
                        mode,
                        horizon=HORIZON,
                    )
        for mode in modes:
            losses[mode].append(totals[mode])
    return losses


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), mini_batch_size=st.integers(1, 4))
def test_loss_is_invariant_to_dp_budget_and_padding(seed, mini_batch_size):
    rng = np.random.default_rng(seed)
    rows = make_rows(rng)
    batch = StepBatch.from_rows(rows)
    token_loss = torch.from_numpy(rng.normal(size=batch.num_tokens))  # float64
    batch.set_token_field("token_loss", token_loss)
    per_row = [
        token_loss[s:e].tolist()
        for s, e in zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist())
    ]
    uids = [r.uid for r in rows]
    trajs = [r.trajectory_id for r in rows]
    results = {mode: [] for mode in LOSS_AGG_MODES}
    for dp in (1, 2, 3):
        for budget in (None, 6, 40):
            plan = plan_minibatches(
                trajs,
                batch.seq_lens,
                mini_batch_size=mini_batch_size,
                dp_size=dp,
                max_tokens_per_micro_batch=budget,
                group_ids=uids,
            )
            # A padding row added to every micro-batch must change nothing.
            losses = mini_batch_losses(batch, plan, LOSS_AGG_MODES, extra_padding=budget == 6)
            for mode in LOSS_AGG_MODES:
                got = [float(x) for x in losses[mode]]
                ref = [
                    reference_loss(rows, mb.rows.tolist(), per_row, mode)
                    for mb in plan.mini_batches
                ]
                np.testing.assert_allclose(got, ref, rtol=0, atol=1e-9)
                results[mode].append(got)
    for mode in LOSS_AGG_MODES:
        for other in results[mode][1:]:
            np.testing.assert_allclose(other, results[mode][0], rtol=0, atol=1e-6)


def test_gradient_is_invariant_to_dp_and_budget():
    rng = np.random.default_rng(1)
    rows = make_rows(rng)
    base = StepBatch.from_rows(rows)
    values = rng.normal(size=base.num_tokens)
    trajs, uids = [r.trajectory_id for r in rows], [r.uid for r in rows]
    grads = []
    for dp, budget in ((1, None), (2, 9), (3, 25)):
        leaf = torch.tensor(values, requires_grad=True)
        batch = StepBatch.from_rows(rows)
        batch.set_token_field("token_loss", leaf)
        plan = plan_minibatches(
            trajs,
            batch.seq_lens,
            mini_batch_size=100,
            dp_size=dp,
            max_tokens_per_micro_batch=budget,
            group_ids=uids,
        )
        mode = "seq-mean-token-mean"
        (loss,) = mini_batch_losses(batch, plan, [mode], extra_padding=True)[mode]
        loss.backward()
        grads.append(leaf.grad.clone())
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0], rtol=0, atol=1e-12)
    assert grads[0].abs().sum() > 0


def test_normalizers_count_real_rows_tokens_and_trajectories():
    rows = make_rows(np.random.default_rng(2))
    batch = StepBatch.from_rows(rows)
    padded = batch.select([-1, *range(len(rows)), -1])
    want = LossNormalizers(
        num_rows=len(rows),
        num_loss_tokens=sum(sum(r.response_mask) for r in rows),
        num_trajectories=len({r.trajectory_id for r in rows}),
        num_tokens=sum(len(r.prompt_ids) + len(r.response_ids) for r in rows),
    )
    assert loss_normalizers(batch) == want
    assert loss_normalizers(padded) == want
    assert loss_normalizers(batch, [-1, *range(len(rows))]) == want
    plan = plan_minibatches(
        [r.trajectory_id for r in rows], batch.seq_lens, mini_batch_size=4, dp_size=2
    )
    per_mb = [loss_normalizers(batch, mb) for mb in plan.mini_batches]
    assert sum(n.num_rows for n in per_mb) == want.num_rows
    assert sum(n.num_loss_tokens for n in per_mb) == want.num_loss_tokens
    assert sum(n.num_tokens for n in per_mb) == want.num_tokens
    assert [n.num_trajectories for n in per_mb] == [mb.num_trajectories for mb in plan.mini_batches]


def test_aggregate_loss_rejects_bad_arguments():
    norms = LossNormalizers(num_rows=1, num_loss_tokens=1, num_trajectories=1)
    loss, mask, cu = torch.ones(3), torch.ones(3), torch.tensor([0, 3])
    with pytest.raises(ValueError, match="'mean'"):
        aggregate_loss(loss, mask, cu, norms, "mean")
    with pytest.raises(ValueError, match="horizon = None"):
        aggregate_loss(loss, mask, cu, norms, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="must both be"):
        aggregate_loss(loss, torch.ones(2), cu, norms, "token-mean")
    with pytest.raises(ValueError, match="cu_seqlens ends at 2"):
        aggregate_loss(loss, mask, torch.tensor([0, 2]), norms, "seq-mean-token-mean")
    with pytest.raises(ValueError, match="refers to row 5"):
        loss_normalizers(StepBatch.from_rows([Row([1], [2], [1], [0.0], 0, 0)]), [5])


def test_no_loss_tokens_gives_zero_not_nan():
    norms = LossNormalizers(num_rows=0, num_loss_tokens=0, num_trajectories=0)
    for mode in LOSS_AGG_MODES:
        out = aggregate_loss(
            torch.ones(2), torch.zeros(2), torch.tensor([0, 2]), norms, mode, horizon=4
        )
        assert float(out) == 0.0
