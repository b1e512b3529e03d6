"""An environment runs on the event loop only where the class that defines its ``reset`` /
``step`` declares it (``rollout.envs.base.runs_inline``): a user's subclass of a built-in that
overrides ``step`` with a blocking tool call runs on worker threads, concurrently, and
``rollout.env_timeout_s`` ends a call that hangs."""

from __future__ import annotations

import threading
import time

from rollout.agent_loop import run_rollouts
from rollout.env_slots import EnvSlots
from rollout.envs.base import runs_inline
from rollout.envs.prompts import PromptItem
from rollout.envs.qa import QAEnv
from rollout.envs.recall import RecallEnv
from rollout.envs.sleepy import SleepyEnv
from tests.test_rollout_async import ReplyEngine, tok  # noqa: F401 - the fixture


class Recall2(RecallEnv):
    """A subclass that changes nothing the loop calls: the parent's declaration holds."""


class BlockingTool(RecallEnv):
    """A user's subclass whose ``step`` blocks on a tool call; counts calls in flight."""

    lock = threading.Lock()
    active = peak = 0
    hang_for: set[int] = set()  # episode seeds whose tool call hangs

    def reset(self, seed: int) -> str:
        self.seed = seed
        return super().reset(seed)

    def step(self, action_text: str):
        cls = BlockingTool
        with cls.lock:
            cls.active += 1
            cls.peak = max(cls.peak, cls.active)
        try:
            time.sleep(5 if self.seed in cls.hang_for else 0.05)
            return super().step(action_text)
        finally:
            with cls.lock:
                cls.active -= 1


def test_the_class_that_defines_the_method_decides():
    assert runs_inline(RecallEnv(), "step") and runs_inline(RecallEnv(), "reset")
    assert runs_inline(Recall2(), "step")  # inherits the method and its declaration
    assert not runs_inline(SleepyEnv(), "step")  # overrides step: not inline
    assert not runs_inline(BlockingTool(), "step") and not runs_inline(BlockingTool(), "reset")
    assert runs_inline(QAEnv(prompt="q", answer="a"), "step")
    quiet = QAEnv(prompt="q", answer="a")
    quiet.inline = False  # an instance may opt out (a user's reward function)
    assert not runs_inline(quiet, "step")


def _rollout(tok, env_timeout_s=None, env_slots=None, env=None):  # noqa: F811 - the fixture
    items = [PromptItem(i, 10 + i) for i in range(4)]
    return run_rollouts(
        ReplyEngine(tok),
        tok,
        env or BlockingTool,
        items,
        n=2,
        max_turns=2,
        step_wise=True,
        merge_stepwise=False,
        max_input_len=200,
        max_new_tokens=6,
        env_timeout_s=env_timeout_s,
        env_concurrency=8,
        env_slots=env_slots,
    )


def test_a_blocking_subclass_runs_its_calls_side_by_side(tok):  # noqa: F811
    BlockingTool.peak = 0
    BlockingTool.hang_for = set()
    out = _rollout(tok)
    assert out.faults == [] and out.rows
    assert BlockingTool.peak > 1  # calls overlapped: they ran on worker threads


def test_its_hung_call_times_out_and_the_batch_goes_on(tok):  # noqa: F811
    BlockingTool.hang_for = {10}  # the first prompt's episodes hang in their tool call
    try:
        out = _rollout(tok, env_timeout_s=0.5)
    finally:
        BlockingTool.hang_for = set()
    assert out.faults, "the hung calls were not timed out"
    assert all("rollout.env_timeout_s" in text for _, text in out.faults)
    assert out.rows  # the other prompts' trajectories finished


def test_rollouts_on_several_threads_share_one_pool_of_env_calls(tok):  # noqa: F811
    """A streamed run's groups, each its own rollout on its own thread, share the slots of
    ``rollout.env_concurrency``: together they never run more environment calls at once."""

    class Counted(RecallEnv):  # its own count: abandoned calls of other tests run on
        lock, active, peak = threading.Lock(), 0, 0

        def step(self, action_text: str):
            with Counted.lock:
                Counted.active += 1
                Counted.peak = max(Counted.peak, Counted.active)
            try:
                time.sleep(0.05)
                return super().step(action_text)
            finally:
                with Counted.lock:
                    Counted.active -= 1

    slots = EnvSlots(3)
    outs = []
    threads = [
        threading.Thread(target=lambda: outs.append(_rollout(tok, env_slots=slots, env=Counted)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(outs) == 3 and all(out.rows and not out.faults for out in outs)
    assert 1 < Counted.peak <= 3  # each rollout alone would run up to 8
