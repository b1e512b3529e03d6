"""Sequence-level rollout correction over streamed trajectories (issue 45, item 12): the product
of hundreds of per-token ratios sits at 0 or at the cap, the more so where a trajectory went
on under new weights and mixes behaviour policies. ``geometric`` is one weight per sequence,
the geometric mean of its tokens' ratios (verl's ``geometric`` aggregation, AReaL's and GSPO's
sequence ratio); ``sequence`` keeps its product (verl's ``rollout_is=sequence``) wherever one
policy sampled the sequence, and takes the geometric mean where versions mix."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainer.algorithms.rollout_correction import rollout_correction_weights
from trainer.config import load_config


def _two_rows():
    # row 0: log(pi_old / pi_rollout) = [0.5, 0.1, (masked)]; row 1: [-0.3, -0.1]
    old = torch.tensor([-1.0, -1.0, -3.0, -2.0, -2.0])
    rollout = torch.tensor([-1.5, -1.1, -1.0, -1.7, -1.9])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    return old, rollout, mask, torch.tensor([0, 3, 5])


def test_geometric_is_the_capped_geometric_mean_of_each_sequences_ratios():
    old, rollout, mask, cu = _two_rows()
    w, m = rollout_correction_weights(old, rollout, mask, cu, level="geometric", cap=1.25)
    row0, row1 = min(math.exp(0.3), 1.25), math.exp(-0.2)  # exp(mean log ratio), capped
    torch.testing.assert_close(w, torch.tensor([row0, row0, 1.0, row1, row1]))
    assert m["rollout_correction/capped_frac"] == pytest.approx(2 / 4)
    assert m["rollout_correction/weight_mean"] == pytest.approx((2 * row0 + 2 * row1) / 4)
    assert "rollout_correction/mixed_version_rows" not in m


def test_sequence_takes_the_geometric_mean_only_where_a_sequence_mixes_versions():
    """Row 0's tokens came from policies 3 and 4 (it went on under new weights): geometric
    mean; row 1 from policy 4 alone: the product, as without versions."""
    old, rollout, mask, cu = _two_rows()
    versions = torch.tensor([3, 4, -1, 4, 4])
    w, m = rollout_correction_weights(
        old, rollout, mask, cu, level="sequence", cap=2.0, versions=versions
    )
    row0, row1 = math.exp(0.3), math.exp(-0.4)
    torch.testing.assert_close(w, torch.tensor([row0, row0, 1.0, row1, row1]))
    assert m["rollout_correction/mixed_version_rows"] == pytest.approx(1 / 2)
    plain, _ = rollout_correction_weights(old, rollout, mask, cu, level="sequence", cap=2.0)
    torch.testing.assert_close(plain, torch.tensor([math.exp(0.6)] * 2 + [1.0] + [row1] * 2))
    # a masked token of another version (an observation) does not make a row mixed
    one, m = rollout_correction_weights(
        old, rollout, mask, cu, level="sequence", cap=2.0, versions=torch.tensor([3, 3, 9, 4, 4])
    )
    torch.testing.assert_close(one, plain)
    assert m["rollout_correction/mixed_version_rows"] == 0.0


def test_a_long_mixed_trajectory_keeps_a_weight_near_one_where_the_product_vanishes():
    """200 tokens, each 0.05 nats less likely under the proximal policy than under the older
    ones that sampled them (half before a load, half after): the product is e^-10, 4.5e-5;
    the geometric mean e^-0.05."""
    tokens = 200
    old = torch.full((tokens,), -1.05)
    rollout = torch.full((tokens,), -1.0)
    mask, cu = torch.ones(tokens), torch.tensor([0, tokens])
    versions = torch.tensor([1] * 100 + [2] * 100)
    product, _ = rollout_correction_weights(old, rollout, mask, cu, level="sequence", cap=2.0)
    assert float(product[0]) == pytest.approx(math.exp(-10.0), rel=1e-4)
    w, _ = rollout_correction_weights(
        old, rollout, mask, cu, level="sequence", cap=2.0, versions=versions
    )
    assert float(w[0]) == pytest.approx(math.exp(-0.05), rel=1e-5)


def test_the_config_takes_geometric_and_names_it_when_refusing():
    cfg = load_config(None, ["algorithm.rollout_correction=geometric"])
    assert cfg.algorithm.rollout_correction == "geometric"
    with pytest.raises(ValueError, match="token, sequence or geometric"):
        rollout_correction_weights(*_two_rows(), level="tokens", cap=2.0)


@pytest.mark.slow
def test_a_streamed_run_with_sequence_correction_reports_its_mixed_rows(local_ray, tmp_path):
    """A streamed multi-turn run with partial rollouts and sequence-level correction: every
    step reports the share of its rows that mixed policy versions and so took the geometric
    mean, the same share its recorded batch shows (the shipped path: the batch's
    ``policy_version`` column reaches the weights)."""
    from rollout.replay import load_rollout
    from trainer.loop.start.run import run_training
    from trainer.records.jsonl_files import read_jsonl

    run_dir = tmp_path / "run"
    keys = [
        "train.max_staleness=1",
        "rollout.engine_devices=1",
        "algorithm.rollout_correction=sequence",
        "rollout.partial_rollout=true",
        "rollout.env=rollout.envs.longtail:LongTailEnv",
        "rollout.max_turns=3",
        "train.batch_size=4",
        "train.mini_batch_size=2",
        "train.total_steps=4",
        "run.save_every=0",
        "run.resume=never",
        f"run.dir={run_dir}",
    ]
    assert run_training(load_config(None, keys)) == 0
    for m in read_jsonl(run_dir / "metrics.jsonl"):
        arrays = load_rollout(run_dir / "rollouts" / f"step_{m['step']}.npz")
        versions, mask = arrays["token/policy_version"], arrays["token/loss_mask"]
        cu = arrays["cu_seqlens"]
        spans = [(versions[a:b][mask[a:b] > 0]) for a, b in zip(cu[:-1], cu[1:])]
        spans = [v for v in spans if v.size]
        mixed = sum(int(np.unique(v).size > 1) for v in spans) / len(spans)
        assert m["rollout_correction/mixed_version_rows"] == pytest.approx(mixed)
        assert 0.0 < m["rollout_correction/weight_mean"] <= 2.0
