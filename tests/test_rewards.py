"""Reward functions (verl's signature, reward.function), the built-in GSM8K / MATH scorers, the
single_turn env, faults counted like env faults, and DAPO's overlong shaping."""

from __future__ import annotations

import pytest

from batching import Row
from rollout.agent_loop import run_rollouts
from rollout.envs import bind_env, make_env, takes_reward_fn
from rollout.envs.prompts import PromptItem
from rollout.rewards import (
    RewardError,
    RewardFunction,
    apply_overlong_penalty,
    gsm8k_score,
    load_reward_function,
    math_score,
    overlong_penalty,
)
from rollout.tokenizer import load_tokenizer
from tests.test_rollout_agent_loop import ScriptedEngine
from tests.verl_reward_fns import CALLS


@pytest.mark.parametrize(
    "reply,truth,score",
    [
        ("so 3 + 4 = 7\n#### 7", "7", 1.0),
        ("#### 1,234", "Natalia sold ... #### 1234", 1.0),
        ("#### $18.00", "18", 1.0),
        ("the answer is 7", "7", 0.0),  # strict: no #### -> no credit
        ("#### 6", "7", 0.0),
        ("#### 7 then #### 8", "8", 1.0),  # the last one counts
    ],
)
def test_gsm8k_scorer(reply, truth, score):
    assert gsm8k_score("openai/gsm8k", reply, truth, {}) == score


@pytest.mark.parametrize(
    "reply,truth,score",
    [
        (r"thus \boxed{\frac{1}{2}}", r"\frac12", 1.0),
        (r"\boxed{\dfrac{1}{2}}", "0.5", 1.0),
        (r"\boxed{x = 3}", r"\boxed{3}", 1.0),
        (r"\boxed{90^\circ}", "90", 1.0),
        (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
        (r"\boxed{\text{(A)}}", "(A)", 1.0),
        (r"\boxed{2} then \boxed{3}", "2", 0.0),  # the last box counts
        (r"\boxed{\sqrt{2}}", r"\sqrt2", 1.0),
        ("no box: 3", "3", 0.0),
        (r"\boxed{3", "3", 0.0),  # unclosed
    ],
)
def test_math_scorer(reply, truth, score):
    assert math_score("math", reply, truth, {}) == score


def test_reward_function_returns_score_and_extras():
    fn = RewardFunction("tests.verl_reward_fns:exact", timeout_s=5)
    result = fn("src", " 42 ", "42", {"i": 1})
    assert result.score == 1.0 and result.extras == {"length": 4.0}
    assert CALLS[-1] == ("src", " 42 ", "42", {"i": 1})  # verl's argument order


@pytest.mark.parametrize(
    "name,fragment",
    [
        ("raises", "RuntimeError: scorer bug"),
        ("returns_nan", "not a finite number"),
        ("returns_text", "not a number"),
        ("sleeps", "reward.timeout_s=0.2"),
    ],
)
def test_reward_faults_raise_reward_error(name, fragment):
    fn = RewardFunction(f"tests.verl_reward_fns:{name}", timeout_s=0.2)
    with pytest.raises(RewardError, match=fragment):
        fn("src", "x", "1", {})


@pytest.mark.parametrize(
    "spec,fragment",
    [
        ("builtin:gsm9k", "builtin:gsm8k"),
        ("no_such_module_xyz:f", "cannot import"),
        ("tests.verl_reward_fns:missing", "no function 'missing'"),
    ],
)
def test_bad_reward_spec_names_the_key(spec, fragment):
    with pytest.raises(ValueError, match=fragment) as err:
        load_reward_function(spec)
    assert "reward.function" in str(err.value)


def test_which_envs_take_a_reward_function():
    assert takes_reward_fn(make_env("single_turn")) and takes_reward_fn(make_env("qa"))
    assert not takes_reward_fn(make_env("recall"))


def _verl_item(index, truth, source="gsm8k"):
    row = {
        "prompt": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "2+2?"},
        ],
        "data_source": source,
        "reward_model": {"ground_truth": truth, "style": "rule"},
        "extra_info": {"index": index},
    }
    return PromptItem(index=index, seed=index, env_kwargs=row)


def test_single_turn_env_scores_with_the_reward_function_and_faults_are_counted():
    tok = load_tokenizer("builtin")
    engine = ScriptedEngine(tok, ["4"])
    kw = dict(n=2, max_turns=3, step_wise=True, merge_stepwise=False, max_input_len=200)
    fn = RewardFunction("tests.verl_reward_fns:exact", timeout_s=5)
    items = [_verl_item(0, "4"), _verl_item(1, "5")]
    out = run_rollouts(engine, tok, bind_env("single_turn", {}, fn), items, max_new_tokens=6, **kw)
    # the chat (system + user) is the prompt; one turn each; the score is the function's
    assert len(engine.calls) == 1
    assert tok.decode(engine.calls[0][0][0]).count("be brief") == 1
    assert [r.score for r in out.rows] == [1.0, 1.0, 0.0, 0.0]
    assert out.metrics["reward/errors"] == 0 and out.metrics["reward/extra/length"] == 1.0

    bad = RewardFunction("tests.verl_reward_fns:raises", timeout_s=5)
    out = run_rollouts(engine, tok, bind_env("single_turn", {}, bad), items, max_new_tokens=6, **kw)
    # a faulty reward ends the trajectory with score 0; the batch goes on, rows kept
    assert out.metrics["reward/errors"] == 4 and out.metrics["rollout/env_errors"] == 4
    assert [r.score for r in out.rows] == [0.0] * 4

    # a reward outside [0, 1] is fine from a reward function
    wide = RewardFunction("tests.verl_reward_fns:length_score", timeout_s=5)
    out = run_rollouts(
        engine,
        tok,
        bind_env("qa", {}, wide),
        [PromptItem(0, 0, {"prompt": "q", "answer": "a"})],
        max_new_tokens=6,
        **kw,
    )
    assert out.metrics["rollout/env_errors"] == 0 and out.rows[0].score == pytest.approx(2.01)


def test_overlong_penalty_by_hand():
    # horizon 10 generated tokens, buffer 4: free up to 6, then -factor/4 per token
    assert [overlong_penalty(n, 10, 4, 1.0) for n in (5, 6, 7, 8, 10)] == [
        0.0,
        0.0,
        -0.25,
        -0.5,
        -1.0,
    ]
    assert overlong_penalty(10, 10, 0, 1.0) == 0.0  # off


def test_overlong_shaping_moves_score_and_token_reward():
    def row(tid, mask, score, last=True):
        n = len(mask)
        rewards = [0.0] * n
        if last:
            rewards[max(i for i, m in enumerate(mask) if m)] = score
        return Row(
            [1],
            [5] * n,
            mask,
            [0.0] * n,
            uid=0,
            trajectory_id=tid,
            is_last_step=last,
            score=score,
            token_rewards=rewards,
        )

    rows = [
        row(0, [1, 1, 1, 0], 1.0),  # 3 generated tokens: within 10 - 4
        row(1, [1] * 8, 1.0, last=False),  # 8-token first turn...
        row(1, [1, 1, 0], 0.5),  # ...decides trajectory 1's length: -0.5
    ]
    out, metrics = apply_overlong_penalty(rows, horizon=10, buffer_len=4, factor=1.0)
    assert [r.score for r in out] == [1.0, 0.5, 0.0]
    assert out[2].token_rewards == [0.0, 0.0, 0.0] and out[0].token_rewards[2] == 1.0
    assert metrics == {"reward/overlong_penalty_mean": -0.25, "reward/overlong_fraction": 0.5}
