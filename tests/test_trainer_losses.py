"""PPO-family losses against hand-computed values, masked metric sums, and the
invariance of the mini-batch loss and gradient to micro-batch splits and padding."""

import math

import numpy as np
import pytest
import torch

import batching
from trainer.algorithms.kl import apply_kl_penalty, kl_divergence
from trainer.algorithms.losses import (
    loss_for_micro_batch,
    masked_sums,
    policy_loss_terms,
    ppo_policy_loss,
    value_loss,
    value_loss_for_micro_batch,
)
from trainer.loop.ranks.forward import logits_entropy, token_entropy

LN = math.log

# ----------------------------------------------------------------------------- policy loss


def _ppo(ratios, advs, **kw):
    ratios = torch.tensor(ratios, dtype=torch.float64)
    lp = torch.log(ratios).requires_grad_(True)
    old = torch.zeros_like(lp)
    adv = torch.tensor(advs, dtype=torch.float64)
    kw.setdefault("clip_ratio_c", 3.0)
    loss, ratio, clipped, dual = ppo_policy_loss(lp, old, adv, **kw)
    loss.sum().backward()
    return loss.detach(), ratio.detach(), clipped, dual, lp.grad


def test_ppo_symmetric_clip_and_dual_clip_by_hand():
    # eps = 0.2, c = 3; L = max(-A r, -A clip(r, 0.8, 1.2)), then min(L, -A c) if A < 0
    #  r=1.5 A=+1: max(-1.5, -1.2) = -1.2  clipped
    #  r=0.5 A=+1: max(-0.5, -0.8) = -0.5
    #  r=0.5 A=-1: max( 0.5,  0.8) =  0.8  clipped
    #  r=1.5 A=-1: max( 1.5,  1.2) =  1.5
    #  r=5.0 A=-1: max( 5.0,  1.2) =  5.0 -> min(5, 3) = 3  dual clipped
    #  r=5.0 A=+1: max(-5.0, -1.2) = -1.2  clipped (dual clip is for A < 0 only)
    #  r=1.0 A=+2: -2
    ratios = [1.5, 0.5, 0.5, 1.5, 5.0, 5.0, 1.0]
    advs = [1, 1, -1, -1, -1, 1, 2]
    loss, ratio, clipped, dual, grad = _ppo(ratios, advs, clip_ratio_low=0.2, clip_ratio_c=3.0)
    torch.testing.assert_close(
        loss, torch.tensor([-1.2, -0.5, 0.8, 1.5, 3.0, -1.2, -2.0], dtype=torch.float64)
    )
    torch.testing.assert_close(ratio, torch.tensor(ratios, dtype=torch.float64))
    assert clipped.tolist() == [1, 0, 1, 0, 0, 1, 0]
    assert dual.tolist() == [0, 0, 0, 0, 1, 0, 0]
    # d(-A r)/d logp = -A r where the unclipped term is active, 0 where a clip is active
    torch.testing.assert_close(
        grad, torch.tensor([0, -0.5, 0, 1.5, 0, 0, -2.0], dtype=torch.float64)
    )


def test_ppo_asymmetric_clip_by_hand():
    # eps_lo = 0.1, eps_hi = 0.3 -> clip(r, 0.9, 1.3)
    #  r=1.5 A=+1: max(-1.5, -1.3) = -1.3 ;  r=1.25 A=+1: -1.25 (inside the high side)
    #  r=0.5 A=-1: max(0.5, 0.9) = 0.9    ;  r=0.85 A=-1: max(0.85, 0.9) = 0.9 clipped
    loss, _, clipped, _, _ = _ppo(
        [1.5, 1.25, 0.5, 0.85], [1, 1, -1, -1], clip_ratio_low=0.1, clip_ratio_high=0.3
    )
    torch.testing.assert_close(loss, torch.tensor([-1.3, -1.25, 0.9, 0.9], dtype=torch.float64))
    assert clipped.tolist() == [1, 0, 1, 1]


def test_ppo_rejects_bad_clip_settings():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_policy_loss(x, x, x, clip_ratio_low=0.2, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        ppo_policy_loss(x, x, x, clip_ratio_low=1.0, clip_ratio_c=3.0)
    with pytest.raises(ValueError, match="clip_ratio_high"):
        ppo_policy_loss(x, x, x, clip_ratio_low=0.2, clip_ratio_high=-0.1, clip_ratio_c=3.0)


# ----------------------------------------------------------------------------- KL, entropy, value


def test_kl_estimators_by_hand():
    # p = 0.5, p_ref = 0.25 -> log r = log(p_ref / p) = -ln 2
    #   k1 = ln 2 = 0.693147; k2 = 0.5 (ln 2)^2 = 0.240227; k3 = 0.5 + ln 2 - 1 = 0.193147
    # p = p_ref -> all 0
    lp = torch.tensor([LN(0.5), LN(0.3)], dtype=torch.float64)
    ref = torch.tensor([LN(0.25), LN(0.3)], dtype=torch.float64)
    l2 = LN(2)
    torch.testing.assert_close(
        kl_divergence(lp, ref, "k1"), torch.tensor([l2, 0], dtype=torch.float64)
    )
    torch.testing.assert_close(
        kl_divergence(lp, ref, "k2"), torch.tensor([0.5 * l2 * l2, 0], dtype=torch.float64)
    )
    torch.testing.assert_close(
        kl_divergence(lp, ref, "k3"), torch.tensor([0.5 + l2 - 1, 0], dtype=torch.float64)
    )


def test_k3_is_clamped_and_other_names_are_rejected():
    # ref puts e^30 times more mass: exp(30) - 30 - 1 is huge -> clamped to 10
    k3 = kl_divergence(torch.tensor([-40.0]), torch.tensor([-10.0]), "k3")
    assert k3.item() == 10.0
    with pytest.raises(ValueError, match="k3"):
        kl_divergence(torch.zeros(1), torch.zeros(1), "low_var_kl")


def test_apply_kl_penalty_by_hand():
    # rewards [0, 1, 0], k1 = logp - ref = [ln2, ln2, ln2], coef 0.1, mask [1, 1, 0]
    #   -> [-0.1 ln2, 1 - 0.1 ln2, 0]
    lp = torch.full((3,), LN(0.5))
    ref = torch.full((3,), LN(0.25))
    out = apply_kl_penalty(
        torch.tensor([0.0, 1.0, 0.0]), lp, ref, 0.1, "k1", loss_mask=torch.tensor([1.0, 1, 0])
    )
    torch.testing.assert_close(out, torch.tensor([-0.1 * LN(2), 1 - 0.1 * LN(2), 0.0]))
    with pytest.raises(ValueError, match="kl_coef"):
        apply_kl_penalty(torch.zeros(1), torch.zeros(1), torch.zeros(1), -1.0, "k1")


def test_entropy_by_hand_and_chunking():
    # uniform over 4 -> ln 4; p = [1/2, 1/4, 1/4] (padded with -inf) -> 1/2 ln2 + 2 * 1/4 ln4 = 1.5 ln2
    logits = torch.tensor(
        [[0.0, 0.0, 0.0, 0.0], [LN(0.5), LN(0.25), LN(0.25), -math.inf]], dtype=torch.float64
    )
    torch.testing.assert_close(
        logits_entropy(logits), torch.tensor([LN(4), 1.5 * LN(2)], dtype=torch.float64)
    )
    # the banned (-inf) token adds no NaN to the gradient either
    banned = logits.clone().requires_grad_(True)
    logits_entropy(banned).sum().backward()
    assert torch.all(torch.isfinite(banned.grad))
    g = torch.Generator().manual_seed(0)
    z = torch.randn(10, 7, generator=g, dtype=torch.float64)
    z1 = z.clone().requires_grad_(True)
    z2 = z.clone().requires_grad_(True)
    w = torch.randn(10, generator=g, dtype=torch.float64)
    (logits_entropy(z1, chunk_tokens=3) * w).sum().backward()
    (logits_entropy(z2, chunk_tokens=100) * w).sum().backward()
    torch.testing.assert_close(z1.grad, z2.grad)
    # bf16 logits are upcast, so the entropy is float32
    assert logits_entropy(z.to(torch.bfloat16)).dtype == torch.float32
    # what training calls: the entropy at token t is the one of the logits at t - 1, 0 at
    # each row's first token, and temperature divides the logits
    cu = torch.tensor([0, 4, 10])
    shifted = token_entropy(z, cu, temperature=2.0)
    expected = logits_entropy(z / 2.0).float()
    torch.testing.assert_close(shifted[1:4], expected[0:3])
    torch.testing.assert_close(shifted[5:], expected[4:9])
    assert shifted[0] == 0 and shifted[4] == 0


def test_value_loss_by_hand():
    # cliprange 0.2, old V = 1:
    #   V=1.5 R=2: V_clip = 1.2; (1.5-2)^2 = 0.25, (1.2-2)^2 = 0.64 -> 0.5 * 0.64 = 0.32 clipped
    #   V=1.1 R=2: V_clip = 1.1 -> 0.5 * 0.81 = 0.405
    #   V=0.5 R=0: V_clip = 0.8; 0.25 vs 0.64 -> 0.32 clipped
    v = torch.tensor([1.5, 1.1, 0.5], dtype=torch.float64)
    loss, clipped = value_loss(
        v,
        torch.ones(3, dtype=torch.float64),
        torch.tensor([2.0, 2, 0], dtype=torch.float64),
        cliprange_value=0.2,
    )
    torch.testing.assert_close(loss, torch.tensor([0.32, 0.405, 0.32], dtype=torch.float64))
    assert clipped.tolist() == [1, 0, 1]


# ----------------------------------------------------------------------------- metrics


def test_masked_sums_ignore_padding_even_when_it_holds_nan():
    lp = torch.tensor([LN(1.5), 0.0, float("nan")], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(3, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, float("nan")], dtype=torch.float64)
    ref = torch.tensor([0.0, 0.0, float("nan")], dtype=torch.float64)
    ent = torch.tensor([1.0, 2.0, float("inf")], dtype=torch.float64)
    mask = torch.tensor([1.0, 1.0, 0.0])
    terms = policy_loss_terms(
        lp,
        old,
        adv,
        ref_logprobs=ref,
        entropy=ent,
        kl_estimator="k1",
        clip_ratio_low=0.2,
        clip_ratio_c=3.0,
    )
    sums = masked_sums(terms, mask)
    # token 0: r = 1.5, A = 1 -> clipped, loss -1.2; token 1: r = 1, A = -1 -> loss 1
    assert sums["loss_tokens"].item() == 2
    assert sums["clipped"].item() == 1
    assert sums["dual_clipped"].item() == 0
    assert sums["pg_loss"].item() == pytest.approx(-0.2)
    assert sums["approx_kl"].item() == pytest.approx(-LN(1.5))  # old - new
    assert sums["kl"].item() == pytest.approx(LN(1.5))  # k1 = logp - ref
    assert sums["entropy"].item() == pytest.approx(3.0)
    assert all(torch.isfinite(v) for v in sums.values())


# ----------------------------------------------------------------------------- aggregation


def _normalizers(lens, masks, traj):
    return batching.LossNormalizers(
        num_rows=len(lens),
        num_loss_tokens=int(sum(int(m.sum()) for m in masks)),
        num_trajectories=len(set(traj)),
    )


MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("mode", MODES)
def test_loss_and_gradient_invariant_to_micro_batches_and_padding(mode):
    g = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(1)
    num_rows, vocab, horizon = 12, 5, 16
    lens = rng.integers(3, 12, size=num_rows)
    masks = []
    for n in lens:
        m = torch.zeros(int(n), dtype=torch.float64)
        m[int(rng.integers(1, n)) :] = 1.0  # prompt then response
        m[int(rng.integers(1, n))] = 0.0  # a masked tool/EOS token somewhere
        masks.append(m)
    traj = [r // 2 for r in range(num_rows)]  # two step rows per trajectory
    total = int(lens.sum())
    # leaves whose gradients we compare
    lp = (-torch.rand(total, generator=g, dtype=torch.float64)).requires_grad_(True)
    logits = torch.randn(total, vocab, generator=g, dtype=torch.float64).requires_grad_(True)
    old = lp.detach() + 0.3 * torch.randn(total, generator=g, dtype=torch.float64)
    ref = lp.detach() + 0.3 * torch.randn(total, generator=g, dtype=torch.float64)
    adv = torch.randn(total, generator=g, dtype=torch.float64)
    cu = np.concatenate([[0], np.cumsum(lens)])
    norm = _normalizers(lens, masks, traj)
    kw = dict(mode=mode, kl_loss_coef=0.05, entropy_coef=0.01, horizon=horizon)

    def micro_loss(rows, n_pad, lp_src, logits_src):
        idx = (
            torch.cat([torch.arange(cu[r], cu[r + 1]) for r in rows])
            if rows
            else torch.zeros(0, dtype=torch.int64)
        )
        seg_lens = [int(lens[r]) for r in rows] + [2] * n_pad
        mask = torch.cat([masks[r] for r in rows] + [torch.zeros(2 * n_pad, dtype=torch.float64)])
        # padding tokens: garbage values, including a huge log-ratio and a huge advantage
        pad_lp = lp_pad[: 2 * n_pad]
        pad_logits = logits_pad[: 2 * n_pad]
        pad_vals = torch.full((2 * n_pad,), 50.0, dtype=torch.float64)
        terms = policy_loss_terms(
            torch.cat([lp_src[idx], pad_lp]),
            torch.cat([old[idx], -pad_vals]),
            torch.cat([adv[idx], 1e6 * pad_vals]),
            ref_logprobs=torch.cat([ref[idx], -pad_vals]),
            entropy=logits_entropy(torch.cat([logits_src[idx], pad_logits]), chunk_tokens=7),
            kl_estimator="k3",
            clip_ratio_low=0.2,
            clip_ratio_high=0.28,
            clip_ratio_c=3.0,
        )
        cu_mb = torch.tensor(np.concatenate([[0], np.cumsum(seg_lens)]), dtype=torch.int64)
        return loss_for_micro_batch(terms, mask, cu_mb, norm, **kw), masked_sums(terms, mask)

    lp_pad = torch.randn(8, generator=g, dtype=torch.float64).requires_grad_(True)
    logits_pad = (100 * torch.randn(8, vocab, generator=g, dtype=torch.float64)).requires_grad_(
        True
    )

    whole, whole_sums = micro_loss(list(range(num_rows)), 0, lp, logits)
    whole.backward()
    grad_lp, grad_logits = lp.grad.clone(), logits.grad.clone()
    lp.grad = None
    logits.grad = None

    # 2 ranks x 2 micro-batches over a shuffled row order, one micro-batch only padding
    order = [int(r) for r in rng.permutation(num_rows)]
    splits = [(order[:4], 1), (order[4:5], 0), (order[5:], 2), ([], 1)]
    parts = [micro_loss(rows, n_pad, lp, logits) for rows, n_pad in splits]
    summed = sum(p[0] for p in parts)
    summed.backward()

    assert abs(summed.item() - whole.item()) < 1e-6
    assert torch.allclose(lp.grad, grad_lp, rtol=0, atol=1e-6)
    assert torch.allclose(logits.grad, grad_logits, rtol=0, atol=1e-6)
    # padding contributes exactly nothing: no gradient and no metric
    assert torch.all(lp_pad.grad == 0) and torch.all(logits_pad.grad == 0)
    for key, value in whole_sums.items():
        assert abs(sum(p[1][key] for p in parts).item() - value.item()) < 1e-6, key
    assert torch.isfinite(summed)


def test_loss_needs_the_terms_its_coefficients_use():
    x = torch.zeros(2)
    terms = policy_loss_terms(x, x, x, kl_estimator="k3", clip_ratio_low=0.2, clip_ratio_c=3.0)
    norm = batching.LossNormalizers(num_rows=1, num_loss_tokens=2, num_trajectories=1)
    cu = torch.tensor([0, 2])
    with pytest.raises(ValueError, match="kl_loss_coef"):
        loss_for_micro_batch(terms, torch.ones(2), cu, norm, mode="token-mean", kl_loss_coef=0.1)
    with pytest.raises(ValueError, match="entropy_coef"):
        loss_for_micro_batch(terms, torch.ones(2), cu, norm, mode="token-mean", entropy_coef=0.1)


@pytest.mark.parametrize("mode", MODES)
def test_value_loss_invariant_to_micro_batches_and_padding(mode):
    g = torch.Generator().manual_seed(2)
    lens = [4, 6, 3, 5]
    masks = [
        torch.tensor(m, dtype=torch.float64)
        for m in ([0, 1, 1, 1], [0, 0, 1, 0, 1, 1], [0, 1, 1], [0, 1, 1, 1, 0])
    ]
    total = sum(lens)
    v = torch.randn(total, generator=g, dtype=torch.float64).requires_grad_(True)
    old = v.detach() + 0.3 * torch.randn(total, generator=g, dtype=torch.float64)
    ret = torch.randn(total, generator=g, dtype=torch.float64)
    cu = np.concatenate([[0], np.cumsum(lens)])
    norm = _normalizers(lens, masks, [0, 0, 1, 2])

    def share(rows, n_pad):
        idx = torch.cat([torch.arange(cu[r], cu[r + 1]) for r in rows])
        pad = torch.full((2 * n_pad,), 1e3, dtype=torch.float64)
        mask = torch.cat([masks[r] for r in rows] + [torch.zeros(2 * n_pad, dtype=torch.float64)])
        seg = [lens[r] for r in rows] + [2] * n_pad
        cu_mb = torch.tensor(np.concatenate([[0], np.cumsum(seg)]), dtype=torch.int64)
        return value_loss_for_micro_batch(
            torch.cat([v[idx], pad]),
            torch.cat([old[idx], -pad]),
            torch.cat([ret[idx], pad]),
            mask,
            cu_mb,
            norm,
            mode=mode,
            cliprange_value=0.2,
            horizon=8,
        )

    whole, whole_sums = share([0, 1, 2, 3], 0)
    (grad,) = torch.autograd.grad(whole, v)
    parts = [share([2], 1), share([3, 0, 1], 0)]
    summed = parts[0][0] + parts[1][0]
    (grad_split,) = torch.autograd.grad(summed, v)
    assert abs(summed.item() - whole.item()) < 1e-6
    assert torch.allclose(grad_split, grad, rtol=0, atol=1e-6)
    for key, value in whole_sums.items():
        assert abs((parts[0][1][key] + parts[1][1][key]).item() - value.item()) < 1e-6, key
