"""Property tests for `plan_minibatches`: the seven promises of DESIGN.md ("The planner")."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batching import plan_minibatches, plan_stats

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------- workloads


def make_workload(rng, num_prompts, n, max_turns, max_len):
    """Rows of a multi-turn GRPO rollout, shuffled: (trajectory ids, lengths, prompt ids)."""
    traj, group, lens = [], [], []
    t = 0
    for p in range(num_prompts):
        for _ in range(n):
            turns = int(rng.integers(1, max_turns + 1))
            traj += [t] * turns
            group += [p] * turns
            lens += rng.integers(1, max_len + 1, turns).tolist()
            t += 1
    perm = rng.permutation(len(traj))
    take = lambda xs: [xs[i] for i in perm]  # noqa: E731
    return take(traj), take(lens), take(group)


@st.composite
def workloads(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    num_prompts = draw(st.integers(1, 12))
    n = draw(st.integers(1, 4))
    max_turns = draw(st.integers(1, 6))
    # Long-tailed lengths: most rows short, some far above the budget.
    max_len = draw(st.sampled_from([1, 3, 50, 400, 3000]))
    traj, lens, group = make_workload(rng, num_prompts, n, max_turns, max_len)
    grouped = draw(st.booleans())
    return dict(
        trajectory_ids=traj,
        seq_lens=lens,
        group_ids=group if grouped else None,
        mini_batch_size=draw(st.integers(1, 8)),
        dp_size=draw(st.integers(1, 5)),
        max_tokens_per_micro_batch=draw(st.one_of(st.none(), st.integers(2, 800))),
    )


# ---------------------------------------------------------------------------- promises


def check_promises(
    plan,
    trajectory_ids,
    seq_lens,
    *,
    mini_batch_size,
    dp_size,
    max_tokens_per_micro_batch,
    group_ids,
):
    lens = np.asarray(seq_lens)
    n = lens.size
    budget = max_tokens_per_micro_batch
    where = {}
    for m, mb in enumerate(plan.mini_batches):
        # Promise 3: every rank has the same number of non-empty micro-batches.
        assert len(mb.micro_batches) == dp_size
        counts = {len(rank) for rank in mb.micro_batches}
        assert len(counts) == 1 and counts.pop() >= 1
        if budget is None:
            assert mb.num_micro_batches == 1
        for r, rank in enumerate(mb.micro_batches):
            real_on_rank = sum(1 for micro in rank for i in micro if i >= 0)
            pads = 0
            for k, micro in enumerate(rank):
                assert len(micro) >= 1
                if -1 in micro:
                    # Padding only fills an otherwise empty micro-batch, one row of it.
                    assert micro == [-1]
                    pads += 1
                    continue
                for i in micro:
                    assert i not in where, f"row {i} planned twice"
                    where[i] = (m, r, k)
                # Promise 4: token budget, unless a single row alone exceeds it.
                if budget is not None and len(micro) > 1:
                    assert lens[micro].sum() <= budget
            # Minimal padding: only when the rank has fewer rows than micro-batches.
            assert pads == max(0, len(rank) - real_on_rank)
        # Promise 5: max rank tokens <= mean rank tokens + longest row (real tokens).
        rank_tokens = [
            lens[[i for mc in rank for i in mc if i >= 0]].sum() for rank in mb.micro_batches
        ]
        if mb.num_rows:
            longest = lens[mb.rows].max()
            assert max(rank_tokens) * dp_size <= sum(rank_tokens) + longest * dp_size
        assert list(mb.rank_real_tokens) == rank_tokens
    # Promise 1: every real row exactly once.
    assert sorted(where) == list(range(n))
    # Promise 2: trajectories (and groups) stay in one mini-batch; count of mini-batches.
    units = group_ids if group_ids is not None else trajectory_ids
    mb_of = defaultdict(set)
    for i in range(n):
        mb_of[("t", trajectory_ids[i])].add(where[i][0])
        mb_of[("u", units[i])].add(where[i][0])
    assert all(len(s) == 1 for s in mb_of.values())
    num_units = len(set(units))
    assert plan.num_mini_batches == math.ceil(num_units / mini_batch_size)
    for mb in plan.mini_batches:
        mb_units = {units[i] for i in mb.rows}
        assert 1 <= len(mb_units) <= mini_batch_size
        assert mb.num_units == len(mb_units)
        assert mb.num_trajectories == len({trajectory_ids[i] for i in mb.rows})
    # The per-row arrays agree with the nested lists.
    for i, (m, r, k) in where.items():
        assert (plan.row_mini_batch[i], plan.row_rank[i], plan.row_micro_batch[i]) == (m, r, k)


def _plan_workload(w: dict):
    """The plan of a generated workload dict (see ``workloads``)."""
    return plan_minibatches(
        w["trajectory_ids"],
        w["seq_lens"],
        mini_batch_size=w["mini_batch_size"],
        dp_size=w["dp_size"],
        max_tokens_per_micro_batch=w["max_tokens_per_micro_batch"],
        group_ids=w["group_ids"],
    )


@SETTINGS
@given(workloads())
def test_promises_on_random_multi_turn_workloads(w):
    check_promises(_plan_workload(w), **w)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    budget=st.sampled_from([None, 64, 300, 2048]),
    max_len=st.sampled_from([20, 500, 4000]),
)
def test_promises_grpo_45_prompts_dp2(seed, budget, max_len):
    """dp=2, 45 prompts, 15 prompts per mini-batch, n=8, 1-6 turns, groups = prompts."""
    traj, lens, group = make_workload(np.random.default_rng(seed), 45, 8, 6, max_len)
    kw = dict(mini_batch_size=15, dp_size=2, max_tokens_per_micro_batch=budget, group_ids=group)
    plan = plan_minibatches(traj, lens, **kw)
    check_promises(plan, traj, lens, **kw)
    assert plan.num_mini_batches == 3
    assert [mb.num_units for mb in plan.mini_batches] == [15, 15, 15]
    assert all(mb.num_trajectories == 15 * 8 for mb in plan.mini_batches)


@SETTINGS
@given(workloads())
def test_same_inputs_same_plan_and_input_types_do_not_matter(w):
    kw = {k: w[k] for k in ("mini_batch_size", "dp_size", "max_tokens_per_micro_batch")}
    a = plan_minibatches(w["trajectory_ids"], w["seq_lens"], group_ids=w["group_ids"], **kw)
    b = plan_minibatches(
        np.asarray(w["trajectory_ids"]),
        np.asarray(w["seq_lens"], dtype=np.int32),
        group_ids=None if w["group_ids"] is None else np.asarray(w["group_ids"]),
        **kw,
    )
    assert a.layout_digest() == b.layout_digest()
    assert [mb.micro_batches for mb in a.mini_batches] == [
        mb.micro_batches for mb in b.mini_batches
    ]


@settings(max_examples=30, deadline=None)
@given(workloads(), st.integers(1, 6), st.one_of(st.none(), st.integers(2, 500)))
def test_mini_batches_do_not_depend_on_dp_or_budget(w, other_dp, other_budget):
    """Runs on 8 and on 16 devices train on the same mini-batches: digest() ignores dp/budget."""
    kw = dict(mini_batch_size=w["mini_batch_size"], group_ids=w["group_ids"])
    a = plan_minibatches(
        w["trajectory_ids"],
        w["seq_lens"],
        dp_size=w["dp_size"],
        max_tokens_per_micro_batch=w["max_tokens_per_micro_batch"],
        **kw,
    )
    b = plan_minibatches(
        w["trajectory_ids"],
        w["seq_lens"],
        dp_size=other_dp,
        max_tokens_per_micro_batch=other_budget,
        **kw,
    )
    assert a.digest() == b.digest()
    assert [mb.rows.tolist() for mb in a.mini_batches] == [
        mb.rows.tolist() for mb in b.mini_batches
    ]


def test_digest_changes_with_membership_and_layout_digest_with_dp():
    traj, lens, _ = make_workload(np.random.default_rng(3), 6, 2, 3, 100)
    a = plan_minibatches(traj, lens, mini_batch_size=2, dp_size=2)
    b = plan_minibatches(traj, lens, mini_batch_size=3, dp_size=2)
    c = plan_minibatches(traj, lens, mini_batch_size=2, dp_size=3)
    assert a.digest() != b.digest()
    assert a.digest() == c.digest() and a.layout_digest() != c.layout_digest()
    assert len(a.digest()) == 64 and int(a.digest(), 16) >= 0


_HASHSEED_SCRIPT = textwrap.dedent(
    """
    import numpy as np
    from batching import plan_minibatches
    rng = np.random.default_rng(7)
    traj, group, lens = [], [], []
    for p in range(30):
        for s in range(4):
            k = int(rng.integers(1, 5))
            traj += [f"prompt{p}/sample{s}"] * k
            group += [f"prompt{p}"] * k
            lens += rng.integers(1, 400, k).tolist()
    perm = rng.permutation(len(traj))
    traj = [traj[i] for i in perm]; group = [group[i] for i in perm]
    lens = [lens[i] for i in perm]
    for g in (None, group):
        plan = plan_minibatches(traj, lens, mini_batch_size=4, dp_size=3,
                                max_tokens_per_micro_batch=500, group_ids=g)
        print(plan.digest(), plan.layout_digest())
    """
)


def test_plan_is_independent_of_pythonhashseed():
    outs = []
    for seed in ("0", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run(
            [sys.executable, "-c", _HASHSEED_SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        outs.append(res.stdout)
    assert outs[0] == outs[1]
    assert len(outs[0].split()) == 4


def test_mini_batches_balanced_in_tokens_and_unit_counts():
    rng = np.random.default_rng(11)
    traj, lens, group = make_workload(rng, 40, 4, 5, 2000)
    plan = plan_minibatches(traj, lens, mini_batch_size=7, dp_size=2, group_ids=group)
    units = [mb.num_units for mb in plan.mini_batches]
    assert max(units) - min(units) <= 1 and max(units) <= 7
    group_tokens = defaultdict(int)
    for g, n in zip(group, lens):
        group_tokens[g] += n
    mb_tokens = [mb.num_tokens for mb in plan.mini_batches]
    # Rounds of largest units to the lightest mini-batch: spread <= the largest unit.
    assert max(mb_tokens) - min(mb_tokens) <= max(group_tokens.values())


def test_rank_balance_on_many_rows_is_tight():
    rng = np.random.default_rng(5)
    lens = np.clip(np.exp(rng.normal(6, 1.0, 20000)), 50, 16000).astype(int)
    traj = rng.integers(0, 2000, lens.size)
    plan = plan_minibatches(
        traj, lens, mini_batch_size=500, dp_size=8, max_tokens_per_micro_batch=16384
    )
    stats = plan_stats(plan)
    assert stats["batch/dp_imbalance_worst"] < 1.01
    assert stats["batch/num_padding_rows"] == 0 and stats["batch/token_efficiency"] == 1.0


def test_padding_fills_ranks_without_rows():
    plan = plan_minibatches([0, 0, 1], [5, 6, 7], mini_batch_size=4, dp_size=5)
    (mb,) = plan.mini_batches
    assert sorted(len(rank) for rank in mb.micro_batches) == [1] * 5
    assert sum(rank == [[-1]] for rank in mb.micro_batches) == 2
    stats = plan_stats(plan)
    assert stats["batch/num_padding_rows"] == 2
    assert stats["batch/token_efficiency"] == pytest.approx(18 / 22)


def test_equalising_splits_micro_batches_before_padding():
    # Rank sizes force 2 micro-batches on the rank holding the 10-token row pair; the other
    # rank holds several small rows and must split them rather than take a padding row.
    plan = plan_minibatches(
        [0, 1, 2, 3, 4, 5],
        [10, 10, 3, 3, 3, 3],
        mini_batch_size=6,
        dp_size=2,
        max_tokens_per_micro_batch=12,
    )
    (mb,) = plan.mini_batches
    assert mb.num_padding_rows == 0
    assert len(mb.micro_batches[0]) == len(mb.micro_batches[1]) >= 2


def test_empty_input_gives_empty_plan():
    plan = plan_minibatches([], [], mini_batch_size=2, dp_size=2)
    assert plan.num_mini_batches == 0 and plan_stats(plan)["batch/num_rows"] == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(trajectory_ids=[0, 1], seq_lens=[3]), "trajectory_ids has 2 entries"),
        (dict(seq_lens=[3, 0]), r"seq_lens\[1\] = 0"),
        (dict(seq_lens=[3, 2.5]), r"seq_lens\[1\] = 2.5"),
        (dict(seq_lens=[[1, 2]]), "1-D"),
        (dict(mini_batch_size=0), "mini_batch_size = 0"),
        (dict(mini_batch_size=1.5), "mini_batch_size = 1.5"),
        (dict(dp_size=0), "dp_size = 0"),
        (dict(dp_size=True), "dp_size = True"),
        (dict(max_tokens_per_micro_batch=1), "max_tokens_per_micro_batch = 1"),
        (dict(group_ids=[0]), "group_ids has 1 entries"),
        (dict(group_ids=["a", "b"]), "trajectory 7 has rows in group"),
        (dict(trajectory_ids=[[1], [2]]), "hashable"),
    ],
)
def test_bad_inputs_raise_clear_value_errors(kwargs, match):
    args = dict(trajectory_ids=[7, 7], seq_lens=[3, 4], mini_batch_size=1, dp_size=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        plan_minibatches(args.pop("trajectory_ids"), args.pop("seq_lens"), **args)


def test_huge_rows_get_their_own_micro_batch():
    plan = plan_minibatches(
        [0, 1, 2], [100, 100, 1], mini_batch_size=3, dp_size=1, max_tokens_per_micro_batch=10
    )
    (mb,) = plan.mini_batches
    assert sorted(map(sorted, mb.micro_batches[0])) == [[0], [1], [2]]


@SETTINGS
@given(workloads())
def test_promises_hold_on_the_large_input_code_paths(w):
    """Force the paths taken by huge inputs (rank rounds past the exact-LPT prefix, snake
    order for late unit rounds, refinement everywhere) onto small workloads."""
    from unittest import mock

    import batching.balance as planner

    with (
        mock.patch.object(planner, "_EXACT_LPT_ROWS", 2),
        mock.patch.object(planner, "_MAX_ADAPTIVE_ROUNDS", 1),
        mock.patch.object(planner, "_REFINE_THRESHOLD_INV", 10**9),
    ):
        plan = _plan_workload(w)
    check_promises(plan, **w)


def lpt_reference(lens, dp):
    """Textbook LPT: rows longest first (ties: lower index), each onto the lightest rank
    (ties: lower rank). Returns the heaviest rank's tokens."""
    loads = [0] * dp
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        r = min(range(dp), key=lambda r: (loads[r], r))
        loads[r] += lens[i]
    return max(loads)


@SETTINGS
@given(
    lens=st.lists(st.integers(1, 5000), min_size=1, max_size=120),
    dp=st.integers(2, 9),
)
def test_rank_assignment_is_at_least_as_good_as_lpt(lens, dp):
    plan = plan_minibatches(list(range(len(lens))), lens, mini_batch_size=len(lens), dp_size=dp)
    (mb,) = plan.mini_batches
    assert max(mb.rank_real_tokens) <= lpt_reference(lens, dp)


def test_accepts_torch_tensors_like_lists():
    import torch

    traj, lens, group = make_workload(np.random.default_rng(9), 8, 3, 4, 300)
    kw = dict(mini_batch_size=3, dp_size=2, max_tokens_per_micro_batch=400)
    a = plan_minibatches(traj, lens, group_ids=group, **kw)
    b = plan_minibatches(
        torch.tensor(traj), torch.tensor(lens), group_ids=torch.tensor(group), **kw
    )
    assert a.layout_digest() == b.layout_digest()
