"""Validation beside a stream (issue 45, item 2): validation's requests go through the
stream's engine, their ``group`` numbers (the validation records' indices) the same numbers as
the stream's prompt ordinals. They must not touch the stream's records: a prompt streamed
after a validation would otherwise inherit the version validation sampled at and be dropped
as stale. A streamed run with validation every 2 steps drops no more groups than the same run
without validation."""

from __future__ import annotations

import pytest

from rollout.engines.base import GenerationRequest, GenerationResult, SamplingParams
from rollout.streaming import VersionedEngine
from tests.stream_envs import recall_rows
from trainer.config import load_config

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


class _Engine:
    """Answers every request with 3 tokens."""

    def generate(self, requests, sampling):
        return [GenerationResult([1, 2, 3], [0.0] * 3, "length") for _ in requests]


def test_requests_outside_the_stream_are_counted_under_no_prompt():
    """Validation's view of the stream's engine: its calls sample (each token tagged with the
    version) but leave the stream's per-prompt counts alone, so stream prompt 5 sampled under
    version 3 is of version 3 only."""
    versioned = VersionedEngine(_Engine(), version=2)
    request = [GenerationRequest(prompt_ids=[1], seed=0, group=5)]
    view = versioned.untracked()
    (out,) = view.generate(request, SamplingParams())
    assert out.token_ids == [1, 2, 3] and out.extra["versions"] == [2, 2, 2]
    assert view.lanes() == [view] and view.lane_of(5) == 0 and view.version == 2
    versioned.load(lambda: None, 3)
    versioned.generate(request, SamplingParams())  # the stream's prompt 5
    assert versioned.tokens_of(5) == {3: 3}


@pytest.mark.slow
def test_a_streamed_run_with_validation_drops_no_more_groups_than_without(local_ray, tmp_path):
    """A verl-format parquet streamed at max_staleness 1 with partial rollouts, 6 steps of 2
    prompts: with validation every 2 steps (24 validation prompts, more than the stream draws
    before the last validation, so their indices cover prompts streamed after it) the stream
    drops no more groups than without validation, and validation still reports."""
    from trainer.loop.start.run import run_training
    from trainer.records.jsonl_files import read_jsonl

    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    pq.write_table(pa.Table.from_pylist(recall_rows(64, "train")), str(train))
    pq.write_table(pa.Table.from_pylist(recall_rows(24, "test")), str(val))
    common = [
        f"data.source={train}",
        "rollout.env=single_turn",
        "reward.function=tests.verl_reward_fns:length_score",
        "train.batch_size=2",
        "train.mini_batch_size=2",
        "rollout.n=2",
        "rollout.max_new_tokens=4",
        "train.total_steps=6",
        "train.max_staleness=1",
        "rollout.partial_rollout=true",
        "rollout.engine_devices=1",
        "algorithm.rollout_correction=token",
        "run.resume=never",
        "run.save_every=0",
    ]
    validated, plain = tmp_path / "validated", tmp_path / "plain"
    val_keys = [f"data.val_source={val}", "run.val_every=2"]
    assert run_training(load_config(None, [*common, *val_keys, f"run.dir={validated}"])) == 0
    assert run_training(load_config(None, [*common, f"run.dir={plain}"])) == 0

    with_val = [m for m in read_jsonl(validated / "metrics.jsonl") if "stream/groups_dropped" in m]
    without = read_jsonl(plain / "metrics.jsonl")
    assert [m["step"] for m in with_val] == [m["step"] for m in without] == [1, 2, 3, 4, 5, 6]
    dropped = [sum(m["stream/groups_dropped"] for m in ms) for ms in (with_val, without)]
    assert dropped[0] <= dropped[1], dropped
    validations = [m for m in read_jsonl(validated / "metrics.jsonl") if "val/reward_mean" in m]
    assert [m["step"] for m in validations] == [2, 4, 6]
    assert all(m["val/reward_mean"] >= 2.0 for m in validations)  # length_score: 2 + ...
