"""Placement as a pure function: which rank and engine replica runs on which device, for
fake clusters (8 GPUs, 16 NPU dies, two nodes of 8), and `crossrl layout` on the shipped
configs; impossible layouts fail with the key and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.cli import main
from trainer.config import load_config
from trainer.loop.plan.layout import LayoutError, deal_prompt, plan_layout

ROOT = Path(__file__).resolve().parents[1]


def _cfg(name: str, *overrides: str):
    return load_config(str(ROOT / "configs" / name), list(overrides), check_environment=False)


def test_gpu_node_of_8_runs_4_replicas_of_tp_2():
    layout = plan_layout(_cfg("gpu/qwen2.5-7b-grpo.yaml"), [8], "GPU", device="cuda")
    assert layout.dp_size == 8 and len(layout.replicas) == 4 and layout.tp == 2
    assert [r.devices for r in layout.replicas] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [r.ranks for r in layout.replicas] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    # every training rank on its own device; the replica on its tp group's devices
    assert layout.rank_slots == tuple((0, d) for d in range(8))
    assert layout.roles == ("actor", "reference")  # GRPO with a KL term, no critic
    assert layout.engine_memory_fraction == 0.6


def test_npu_node_of_16_dies_runs_8_replicas_of_tp_2():
    layout = plan_layout(_cfg("npu/qwen2.5-7b-grpo.yaml"), [16], "NPU", device="npu")
    assert len(layout.replicas) == 8 and layout.tp == 2
    assert sorted(d for r in layout.replicas for d in r.devices) == list(range(16))
    ppo = plan_layout(_cfg("npu/qwen2.5-7b-ppo.yaml"), [16], "NPU")
    assert ppo.roles == ("actor", "reference", "critic")


def test_two_nodes_of_8_keep_every_tp_group_on_one_node():
    cfg = _cfg("gpu/qwen2.5-7b-grpo.yaml", "train.dp_size=16", "rollout.tensor_parallel_size=4")
    layout = plan_layout(cfg, [8, 8], "GPU")
    assert [(r.node, r.devices) for r in layout.replicas] == [
        (0, (0, 1, 2, 3)),
        (0, (4, 5, 6, 7)),
        (1, (0, 1, 2, 3)),
        (1, (4, 5, 6, 7)),
    ]
    assert layout.rank_slots[8] == (1, 0)


def test_impossible_layouts_name_the_key():
    cfg = _cfg("gpu/qwen2.5-7b-grpo.yaml")
    with pytest.raises(LayoutError, match="train.dp_size=8 needs 8 GPU devices, the cluster has 4"):
        plan_layout(cfg, [4], "GPU")
    big_tp = _cfg("gpu/qwen2.5-7b-grpo.yaml", "rollout.tensor_parallel_size=8")
    with pytest.raises(LayoutError, match="tensor_parallel_size=8 is larger than a node"):
        plan_layout(big_tp, [4, 4], "GPU")
    # 3 devices per node hold one whole tp-2 group each: a group would span the nodes
    with pytest.raises(LayoutError, match="cannot span nodes"):
        plan_layout(_cfg("gpu/qwen2.5-7b-grpo.yaml", "train.dp_size=6"), [3, 3], "GPU")
    # the config checks refuse tp not dividing dp at load; the layout refuses it too
    cfg.rollout.tensor_parallel_size = 3
    with pytest.raises(LayoutError, match="tensor_parallel_size=3 does not divide"):
        plan_layout(cfg, [8], "GPU")


def test_prompts_are_dealt_by_index_only():
    # consecutive prompts of a step spread evenly; the same prompt always lands on one replica
    dealt = [deal_prompt(i, 4) for i in range(16, 32)]
    assert [dealt.count(r) for r in range(4)] == [4, 4, 4, 4]
    assert deal_prompt(21, 4) == deal_prompt(21, 4) == 1
    assert {deal_prompt(i, 1) for i in range(10)} == {0}


def test_crossrl_layout_prints_the_shipped_configs(capsys):
    assert main(["layout", "--config", str(ROOT / "configs/gpu/qwen2.5-7b-grpo.yaml")]) == 0
    out = capsys.readouterr().out
    assert "4 vllm engine replicas x tp 2" in out and "over 8 devices" in out
    assert "device  7: actor rank 7, reference rank 7, engine replica 3 (tp rank 1 of 2)" in out
    assert main(["layout", "--config", str(ROOT / "configs/npu/qwen2.5-7b-grpo.yaml")]) == 0
    out = capsys.readouterr().out
    assert "8 vllm engine replicas x tp 2" in out and "over 16 devices" in out


def test_crossrl_layout_exits_2_on_an_impossible_layout(capsys):
    gpu = str(ROOT / "configs/gpu/qwen2.5-7b-grpo.yaml")
    assert main(["layout", "--config", gpu, "--devices-per-node", "4"]) == 2
    assert "train.dp_size=8 needs 8 GPU devices" in capsys.readouterr().err
    assert main(["layout", "--config", gpu, "rollout.tensor_parallel_size=3"]) == 2
    assert "rollout.tensor_parallel_size" in capsys.readouterr().err
