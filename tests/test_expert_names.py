"""``rollout.engines.weights.expert_names``: transformers 5's fused experts split into the
per-expert names a checkpoint (and vLLM 0.24's / 0.26's loaders) use, checked against
transformers' own loading rule, and the vLLM model wrapper that applies it on every path."""

from __future__ import annotations

import shutil

import pytest
import torch

from rollout.engines.weights import loaded_names
from rollout.engines.weights.expert_names import per_expert, split_fused_experts
from rollout.models import builtin_config_dir, load_model


def test_per_expert_names_load_back_into_transformers_fused_experts(tmp_path):
    """The tiny MoE's state, split per expert and saved as a checkpoint, loads through
    transformers' ``from_pretrained`` (its own rule: per-expert names stacked into the fused
    tensors) into exactly the fused tensors it came from."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    state = load_model("builtin:tiny-moe", seed=3).state_dict()
    split = dict(per_expert(state.items()))
    experts = [n for n in split if ".mlp.experts." in n]
    assert len(experts) == 8 * 3  # gate, up and down of each of 8 experts, one MoE layer
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in split
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in split)
    dense = {n: t for n, t in state.items() if ".mlp.experts." not in n}
    assert all(torch.equal(split[n], t) for n, t in dense.items())  # the rest as it was
    shutil.copy(builtin_config_dir("builtin:tiny-moe") / "config.json", tmp_path)
    tensors = {n: t.contiguous().clone() for n, t in split.items() if n != "lm_head.weight"}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).state_dict()
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize(
    "name, shape",
    [("model.layers.1.mlp.experts.gate_up_proj", (8, 5, 4)), ("x.mlp.experts.down_proj", (8, 4))],
)
def test_a_fused_tensor_of_another_layout_is_named_in_one_line(name, shape):
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*shape"):
        list(per_expert([(name, torch.zeros(shape))]))


class _Model:
    """A vLLM model's loading surface: ``load_weights`` returns the names it loaded."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def load_weights(self, weights):
        names = [name for name, _ in weights]
        self.seen += names
        return {n for n in names if n != "nope"}  # a name it has no parameter for: "nope"


def test_a_split_model_loads_fused_names_one_expert_a_name_through_a_watched_push():
    """``split_fused_experts`` puts the split in front of the model's own loader, once; the
    first push's name check (``loaded_names.watch``) wraps it and gives it back after."""
    model = _Model()
    split_fused_experts(model)
    split_fused_experts(model)  # once only
    fused = [("l.mlp.experts.gate_up_proj", torch.zeros(2, 6, 4)), ("l.norm.weight", torch.ones(4))]
    model.load_weights(fused)
    assert model.seen == [
        "l.mlp.experts.0.gate_proj.weight",
        "l.mlp.experts.0.up_proj.weight",
        "l.mlp.experts.1.gate_proj.weight",
        "l.mlp.experts.1.up_proj.weight",
        "l.norm.weight",
    ]
    loaded_names.watch(model)
    model.load_weights([("l.mlp.experts.down_proj", torch.zeros(2, 4, 3)), ("nope", torch.ones(1))])
    assert loaded_names.unloaded(model) == (["nope"], 2)
    model.seen.clear()
    model.load_weights([("l.mlp.experts.down_proj", torch.zeros(1, 4, 3))])
    assert model.seen == ["l.mlp.experts.0.down_proj.weight"]  # still split after the watch


def _per_expert_checkpoint(directory, seed: int = 3) -> dict:
    """The tiny MoE saved as published MoE checkpoints are: one tensor per expert."""
    from safetensors.torch import save_file

    state = load_model("builtin:tiny-moe", seed=seed).state_dict()
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(builtin_config_dir("builtin:tiny-moe") / "config.json", directory)
    split = {n: t.contiguous().clone() for n, t in per_expert(state.items())}
    save_file(split, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return state


def test_a_per_expert_checkpoint_reads_under_the_fused_names_one_tensor_at_a_time(tmp_path):
    from rollout.models import CheckpointTensors

    state = _per_expert_checkpoint(tmp_path / "moe")
    source = CheckpointTensors(tmp_path / "moe")
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    assert fused in source and "model.layers.1.mlp.experts.down_proj" in source
    assert "model.layers.0.mlp.experts.gate_up_proj" not in source  # the dense layer has none
    for name, tensor in state.items():
        assert torch.equal(source.read(name), tensor), name
    with pytest.raises(KeyError, match="model.layers.9.mlp.experts.down_proj"):
        source.read("model.layers.9.mlp.experts.down_proj")


def test_the_actor_starts_from_a_per_expert_checkpoint_without_a_whole_copy(tmp_path, monkeypatch):
    """The trainer's start-up streams the per-expert checkpoint tensor by tensor: transformers'
    ``from_pretrained`` (one whole fp32 copy on rank 0: 122 GB for Qwen3-30B-A3B) never runs,
    and the actor holds exactly the checkpoint's weights."""
    import rollout.models
    from trainer.config import load_config
    from trainer.loop.cluster.group import free_port
    from trainer.loop.ranks.fsdp_worker import WorkerSpec
    from trainer.loop.ranks.policy import PolicyWorker

    state = _per_expert_checkpoint(tmp_path / "moe")

    def refuse(*args, **kwargs):
        raise AssertionError("from_pretrained ran: the checkpoint was read whole")

    monkeypatch.setattr(rollout.models, "load_model", refuse)
    cfg = load_config(None, [f"model.path={tmp_path / 'moe'}", "model.dtype=float32"])
    worker = PolicyWorker(WorkerSpec(role="actor", rank=0, cfg=cfg))
    worker.setup("127.0.0.1", free_port())
    try:
        got = worker.full_state_dict()
        for name, tensor in state.items():
            assert torch.equal(got[name], tensor), name
    finally:
        worker.shutdown()
