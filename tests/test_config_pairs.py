"""The shipped job configs: every one loads, and each gpu/npu pair computes the same job."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import hal
from trainer.config import LAYOUT_KEYS, all_keys, default_config_path, load_config

CONFIGS = default_config_path().parent.parent
GPU = sorted(p.name for p in (CONFIGS / "gpu").glob("*.yaml"))
NPU = sorted(p.name for p in (CONFIGS / "npu").glob("*.yaml"))
REQUIRED_JOBS = {
    "qwen2.5-0.5b-grpo.yaml",
    "qwen2.5-1.5b-grpo.yaml",
    "qwen2.5-7b-grpo.yaml",
    "qwen2.5-7b-ppo.yaml",
}


def test_layout_keys_are_schema_keys():
    assert LAYOUT_KEYS <= set(all_keys())


def test_every_job_has_a_gpu_and_an_npu_config():
    assert GPU == NPU
    assert REQUIRED_JOBS <= set(GPU)


@pytest.mark.parametrize("name", GPU)
def test_pair_differs_only_in_layout_keys(name):
    gpu = load_config(CONFIGS / "gpu" / name, check_environment=False).flat()
    npu = load_config(CONFIGS / "npu" / name, check_environment=False).flat()
    differing = {key for key in gpu if gpu[key] != npu[key]}
    assert differing <= LAYOUT_KEYS, sorted(differing - LAYOUT_KEYS)
    assert (gpu["device"], gpu["train.dp_size"]) == ("cuda", 8)
    assert (npu["device"], npu["train.dp_size"]) == ("npu", 16)


@pytest.mark.parametrize("path", [f"gpu/{n}" for n in GPU] + [f"npu/{n}" for n in NPU])
def test_device_file_sets_only_layout_keys_over_its_base(path):
    raw = yaml.safe_load((CONFIGS / path).read_text())
    include = raw.pop("include")
    assert include == f"../base/{Path(path).name}"
    assert (CONFIGS / path).parent.joinpath(include).is_file()
    set_keys = {
        f"{section}.{key}" if isinstance(values, dict) else section
        for section, values in raw.items()
        for key in (values if isinstance(values, dict) else [None])
    }
    assert set_keys <= LAYOUT_KEYS, sorted(set_keys - LAYOUT_KEYS)


@pytest.mark.parametrize("name", GPU)
def test_real_jobs_are_bf16_agents_on_local_models(name):
    cfg = load_config(CONFIGS / "gpu" / name, check_environment=False)
    assert cfg.model.path.startswith(("/models/Qwen2.5-", "/models/Qwen3-"))
    assert cfg.model.dtype == "bfloat16"
    assert cfg.rollout.engine == "vllm"
    assert cfg.rollout.step_wise and cfg.rollout.max_turns > 1
    assert (cfg.algorithm.adv_estimator == "gae") == cfg.critic.enable == name.endswith("ppo.yaml")


def test_cpu_default_job_runs_here(monkeypatch):
    monkeypatch.setattr(hal, "available_backends", lambda: ["cpu"], raising=False)
    cfg = load_config(default_config_path())
    assert cfg.device == "cpu"
    assert (cfg.model.path, cfg.model.dtype) == ("builtin:tiny", "float32")
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.rollout.step_wise
    assert cfg.train.dp_size == 1
    assert cfg.run.dir == "runs/tiny"
