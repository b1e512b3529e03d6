"""train.rollout_lag=1 with an engine on a device of its own, end to end on the CPU: two runs
of the same job give identical fingerprints, a run at dp 2 agrees with one at dp 1 under
``crossrl parity``, so does one with two engines of their own (and both at once), a lagged run
resumed from a checkpoint trains on the very batches the uninterrupted run did, and the
off-policy metrics say what the lag did. The weights reach the engines through the collective
push (``rollout.weight_transport``'s default here); a run through host-memory snapshots gives
the very same fingerprints, and at lag 2 with a slow environment each step samples the weights
three steps behind."""

from __future__ import annotations

import pytest
import ray

from trainer.commands.parity import compare_runs
from trainer.config import load_config
from trainer.loop.cluster.group import start_ray
from trainer.loop.start.run import run_training
from trainer.records.jsonl_files import read_jsonl

pytestmark = pytest.mark.slow

LAG1 = [
    "train.rollout_lag=1",
    "rollout.engine_devices=1",
    "algorithm.rollout_correction=token",
    "train.batch_size=4",
    "train.mini_batch_size=2",
    "train.total_steps=4",
    "run.save_every=2",
    "run.resume=never",
]


@pytest.fixture(scope="module")
def local_ray():
    started = start_ray(None, num_cpus=6)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def runs(local_ray, tmp_path_factory):
    out = {}
    for name, extra in (
        ("a", []),
        ("b", []),
        ("dp2", ["train.dp_size=2"]),
        ("engines2", ["rollout.engine_devices=2"]),
        ("dp2engines2", ["train.dp_size=2", "rollout.engine_devices=2"]),
        ("host", ["rollout.weight_transport=host"]),
    ):
        run_dir = tmp_path_factory.mktemp(name)
        assert run_training(load_config(None, [*LAG1, *extra, f"run.dir={run_dir}"])) == 0
        out[name] = run_dir
    return out


def _lines(run_dir, name):
    return (run_dir / name).read_text().splitlines()


def test_two_lagged_runs_give_identical_fingerprints(runs):
    assert _lines(runs["a"], "fingerprint.jsonl") == _lines(runs["b"], "fingerprint.jsonl")


def test_a_lagged_run_at_dp_2_agrees_with_dp_1(runs):
    report = compare_runs(runs["a"], runs["dp2"])
    assert report.agree, report.first_divergence()


def test_two_engines_of_their_own_sample_what_one_does(runs):
    # Prompts are dealt to replicas by index and every replica loads each snapshot, so the
    # rows, and everything trained on them, are the ones a single engine gives.
    report = compare_runs(runs["a"], runs["engines2"])
    assert report.agree, report.first_divergence()


def test_two_ranks_push_to_two_engines_what_one_pushes_to_one(runs):
    report = compare_runs(runs["a"], runs["dp2engines2"])
    assert report.agree, report.first_divergence()


def test_the_collective_push_and_the_host_snapshot_give_the_same_run(runs):
    # Same weights, same dtype, whichever way they travel: bit for bit the same run.
    assert _lines(runs["a"], "fingerprint.jsonl") == _lines(runs["host"], "fingerprint.jsonl")
    report = compare_runs(runs["host"], runs["dp2engines2"])
    assert report.agree, report.first_divergence()


def test_at_lag_2_with_slow_rollouts_each_step_samples_the_weights_three_behind(
    local_ray, tmp_path
):
    slow = [
        *LAG1,
        "train.rollout_lag=2",
        "train.total_steps=6",
        "rollout.env=rollout.envs.sleepy:SleepyEnv",
        # Tool waits make each rollout slower than an update: pushes arrive while the
        # engine is still busy with the rollouts queued before the one that loads them.
        "rollout.env_kwargs={turns: 2, max_delay_s: 0.5}",
        f"run.dir={tmp_path}",
    ]
    assert run_training(load_config(None, slow)) == 0
    versions = [m["pipeline/policy_version"] for m in read_jsonl(tmp_path / "metrics.jsonl")]
    # Steps 1-3 sample with the initial weights; later ones load push t-3, staged on training
    # rank 0 until the rollout that asks for it (one push at a time: the next update's push
    # waits for it), so no engine ever mixes two versions.
    assert versions == [0.0, 0.0, 0.0, 1.0, 2.0, 3.0], versions


def test_the_lag_shows_in_the_metrics(runs):
    metrics = read_jsonl(runs["a"] / "metrics.jsonl")
    assert [m["pipeline/rollout_lag"] for m in metrics] == [1.0] * 4
    assert [m["pipeline/policy_version"] for m in metrics] == [0.0, 0.0, 1.0, 2.0]
    # Step 1 trains on the weights that sampled it; later steps on a newer proximal policy,
    # whose distance from the behaviour policy the KL measures and the weights correct.
    assert metrics[0]["rollout/logprob_kl"] == pytest.approx(0.0, abs=1e-7)
    for m in metrics[1:]:
        assert m["rollout/logprob_kl"] > 0
        assert 0.0 <= m["rollout_correction/capped_frac"] <= 1.0
        assert m["rollout_correction/weight_mean"] != 1.0


def test_a_resumed_lagged_run_trains_on_the_same_batches(runs, tmp_path):
    ckpt = runs["a"] / "checkpoints" / "step_2"
    assert sorted(p.name for p in (ckpt / "pending").iterdir()) == ["step_3.json", "step_3.npz"]
    cfg = load_config(None, [*LAG1, f"run.dir={tmp_path}", f"run.resume={ckpt}"])
    assert run_training(cfg) == 0
    assert _lines(tmp_path, "fingerprint.jsonl") == _lines(runs["a"], "fingerprint.jsonl")[2:]
