"""Agent loop: the step-wise rules, merge, whole-trajectory rows, reward placement, env faults."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from batching import StepBatch
from rollout.agent_loop import run_rollouts
from rollout.engines import Engine, GenerationResult
from rollout.envs.prompts import PromptItem
from rollout.tokenizer import chat_token_ids, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin")


class ScriptedEngine(Engine):
    """Replies with fixed text per turn; records every call. ``eos``: end replies with EOS."""

    def __init__(self, tok, replies, *, eos=True):
        self.tok, self.replies, self.eos = tok, replies, eos
        self.calls = []

    def generate(self, requests, sampling):
        self.calls.append(
            ([list(r.prompt_ids) for r in requests], sampling, [r.seed for r in requests])
        )
        turn = len(self.calls) - 1
        out = []
        for _ in requests:
            ids = self.tok.encode(self.replies[min(turn, len(self.replies) - 1)])
            ids = ids[: sampling.max_new_tokens]
            if self.eos and len(ids) < sampling.max_new_tokens:
                ids.append(self.tok.eos_token_id)
            reason = "stop" if ids and ids[-1] == self.tok.eos_token_id else "length"
            out.append(GenerationResult(ids, [-0.5] * len(ids), reason))
        return out

    def update_weights(self, named_tensors):
        pass


class EchoEnv:
    """``turns`` turns; observation k is ``obs_len`` characters; reward 0.1 * turn, final 0.75."""

    def __init__(self, turns=3, obs_len=5):
        self.turns, self.obs_len = turns, obs_len

    def reset(self, seed):
        self.k = 0
        return "q" * self.obs_len

    def step(self, text):
        self.k += 1
        if self.k >= self.turns:
            return "", 0.75, True, {}
        return chr(ord("a") + self.k) * self.obs_len, 0.1 * self.k, False, {}


def _run(tok, engine, env_factory=EchoEnv, **kw):
    args = dict(
        n=2, max_turns=3, step_wise=True, merge_stepwise=False, max_input_len=200, max_new_tokens=6
    )
    args.update(kw)
    return run_rollouts(engine, tok, env_factory, [PromptItem(0, 1), PromptItem(1, 2)], **args)


def test_one_generate_call_per_turn_for_all_trajectories(tok):
    engine = ScriptedEngine(tok, ["12"])
    out = _run(tok, engine)
    assert len(engine.calls) == 3
    assert all(len(prompts) == 4 for prompts, _, _ in engine.calls)  # 2 prompts x n=2
    assert out.metrics["rollout/num_trajectories"] == 4
    assert out.metrics["rollout/mean_turns"] == 3
    StepBatch.from_rows(out.rows)  # the rows satisfy the batching contract
    # Request seeds are distinct per (prompt, sample, turn) and reproducible.
    seeds = [s for _, _, ss in engine.calls for s in ss]
    assert len(set(seeds)) == len(seeds)
    again = ScriptedEngine(tok, ["12"])
    _run(tok, again)
    assert [c[2] for c in again.calls] == [c[2] for c in engine.calls]


def test_rule_a_length_is_checked_on_the_retokenized_history(tok):
    # Turn 2's prompt is turn 1's prompt + reply + observation + template tokens. Choose
    # max_input_len so that turn 1's prompt + reply + raw observation text fits but the
    # re-tokenized chat (with its template tokens) does not: a loop that checks before
    # re-tokenizing would send an over-long prompt.
    engine = ScriptedEngine(tok, ["12"])
    obs_len = 5
    first = chat_token_ids(tok, [{"role": "user", "content": "q" * obs_len}])
    second = chat_token_ids(
        tok,
        [
            {"role": "user", "content": "q" * obs_len},
            {"role": "assistant", "content": "12"},
            {"role": "user", "content": "b" * obs_len},
        ],
    )
    naive = len(first) + 3 + obs_len  # prompt + "12" + EOS + observation characters
    limit = naive + 1
    assert len(second) > limit >= len(first)
    out = _run(tok, engine, max_input_len=limit)
    assert len(engine.calls) == 1
    assert all(len(p) <= limit for prompts, _, _ in engine.calls for p in prompts)
    assert out.metrics["rollout/truncated_trajectories"] == 4
    assert all(len(r.prompt_ids) <= limit for r in out.rows)
    assert all(r.is_last_step for r in out.rows)


def test_rule_b_appended_eos_has_mask_zero(tok):
    eos = tok.eos_token_id
    # The reply is longer than the budget: the engine stops on length without EOS.
    out = _run(tok, ScriptedEngine(tok, ["123456789"], eos=False), max_new_tokens=6)
    for row in out.rows:
        assert row.response_ids[-1] == eos
        assert row.response_mask[-1] == 0 and row.response_logprobs[-1] == 0.0
        assert all(m == 1 for m in row.response_mask[:-1])
        assert len(row.response_ids) == 6  # 5 generated + the appended EOS
    # An EOS the model generated itself is trained on.
    out = _run(tok, ScriptedEngine(tok, ["12"], eos=True))
    for row in out.rows:
        assert row.response_ids[-1] == eos and row.response_mask[-1] == 1
        assert row.response_logprobs[-1] == -0.5


def test_rule_b_stop_string_ends_the_turn_with_an_untrained_eos(tok):
    eos = tok.eos_token_id
    # The model writes past a stop string: the response keeps the string, drops what follows,
    # and an appended EOS (mask 0, logprob 0) closes the turn.
    engine = ScriptedEngine(tok, ["1+2=3;xyz"], eos=False)
    out = _run(tok, engine, max_new_tokens=12, stop_strings=("=3;",))
    for row in out.rows:
        assert tok.decode(row.response_ids[:-1]) == "1+2=3;"
        assert row.response_ids[-1] == eos
        assert row.response_mask == [1] * 6 + [0]
        assert row.response_logprobs[-1] == 0.0
    # The assistant message the environment sees ends at the stop string too.
    second_prompt = tok.decode(engine.calls[1][0][0])
    assert "1+2=3;" in second_prompt and "xyz" not in second_prompt


def test_stop_string_cut_is_the_shortest_prefix(tok):
    from rollout.agent_loop import stop_string_cut

    ids = tok.encode("abc</tool>def</tool>")
    assert stop_string_cut(tok, ids, ("</tool>",)) == len(tok.encode("abc</tool>"))
    assert stop_string_cut(tok, ids, ("zzz",)) == len(ids)
    assert stop_string_cut(tok, ids, ("zzz", "c<")) == len(tok.encode("abc<"))
    assert stop_string_cut(tok, [], ("a",)) == 0


def test_rule_c_step_response_holds_only_generated_tokens(tok):
    engine = ScriptedEngine(tok, ["12", "34", "56"])
    max_in, max_new = 200, 6
    out = _run(tok, engine, max_input_len=max_in, max_new_tokens=max_new)
    assert all(s.max_new_tokens == max_new - 1 for _, s, _ in engine.calls)
    rows = sorted((r for r in out.rows if r.trajectory_id == 0), key=lambda r: r.step_index)
    assert [r.step_index for r in rows] == [0, 1, 2]
    assert [r.is_last_step for r in rows] == [False, False, True]
    for row, reply in zip(rows, ["12", "34", "56"]):
        assert tok.decode(row.response_ids, skip_special_tokens=True) == reply
        assert row.response_mask == [1] * len(row.response_ids)
        assert len(row.prompt_ids) + len(row.response_ids) <= max_in + max_new
    # The observation after turn k is in turn k+1's prompt, not in turn k's response.
    assert "bbbbb" not in tok.decode(rows[0].response_ids)
    assert "bbbbb" in tok.decode(rows[1].prompt_ids)
    assert "ccccc" in tok.decode(rows[2].prompt_ids)


def test_merge_reproduces_the_unmerged_turns(tok):
    plain = _run(tok, ScriptedEngine(tok, ["12", "34", "56"]))
    merged = _run(tok, ScriptedEngine(tok, ["12", "34", "56"]), merge_stepwise=True)
    assert len(merged.rows) == 4 and len(plain.rows) == 12
    for row in merged.rows:
        steps = sorted(
            (r for r in plain.rows if r.trajectory_id == row.trajectory_id),
            key=lambda r: r.step_index,
        )
        last = steps[-1]
        assert row.prompt_ids == steps[0].prompt_ids
        assert row.prompt_ids + row.response_ids == last.prompt_ids + last.response_ids
        trained = [t for t, m in zip(row.response_ids, row.response_mask) if m]
        assert trained == [t for s in steps for t in s.response_ids]
        kept_lp = [lp for lp, m in zip(row.response_logprobs, row.response_mask) if m]
        assert kept_lp == [lp for s in steps for lp in s.response_logprobs]
        assert all(lp == 0.0 for lp, m in zip(row.response_logprobs, row.response_mask) if not m)
        untrained = tok.decode([t for t, m in zip(row.response_ids, row.response_mask) if not m])
        assert "bbbbb" in untrained and "ccccc" in untrained
        assert row.is_last_step and row.score == 0.75


def test_whole_trajectory_row_masks_observations(tok):
    out = _run(tok, ScriptedEngine(tok, ["12", "34", "56"]), step_wise=False)
    assert len(out.rows) == 4
    stepwise = _run(tok, ScriptedEngine(tok, ["12", "34", "56"]))
    for row in out.rows:
        trained = tok.decode([t for t, m in zip(row.response_ids, row.response_mask) if m])
        assert trained == "12<|im_end|>34<|im_end|>56<|im_end|>"
        untrained = tok.decode([t for t, m in zip(row.response_ids, row.response_mask) if not m])
        assert "bbbbb" in untrained and "ccccc" in untrained
        # Whole-trajectory tokens are exactly the chat the model saw.
        last = [
            r for r in stepwise.rows if r.trajectory_id == row.trajectory_id and r.is_last_step
        ][0]
        assert row.prompt_ids + row.response_ids == last.prompt_ids + last.response_ids


def test_score_sits_on_last_generated_token_of_last_step(tok):
    out = _run(tok, ScriptedEngine(tok, ["123456789"], eos=False))
    for tid in {r.trajectory_id for r in out.rows}:
        rows = sorted((r for r in out.rows if r.trajectory_id == tid), key=lambda r: r.step_index)
        assert all(r.score == 0.75 for r in rows)
        assert [r.step_reward for r in rows] == pytest.approx([0.1, 0.2, 0.75])
        for r in rows[:-1]:
            assert not any(r.token_rewards)
        last = rows[-1]
        last_trained = max(i for i, m in enumerate(last.response_mask) if m)
        assert last.token_rewards[last_trained] == 0.75
        assert sum(last.token_rewards) == 0.75


class FaultyEnv(EchoEnv):
    def __init__(self, fault="raise", at=1):
        super().__init__()
        self.fault, self.at = fault, at

    def reset(self, seed):
        if self.fault == "reset":
            raise RuntimeError("boom")
        return super().reset(seed)

    def step(self, text):
        obs, reward, done, info = super().step(text)
        if self.k != self.at:
            return obs, reward, done, info
        if self.fault == "raise":
            raise RuntimeError("env crashed")
        if self.fault == "nan":
            return obs, math.nan, done, info
        if self.fault == "range":
            return obs, 1.5, done, info
        if self.fault == "obs_type":
            return 123, reward, done, info
        if self.fault == "reward_type":
            return obs, "1.0", done, info
        return obs, reward, done, info


@pytest.mark.parametrize("fault", ["raise", "nan", "range", "obs_type", "reward_type", "reset"])
def test_env_faults_end_only_that_trajectory(tok, fault):
    def factory():
        return FaultyEnv(fault) if factory.count % 2 == 0 else EchoEnv()

    factory.count = 0

    def counting_factory():
        env = factory()
        factory.count += 1
        return env

    out = _run(tok, ScriptedEngine(tok, ["12"]), env_factory=counting_factory)
    assert out.metrics["rollout/env_errors"] == 2  # trajectories 0 and 2 are faulty
    healthy = {r.trajectory_id for r in out.rows if r.score == 0.75}
    assert healthy == {1, 3}
    faulty_rows = [r for r in out.rows if r.trajectory_id in (0, 2)]
    if fault == "reset":
        assert faulty_rows == []
    else:
        # Rows so far are kept with score 0; the failing turn is the last step.
        assert {r.step_index for r in faulty_rows} == {0}
        assert all(r.score == 0.0 and r.is_last_step for r in faulty_rows)
    StepBatch.from_rows(out.rows)


def test_user_errors_name_the_field(tok):
    engine = ScriptedEngine(tok, ["12"])
    with pytest.raises(ValueError, match="max_new_tokens"):
        _run(tok, engine, max_new_tokens=1)
    with pytest.raises(ValueError, match="rollout.n"):
        _run(tok, engine, n=0)


def test_real_engine_end_to_end(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSRL_CACHE", str(tmp_path))
    from rollout.engines import make_engine
    from rollout.envs import make_env
    from rollout.envs.prompts import PromptSource

    engine = make_engine("hf", "builtin:tiny", tok, seed=0)
    prompts = PromptSource("env", seed=3).batch(0, 3)
    kw = dict(
        n=2,
        max_turns=3,
        step_wise=True,
        merge_stepwise=False,
        max_input_len=64,
        max_new_tokens=5,
        seed=3,
    )
    out = run_rollouts(engine, tok, make_env("recall"), prompts, **kw)
    again = run_rollouts(engine, tok, make_env("recall"), prompts, **kw)
    assert [r.response_ids for r in out.rows] == [r.response_ids for r in again.rows]
    assert all(len(r.prompt_ids) + len(r.response_ids) <= 64 + 5 for r in out.rows)
    assert 0.0 <= out.metrics["rollout/score_mean"] <= 1.0
    batch = StepBatch.from_rows(out.rows)
    assert batch.cu_seqlens.numel() == len(out.rows) + 1


def test_stable_seed_ignores_hash_randomisation():
    code = "from rollout.seeding import stable_seed; print(stable_seed(1, 2, 3, 4, 5))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": str(h)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for h in (0, 1, 2)
    }
    assert len(outs) == 1
