"""dp=2 on the CPU: two hf engine replicas, one per rank, trained end to end. The rows are
the ones a single replica (dp=1) samples, the new weights reach both replicas through shared
memory, and the engines are awake with the new weights after each step's sync."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rollout.replay import load_rollout
from trainer.config import load_config
from trainer.loop.schedule.controller import Trainer
from trainer.loop.start import launch
from trainer.loop.start.run import run_training
from trainer.records.jsonl_files import read_jsonl

pytestmark = pytest.mark.slow

SHORT = [
    "train.batch_size=4",
    "train.mini_batch_size=2",
    "rollout.n=4",
    "train.total_steps=2",
    "run.resume=never",
    "run.record_rollouts=true",
]


@pytest.fixture(scope="module")
def runs(local_ray, tmp_path_factory):
    out = {}
    for dp in (1, 2):
        run_dir = tmp_path_factory.mktemp(f"dp{dp}")
        cfg = load_config(None, [*SHORT, f"train.dp_size={dp}", f"run.dir={run_dir}"])
        assert run_training(cfg) == 0
        out[dp] = run_dir
    return out


def test_two_replicas_sample_the_rows_of_one(runs):
    for step in (1, 2):
        one = load_rollout(runs[1] / "rollouts" / f"step_{step}.npz")
        two = load_rollout(runs[2] / "rollouts" / f"step_{step}.npz")
        assert sorted(one) == sorted(two)
        for key in one:
            if key == "token/rollout_logprobs":  # another batch shape: float noise only
                np.testing.assert_allclose(two[key], one[key], atol=1e-5)
            else:
                np.testing.assert_array_equal(two[key], one[key], err_msg=f"step {step}: {key}")


def test_two_replicas_learn_with_synced_weights(runs):
    one, two = (read_jsonl(runs[dp] / "metrics.jsonl") for dp in (1, 2))
    assert [m["step"] for m in two] == [1, 2]
    for a, b in zip(one, two):
        assert b["actor/grad_norm"] > 0
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-4)
        assert b["reward/mean"] == a["reward/mean"]
    # Step 2's rows were sampled by both replicas after step 1's sync: their logprobs agree
    # with the trainer's under the updated weights, so both replicas got them.
    assert two[1]["rollout/logprob_abs_diff"] < 1e-5
    prints = [read_jsonl(runs[dp] / "fingerprint.jsonl") for dp in (1, 2)]
    assert prints[0][0]["plan_digest"] != prints[0][1]["plan_digest"]  # new rows each step


def test_replicas_sleep_through_training_and_wake_for_the_sync(local_ray, tmp_path):
    cfg = load_config(None, [*SHORT, "train.dp_size=2", f"run.dir={tmp_path}"])
    trainer = Trainer(cfg, Path(cfg.run.dir))
    try:
        launch.start(trainer)
        assert len(trainer.replicas) == 2
        both = [["weights", "kv_cache"]] * 2
        assert trainer._engines("awake_tags") == both
        trainer._rollout(1)
        trainer._engines("sleep")
        assert trainer._engines("awake_tags") == [[], []]
        trainer.sync_weights()  # weights first ...
        assert trainer._engines("awake_tags") == [["weights"]] * 2
        trainer._engines("wake_up", ["kv_cache"])  # ... the KV cache after
        assert trainer._engines("awake_tags") == both
        metrics, _ = trainer.train_step(2)
        assert trainer._engines("awake_tags") == both
        assert metrics["rollout/logprob_abs_diff"] < 1e-5
    finally:
        trainer.shutdown()
