"""A streamed group whose every environment reset failed (issue 45, item 12): it samples no
token, so nothing in it is stale; it is taken in its turn, as a synchronous step takes such a
prompt, and its faults reach the step's environment-fault check (``run.max_env_error_fraction``)
instead of the group being dropped as stale, unseen."""

from __future__ import annotations

import threading

import pytest

from rollout.agent_loop import RolloutOutput
from rollout.engines.base import GenerationRequest, GenerationResult, SamplingParams
from rollout.streaming import FinishedGroup, StreamSampler, VersionedEngine, admit
from tests.stream_envs import recall_rows
from trainer.config import load_config

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def test_a_group_that_sampled_nothing_is_taken_not_dropped_as_stale():
    failed = FinishedGroup(0, output=None, tokens={}, version=1)
    stale, fresh = FinishedGroup(1, None, {1: 4}), FinishedGroup(2, None, {3: 4})
    taken, dropped, left = admit([failed, stale, fresh], 2, min_version=3)
    assert [g.ordinal for g in taken] == [0, 2] and [g.ordinal for g in dropped] == [1]
    assert not left and failed.oldest == failed.newest == 1  # the engine's when it finished


class _Engine:
    def generate(self, requests, sampling):
        return [GenerationResult([1, 2], [0.0] * 2, "length") for _ in requests]


def test_the_sampler_hands_over_a_failed_group_with_its_faults_after_new_weights():
    """Prompt 0's resets all fail (no engine call); the weights move on to version 5 before a
    step asks for groups of version 5 or newer: prompt 0 comes with its faults, not dropped."""
    engine = VersionedEngine(_Engine())
    go = threading.Event()

    def sample_group(ordinal):
        go.wait(5)
        if ordinal == 0:
            return RolloutOutput(
                rows=[], metrics={}, faults=[(0, "reset: boom"), (1, "reset: boom")]
            )
        engine.generate([GenerationRequest([1], seed=0, group=ordinal)], SamplingParams())
        return RolloutOutput(rows=[], metrics={}, faults=[])

    engine.load(lambda: None, 5)
    sampler = StreamSampler(sample_group, engine, workers=1, allowed=lambda: 2)
    try:
        go.set()
        taken, dropped, _ = sampler.take(2, min_version=5, timeout_s=10)
        assert [g.ordinal for g in taken] == [0, 1] and not dropped
        assert taken[0].output.faults == [(0, "reset: boom"), (1, "reset: boom")]
    finally:
        sampler.stop()


@pytest.mark.slow
def test_a_streamed_run_whose_late_resets_fail_stops_at_the_env_fault_check(
    local_ray, tmp_path, capsys
):
    """Once the first 24 groups have reset (the stream starts the 25th after step 2's weights,
    so only steps 3 and later can take the groups after it), the resets of every other row
    fail: about half of each later step's groups sample nothing. The run stops (exit 1) at the
    environment-fault check naming the fault and run.max_env_error_fraction (or, should every
    group of a step have failed, at the step without rows, naming the fault too), where it used
    to drop those groups as stale and finish as if nothing had failed."""
    from tests.stream_envs import LateFailingReset
    from trainer.loop.start.run import run_training

    LateFailingReset.resets = 0  # a run in this process (in-process workers) counts from 0
    train = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(recall_rows(64)), str(train))
    keys = [
        f"data.source={train}",
        "rollout.env=tests.stream_envs:LateFailingReset",
        "rollout.env_kwargs.fail_after=48",
        "reward.function=tests.verl_reward_fns:length_score",
        "train.batch_size=8",
        "train.mini_batch_size=8",
        "rollout.n=2",
        "rollout.max_new_tokens=4",
        "train.total_steps=6",
        "train.max_staleness=1",
        "rollout.partial_rollout=true",
        "rollout.engine_devices=1",
        "algorithm.rollout_correction=token",
        "run.max_env_error_fraction=0.25",
        "run.resume=never",
        "run.save_every=0",
        f"run.dir={tmp_path / 'run'}",
    ]
    assert run_training(load_config(None, keys)) == 1
    err = capsys.readouterr().err
    assert "reset: ConnectionError: sandbox refused the episode" in err
    assert "run.max_env_error_fraction=0.25" in err or "the rollout produced no rows" in err
