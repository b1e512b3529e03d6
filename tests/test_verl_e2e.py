"""A verl user's job end to end: a verl-format parquet, a reward-function module, validation
every step (and before training), with dynamic sampling, overlong shaping, GSPO, rollout
correction and the KL reward penalty on; validation must not change the training stream."""

from __future__ import annotations

import json

import pytest
import ray

from trainer.config import load_config
from trainer.loop.start.run import run_training
from trainer.records.checkpoint import find_latest
from trainer.records.jsonl_files import read_jsonl

pytestmark = pytest.mark.slow
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _rows(n: int, split: str) -> list[dict]:
    return [
        {
            "data_source": "arith" if i % 2 else "recall",
            "prompt": [
                {"role": "system", "content": "answer with digits"},
                {"role": "user", "content": f"say {i}{i}"},
            ],
            "ability": "toy",
            "reward_model": {"ground_truth": f"{i}{i}", "style": "rule"},
            "extra_info": {"split": split, "index": i},
        }
        for i in range(n)
    ]


def test_verl_parquet_reward_module_validation_every_step(local_ray, tmp_path):
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(8, "train")), str(train))
    pq.write_table(pa.Table.from_pylist(_rows(3, "test")), str(val))
    common = [
        f"data.source={train}",
        "rollout.env=single_turn",
        "reward.function=tests.verl_reward_fns:length_score",
        "train.batch_size=2",
        "train.mini_batch_size=2",
        "rollout.n=2",
        "rollout.max_new_tokens=6",
        "train.total_steps=2",
        "run.resume=never",
        "rollout.max_sample_batches=2",
        "reward.overlong_buffer_len=2",
        "algorithm.policy_loss=gspo",
        "algorithm.loss_agg=seq-mean-token-mean",
        "algorithm.rollout_correction=token",
        "algorithm.kl_coef=0.01",
    ]
    validated, plain = tmp_path / "validated", tmp_path / "plain"
    val_keys = [
        f"data.val_source={val}",
        "run.val_every=1",
        "run.val_before_train=true",
        "rollout.val_n=2",
        "rollout.val_temperature=0.8",
    ]
    assert run_training(load_config(None, [*common, *val_keys, f"run.dir={validated}"])) == 0
    assert run_training(load_config(None, [*common, f"run.dir={plain}"])) == 0

    metrics = read_jsonl(validated / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]  # step 0: validation before training
    for m in metrics:
        assert m["val/reward_mean"] >= 2.0  # length_score is 2 + 0.01 x characters
        assert m["val/pass@2"] == 1.0 and m["val/best@2"] >= m["val/reward_mean"] - 1e-9
        assert {"val/reward_mean/arith", "val/reward_mean/recall"} <= set(m)
    for m in metrics[1:]:
        assert m["reward/errors"] == 0 and m["rollout/env_errors"] == 0
        assert "rollout_correction/weight_mean" in m and "rollout/logprob_kl" in m
        assert m["dynamic_sampling/sample_batches"] >= 1

    # Validation never changes the training stream: the same rows, losses and weights.
    fa, fb = read_jsonl(validated / "fingerprint.jsonl"), read_jsonl(plain / "fingerprint.jsonl")
    assert fa == fb
    # The checkpoint knows how many prompts the (variable) sampling consumed.
    state = json.loads((find_latest(plain) / "trainer_state.json").read_text())
    batches = sum(m["dynamic_sampling/sample_batches"] for m in read_jsonl(plain / "metrics.jsonl"))
    assert state["prompts_consumed"] == 2 * batches


def test_dynamic_sampling_prompt_stream_resumes_where_it_stopped(local_ray, tmp_path):
    """With dynamic sampling a step consumes a variable number of prompts; a host that resumes
    from the saved count samples exactly what the uninterrupted host sampled next."""
    from trainer.loop.engines.rollout_host import RolloutHost

    train = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(8, "train")), str(train))
    cfg = load_config(
        None,
        [
            f"data.source={train}",
            "rollout.env=single_turn",
            "reward.function=tests.verl_reward_fns:length_score",
            "train.batch_size=2",
            "train.mini_batch_size=2",
            "rollout.n=2",
            "rollout.max_new_tokens=4",
            "rollout.max_sample_batches=3",
            f"run.dir={tmp_path / 'run'}",
        ],
    )
    straight = RolloutHost(cfg)
    straight.setup()
    straight.rollout(1)
    after_step_1 = straight.get_prompts_consumed()
    meta, ref = straight.rollout(2)
    batches = meta["metrics"]["dynamic_sampling/sample_batches"]
    assert after_step_1 % 2 == 0 and after_step_1 >= 2
    assert straight.get_prompts_consumed() == after_step_1 + 2 * batches

    resumed = RolloutHost(cfg)
    resumed.setup()
    resumed.set_prompts_consumed(after_step_1)
    meta2, ref2 = resumed.rollout(2)
    assert meta2["prompts_consumed"] == meta["prompts_consumed"]
    a, b = ray.get(ref[0]), ray.get(ref2[0])
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
