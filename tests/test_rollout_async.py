"""The asynchronous agent loop: trajectories advance on their own, environments run concurrently
with a time limit and a cap, faults are counted, and results equal the lockstep loop's."""

from __future__ import annotations

import asyncio
import functools
import threading
from pathlib import Path

import numpy as np
import pytest

from batching import StepBatch
from bench.rollout import lockstep_rollouts
from rollout.agent_loop import run_rollouts
from rollout.engines import Engine, GenerationResult, SamplingParams
from rollout.envs import make_env
from rollout.envs.prompts import PromptItem, PromptSource
from rollout.envs.sleepy import AsyncSleepyEnv, SleepyEnv
from rollout.tokenizer import load_tokenizer

GOLDEN_STEP_1 = Path(__file__).parent / "golden" / "tiny_rollouts" / "step_1.npz"
#: Safety net for the gates below: a broken loop fails the test instead of hanging it.
GATE_S = 60.0


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin")


class ReplyEngine(Engine):
    """Replies "12" + EOS to every request; records each call's trajectory seeds."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def generate(self, requests, sampling):
        self.calls.append([r.seed for r in requests])
        ids = self.tok.encode("12") + [self.tok.eos_token_id]
        return [GenerationResult(list(ids), [-0.5] * len(ids), "stop") for _ in requests]

    def update_weights(self, named_tensors):
        pass


class FailingEngine(ReplyEngine):
    def generate(self, requests, sampling):
        raise ValueError("prompt too long for the model")


class Gate:
    """Shared by the environments of one rollout: an event log and a gate to hold one step."""

    def __init__(self):
        self.lock = threading.Lock()
        self.events: list[tuple[str, int]] = []
        self.opened = threading.Event()
        self.active = self.peak = 0

    def log(self, what, who):
        with self.lock:
            self.events.append((what, who))


class GatedEnv:
    """3 turns; reward 0.75 at the end. ``hold``: step ``hold_turn`` of this env waits for the
    gate (``sync``) or an asyncio event never set (``async``); ``raise_at``: that step raises."""

    def __init__(self, gate, who, hold=None, hold_turn=0, raise_at=None, on_finish=None):
        self.gate, self.who, self.hold, self.hold_turn = gate, who, hold, hold_turn
        self.raise_at, self.on_finish = raise_at, on_finish

    def reset(self, seed):
        self.k = 0
        return f"question {seed}"

    def _step(self, text):
        turn, self.k = self.k, self.k + 1
        if turn == self.raise_at:
            raise RuntimeError("tool crashed")
        if self.k >= 3:
            self.gate.log("finished", self.who)
            if self.on_finish:
                self.on_finish(self.who)
            return "", 0.75, True, {}
        return f"obs {self.k}", 0.1, False, {}

    def step(self, text):
        if self.hold == "sync" and self.k == self.hold_turn:
            self.gate.log("held", self.who)
            self.gate.opened.wait(GATE_S)
            self.gate.log("released", self.who)
        return self._step(text)


class AsyncGatedEnv(GatedEnv):
    async def reset(self, seed):
        return GatedEnv.reset(self, seed)

    async def step(self, text):
        if self.hold == "async" and self.k == self.hold_turn:
            await asyncio.Event().wait()  # hangs until cancelled by the timeout
        return self._step(text)


def _factory(gate, per_trajectory=None):
    """Env factory numbering trajectories in construction order (= trajectory order);
    ``per_trajectory[who]``: kwargs for that trajectory's env, ``cls`` picks the class."""
    count = iter(range(10**6))

    def make():
        who = next(count)
        kw = dict((per_trajectory or {}).get(who, {}))
        cls = kw.pop("cls", GatedEnv)
        return cls(gate, who, **kw)

    return make


def _run(tok, engine, env_factory, prompts=3, **kw):
    args = dict(
        n=2, max_turns=3, step_wise=True, merge_stepwise=False, max_input_len=200, max_new_tokens=6
    )
    args.update(kw)
    items = [PromptItem(i, 10 + i) for i in range(prompts)]
    return run_rollouts(engine, tok, env_factory, items, **args)


def test_a_slow_environment_does_not_delay_the_others(tok):
    gate = Gate()
    total = 6

    def open_when_others_finish(who):
        with gate.lock:
            finished = sum(what == "finished" for what, _ in gate.events)
        if finished == total - 1:
            gate.opened.set()

    # Trajectory 0's first step is held until every other trajectory has finished all 3 turns.
    kw = {w: {"on_finish": open_when_others_finish} for w in range(total)}
    kw[0]["hold"] = "sync"
    factory = _factory(gate, kw)
    out = _run(tok, ReplyEngine(tok), factory, deterministic=False)
    assert gate.opened.is_set()
    events = gate.events
    released = events.index(("released", 0))
    finished_before = {who for what, who in events[:released] if what == "finished"}
    assert finished_before == set(range(1, total))  # nobody waited for trajectory 0
    # ... and trajectory 0 then played its remaining turns normally.
    assert events[-1] == ("finished", 0)
    assert out.metrics["rollout/env_errors"] == 0
    assert [r.step_index for r in out.rows if r.trajectory_id == 0] == [0, 1, 2]
    assert all(r.score == 0.75 for r in out.rows)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_hung_environment_times_out_and_the_batch_goes_on(tok, kind, deterministic):
    gate = Gate()
    hung = {"hold": kind, "hold_turn": 1, "cls": AsyncGatedEnv if kind == "async" else GatedEnv}
    try:
        out = _run(
            tok,
            ReplyEngine(tok),
            _factory(gate, {3: hung}),
            env_timeout_s=0.3,
            deterministic=deterministic,
        )
    finally:
        gate.opened.set()  # free the abandoned thread
    assert out.metrics["rollout/env_errors"] == 1
    assert out.metrics["rollout/env_timeout_errors"] == 1
    assert out.faults == [(3, "step 1: took longer than rollout.env_timeout_s=0.3 s")]
    # The hung trajectory keeps its first two turns, scored 0; every other one finished.
    hung_rows = [r for r in out.rows if r.trajectory_id == 3]
    assert [r.step_index for r in hung_rows] == [0, 1]
    assert all(r.score == 0.0 for r in hung_rows)
    others = [r for r in out.rows if r.trajectory_id != 3]
    assert len(others) == 5 * 3 and all(r.score == 0.75 for r in others)
    StepBatch.from_rows(out.rows)


@pytest.mark.parametrize("cls", [GatedEnv, AsyncGatedEnv])
def test_an_environment_raising_mid_trajectory_is_counted(tok, cls):
    gate = Gate()
    factory_kw = {w: {"cls": cls} for w in range(6)}
    factory_kw[2]["raise_at"] = 1
    factory = _factory(gate, factory_kw)
    out = _run(tok, ReplyEngine(tok), factory, deterministic=False)
    assert out.metrics["rollout/env_errors"] == 1
    assert out.metrics["rollout/env_timeout_errors"] == 0
    assert out.faults == [(2, "step 1: RuntimeError: tool crashed")]
    assert [(r.step_index, r.score) for r in out.rows if r.trajectory_id == 2] == [
        (0, 0.0),
        (1, 0.0),
    ]
    assert sum(r.score == 0.75 for r in out.rows if r.is_last_step) == 5


def test_env_concurrency_caps_concurrent_steps(tok):
    cap = 3
    barrier = threading.Barrier(cap, timeout=GATE_S)
    gate = Gate()

    class CountingEnv(GatedEnv):
        def step(self, text):
            with gate.lock:
                gate.active += 1
                gate.peak = max(gate.peak, gate.active)
            try:
                if self.k == 0:
                    barrier.wait()  # trips only when `cap` first steps run at once
                return self._step(text)
            finally:
                with gate.lock:
                    gate.active -= 1

    factory = _factory(gate, {w: {"cls": CountingEnv} for w in range(6)})
    out = _run(tok, ReplyEngine(tok), factory, env_concurrency=cap, deterministic=True)
    assert out.metrics["rollout/env_errors"] == 0
    assert gate.peak == cap


def test_request_seeds_follow_prompt_sample_and_turn(tok):
    from rollout.seeding import stable_seed

    engine = ReplyEngine(tok)
    _run(tok, engine, _factory(Gate()), deterministic=False, seed=5, step=2)
    expected = {
        stable_seed(5, 2, p, s, turn) for p in range(3) for s in range(2) for turn in range(3)
    }
    seeds = [s for call in engine.calls for s in call]
    assert sorted(seeds) == sorted(expected)


def test_an_engine_failure_raises_it(tok):
    with pytest.raises(ValueError, match="prompt too long"):
        _run(tok, FailingEngine(tok), _factory(Gate()), deterministic=False)


def test_bad_settings_name_the_key(tok):
    with pytest.raises(ValueError, match="rollout.env_timeout_s"):
        _run(tok, ReplyEngine(tok), _factory(Gate()), env_timeout_s=0)
    with pytest.raises(ValueError, match="rollout.env_concurrency"):
        _run(tok, ReplyEngine(tok), _factory(Gate()), env_concurrency=0)


# ------------------------------------------------------------------ equal to the lockstep loop


def _golden_step_1(tok, engine, **kw):
    """Step 1 of the golden recording's job (tests/golden/tiny_cpu_fp32/config.yaml)."""
    items = PromptSource("env", seed=1).take(0, 4)
    out = run_rollouts(
        engine,
        tok,
        make_env("recall"),
        items,
        n=4,
        max_turns=3,
        step_wise=True,
        merge_stepwise=False,
        max_input_len=256,
        max_new_tokens=4,
        sampling=SamplingParams(max_new_tokens=4),
        seed=1,
        step=1,
        **kw,
    )
    return StepBatch.from_rows(out.rows).to_numpy()


@pytest.mark.parametrize("deterministic", [True, False])
def test_rows_equal_the_recorded_lockstep_rollout(tok, tiny_engine, deterministic):
    """The golden recording was made by the lockstep loop: same tokens, lengths, masks,
    rewards, ids; logprobs within float noise (the recording ran in another process)."""
    from rollout.replay import load_rollout

    golden = load_rollout(GOLDEN_STEP_1)
    arrays = _golden_step_1(tok, tiny_engine, deterministic=deterministic)
    assert sorted(arrays) == sorted(golden)
    for key in golden:
        if key == "token/rollout_logprobs":
            np.testing.assert_allclose(arrays[key], golden[key], atol=1e-5, rtol=0)
        else:
            np.testing.assert_array_equal(arrays[key], golden[key], err_msg=key)


def test_async_rows_equal_the_lockstep_baseline(tok, tiny_engine):
    """Zero-delay environments, same process: waves give the lockstep loop's rows bit for bit;
    continuous batching the same tokens and logprobs within float noise."""
    env = functools.partial(SleepyEnv, turns=3, max_delay_s=0.0)
    items = [PromptItem(i, 50 + i) for i in range(3)]
    kw = dict(
        n=3, max_turns=3, step_wise=True, merge_stepwise=False, max_input_len=128, max_new_tokens=5
    )
    base = lockstep_rollouts(tiny_engine, tok, env, items, seed=7, **kw)
    waves = run_rollouts(tiny_engine, tok, env, items, seed=7, deterministic=True, **kw)
    free = run_rollouts(tiny_engine, tok, env, items, seed=7, deterministic=False, **kw)
    async_env = functools.partial(AsyncSleepyEnv, turns=3, max_delay_s=0.0)
    free_async = run_rollouts(tiny_engine, tok, async_env, items, seed=7, deterministic=False, **kw)
    assert waves.rows == base.rows
    assert waves.metrics == base.metrics
    for out in (free, free_async):
        assert len(out.rows) == len(base.rows)
        for a, b in zip(out.rows, base.rows):
            assert (a.trajectory_id, a.step_index) == (b.trajectory_id, b.step_index)
            assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids
            assert a.score == b.score and a.response_mask == b.response_mask
            np.testing.assert_allclose(a.response_logprobs, b.response_logprobs, atol=1e-5)


class ThreadNotingEnv:
    """Records the thread each call runs on; ``inline`` as the instance says (the class
    declares it, ``rollout.envs.base.runs_inline``)."""

    inline = True

    def __init__(self, threads: list, inline: bool):
        self.threads, self.inline = threads, inline

    def reset(self, seed):
        self.threads.append(threading.current_thread().name)
        return "say 12"

    def step(self, text):
        self.threads.append(threading.current_thread().name)
        return "", 0.5, True, {}


@pytest.mark.parametrize("inline", [True, False])
def test_inline_environments_run_on_the_event_loop_others_on_worker_threads(tok, inline):
    threads: list[str] = []
    out = _run(tok, ReplyEngine(tok), lambda: ThreadNotingEnv(threads, inline), prompts=2)
    assert len(out.rows) == 4 and out.faults == []
    assert len(threads) == 8  # 4 trajectories x (reset + step)
    loop_thread = threading.current_thread().name  # asyncio.run runs on the caller's thread
    if inline:
        assert set(threads) == {loop_thread}
    else:
        assert all(name.startswith("env") for name in threads)


class HeldReplica(ReplyEngine):
    """A replica whose first call is held until ``release`` is set (a slow replica), failing
    after ``GATE_S`` instead of hanging a broken loop."""

    def __init__(self, tok, release: threading.Event):
        super().__init__(tok)
        self.release = release

    def generate(self, requests, sampling):
        if not self.calls and not self.release.wait(GATE_S):
            raise RuntimeError("the other replica's trajectories never finished")
        return super().generate(requests, sampling)


class CountingReplica(ReplyEngine):
    """A fast replica that sets ``done`` once it has served ``turns`` calls."""

    def __init__(self, tok, done: threading.Event, turns: int):
        super().__init__(tok)
        self.done, self.turns = done, turns

    def generate(self, requests, sampling):
        out = super().generate(requests, sampling)
        if len(self.calls) == self.turns:
            self.done.set()
        return out


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_slow_replica_holds_up_only_its_own_prompts(tok, deterministic):
    from rollout.engines.serving.router import ReplicaRouter, deal_prompt

    # Prompts 0 and 2 go to replica 0, prompt 1 to replica 1 (dealt by prompt index). Replica
    # 0's first call is held until replica 1 has served all three turns of its prompt: with
    # one call in flight for the whole router this would never happen (replica 1's second
    # turn would wait for replica 0's first call).
    assert [deal_prompt(i, 2) for i in range(3)] == [0, 1, 0]
    finished = threading.Event()
    slow, fast = HeldReplica(tok, finished), CountingReplica(tok, finished, turns=3)
    router = ReplicaRouter([slow, fast])
    try:
        out = _run(tok, router, _factory(Gate()), deterministic=deterministic)
    finally:
        finished.set()
        router.shutdown()
    assert finished.is_set()
    # Each replica served only its own prompts' trajectories (n=2 each), 3 turns each: in
    # waves one call per turn; continuously, as many calls as the arrivals made.
    assert [len(call) for call in fast.calls] == [2, 2, 2]
    assert sum(len(call) for call in slow.calls) == 2 * 2 * 3
    if deterministic:
        assert [len(call) for call in slow.calls] == [4, 4, 4]
    assert len(out.rows) == 3 * 2 * 3 and all(r.score == 0.75 for r in out.rows)
