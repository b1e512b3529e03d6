"""Advantage estimators against hand-computed examples, and the batch plumbing
(step-wise broadcast, chaining, padding) of compute_advantages."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batching import Row, StepBatch
from trainer.algorithms import (
    compute_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from trainer.algorithms.common import reverse_discounted_cumsum

# ----------------------------------------------------------------------------- plain arrays


def test_grpo_hand_example():
    # group 7: scores [1, 0, 0, 1]: mean 0.5, deviations +-0.5,
    #   unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.57735 -> A = +-0.5 / 0.57735 = +-0.86603
    # group 3: scores [2, 4, 9]: mean 5, deviations [-3, -1, 4],
    #   var = (9 + 1 + 16) / 2 = 13, std = sqrt(13) -> A = [-3, -1, 4] / sqrt(13)
    # group 5: a single trajectory -> no baseline -> 0
    scores = [1, 2, 0, 4, 0, 9, 1, 8]
    groups = [7, 3, 7, 3, 7, 3, 7, 5]
    adv = grpo_advantages(scores, groups, eps=0.0)
    s3 = math.sqrt(13)
    h = 0.5 / math.sqrt(1 / 3)
    expected = [h, -3 / s3, -h, -1 / s3, -h, 4 / s3, h, 0.0]
    np.testing.assert_allclose(adv, expected, rtol=0, atol=1e-12)


def test_grpo_eps_and_equal_scores():
    # all equal scores: deviations 0, std 0 -> 0 / (0 + eps) = 0, never NaN
    adv = grpo_advantages([1.0, 1.0, 1.0], [0, 0, 0])
    assert np.all(adv == 0.0)
    # eps enters the denominator: [1, 0] -> std = sqrt(0.5), A = 0.5 / (sqrt(0.5) + 0.1)
    adv = grpo_advantages([1.0, 0.0], [0, 0], eps=0.1)
    np.testing.assert_allclose(adv, [0.5 / (math.sqrt(0.5) + 0.1), -0.5 / (math.sqrt(0.5) + 0.1)])


def test_dr_grpo_skips_std():
    # Dr. GRPO: A = s - mean(group): [1,0,0,1] -> [.5,-.5,-.5,.5]; [2,4,9] -> [-3,-1,4]
    adv = grpo_advantages([1, 0, 0, 1, 2, 4, 9], [0, 0, 0, 0, 1, 1, 1], norm_adv_by_std=False)
    np.testing.assert_allclose(adv, [0.5, -0.5, -0.5, 0.5, -3, -1, 4], atol=1e-12)


def test_rloo_hand_example():
    # [1, 0, 0, 1]: a 1 sees others' mean 1/3 -> 2/3; a 0 sees 2/3 -> -2/3
    # [2, 4, 9]: 2 - (4+9)/2 = -4.5; 4 - (2+9)/2 = -1.5; 9 - (2+4)/2 = 6
    # singleton -> 0
    adv = rloo_advantages([1, 2, 0, 4, 0, 9, 1, 8], [7, 3, 7, 3, 7, 3, 7, 5])
    np.testing.assert_allclose(
        adv, [2 / 3, -4.5, -2 / 3, -1.5, -2 / 3, 6.0, 2 / 3, 0.0], rtol=0, atol=1e-12
    )


def test_reverse_discounted_cumsum_resets_at_sequence_boundaries():
    # seq A = [1, 2, 3], seq B = [4, 5], factor 0.5:
    #   A: y2 = 3, y1 = 2 + 1.5 = 3.5, y0 = 1 + 1.75 = 2.75;  B: y1 = 5, y0 = 4 + 2.5 = 6.5
    y = reverse_discounted_cumsum(np.array([1.0, 2, 3, 4, 5]), np.array([3, 2]), 0.5)
    np.testing.assert_allclose(y, [2.75, 3.5, 3.0, 6.5, 5.0])
    # empty sequences are allowed and take no tokens
    y = reverse_discounted_cumsum(np.array([1.0, 2]), np.array([0, 2, 0]), 1.0)
    np.testing.assert_allclose(y, [3.0, 2.0])


def test_reinforce_pp_hand_example():
    # seq A rewards [0, 0, 1], seq B [0, 2], gamma = 0.5
    #   returns A: G2 = 1, G1 = 0.5, G0 = 0.25; B: G1 = 2, G0 = 1
    #   mean = 4.75 / 5 = 0.95; deviations [-0.7, -0.45, 0.05, 0.05, 1.05]
    #   sum sq = 0.49 + 0.2025 + 0.0025 + 0.0025 + 1.1025 = 1.8; unbiased var = 0.45
    adv, ret = reinforce_pp_advantages([0, 0, 1, 0, 2], [3, 2], gamma=0.5)
    np.testing.assert_allclose(ret, [0.25, 0.5, 1.0, 1.0, 2.0])
    std = math.sqrt(0.45 + 1e-8)
    np.testing.assert_allclose(adv, np.array([-0.7, -0.45, 0.05, 0.05, 1.05]) / std)


def test_gae_hand_example():
    # seq A: r = [0, 0, 1], V = [0.5, 0.2, 0.8]; seq B: r = [1], V = [0.4]; gamma 1, lam 0.5
    #   A: delta = [0 + 0.2 - 0.5, 0 + 0.8 - 0.2, 1 + 0 - 0.8] = [-0.3, 0.6, 0.2]
    #      A2 = 0.2; A1 = 0.6 + 0.5 * 0.2 = 0.7; A0 = -0.3 + 0.5 * 0.7 = 0.05
    #      R = A + V = [0.55, 0.9, 1.0]
    #   B: delta = 1 - 0.4 = 0.6 (no V_{t+1} from seq A leaks in) -> A = 0.6, R = 1.0
    adv, ret = gae_advantages(
        [0, 0, 1, 1], [0.5, 0.2, 0.8, 0.4], [3, 1], gamma=1.0, lam=0.5, whiten_advantages=False
    )
    np.testing.assert_allclose(adv, [0.05, 0.7, 0.2, 0.6], atol=1e-12)
    np.testing.assert_allclose(ret, [0.55, 0.9, 1.0, 1.0], atol=1e-12)
    # gamma 0.9, lam 1, one token before the end: r = [0, 1], V = [0, 0]
    #   A1 = 1, A0 = 0 + 0.9 * 0 - 0 + 0.9 * 1 = 0.9
    adv, ret = gae_advantages([0, 1], [0, 0], [2], gamma=0.9, lam=1.0, whiten_advantages=False)
    np.testing.assert_allclose(adv, [0.9, 1.0])


def test_gae_whitening_keeps_returns():
    adv_raw, ret_raw = gae_advantages(
        [0, 0, 1, 1], [0.5, 0.2, 0.8, 0.4], [3, 1], lam=0.5, whiten_advantages=False
    )
    adv, ret = gae_advantages([0, 0, 1, 1], [0.5, 0.2, 0.8, 0.4], [3, 1], lam=0.5)
    np.testing.assert_allclose(ret, ret_raw)
    assert abs(adv.mean()) < 1e-12
    assert abs(adv.var(ddof=1) - 1.0) < 1e-6
    # whitening is affine and increasing: the order of the raw advantages is kept
    assert list(np.argsort(adv)) == list(np.argsort(adv_raw))


# ----------------------------------------------------------------------------- batches


def _row(uid, traj, step, last, score, prompt=2, mask=(1, 1, 0), **kw):
    n = len(mask)
    return Row(
        prompt_ids=list(range(1, prompt + 1)),
        response_ids=list(range(10, 10 + n)),
        response_mask=list(mask),
        response_logprobs=[-0.1] * n,
        uid=uid,
        trajectory_id=traj,
        step_index=step,
        is_last_step=last,
        score=score,
        **kw,
    )


def _masked_tokens(batch, row):
    """Token indices of `row` whose loss_mask is 1, and those whose mask is 0."""
    cu = batch.cu_seqlens
    lo, hi = int(cu[row]), int(cu[row + 1])
    mask = batch.loss_mask[lo:hi] > 0
    idx = torch.arange(lo, hi)
    return idx[mask], idx[~mask]


def test_whole_trajectory_grpo_on_batch():
    # one row per trajectory; group 0 scores [1, 0] -> std sqrt(0.5) -> A = +-0.5 / sqrt(0.5)
    rows = [
        _row(0, 0, 0, True, 1.0, mask=(1, 0, 1, 0)),  # tool tokens in the middle: mask 0
        _row(0, 1, 0, True, 0.0),
        _row(1, 2, 0, True, 5.0),  # singleton group -> 0
    ]
    batch = StepBatch.from_rows(rows)
    adv, ret = compute_advantages(batch, "grpo", eps=0.0)
    a = 0.5 / math.sqrt(0.5)
    for r, expected in ((0, a), (1, -a), (2, 0.0)):
        on, off = _masked_tokens(batch, r)
        assert torch.allclose(adv[on], torch.full((len(on),), expected))
        assert torch.all(adv[off] == 0)
    assert adv.dtype == torch.float32 and adv.shape == batch.loss_mask.shape
    assert torch.equal(ret, adv)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_stepwise_outcome_broadcast_to_every_step(estimator):
    # group 4: trajectory 10 (3 steps, score 1) and trajectory 11 (2 steps, score 0).
    #   GRPO: std of [1, 0] = sqrt(0.5) -> +-0.5 / sqrt(0.5) = +-0.70711
    #   RLOO: 1 - 0 = 1 and 0 - 1 = -1
    # group 5: trajectories 12 (score 3) and 13 (score 1), one step each:
    #   GRPO +-1 / sqrt(2); RLOO +-2
    rows = [
        _row(4, 10, 2, True, 1.0),
        _row(4, 11, 0, False, 0.0, mask=(1, 1, 1, 0)),
        _row(5, 12, 0, True, 3.0),
        _row(4, 10, 0, False, 1.0),
        _row(4, 11, 1, True, 0.0),
        _row(5, 13, 0, True, 1.0),
        _row(4, 10, 1, False, 1.0, mask=(0, 1)),
    ]
    # Two padding rows (-1) mixed in, as the planner would place them.
    batch = StepBatch.from_rows(rows).select([0, 1, -1, 2, 3, 4, 5, -1, 6])
    adv, _ = compute_advantages(batch, estimator, eps=0.0)
    if estimator == "grpo":
        g4, g5 = 0.5 / math.sqrt(0.5), 1.0 / math.sqrt(2.0)
    else:
        g4, g5 = 1.0, 2.0
    want = {10: g4, 11: -g4, 12: g5, 13: -g5}
    traj = batch.trajectory_id
    for r in range(batch.num_rows):
        on, off = _masked_tokens(batch, r)
        assert torch.all(adv[off] == 0)
        if bool(batch.is_padding[r]):
            assert len(on) == 0
            lo, hi = int(batch.cu_seqlens[r]), int(batch.cu_seqlens[r + 1])
            assert torch.all(adv[lo:hi] == 0)
        else:
            # every step, not just the last, carries the trajectory's advantage
            assert len(on) > 0
            assert torch.allclose(adv[on], torch.full((len(on),), want[int(traj[r])]))


def test_stepwise_reinforce_pp_chains_steps_in_order():
    # trajectory 0: step 0 generates 2 loss tokens, step 1 generates 2 loss tokens + EOS (mask 0),
    # score 1 sits on step 1's last loss token. Chained rewards [0, 0, 0, 1], gamma 0.5:
    #   G = [0.125, 0.25, 0.5, 1.0] (step 0 gets the discounted outcome, not 0)
    # trajectory 1: one step, 1 loss token, score 0 -> G = [0]
    rows = [
        _row(0, 0, 1, True, 1.0, mask=(1, 1, 0)),  # step 1 listed first on purpose
        _row(0, 0, 0, False, 1.0, mask=(1, 1)),
        _row(0, 1, 0, True, 0.0, mask=(1,)),
    ]
    batch = StepBatch.from_rows(rows).select([0, -1, 1, 2])
    adv, ret = compute_advantages(batch, "reinforce_pp", gamma=0.5)
    on_step1, _ = _masked_tokens(batch, 0)
    on_step0, _ = _masked_tokens(batch, 2)
    on_t1, _ = _masked_tokens(batch, 3)
    assert torch.allclose(ret[on_step0], torch.tensor([0.125, 0.25]))
    assert torch.allclose(ret[on_step1], torch.tensor([0.5, 1.0]))
    assert torch.allclose(ret[on_t1], torch.tensor([0.0]))
    # advantages: the 5 returns whitened over the batch's 5 real loss tokens
    g = np.array([0.125, 0.25, 0.5, 1.0, 0.0])
    z = (g - g.mean()) / math.sqrt(g.var(ddof=1) + 1e-8)
    got = torch.cat([adv[on_step0], adv[on_step1], adv[on_t1]]).double().numpy()
    np.testing.assert_allclose(got, z, rtol=1e-6)
    mask = batch.loss_mask > 0
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)


def test_stepwise_gae_uses_next_step_value_across_the_boundary():
    # trajectory: step 0 loss tokens with V = [0.1, 0.2], step 1 loss tokens V = [0.3, 0.4],
    # reward 1 on the last one. gamma 1, lam 0 (one-step TD, no whitening):
    #   delta = [0 + 0.2 - 0.1, 0 + 0.3 - 0.2, 0 + 0.4 - 0.3, 1 + 0 - 0.4] = [0.1, 0.1, 0.1, 0.6]
    #   (step 0's last token looks ahead to step 1's first value 0.3)
    #   R = A + V = [0.2, 0.3, 0.4, 1.0]
    rows = [
        _row(0, 0, 0, False, 1.0, mask=(1, 1)),
        _row(0, 0, 1, True, 1.0, mask=(1, 1)),
    ]
    batch = StepBatch.from_rows(rows)
    values = torch.zeros(batch.num_tokens)
    on0, _ = _masked_tokens(batch, 0)
    on1, _ = _masked_tokens(batch, 1)
    values[on0] = torch.tensor([0.1, 0.2])
    values[on1] = torch.tensor([0.3, 0.4])
    values[batch.loss_mask == 0] = 99.0  # prompt-token values must be ignored
    batch.set_token_field("values", values)
    adv, ret = compute_advantages(batch, "gae", gamma=1.0, lam=0.0, whiten_gae=False)
    on = torch.cat([on0, on1])
    assert torch.allclose(adv[on], torch.tensor([0.1, 0.1, 0.1, 0.6]))
    assert torch.allclose(ret[on], torch.tensor([0.2, 0.3, 0.4, 1.0]))
    # gamma = lam = 1: R_t is the undiscounted reward-to-go whatever V is -> all 1
    _, ret = compute_advantages(batch, "gae", gamma=1.0, lam=1.0)
    assert torch.allclose(ret[on], torch.ones(4))


def test_padding_rows_never_join_a_group():
    # a real group of one plus padding rows: padding must not become the real row's baseline
    batch = StepBatch.from_rows([_row(0, 0, 0, True, 1.0)]).select([-1, 0, -1])
    for est in ("grpo", "rloo"):
        adv, _ = compute_advantages(batch, est)
        assert torch.all(adv == 0)


def test_errors_name_the_problem():
    batch = StepBatch.from_rows([_row(0, 0, 0, True, 1.0), _row(0, 1, 0, True, 0.0)])
    with pytest.raises(ValueError, match="algorithm.adv_estimator"):
        compute_advantages(batch, "ppo")
    with pytest.raises(ValueError, match="values"):
        compute_advantages(batch, "gae")
    with pytest.raises(ValueError, match="algorithm.gamma"):
        compute_advantages(batch, "reinforce_pp", gamma=1.5)
    lonely = StepBatch.from_rows([_row(0, 0, 0, False, 1.0)])
    with pytest.raises(ValueError, match="is_last_step"):
        compute_advantages(lonely, "grpo")


@st.composite
def _stepwise_batches(draw):
    """Random step-wise batches: groups of trajectories, each with 1-3 step rows."""
    rows, traj = [], 0
    for uid in range(draw(st.integers(1, 3))):
        for _ in range(draw(st.integers(1, 3))):
            steps = draw(st.integers(1, 3))
            score = draw(st.sampled_from([0.0, 0.5, 1.0]))
            for step in range(steps):
                mask = draw(st.lists(st.sampled_from([0, 1]), min_size=1, max_size=4))
                rows.append(
                    _row(uid, traj, step, step == steps - 1, score, mask=mask, step_reward=0.25)
                )
            traj += 1
    return rows


@settings(max_examples=40, deadline=None)
@given(rows=_stepwise_batches(), data=st.data())
def test_advantages_do_not_depend_on_row_order_or_padding(rows, data):
    base = StepBatch.from_rows(rows)
    base.set_token_field("values", torch.linspace(-1, 1, base.num_tokens))
    order = data.draw(st.permutations(list(range(len(rows)))))
    pads = data.draw(st.lists(st.integers(0, len(rows)), max_size=3))
    for p in sorted(pads, reverse=True):
        order.insert(p, -1)
    shuffled = base.select(order)
    # token index in `shuffled` -> token index in `base` (-1 for padding tokens)
    src = torch.full((shuffled.num_tokens,), -1, dtype=torch.int64)
    for new_row, old_row in enumerate(order):
        if old_row >= 0:
            lo, hi = int(shuffled.cu_seqlens[new_row]), int(shuffled.cu_seqlens[new_row + 1])
            src[lo:hi] = torch.arange(
                int(base.cu_seqlens[old_row]), int(base.cu_seqlens[old_row + 1])
            )
    for est in ("grpo", "rloo", "reinforce_pp", "gae"):
        a0, r0 = compute_advantages(base, est, gamma=0.9, lam=0.8)
        a1, r1 = compute_advantages(shuffled, est, gamma=0.9, lam=0.8)
        real = src >= 0
        torch.testing.assert_close(a1[real], a0[src[real]], rtol=0, atol=1e-5)
        torch.testing.assert_close(r1[real], r0[src[real]], rtol=0, atol=1e-5)
        assert torch.all(a1[~real] == 0) and torch.all(r1[~real] == 0)
        assert torch.all(a0[base.loss_mask == 0] == 0)
