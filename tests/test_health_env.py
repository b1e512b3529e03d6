"""A broken environment no longer trains silently (issue 18): every kind of fault ends its
trajectory with a text that shows the offending value, the rollout carries those texts with
their trajectory ids, and the health gate stops a step where more than
``run.max_env_error_fraction`` of the trajectories faulted, showing the faults."""

from __future__ import annotations

import math

import pytest

from rollout.agent_loop import run_rollouts
from rollout.engines import Engine, GenerationResult
from rollout.envs import make_env
from rollout.envs.prompts import PromptItem
from rollout.tokenizer import load_tokenizer
from trainer.config import ConfigError, load_config
from trainer.loop.schedule.health import HealthError, check_env_faults


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin")


class OneTokenEngine(Engine):
    """Answers every request with "7" and EOS."""

    def __init__(self, tok):
        self.tok = tok

    def generate(self, requests, sampling):
        ids = self.tok.encode("7")[:1] + [self.tok.eos_token_id]
        return [GenerationResult(list(ids), [-0.5] * len(ids), "stop") for _ in requests]

    def update_weights(self, named_tensors):
        pass


def _env_returning(value_of_step, *, reward_range=None):
    class Scripted:
        def __init__(self):
            pass

        def reset(self, seed):
            return "repeat 7"

        def step(self, text):
            return value_of_step()

    if reward_range is not None:
        Scripted.reward_range = reward_range
    return Scripted


def _rollout(tok, env_factory, prompts=2, n=2):
    return run_rollouts(
        OneTokenEngine(tok),
        tok,
        env_factory,
        [PromptItem(i, i + 1) for i in range(prompts)],
        n=n,
        max_turns=2,
        step_wise=True,
        merge_stepwise=False,
        max_input_len=200,
        max_new_tokens=4,
    )


def _raise():
    raise ZeroDivisionError("scorer divided by zero")


@pytest.mark.parametrize(
    ("step_result", "shown"),
    [
        (_raise, "ZeroDivisionError: scorer divided by zero"),
        (lambda: ("", math.nan, True, {}), "reward nan is not a finite number"),
        (lambda: ("", math.inf, True, {}), "reward inf is not a finite number"),
        (lambda: ("", None, True, {}), "reward must be a real number, got None (NoneType)"),
        (lambda: ("", [0.5], True, {}), "reward must be a real number, got [0.5] (list)"),
        (lambda: ("", 1.5, True, {}), "reward 1.5 is outside the env's reward_range [0, 1]"),
        (lambda: ("", -0.25, True, {}), "reward -0.25 is outside the env's reward_range [0, 1]"),
        (lambda: ("", 0.5, "yes", {}), "done must be a bool, got 'yes' (str)"),
        (lambda: ("", 0.5, 1, {}), "done must be a bool, got 1 (int)"),
        (lambda: None, "step() must return (obs, reward, done, info), got None (NoneType)"),
        (lambda: (None, 0.5, False, {}), "observation must be a str, got None (NoneType)"),
    ],
    ids=[
        "raises",
        "nan",
        "inf",
        "none",
        "list",
        "above-range",
        "below-range",
        "done-str",
        "done-int",
        "returns-none",
        "obs-none",
    ],
)
def test_every_step_fault_is_shown_with_its_value_and_stops_the_step(tok, step_result, shown):
    out = _rollout(tok, _env_returning(step_result))
    assert out.metrics["rollout/env_errors"] == 4
    assert [tid for tid, _ in out.faults] == [0, 1, 2, 3]
    first = out.faults[0][1]
    assert first.startswith("step 0: ") and shown in first
    assert all(text == first for _, text in out.faults)
    meta = {"env_faults": out.faults, "metrics": out.metrics}
    with pytest.raises(HealthError) as info:
        check_env_faults(meta, 0.5, step=7)
    message = str(info.value)
    assert "\n" not in message
    assert "step 7: 4 of 4 trajectories" in message and "[trajectories 0, 1, 2, 3]" in message
    assert shown in message and "run.max_env_error_fraction=0.5" in message


def test_a_declared_reward_range_is_the_one_checked(tok):
    signed = _env_returning(lambda: ("", -0.5, True, {}), reward_range=(-1.0, 1.0))
    out = _rollout(tok, signed)
    assert out.faults == [] and out.metrics["rollout/env_errors"] == 0
    assert {r.score for r in out.rows} == {-0.5}
    too_big = _env_returning(lambda: ("", 2.0, True, {}), reward_range=(-1.0, 1.0))
    assert "outside the env's reward_range [-1, 1]" in _rollout(tok, too_big).faults[0][1]


@pytest.mark.parametrize("declared", [(1.0, 0.0), (0.0, math.inf), "0..1", (0.0,)])
def test_a_malformed_reward_range_is_a_config_error(monkeypatch, tmp_path, declared):
    module = tmp_path / "range_envs.py"
    module.write_text(
        "from rollout.envs import RecallEnv\n"
        f"class Odd(RecallEnv):\n    reward_range = {declared!r}\n".replace("inf", "float('inf')")
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="reward_range=.* must be \\(low, high\\)"):
        make_env("range_envs:Odd")
    with pytest.raises(ConfigError, match="rollout.env: got 'range_envs:Odd'; reward_range="):
        load_config(None, ["rollout.env=range_envs:Odd"])


def test_reset_and_constructor_faults_show_the_exception(tok):
    class ResetFails:
        def reset(self, seed):
            raise KeyError("no such task")

    def constructor_fails():
        raise RuntimeError("sandbox image not found")

    out = _rollout(tok, ResetFails)
    assert out.rows == [] and out.faults[0][1] == "reset: KeyError: 'no such task'"
    out = _rollout(tok, constructor_fails)
    assert out.faults[0][1] == "constructor: RuntimeError: sandbox image not found"
    with pytest.raises(HealthError, match="constructor: RuntimeError: sandbox image not found"):
        check_env_faults({"env_faults": out.faults, "metrics": out.metrics}, 0.5, step=1)


def test_below_the_threshold_faults_are_only_counted(tok):
    calls = {"n": 0}

    def every_fourth_raises():
        calls["n"] += 1
        return _raise() if calls["n"] % 4 == 0 else ("", 0.5, True, {})

    out = _rollout(tok, _env_returning(every_fourth_raises), prompts=4)
    assert out.metrics["rollout/env_errors"] == 2 and len(out.faults) == 2
    meta = {"env_faults": out.faults, "metrics": out.metrics}
    check_env_faults(meta, 0.5, step=1)  # 2 of 8: below the default, the run goes on
    check_env_faults(meta, 0.25, step=1)  # exactly the fraction is still allowed
    with pytest.raises(HealthError, match="2 of 8 trajectories"):
        check_env_faults(meta, 0.2, step=1)


def test_many_distinct_faults_are_summarised_on_one_line():
    faults = [(i, f"step 0: ValueError: case {i % 5}") for i in range(20)]
    meta = {"env_faults": faults, "metrics": {"rollout/num_trajectories": 20.0}}
    with pytest.raises(HealthError) as info:
        check_env_faults(meta, 0.5, step=3)
    message = str(info.value)
    assert "[trajectories 0, 5, 10, 15] step 0: ValueError: case 0" in message
    assert "case 2" in message and "case 3" not in message and "2 more distinct" in message


def test_an_env_module_raising_on_import_is_one_config_line(monkeypatch, tmp_path):
    (tmp_path / "broken_env_mod.py").write_text("raise RuntimeError('missing API key')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rollout.env=broken_env_mod:Env"])
    message = str(info.value)
    assert info.value.key == "rollout.env" and "\n" not in message
    assert "raised RuntimeError: missing API key" in message


def test_an_env_constructor_raising_is_one_config_line(monkeypatch, tmp_path):
    (tmp_path / "ctor_env_mod.py").write_text(
        "from rollout.envs import RecallEnv\n"
        "class Env(RecallEnv):\n"
        "    def __init__(self, **kw):\n"
        "        raise RuntimeError('sandbox image not found')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="raised RuntimeError: sandbox image not found"):
        load_config(None, ["rollout.env=ctor_env_mod:Env"])
