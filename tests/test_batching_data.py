"""StepBatch: packing, selection, padding rows, transport, and accuracy metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batching import (
    PADDING_TOKEN_ID,
    Row,
    StepBatch,
    real_row_mean,
    response_length_mean,
    trajectory_score_mean,
)
from batching.data import REQUIRED_ROW_FIELDS, REQUIRED_TOKEN_FIELDS


def random_rows(rng, num_traj=5, max_turns=3, with_token_rewards=False):
    rows = []
    for t in range(num_traj):
        turns = int(rng.integers(1, max_turns + 1))
        score = float(rng.normal())
        for s in range(turns):
            p, r = int(rng.integers(1, 6)), int(rng.integers(0, 6))
            mask = rng.integers(0, 2, r).tolist()
            rows.append(
                Row(
                    prompt_ids=rng.integers(1, 100, p).tolist(),
                    response_ids=rng.integers(1, 100, r).tolist(),
                    response_mask=mask,
                    response_logprobs=[-float(x) * m for x, m in zip(rng.random(r), mask)],
                    uid=t // 2,
                    trajectory_id=t,
                    step_index=s,
                    is_last_step=s == turns - 1,
                    score=score,
                    step_reward=float(rng.normal()),
                    token_rewards=rng.normal(size=r).tolist() if with_token_rewards else None,
                )
            )
    return rows


def expected_tokens(row):
    """What one row's token fields must be, computed straight from the Row."""
    p, r = len(row.prompt_ids), len(row.response_ids)
    rewards = [0.0] * (p + r)
    if row.token_rewards is not None:
        rewards[p:] = row.token_rewards
    else:
        trained = [p + j for j, m in enumerate(row.response_mask) if m]
        at = trained[-1] if trained else p + r - 1
        rewards[at] = row.step_reward + (row.score if row.is_last_step else 0.0)
    return {
        "input_ids": row.prompt_ids + row.response_ids,
        "position_ids": list(range(p + r)),
        "loss_mask": [0.0] * p + [float(m) for m in row.response_mask],
        "rollout_logprobs": [0.0] * p + list(row.response_logprobs),
        "token_rewards": rewards,
    }


def assert_row_matches(batch, i, row):
    s, e = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
    for name, want in expected_tokens(row).items():
        got = batch.token_fields[name][..., s:e]
        torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype).expand_as(got))
    assert int(batch.uid[i]) == row.uid and int(batch.trajectory_id[i]) == row.trajectory_id
    assert int(batch.step_index[i]) == row.step_index
    assert bool(batch.is_last_step[i]) == row.is_last_step and not bool(batch.is_padding[i])
    assert int(batch.prompt_len[i]) == len(row.prompt_ids)
    assert int(batch.response_len[i]) == len(row.response_ids)
    assert float(batch.score[i]) == pytest.approx(row.score, abs=1e-6)
    assert float(batch.step_reward[i]) == pytest.approx(row.step_reward, abs=1e-6)


def assert_padding_row(batch, i):
    s, e = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
    assert e - s == 2 and bool(batch.is_padding[i])
    assert int(batch.prompt_len[i]) == 1 and int(batch.response_len[i]) == 1
    assert batch.input_ids[..., s:e].tolist() == [PADDING_TOKEN_ID] * 2
    assert (batch.position_ids[..., s:e] == torch.tensor([0, 1])).all()
    for name, t in batch.token_fields.items():
        if name not in ("input_ids", "position_ids"):
            assert not t[..., s:e].any(), name
    assert int(batch.uid[i]) < 0 and int(batch.trajectory_id[i]) < 0
    assert float(batch.score[i]) == 0.0 and float(batch.step_reward[i]) == 0.0


def test_from_rows_packs_every_field():
    rows = random_rows(np.random.default_rng(0))
    b = StepBatch.from_rows(rows)
    assert len(b) == b.num_rows == len(rows)
    assert b.num_tokens == sum(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    assert b.seq_lens.tolist() == [len(r.prompt_ids) + len(r.response_ids) for r in rows]
    assert b.cu_seqlens.dtype == torch.int64 and b.cu_seqlens.tolist()[0] == 0
    for name, dtype in REQUIRED_TOKEN_FIELDS.items():
        assert b.token_fields[name].dtype == dtype
    for name, dtype in REQUIRED_ROW_FIELDS.items():
        assert b.row_fields[name].dtype == dtype
    for i, row in enumerate(rows):
        assert_row_matches(b, i, row)
    assert b.row_of_token().tolist() == [i for i, n in enumerate(b.seq_lens) for _ in range(n)]
    assert b.row_loss_tokens().tolist() == [sum(r.response_mask) for r in rows]


def test_explicit_token_rewards_are_placed_on_response_tokens():
    rows = random_rows(np.random.default_rng(1), with_token_rewards=True)
    b = StepBatch.from_rows(rows)
    for i, row in enumerate(rows):
        assert_row_matches(b, i, row)


def test_default_reward_goes_to_last_trained_token():
    row = Row(
        [5, 6],
        [7, 8, 2],
        [1, 1, 0],
        [-0.5, -0.25, 0.0],
        uid=0,
        trajectory_id=0,
        score=1.0,
        step_reward=0.5,
    )
    b = StepBatch.from_rows([row])
    # The appended EOS (mask 0) does not get the reward; the last generated token does.
    assert b.token_rewards.tolist() == [0.0, 0.0, 0.0, 1.5, 0.0]
    row.is_last_step = False
    assert StepBatch.from_rows([row]).token_rewards.tolist() == [0.0, 0.0, 0.0, 0.5, 0.0]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), data=st.data())
def test_select_transport_concat_split_round_trip(seed, data):
    rng = np.random.default_rng(seed)
    rows = random_rows(rng, num_traj=int(rng.integers(1, 6)))
    b = StepBatch.from_rows(rows)
    b.set_token_field("advantages", torch.from_numpy(rng.normal(size=b.num_tokens)).float())
    b.set_row_field("extra", torch.from_numpy(rng.integers(0, 9, (b.num_rows, 2))))
    picks = data.draw(st.lists(st.integers(-1, len(rows) - 1), min_size=1, max_size=12))
    sel = b.select(picks)
    assert sel.num_rows == len(picks)
    back = StepBatch.from_numpy(sel.to_numpy())
    cut = data.draw(st.integers(0, len(picks)))
    parts = back.split([cut, len(picks) - cut])
    again = StepBatch.concat(parts)
    for batch in (sel, back, again):
        assert set(batch.token_fields) == set(b.token_fields)
        assert set(batch.row_fields) == set(b.row_fields)
        for k, src in enumerate(picks):
            if src < 0:
                assert_padding_row(batch, k)
                assert batch.row_fields["extra"][k].tolist() == [0, 0]
                continue
            assert_row_matches(batch, k, rows[src])
            s, e = int(batch.cu_seqlens[k]), int(batch.cu_seqlens[k + 1])
            s0, e0 = int(b.cu_seqlens[src]), int(b.cu_seqlens[src + 1])
            assert torch.equal(
                batch.token_fields["advantages"][s:e], b.token_fields["advantages"][s0:e0]
            )
            assert torch.equal(batch.row_fields["extra"][k], b.row_fields["extra"][src])
        pad_ids = batch.uid[batch.is_padding].tolist()
        assert len(set(pad_ids)) == len(pad_ids)
        assert batch.trajectory_id[batch.is_padding].tolist() == pad_ids


def test_padding_rows_keep_3d_position_ids_and_never_share_ids():
    rows = random_rows(np.random.default_rng(2))
    b = StepBatch.from_rows(rows)
    b.set_token_field("position_ids", torch.stack([b.position_ids] * 3))
    sel = b.select([-1, 0, -1, 1, -1])
    assert sel.position_ids.shape == (3, sel.num_tokens)
    for k in (0, 2, 4):
        assert_padding_row(sel, k)
    both = StepBatch.concat([sel, sel])
    pad = both.is_padding
    real_uids, real_trajs = set(both.uid[~pad].tolist()), set(both.trajectory_id[~pad].tolist())
    pad_uids = both.uid[pad].tolist()
    assert len(set(pad_uids)) == 6  # renumbered by concat: still unique
    assert not real_uids & set(pad_uids)
    assert not real_trajs & set(both.trajectory_id[pad].tolist())


def test_metrics_ignore_padding_rows():
    rows = random_rows(np.random.default_rng(3), num_traj=4)
    b = StepBatch.from_rows(rows)
    padded = b.select([-1, *range(len(rows)), -1, -1])
    last = [r.score for r in rows if r.is_last_step]
    for batch in (b, padded):
        assert trajectory_score_mean(batch) == pytest.approx(sum(last) / len(last), abs=1e-6)
        assert response_length_mean(batch) == pytest.approx(
            sum(len(r.response_ids) for r in rows) / len(rows)
        )
        assert real_row_mean(batch, "step_reward") == pytest.approx(
            sum(r.step_reward for r in rows) / len(rows), abs=1e-6
        )
    only_padding = b.select([-1, -1])
    assert math.isnan(trajectory_score_mean(only_padding))
    with pytest.raises(ValueError, match="'nope'"):
        real_row_mean(b, "nope")


def test_from_numpy_accepts_read_only_arrays_without_copying():
    b = StepBatch.from_rows(random_rows(np.random.default_rng(4)))
    arrays = b.to_numpy()
    for a in arrays.values():
        a.flags.writeable = False
    back = StepBatch.from_numpy(arrays)
    assert back.input_ids.data_ptr() == arrays["token/input_ids"].ctypes.data
    copied = StepBatch.from_numpy(arrays, copy=True)
    assert copied.input_ids.data_ptr() != arrays["token/input_ids"].ctypes.data
    assert torch.equal(copied.input_ids, b.input_ids)


def _row(**kw):
    base = dict(
        prompt_ids=[1],
        response_ids=[2, 3],
        response_mask=[1, 0],
        response_logprobs=[-1.0, 0.0],
        uid=0,
        trajectory_id=0,
    )
    base.update(kw)
    return Row(**base)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(prompt_ids=[], response_ids=[], response_mask=[], response_logprobs=[]), "0 tokens"),
        (dict(response_mask=[1]), "response_mask has 1 entries"),
        (dict(response_logprobs=[0.0]), "response_logprobs has 1 entries"),
        (dict(token_rewards=[1.0]), "token_rewards has 1 entries"),
        (dict(response_mask=[1, 2]), "response_mask contains 2"),
        (dict(uid=-1), "uid = -1"),
        (dict(trajectory_id=-3), "trajectory_id = -3"),
    ],
)
def test_bad_rows_raise_value_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        StepBatch.from_rows([_row(), _row(**kw)])


def test_bad_batch_operations_raise_value_errors():
    b = StepBatch.from_rows([_row(), _row(trajectory_id=1)])
    with pytest.raises(ValueError, match="out of range"):
        b.select([2])
    with pytest.raises(ValueError, match="out of range"):
        b.select([-2])
    with pytest.raises(ValueError, match="num_tokens = 6"):
        b.set_token_field("values", torch.zeros(5))
    with pytest.raises(ValueError, match="num_rows = 2"):
        b.set_row_field("x", torch.zeros(3))
    with pytest.raises(ValueError, match="sum to num_rows"):
        b.split([1, 2])
    other = StepBatch.from_rows([_row()])
    other.set_token_field("values", torch.zeros(other.num_tokens))
    with pytest.raises(ValueError, match="token fields"):
        StepBatch.concat([b, other])
    with pytest.raises(ValueError, match="at least one"):
        StepBatch.concat([])
    with pytest.raises(ValueError, match="unknown key"):
        StepBatch.from_numpy({**b.to_numpy(), "weird": np.zeros(1)})
    with pytest.raises(ValueError, match="missing required token field"):
        StepBatch({}, b.row_fields, b.cu_seqlens)
