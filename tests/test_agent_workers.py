"""Agent loops in processes of their own (``rollout.agent_workers``, issue 57): a rollout
through the workers equals the rollout in one process, bit for bit under waves, in both row
modes, with stop strings, faulty environments and time limits; an engine's error reaches the
caller with its type; a worker that dies fails its rollout in one line and the next rollout
gets a new one; a stream's shutdown ends the rollouts in flight; the workers share out
``rollout.env_concurrency``; and the trainer's runs with workers equal those without."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from rollout.agent_loop import run_rollouts
from rollout.agent_workers import AgentContext, AgentWorkerLost, AgentWorkers
from rollout.engines import Engine, SamplingParams
from rollout.env_slots import EnvCallsClosed
from rollout.envs import make_env
from rollout.envs.prompts import PromptItem
from rollout.tokenizer import load_tokenizer

#: Safety net: a broken relay fails the test instead of hanging it.
GATE_S = 120.0
ENV = "tests.agent_envs:FaultyEnv"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin")


@pytest.fixture(scope="module")
def workers(tok):
    kwargs = {"turns": 3, "max_delay_s": 0.02, "bad_seed": 52, "slow_seed": 53, "slow_s": 3.0}
    pool = AgentWorkers(2, AgentContext(tok, ENV, kwargs), env_slots=5)
    pool.start()
    yield pool, kwargs
    pool.close()


def _settings(step_wise: bool, stops: tuple[str, ...]) -> dict:
    return dict(
        n=3,
        max_turns=3,
        step_wise=step_wise,
        merge_stepwise=False,
        max_input_len=160,
        max_new_tokens=6,
        sampling=SamplingParams(max_new_tokens=6),
        seed=7,
        step=2,
        stop_strings=stops,
        env_timeout_s=1.0,
    )


@pytest.mark.parametrize("step_wise", [True, False], ids=["step-wise", "whole"])
@pytest.mark.parametrize("stops", [(), ("2",)], ids=["no-stops", "stop-string"])
def test_rollouts_through_workers_equal_one_process(tok, tiny_engine, workers, step_wise, stops):
    """Waves: rows, metrics and faults bit for bit; continuous admission: the same tokens and
    faults, logprobs within float noise. The prompts hold a faulty episode (a step raises), a
    slow one (past rollout.env_timeout_s) and sleepy ones."""
    pool, kwargs = workers
    items = [PromptItem(i, 50 + i) for i in range(5)]
    settings = _settings(step_wise, stops)
    env = make_env(ENV)
    factory = lambda **kw: env(**{**kwargs, **kw})  # noqa: E731
    here = run_rollouts(tiny_engine, tok, factory, items, env_concurrency=5, **settings)
    there = pool.rollouts(tiny_engine, tok, items, **settings)
    assert there.rows == here.rows
    assert there.metrics == here.metrics
    assert there.faults == here.faults
    texts = {text for _, text in here.faults}
    assert any("ConnectionError" in t for t in texts) and any("env_timeout_s" in t for t in texts)

    free = pool.rollouts(tiny_engine, tok, items, deterministic=False, **settings)
    assert free.faults == here.faults
    assert len(free.rows) == len(here.rows)
    for a, b in zip(free.rows, here.rows):
        assert (a.trajectory_id, a.step_index, a.score) == (b.trajectory_id, b.step_index, b.score)
        assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids
        np.testing.assert_allclose(a.response_logprobs, b.response_logprobs, atol=1e-5)


def test_constructor_faults_stay_with_their_trajectories(tok, tiny_engine):
    """A prompt whose environment cannot be built ends its trajectories with the fault, as in
    one process, while the workers roll the others."""
    items = [PromptItem(i, 60 + i, {"seed": 60 + i}) for i in range(4)]
    spec = "tests.agent_envs:BrokenConstructor"
    settings = _settings(True, ())
    here = run_rollouts(tiny_engine, tok, make_env(spec), items, env_concurrency=4, **settings)
    pool = AgentWorkers(2, AgentContext(tok, spec, {}), env_slots=4)
    try:
        there = pool.rollouts(tiny_engine, tok, items, **settings)
    finally:
        pool.close()
    assert there.rows == here.rows and there.faults == here.faults
    assert {t for t, _ in there.faults} == {3, 4, 5, 9, 10, 11}  # prompts 1 and 3, n = 3


class FailingEngine(Engine):
    def generate(self, requests, sampling):
        raise ValueError("prompt too long for the model")

    def update_weights(self, named_tensors):
        pass


def test_an_engine_error_reaches_the_caller_with_its_type(tok, workers):
    pool, _ = workers
    items = [PromptItem(i, 70 + i) for i in range(3)]
    with pytest.raises(ValueError, match="prompt too long for the model"):
        pool.rollouts(FailingEngine(), tok, items, **_settings(True, ()))


def test_a_worker_that_dies_fails_its_rollout_in_one_line_and_is_replaced(tok, tiny_engine):
    """An environment that ends its process (a crashing sandbox): the rollout raises one line
    naming rollout.agent_workers, the worker and its exit code; the next rollout runs."""
    pool = AgentWorkers(2, AgentContext(tok, ENV, {"turns": 2, "exit_seed": 81}), env_slots=2)
    settings = _settings(True, ())
    try:
        with pytest.raises(AgentWorkerLost) as caught:
            pool.rollouts(tiny_engine, tok, [PromptItem(i, 80 + i) for i in range(2)], **settings)
        line = str(caught.value)
        assert "\n" not in line and "rollout.agent_workers" in line and "exit code 3" in line
        assert pool.lost == 1
        out = pool.rollouts(tiny_engine, tok, [PromptItem(i, 90 + i) for i in range(4)], **settings)
        assert len({r.trajectory_id for r in out.rows}) == 12 and not out.faults
    finally:
        pool.close()


def test_cancel_all_ends_the_rollouts_in_flight(tok, tiny_engine):
    """A stream's shutdown: rollouts waiting on their workers' long environment calls end at
    once with the error given, and the workers take new rollouts afterwards."""
    pool = AgentWorkers(1, AgentContext(tok, ENV, {"turns": 2, "max_delay_s": 30.0}), 4)
    settings = {**_settings(True, ()), "env_timeout_s": None}
    errors: list[BaseException] = []

    def roll() -> None:
        try:
            pool.rollouts(tiny_engine, tok, [PromptItem(0, 5)], **settings)
        except BaseException as exc:  # noqa: BLE001 - what the test looks at
            errors.append(exc)

    try:
        threads = [threading.Thread(target=roll) for _ in range(2)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + GATE_S
        while len(pool._jobs) < 2 and time.monotonic() < deadline:  # both rolling
            time.sleep(0.05)
        time.sleep(1.0)  # their first turns are out; the long steps have begun
        began = time.monotonic()
        pool.cancel_all(EnvCallsClosed("the stream shuts down"))
        for thread in threads:
            thread.join(GATE_S)
        assert time.monotonic() - began < 10.0
        assert len(errors) == 2 and all(isinstance(e, EnvCallsClosed) for e in errors)
    finally:
        pool.close()


def test_the_workers_share_out_the_environment_calls(tok):
    pool = AgentWorkers(3, AgentContext(tok, "recall", {}), env_slots=8)
    assert pool.shares == [3, 3, 2]
    with pytest.raises(ValueError, match="rollout.agent_workers=3 with rollout.env_concurrency=2"):
        AgentWorkers(3, AgentContext(tok, "recall", {}), env_slots=2)


# ------------------------------------------------------------------ the trainer's runs


def _metrics_without_timing(run_dir) -> list[dict]:
    from trainer.records.jsonl_files import read_jsonl

    skip = ("timing/", "throughput/", "perf/", "memory/", "rollout/weight_load_s")
    return [
        {k: v for k, v in m.items() if not k.startswith(skip)}
        for m in read_jsonl(run_dir / "metrics.jsonl")
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule",
    [[], ["train.rollout_lag=1", "rollout.engine_devices=1", "algorithm.rollout_correction=token"]],
    ids=["lag-0", "lag-1"],
)
def test_a_run_with_agent_workers_equals_the_run_without(tmp_path, schedule):
    """The default job's run.deterministic promise holds with the agent loops in two worker
    processes: the same fingerprints and metrics, step by step."""
    from trainer.config import load_config
    from trainer.loop.start.run import run_training

    keys = ["train.total_steps=3", "run.resume=never", *schedule]
    runs = {}
    for workers in (0, 2):
        run_dir = tmp_path / f"workers{workers}"
        cfg = load_config(None, [*keys, f"rollout.agent_workers={workers}", f"run.dir={run_dir}"])
        assert run_training(cfg) == 0
        runs[workers] = run_dir
    fingerprints = [(d / "fingerprint.jsonl").read_text() for d in runs.values()]
    assert fingerprints[0] == fingerprints[1]
    assert _metrics_without_timing(runs[0]) == _metrics_without_timing(runs[2])


@pytest.mark.slow
def test_a_streamed_run_with_agent_workers_trains_every_step(tmp_path):
    """A stream (s = 1, partial rollouts, continuous admission) with its groups' agent loops in
    two workers runs to its end, every group through them, and shuts down cleanly; groups too
    stale are aborted (``train.stale_prompts=drop``, the default) across the relay. Before the
    engine server kept each request's group, this run livelocked about one time in two, in one
    process too (``tests/test_engine_server.py``)."""
    from trainer.config import load_config
    from trainer.loop.start.run import run_training
    from trainer.records.jsonl_files import read_jsonl

    keys = [
        "train.total_steps=3",
        "train.max_staleness=1",
        "rollout.partial_rollout=true",
        "algorithm.rollout_correction=token",
        "run.deterministic=false",
        "rollout.agent_workers=2",
        "rollout.env=rollout.envs.sleepy:SleepyEnv",
        "rollout.env_kwargs={turns: 3, max_delay_s: 0.05}",
        f"run.dir={tmp_path}",
    ]
    assert run_training(load_config(None, keys)) == 0
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["rollout/num_trajectories"] > 0 for m in metrics)


def test_a_stream_s_abort_crosses_to_the_worker_as_itself():
    """The stream aborts a group by raising ``GroupAborted`` from the engine: relayed to the
    worker and back, it must stay that type (the stream sets the group aside on it)."""
    import pickle

    from rollout.agent_process import sendable_error
    from rollout.stream_jobs import EngineClosed, GroupAborted

    for error in (GroupAborted(4), EngineClosed("closed"), ValueError("bad prompt")):
        back = pickle.loads(pickle.dumps(sendable_error(error)))
        assert type(back) is type(error) and str(back) == str(error)
    assert pickle.loads(pickle.dumps(GroupAborted(4))).group == 4

    class Local(Exception):  # not importable by name: sent as its line
        pass

    assert str(sendable_error(Local("x"))) == "Local: x"
