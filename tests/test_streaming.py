"""Streaming rollouts (``train.max_staleness``): groups sampled without step boundaries, each
step taking whole groups within the staleness bound, oldest first, every live group's turns
batched in one engine call per replica, groups that can no longer be taken aborted, weights
loaded between engine calls; refused by name where it cannot run; end to end on the CPU, a streamed
run keeps its bound, records every batch, and its replay agrees with it under
``crossrl parity``."""

from __future__ import annotations

import threading
import time

import pytest

from rollout.engines.base import GenerationRequest, GenerationResult, SamplingParams
from rollout.replay import load_rollout
from rollout.streaming import FinishedGroup, StreamSampler, VersionedEngine, admit
from trainer.config import ConfigError, load_config
from trainer.loop.engines.stream_host import staleness_metrics


class _Engine:
    """Answers every request with 3 tokens; remembers the weights it held at each call."""

    def __init__(self) -> None:
        self.weights = "v0"
        self.calls: list[str] = []

    def generate(self, requests, sampling):
        self.calls.append(self.weights)
        time.sleep(0.01)
        return [GenerationResult([1, 2, 3], [0.0] * 3, "length") for _ in requests]


def _group(ordinal: int, tokens: dict[int, int]) -> FinishedGroup:
    return FinishedGroup(ordinal, output=None, tokens=tokens)


def test_a_step_takes_the_oldest_groups_in_the_bound_and_drops_older_ones():
    ready = [
        _group(0, {0: 5}),
        _group(1, {2: 5}),
        _group(2, {1: 3, 2: 2}),
        _group(3, {3: 1}),
        _group(5, {2: 1}),
        _group(4, {2: 2}),
    ]
    taken, dropped, left = admit(ready, 3, min_version=1)
    # oldest first within the bound: by oldest version, then by place in the prompt stream
    assert [g.ordinal for g in taken] == [2, 1, 4]
    assert [g.ordinal for g in dropped] == [0]
    assert [g.ordinal for g in left] == [3, 5]  # finishing order kept for later steps
    assert ready[2].oldest == 1 and ready[2].newest == 2


def test_staleness_counts_versions_behind_the_trainer_and_partial_tokens():
    m = staleness_metrics([_group(0, {2: 6}), _group(1, {1: 3, 2: 1})], trained_version=3)
    assert (m["stream/staleness_min"], m["stream/staleness_max"]) == (1.0, 2.0)
    assert m["stream/staleness_mean"] == pytest.approx((7 * 1 + 3 * 2) / 10)  # over tokens
    assert m["stream/partial_token_share"] == pytest.approx(1 / 10)  # one token after a load


def test_weights_load_between_engine_calls_and_tokens_carry_their_version():
    engine = _Engine()
    versioned = VersionedEngine(engine, version=0)
    request = [GenerationRequest(prompt_ids=[1], seed=0, group=7)]
    versioned.generate(request, SamplingParams())

    def load():
        engine.weights = "v1"
        return "loaded"

    assert versioned.load(load, 1) == "loaded" and versioned.version == 1
    versioned.generate(request, SamplingParams())
    assert engine.calls == ["v0", "v1"]
    assert versioned.tokens_of(7) == {0: 3, 1: 3} and versioned.tokens_of(7) == {}
    assert versioned.lanes() == [versioned] and versioned.lane_of(123) == 0


def test_the_sampler_bounds_groups_in_flight_and_hands_over_what_finished():
    engine = VersionedEngine(_Engine())
    started: list[int] = []
    release = threading.Event()

    def sample_group(ordinal):
        started.append(ordinal)
        if ordinal == 0:
            release.wait(5)  # the long tail: group 0 finishes last
        engine.generate(
            [GenerationRequest(prompt_ids=[1], seed=0, group=ordinal)], SamplingParams()
        )
        return f"group {ordinal}"

    sampler = StreamSampler(sample_group, engine, workers=3, allowed=lambda: 3)
    try:
        taken, dropped, waited = sampler.take(2, min_version=0, timeout_s=10)
        assert sorted(g.ordinal for g in taken) == [1, 2] and not dropped
        assert all(g.tokens == {0: 3} for g in taken)
        release.set()
        taken, _, _ = sampler.take(1, min_version=0, timeout_s=10)
        assert taken[0].ordinal == 0  # nothing else may start: 3 groups started, 3 allowed
        assert sorted(started) == [0, 1, 2]
        with pytest.raises(TimeoutError, match="did not finish within"):
            sampler.take(50, min_version=0, timeout_s=0.2)
    finally:
        sampler.stop()


def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.perf_counter() + timeout_s
    while not condition():
        assert time.perf_counter() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_without_partial_rollouts_a_load_waits_for_the_groups_in_flight():
    engine = VersionedEngine(_Engine())
    release = threading.Event()
    started: list[int] = []

    def sample_group(ordinal):
        started.append(ordinal)
        release.wait(5)
        return ordinal

    sampler = StreamSampler(sample_group, engine, workers=2, allowed=lambda: 2)
    try:
        _until(lambda: len(started) == 2)
        loaded = []
        loader = threading.Thread(
            target=lambda: loaded.append(sampler.quiesced(lambda: len(started), timeout_s=5))
        )
        loader.start()
        time.sleep(0.1)
        assert loaded == []  # two groups in flight: the load waits
        release.set()
        loader.join(5)
        assert loaded == [2]  # it ran once they had finished, and none started meanwhile
    finally:
        sampler.stop()
        release.set()


def test_a_load_that_waits_longer_than_its_limit_names_the_key():
    never = threading.Event()
    sampler = StreamSampler(
        lambda ordinal: never.wait(5), VersionedEngine(_Engine()), workers=1, allowed=lambda: 1
    )
    try:
        _until(lambda: sampler.in_flight == 1)
        with pytest.raises(TimeoutError, match="rollout.partial_rollout=false"):
            sampler.quiesced(lambda: None, timeout_s=0.2)
    finally:
        sampler.stop()
        never.set()


def test_an_error_in_a_group_stops_the_stream_and_take_raises_it():
    def sample_group(ordinal):
        raise RuntimeError("env exploded")

    sampler = StreamSampler(sample_group, VersionedEngine(_Engine()), workers=2, allowed=lambda: 2)
    with pytest.raises(RuntimeError, match="env exploded"):
        sampler.take(1, 0, timeout_s=5)


STREAM = [
    "train.max_staleness=1",
    "rollout.engine_devices=1",
    "algorithm.rollout_correction=token",
]


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        (["train.rollout_lag=1"], "train.rollout_lag"),
        (["algorithm.rollout_correction=none"], "algorithm.rollout_correction"),
        (["rollout.max_sample_batches=2"], "rollout.max_sample_batches"),
    ],
)
def test_what_streaming_cannot_run_with_is_refused_naming_both_keys(extra, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*STREAM, *extra])
    assert "train.max_staleness" in str(err.value) and key in str(err.value)


def test_a_staleness_bound_below_one_and_partial_rollouts_without_a_stream_are_refused():
    with pytest.raises(ConfigError, match="train.max_staleness"):
        load_config(None, ["train.max_staleness=0"])
    with pytest.raises(ConfigError, match="rollout.partial_rollout.*train.max_staleness"):
        load_config(None, ["rollout.partial_rollout=true"])


LONGTAIL_STREAM = [
    *STREAM,
    "rollout.env=rollout.envs.longtail:LongTailEnv",
    "rollout.max_turns=3",
    "train.batch_size=4",
    "train.mini_batch_size=2",
    "train.total_steps=4",
    "run.save_every=0",
    "run.resume=never",
]
#: name -> overrides: partial rollouts, whole ones, and dp 2 with step-wise rows and GAE at s = 2
RUNS = {
    "partial": ["rollout.partial_rollout=true"],
    "whole": ["rollout.partial_rollout=false"],
    # AReaL's mode: late groups trained with their per-token correction, none dropped
    "keep": ["rollout.partial_rollout=true", "train.stale_prompts=keep"],
    "dp2-stepwise-gae": [
        "train.max_staleness=2",
        "rollout.partial_rollout=true",
        "train.dp_size=2",
        "rollout.step_wise=true",
        "algorithm.adv_estimator=gae",
        "critic.enable=true",
        "train.stale_prompts=retry",
    ],
    # colocated engines: the stream holds while they sleep for the update
    "colocated-partial": ["rollout.engine_devices=0", "rollout.partial_rollout=true"],
    "colocated-whole-dp2": [
        "rollout.engine_devices=0",
        "rollout.partial_rollout=false",
        "train.dp_size=2",
    ],
}


@pytest.fixture(scope="module")
def streamed(local_ray, tmp_path_factory):
    from trainer.loop.start.run import run_training

    out = {}
    for name, extra in RUNS.items():
        run_dir = tmp_path_factory.mktemp(name)
        assert (
            run_training(load_config(None, [*LONGTAIL_STREAM, *extra, f"run.dir={run_dir}"])) == 0
        )
        out[name] = run_dir
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_a_streamed_run_keeps_its_bound_and_records_every_batch(streamed, name):
    """Every step's groups are at most max_staleness policies behind the trainer, every batch
    is recorded (without run.record_rollouts), and without partial rollouts no token comes
    from a newer policy than its group's first."""
    from trainer.records.jsonl_files import read_jsonl

    run_dir = streamed[name]
    bound = 2 if name == "dp2-stepwise-gae" else 1
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        if name == "keep":  # the bound limits what starts, not what finishes: none thrown away
            assert r["stream/groups_dropped"] == r["stream/groups_aborted"] == 0
            assert r["stream/tokens_discarded"] == 0
        else:
            assert 0 <= r["stream/staleness_min"] <= r["stream/staleness_max"] <= bound
        assert r["pipeline/max_staleness"] == bound and r["stream/groups_dropped"] >= 0
        for share in ("partial_token_share", "engine_idle_share", "trainer_idle_share"):
            assert 0.0 <= r[f"stream/{share}"] <= 1.0
        if "whole" in name:
            assert r["stream/partial_token_share"] == 0.0
        # the bias made visible: what was taken, dropped and aborted, and the engine's batches
        assert r["stream/taken_mean_length"] > 0 and r["stream/taken_mean_turns"] >= 1
        # 0 where the engines made no call since the last batch (every group already done)
        assert r["stream/requests_per_call"] >= 0 and r["stream/groups_aborted"] >= 0
        if r["stream/groups_dropped"] == 0:
            assert r["stream/dropped_mean_length"] == 0.0
    assert max(r["stream/requests_per_call"] for r in records) >= 1
    # the HF engine's engine server: every step that served turns says how long they waited
    waits = [r for r in records if "stream/turn_wait_ms" in r]
    assert waits and all(
        0 <= r["stream/turn_wait_ms"] <= r["stream/turn_wait_p99_ms"] for r in waits
    )
    made = sum(r["stream/tokens_generated"] for r in records)
    assert 0 <= sum(r["stream/tokens_discarded"] for r in records) <= made
    assert records[0]["stream/staleness_max"] == 0  # step 1: the initial weights train
    recorded = sorted(p.name for p in (run_dir / "rollouts").glob("step_*.npz"))
    assert recorded == [f"step_{s}.npz" for s in (1, 2, 3, 4)]
    for step in (1, 2, 3, 4):  # every sampled token records the policy that sampled it
        arrays = load_rollout(run_dir / "rollouts" / f"step_{step}.npz")
        versions, mask = arrays["token/policy_version"], arrays["token/loss_mask"]
        sampled = versions[mask > 0]
        assert sampled.size and (name == "keep" or sampled.min() >= max(0, step - 1 - bound))
        assert sampled.max() <= step - 1
        gaps = step - 1 - sampled
        assert gaps.max() == records[step - 1]["stream/staleness_max"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "replay_keys"),
    [
        ("partial", []),
        ("partial", ["train.dp_size=2"]),  # replayed on another dp size
        ("dp2-stepwise-gae", []),
        ("dp2-stepwise-gae", ["train.dp_size=1"]),
        ("colocated-partial", []),
        ("keep", []),
    ],
)
def test_the_replay_of_a_streamed_run_trains_to_the_same_fingerprints(
    streamed, name, replay_keys, tmp_path
):
    """Streamed runs differ run to run; replaying one's recording (``crossrl probe``) trains
    exactly its updates: ``crossrl parity`` agrees, at dp 1 and at dp 2, and on the other dp
    size than the run's."""
    from trainer.commands.parity import compare_runs
    from trainer.commands.probe import probe_config, run_probe

    run_dir = streamed[name]
    replay = tmp_path / "replay"
    cfg = probe_config(
        str(run_dir / "config.yaml"),
        replay_keys,
        rollouts=run_dir / "rollouts",
        steps=4,
        out=replay,
    )
    assert run_probe(cfg, run_dir / "rollouts") == 0
    report = compare_runs(run_dir, replay)
    assert report.agree, report.first_divergence()


@pytest.mark.slow
def test_a_streamed_run_resumes_with_a_fresh_stream_from_the_prompts_it_drew(local_ray, tmp_path):
    """Not exact (the groups in flight are not kept), but it goes on: steps 3-4 after a resume
    from step 2's checkpoint, the stream starting past every prompt the first part drew."""
    import json

    from trainer.loop.start.run import run_training
    from trainer.records.checkpoint import LAYOUT, load_json
    from trainer.records.jsonl_files import read_jsonl

    run_dir = tmp_path / "run"
    keys = [*LONGTAIL_STREAM, "rollout.partial_rollout=true", f"run.dir={run_dir}"]
    first = [*keys, "train.total_steps=2", "run.save_every=2"]
    assert run_training(load_config(None, first)) == 0
    drawn = load_json(run_dir / "checkpoints" / "step_2" / LAYOUT.trainer_state)
    assert drawn["prompts_consumed"] >= 2 * 4  # the stream drew ahead of the two steps
    assert run_training(load_config(None, [*keys, "train.total_steps=4", "run.resume=auto"])) == 0
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 4


def test_the_layout_counts_a_streams_snapshots_and_groups_in_flight(capsys):
    """A streamed run keeps max_staleness + 1 weight snapshots alive (the host loads them in
    order; the step training with policy t needs policy t - s loaded) and up to
    (s + 1) x batch_size groups in flight; ``crossrl layout`` prints both, and a store too
    small for the snapshots is refused naming train.max_staleness."""
    from trainer.cli import main
    from trainer.loop.plan.model_shape import model_shape
    from trainer.loop.plan.snapshot_budget import live_snapshots, snapshot_bytes, snapshot_problem

    keys = [*STREAM, "train.max_staleness=2", "rollout.weight_transport=host"]
    cfg = load_config(None, keys, check_environment=False)
    assert live_snapshots(cfg) == 3
    one = snapshot_bytes(model_shape("builtin:small"), cfg.model.dtype)
    cfg.model.path = "builtin:small"
    text = snapshot_problem(cfg, model_shape("builtin:small"), 2.5 * one, "a node")
    assert text.startswith("train.max_staleness=2: the stream keeps 3 weight snapshots alive")
    assert text.endswith("or lower train.max_staleness to 1")
    sizes = ["train.batch_size=4", "train.mini_batch_size=2", "rollout.n=2"]
    assert main(["layout", *keys, *sizes]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "weight snapshots in Ray's object store: 3 (train.max_staleness + 1)" in out
    assert "up to 12 groups in flight" in out and "24 trajectories" in out
