"""The algorithm variants verl users bring, each against numbers computed by hand: KL as a
reward penalty with outcome estimators, REINFORCE++ with a group baseline, GSPO, DAPO dynamic
sampling, and rollout correction (truncated importance sampling)."""

from __future__ import annotations

import math

import pytest
import torch

from batching import Row, StepBatch
from trainer.algorithms import compute_advantages
from trainer.algorithms.dynamic_sampling import GroupSelection
from trainer.algorithms.kl import kl_reward_penalty
from trainer.algorithms.losses import gspo_policy_loss, policy_loss_terms
from trainer.algorithms.rollout_correction import (
    mismatch_from_sums,
    mismatch_metrics,
    mismatch_sums,
    rollout_correction_weights,
)
from trainer.config import ConfigError, load_config


def _row(uid, traj, score, mask=(1, 1, 0), last=True):
    n = len(mask)
    return Row(
        prompt_ids=[1, 2],
        response_ids=list(range(10, 10 + n)),
        response_mask=list(mask),
        response_logprobs=[-0.1] * n,
        uid=uid,
        trajectory_id=traj,
        is_last_step=last,
        score=score,
    )


def _on_loss_tokens(batch, values):
    """A [T] tensor with ``values`` on the loss-mask tokens, in order, and 0 elsewhere."""
    out = torch.zeros(batch.loss_mask.shape)
    out[batch.loss_mask > 0] = torch.tensor(values)
    return out


def _per_row(batch, adv):
    """The advantage on each row's first loss token."""
    cu, mask = batch.cu_seqlens, batch.loss_mask
    return [
        float(adv[int(cu[r]) : int(cu[r + 1])][mask[int(cu[r]) : int(cu[r + 1])] > 0][0])
        for r in range(batch.num_rows)
    ]


# ----------------------------------------------------------------------------- KL in the score


def test_kl_reward_penalty_by_hand():
    # k1 = logp - ref = [0.5, 0, 0.25]; masked third token; coef 0.2 -> [-0.1, 0, 0]
    pen = kl_reward_penalty(
        torch.tensor([-1.0, -2.0, -1.0]),
        torch.tensor([-1.5, -2.0, -1.25]),
        0.2,
        "k1",
        loss_mask=torch.tensor([1.0, 1.0, 0.0]),
    )
    torch.testing.assert_close(pen, torch.tensor([-0.1, 0.0, 0.0]))


def test_kl_penalty_moves_rloo_and_grpo_advantages():
    # Three trajectories of one prompt, scores [1, 0, 0], two loss tokens each.
    # Token penalties (-coef * KL): traj 0 [-0.1, -0.3], traj 1 [-0.2, 0], traj 2 [0, 0]
    #   -> penalised scores [0.6, -0.2, 0.0]
    rows = [_row(0, 0, 1.0), _row(0, 1, 0.0), _row(0, 2, 0.0)]
    batch = StepBatch.from_rows(rows)
    penalty = _on_loss_tokens(batch, [-0.1, -0.3, -0.2, 0.0, 0.0, 0.0])
    # RLOO: 0.6 - (-0.2 + 0)/2 = 0.7; -0.2 - (0.6 + 0)/2 = -0.5; 0 - (0.6 - 0.2)/2 = -0.2
    adv, _ = compute_advantages(batch, "rloo", token_penalty=penalty)
    assert _per_row(batch, adv) == pytest.approx([0.7, -0.5, -0.2], abs=1e-6)
    # without the penalty: 1 - 0 = 1, 0 - 0.5 = -0.5 twice: the penalty was ignored before
    adv, _ = compute_advantages(batch, "rloo")
    assert _per_row(batch, adv) == pytest.approx([1.0, -0.5, -0.5], abs=1e-6)
    # GRPO: mean 2/15, deviations [7/15, -5/15, -2/15], unbiased var (49+25+4)/225/2 = 13/75
    adv, _ = compute_advantages(batch, "grpo", eps=0.0, token_penalty=penalty)
    std = math.sqrt(13 / 75)
    assert _per_row(batch, adv) == pytest.approx([7 / 15 / std, -1 / 3 / std, -2 / 15 / std])


def test_kl_penalty_with_grpo_is_accepted_and_documented():
    cfg = load_config(None, ["algorithm.kl_coef=0.1"])  # use_kl_loss false: reward penalty
    assert cfg.algorithm.adv_estimator == "grpo" and not cfg.algorithm.use_kl_loss
    from trainer.config.schema import AlgorithmConfig

    assert "before the group statistics" in AlgorithmConfig.model_fields["kl_coef"].description


# ----------------------------------------------------------------------------- REINFORCE++ baseline


def test_reinforce_pp_baseline_by_hand():
    # group 0: scores [1, 0] -> centred [0.5, -0.5], two loss tokens each
    # group 1: one trajectory, score 5 -> centred 0, one loss token
    # tokens [0.5, 0.5, -0.5, -0.5, 0]: mean 0, unbiased var 1 / 4 -> std 0.5
    #   -> whitened [1, 1, -1, -1, 0]
    rows = [_row(0, 0, 1.0), _row(0, 1, 0.0), _row(1, 2, 5.0, mask=(1, 0))]
    batch = StepBatch.from_rows(rows)
    adv, ret = compute_advantages(batch, "reinforce_pp_baseline")
    on = batch.loss_mask > 0
    torch.testing.assert_close(
        adv[on], torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0]), atol=1e-6, rtol=0
    )
    assert torch.all(adv[~on] == 0) and torch.equal(ret, adv)


def test_reinforce_pp_baseline_is_a_config_choice():
    cfg = load_config(None, ["algorithm.adv_estimator=reinforce_pp_baseline"])
    assert cfg.algorithm.adv_estimator == "reinforce_pp_baseline"


# ----------------------------------------------------------------------------- GSPO


def test_gspo_sequence_ratio_and_clip_by_hand():
    # Two rows, each 1 prompt token (mask 0) + 2 response tokens.
    # logp - old = [0.2, -0.4] on both rows -> log s = mean = -0.1, s = exp(-0.1) = 0.904837
    # clip eps 0.05: clip(s) = 0.95.
    #   row 0, A = +1: max(-s, -0.95) = -s          (not clipped, gradient -A * s per token)
    #   row 1, A = -1: max(s, 0.95) = 0.95          (clipped, no gradient)
    logp = torch.tensor([0.0, -1.0, -2.0, 0.0, -1.0, -2.0], requires_grad=True)
    old = torch.tensor([0.0, -1.2, -1.6, 0.0, -1.2, -1.6])
    adv = torch.tensor([0.0, 1.0, 1.0, 0.0, -1.0, -1.0])
    mask = torch.tensor([0.0, 1, 1, 0, 1, 1])
    cu = torch.tensor([0, 3, 6])
    loss, ratio, clipped, dual = gspo_policy_loss(
        logp, old, adv, mask, cu, clip_ratio_low=0.05, clip_ratio_high=0.05
    )
    s = math.exp(-0.1)
    on = mask > 0
    torch.testing.assert_close(ratio[on], torch.full((4,), s))
    torch.testing.assert_close(loss[on], torch.tensor([-s, -s, 0.95, 0.95]))
    assert clipped[on].tolist() == [0.0, 0.0, 1.0, 1.0] and not dual.any()
    (loss * mask).sum().backward()
    # one sequence-level ratio: both tokens of row 0 get the same weight s (PPO would give
    # exp(0.2) and exp(-0.4)); the clipped row gets none
    torch.testing.assert_close(logp.grad[on], torch.tensor([-s, -s, 0.0, 0.0]))


def test_policy_loss_terms_dispatch_to_gspo():
    logp, old = torch.tensor([-1.0, -2.0]), torch.tensor([-1.2, -1.6])
    terms = policy_loss_terms(
        logp,
        old,
        torch.tensor([1.0, 1.0]),
        kl_estimator="k3",
        clip_ratio_low=0.2,
        clip_ratio_c=3.0,
        policy_loss="gspo",
        loss_mask=torch.tensor([1.0, 1.0]),
        cu_seqlens=torch.tensor([0, 2]),
    )
    torch.testing.assert_close(terms.ratio, torch.full((2,), math.exp(-0.1)))


# ----------------------------------------------------------------------------- rollout correction


def test_rollout_correction_weights_by_hand():
    # row 0: three tokens, log(pi_old / pi_rollout) = [0.5, 0.1, (masked)]; row 1: one token, 0
    old = torch.tensor([-1.0, -1.0, -3.0, -2.0])
    rollout = torch.tensor([-1.5, -1.1, -1.0, -2.0])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    cu = torch.tensor([0, 3, 4])
    # token level, cap 1.5: [min(e^0.5, 1.5), e^0.1, 1 (off mask), e^0] = [1.5, 1.10517, 1, 1]
    w, m = rollout_correction_weights(old, rollout, mask, cu, level="token", cap=1.5)
    torch.testing.assert_close(w, torch.tensor([1.5, math.exp(0.1), 1.0, 1.0]))
    assert m["rollout_correction/capped_frac"] == pytest.approx(1 / 3)
    assert m["rollout_correction/weight_mean"] == pytest.approx((1.5 + math.exp(0.1) + 1) / 3)
    # sequence level: row 0 -> exp(0.5 + 0.1) = 1.822 -> capped at 1.5 on both loss tokens
    w, m = rollout_correction_weights(old, rollout, mask, cu, level="sequence", cap=1.5)
    torch.testing.assert_close(w, torch.tensor([1.5, 1.5, 1.0, 1.0]))
    assert m["rollout_correction/capped_frac"] == pytest.approx(2 / 3)
    # mismatch: |d| mean = (0.5 + 0.1 + 0) / 3; k3 = e^d - 1 - d per token
    mm = mismatch_metrics(old, rollout, mask)
    assert mm["rollout/logprob_abs_diff"] == pytest.approx(0.2)
    k3 = [math.exp(d) - 1 - d for d in (0.5, 0.1, 0.0)]
    assert mm["rollout/logprob_kl"] == pytest.approx(sum(k3) / 3)
    # the same from sums over pieces of the batch (ranks' rows), added up
    pieces = [mismatch_sums(old[a:b], rollout[a:b], mask[a:b]) for a, b in ((0, 1), (1, 4))]
    assert mismatch_from_sums(pieces) == pytest.approx(mm)
    assert mismatch_from_sums([]) == {"rollout/logprob_abs_diff": 0.0, "rollout/logprob_kl": 0.0}


def test_rollout_correction_weights_scale_the_policy_loss():
    common = dict(kl_estimator="k3", clip_ratio_low=0.2, clip_ratio_c=3.0)
    logp = torch.tensor([-1.0, -1.0])
    base = policy_loss_terms(logp, logp, torch.tensor([1.0, -2.0]), **common)
    weighted = policy_loss_terms(
        logp, logp, torch.tensor([1.0, -2.0]), is_weights=torch.tensor([1.5, 0.5]), **common
    )
    # ratio 1: L = -A = [-1, 2]; weighted [-1.5, 1.0]
    torch.testing.assert_close(base.pg_loss, torch.tensor([-1.0, 2.0]))
    torch.testing.assert_close(weighted.pg_loss, torch.tensor([-1.5, 1.0]))


# ----------------------------------------------------------------------------- dynamic sampling


def _group(uid, scores, first_tid):
    return [_row(uid, first_tid + k, s) for k, s in enumerate(scores)]


def test_dynamic_sampling_keeps_groups_that_disagree():
    sel = GroupSelection()
    # batch 1: group 0 all 1 (dropped), group 1 [1, 0] (kept)
    sel.add(_group(0, [1.0, 1.0], 0) + _group(1, [1.0, 0.0], 2))
    assert len(sel.kept) == 1
    # batch 2: group 0 [0, 0] (dropped), group 1 [0.5, 0] (kept) -> 2 kept
    sel.add(_group(0, [0.0, 0.0], 0) + _group(1, [0.5, 0.0], 2))
    rows, metrics = sel.final(2)
    assert [(r.uid, r.trajectory_id, r.score) for r in rows] == [
        (0, 0, 1.0),
        (0, 1, 0.0),
        (1, 2, 0.5),
        (1, 3, 0.0),
    ]
    assert metrics["dynamic_sampling/kept_groups"] == 2
    assert metrics["dynamic_sampling/dropped_groups"] == 2
    assert metrics["dynamic_sampling/topped_up_groups"] == 0
    assert metrics["dynamic_sampling/dropped_score_mean"] == 0.5  # [1, 1, 0, 0]


def test_dynamic_sampling_tops_up_with_the_earliest_dropped_groups():
    sel = GroupSelection()
    sel.add(_group(0, [1.0, 1.0], 0) + _group(1, [1.0, 0.0], 2))
    rows, metrics = sel.final(2)  # one kept, one short: the dropped all-1 group fills in
    assert [(r.uid, r.score) for r in rows] == [(0, 1.0), (0, 0.0), (1, 1.0), (1, 1.0)]
    assert metrics["dynamic_sampling/topped_up_groups"] == 1
    assert len({r.trajectory_id for r in rows}) == 4


def test_overlong_buffer_must_fit_the_horizon():
    with pytest.raises(ConfigError, match="reward.overlong_buffer_len"):
        load_config(None, ["rollout.max_new_tokens=8", "reward.overlong_buffer_len=7"])
