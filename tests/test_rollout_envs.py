"""Built-in environments, the env registry and prompt sources."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest

from rollout.envs import BUILTIN_ENVS, CalcEnv, RecallEnv, calculator, make_env, match_credit
from rollout.envs.prompts import PromptSource, read_jsonl


def _play(env, seed, replies):
    obs = env.reset(seed)
    rewards, done = [], False
    for reply in replies:
        obs, reward, done, _ = env.step(reply)
        rewards.append(reward)
        if done:
            break
    return obs, rewards, done


def test_recall_full_credit_for_the_right_answers():
    env = RecallEnv(turns=3, length=2)
    first = env.reset(5)
    assert first.startswith("say ")
    n1 = first.split()[1]
    obs, r, done, _ = env.step(n1)
    assert r == 1.0 and not done
    n2 = obs.split()[1]
    obs, r, done, _ = env.step(n2)
    assert r == 1.0 and obs == "first?" and not done
    _, r, done, _ = env.step(n1)  # the last turn asks for the first number again
    assert done and r == 1.0


def test_recall_is_deterministic_and_partial_credit_orders_answers():
    a, b = RecallEnv(), RecallEnv()
    assert a.reset(9) == b.reset(9)
    assert len({RecallEnv().reset(s) for s in range(20)}) > 5
    target = "42"
    wrong_digits, letters, right = match_credit("17", target), match_credit("ab", target), 1.0
    noise = match_credit("x%q!z", target)
    assert noise < letters < wrong_digits < right == match_credit("42", target)
    assert match_credit("4", target) < match_credit("43", target)


def test_random_policy_starts_low_and_digits_help():
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(32, 127)]
    env = RecallEnv(turns=2)
    rand = [
        _play(env, s, ["".join(rng.choice(alphabet) for _ in range(5)) for _ in range(2)])[1][-1]
        for s in range(200)
    ]
    digits = [
        _play(env, s, ["".join(rng.choice("0123456789") for _ in range(2)) for _ in range(2)])[1][
            -1
        ]
        for s in range(200)
    ]
    mean_rand, mean_digits = sum(rand) / 200, sum(digits) / 200
    assert 0.0 < mean_rand < 0.3
    assert mean_digits - mean_rand >= 0.3
    assert all(0.0 <= r <= 1.0 for r in rand + digits)


def test_calc_tool_then_answer_gets_full_credit():
    env = CalcEnv(max_operand=9, ops="+*")
    question = env.reset(3)
    expr = question.removesuffix("=?")
    obs, reward, done, info = env.step(f"calc {expr}")
    assert not done and reward == 0.0 and obs == f"= {info['result']}"
    _, reward, done, _ = env.step(str(info["result"]))
    assert done and reward == pytest.approx(1.0)
    # Answering directly and correctly without the tool: 0.9; a second tool call is an answer.
    env.reset(3)
    assert env.step(str(info["result"]))[1] == pytest.approx(0.9)
    env = CalcEnv(max_calls=1)
    env.reset(3)
    env.step("calc 1+1")
    _, reward, done, _ = env.step("calc 1+1")
    assert done and reward < 0.5


@pytest.mark.parametrize(
    "text", ["__import__('os').system('x')", "1+", "2**100", "1+2+3", "", "9999999+1", "os.sep"]
)
def test_calculator_rejects_anything_but_a_op_b(text):
    assert calculator(text) is None


def test_calculator_arithmetic():
    assert calculator("12+30") == 42 and calculator(" 7 * -3 ") == -21 and calculator("5-9") == -4


def test_make_env_builtin_and_import_path():
    assert make_env("recall") is RecallEnv
    assert make_env("rollout.envs.calc:CalcEnv") is CalcEnv
    assert set(BUILTIN_ENVS) >= {"recall", "calc"}
    for spec, fragment in [
        ("nope", "'nope'"),
        ("no_such_module_xyz:Env", "no_such_module_xyz"),
        ("rollout.envs:Missing", "Missing"),
        ("rollout.envs:match_credit", "not an environment"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            make_env(spec)


def test_env_constructor_errors_name_the_field():
    with pytest.raises(ValueError, match="turns"):
        RecallEnv(turns=0)
    with pytest.raises(ValueError, match="ops"):
        CalcEnv(ops="/")


def test_prompt_source_env_is_deterministic():
    a, b = PromptSource("env", seed=4), PromptSource("env", seed=4)
    assert a.batch(3, 5) == b.batch(3, 5)
    assert a.batch(0, 5) != a.batch(1, 5)
    assert [p.index for p in a.batch(2, 4)] == [8, 9, 10, 11]
    assert a.batch(0, 5) != PromptSource("env", seed=5).batch(0, 5)


def test_prompt_source_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    records = [{"prompt": f"q{i}", "answer": str(i)} for i in range(3)]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    src = PromptSource(str(path), seed=0)
    epoch = src.batch(0, 3)
    assert sorted(p.env_kwargs["prompt"] for p in epoch) == ["q0", "q1", "q2"]
    env = make_env("qa")(**epoch[0].env_kwargs)
    assert env.reset(epoch[0].seed) == epoch[0].env_kwargs["prompt"]
    assert env.step(epoch[0].env_kwargs["answer"])[1:3] == (1.0, True)


@pytest.mark.parametrize(
    "bad_line,fragment",
    [("{not json", "not valid JSON"), ('{"answer": "1"}', "prompt"), ("[1, 2]", "JSON object")],
)
def test_bad_jsonl_record_names_file_and_line(tmp_path, bad_line, fragment):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "ok"}\n\n' + bad_line + "\n")
    with pytest.raises(ValueError, match=fragment) as err:
        read_jsonl(path)
    assert f"{path}:3" in str(err.value)


def test_bad_data_source(tmp_path):
    with pytest.raises(ValueError, match="missing.jsonl"):
        PromptSource(str(tmp_path / "missing.jsonl"))
    other = tmp_path / "data.csv"
    other.write_text("prompt\n")
    with pytest.raises(ValueError, match="jsonl"):
        PromptSource(str(other))


@pytest.mark.skipif(
    importlib.util.find_spec("pyarrow") is not None, reason="pyarrow installed: no error path"
)
def test_parquet_without_pyarrow_is_a_clear_error(tmp_path):
    path = tmp_path / "data.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(ValueError, match="pyarrow"):
        PromptSource(str(path))
