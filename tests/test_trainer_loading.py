"""Start-up of the training workers: the model is built on the meta device, sharded with FSDP2,
then loaded (rank 0 reads the checkpoint and broadcasts). What a user must not notice: the
weights, the recomputed buffers (rotary ``inv_freq``) and the logits equal those of a plain
``from_pretrained`` load, exactly in fp32, at dp=1 and dp=2, for every role.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import hal
from rollout.models import build_empty_model, load_model, write_random_model
from trainer.config import load_config
from trainer.loop.cluster.group import free_port
from trainer.loop.ranks.critic import CriticWorker
from trainer.loop.ranks.fsdp_worker import WorkerSpec
from trainer.loop.ranks.policy import PolicyWorker

SEED = 1
#: A local model directory's shape with untied embeddings (the builtins tie them).
UNTIED = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 96,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}


def _packed_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two packed rows (12 + 8 tokens) of fixed random ids."""
    ids = torch.randint(3, 90, (20,), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(12), torch.arange(8)])
    return ids, pos, torch.tensor([0, 12, 20], dtype=torch.int32)


def _plain(path: str):
    """Today's reference: the whole model read by ``from_pretrained`` on one process."""
    hal.register_attention()
    return load_model(path, seed=SEED, attn_implementation=hal.ATTN_IMPLEMENTATION)


def _worker(role: str, path: str, rank: int = 0, dp: int = 1, *overrides: str):
    job = ["device=cpu", f"train.dp_size={dp}", f"model.path={path}", f"seed={SEED}"]
    if role == "critic":
        job += ["algorithm.adv_estimator=gae", "critic.enable=true"]
    cfg = load_config(None, [*job, *overrides])
    cls = CriticWorker if role == "critic" else PolicyWorker
    return cls(WorkerSpec(role=role, rank=rank, cfg=cfg))


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    return str(write_random_model(tmp_path_factory.mktemp("m") / "untied", UNTIED, seed=4))


@pytest.mark.parametrize("path", ["builtin:tiny", "builtin:small", "untied"])
def test_actor_starts_with_the_checkpoint_weights_buffers_and_logits(path, untied_dir):
    path = untied_dir if path == "untied" else path
    plain = _plain(path)
    worker = _worker("actor", path)
    worker.setup("127.0.0.1", free_port())
    try:
        model = worker.model
        state, expected = worker.full_state_dict(), plain.state_dict()
        assert state.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(state[key], value), key
        # Non-persistent buffers are not in any checkpoint: recomputed, not left as garbage.
        buffers = dict(plain.named_buffers())
        assert {n for n, _ in model.named_buffers()} == buffers.keys()
        for name, buf in model.named_buffers():
            assert torch.equal(buf, buffers[name]), name
        tied = plain.config.tie_word_embeddings
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        with torch.no_grad():
            got = hal.packed_forward(model, *_packed_inputs())
            want = hal.packed_forward(plain, *_packed_inputs())
        assert torch.equal(got, want)
    finally:
        worker.shutdown()


def test_tied_embeddings_stay_tied_through_an_update():
    from batching import Row, StepBatch, plan_minibatches

    rows = [
        Row(
            prompt_ids=[5, 6, 7],
            response_ids=[8 + i, 9, 10],
            response_mask=[1, 1, 1],
            response_logprobs=[-2.0] * 3,
            uid=0,
            trajectory_id=i,
            step_index=0,
            is_last_step=True,
            score=float(i),
        )
        for i in range(2)
    ]
    batch = StepBatch.from_rows(rows)
    worker = _worker("actor", "builtin:tiny", 0, 1, "train.lr=1e-2")
    worker.setup("127.0.0.1", free_port())
    try:
        worker.load_batch([batch.to_numpy()])
        (mini,) = plan_minibatches(
            batch.row_fields["trajectory_id"].numpy(), batch.seq_lens, mini_batch_size=2, dp_size=1
        ).mini_batches
        worker.set_token_field("old_logprobs", [worker.compute_logprobs(mini.micro_batches[0])])
        worker.compute_advantages()
        worker.train_mini_batch(mini.micro_batches[0], mini.rows.tolist())
        state = worker.full_state_dict()
        before = load_model("builtin:tiny", seed=SEED).state_dict()
        assert not torch.equal(state["model.embed_tokens.weight"], before["lm_head.weight"])
        assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    finally:
        worker.shutdown()


@pytest.mark.parametrize("path", ["builtin:tiny", "untied"])
def test_critic_loads_the_backbone_and_a_zero_value_head(path, untied_dir):
    path = untied_dir if path == "untied" else path
    expected = _plain(path).state_dict()
    worker = _worker("critic", path)
    worker.setup("127.0.0.1", free_port())
    try:
        state = worker.full_state_dict()
        hidden = UNTIED["hidden_size"] if path == untied_dir else 64
        assert state["lm_head.weight"].shape == (1, hidden)
        assert not state["lm_head.weight"].any() and not state["lm_head.bias"].any()
        backbone = [k for k in expected if not k.startswith("lm_head.")]
        assert set(backbone) | {"lm_head.weight", "lm_head.bias"} == set(state)
        for key in backbone:
            assert torch.equal(state[key], expected[key]), key
        assert worker.model.lm_head.weight is not worker.model.model.embed_tokens.weight
    finally:
        worker.shutdown()


def test_meta_build_reads_no_weights_and_names_a_bad_path(tmp_path):
    model = build_empty_model("builtin:tiny", seed=SEED)
    assert all(t.is_meta for t in model.state_dict().values())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="model.path=.*no config.json"):
        build_empty_model(str(tmp_path / "nowhere"))


def test_checkpoint_names_transformers_converts_fall_back_to_a_whole_load(monkeypatch):
    """When the files' names are not the modules' (transformers renames some architectures'
    weights on load), rank 0 reads the model whole through ``from_pretrained``."""
    import rollout.models

    loads = []
    real_load = rollout.models.load_model
    monkeypatch.setattr(rollout.models.CheckpointTensors, "__contains__", lambda self, n: False)
    monkeypatch.setattr(
        rollout.models, "load_model", lambda *a, **k: loads.append(a[0]) or real_load(*a, **k)
    )
    worker = _worker("actor", "builtin:tiny")
    worker.setup("127.0.0.1", free_port())
    try:
        assert loads == ["builtin:tiny"]
        expected = _plain("builtin:tiny").state_dict()
        state = worker.full_state_dict()
        assert all(torch.equal(state[k], v) for k, v in expected.items())
    finally:
        worker.shutdown()


# ---- dp=2: two spawned ranks over gloo -------------------------------------------------------

#: What the dp=2 ranks start: every role on the builtin model, and the actor on a model with
#: an odd vocabulary (FSDP2 pads rank 0's shard of the embedding, 49 rows against 48).
DP2_STARTS = [("actor", "tiny"), ("reference", "tiny"), ("critic", "tiny"), ("actor", "odd")]


def _start_rank(rank: int, paths: dict, ports: list[int], queue) -> None:
    """Start every entry of ``DP2_STARTS`` at dp=2 on this rank; report what each holds and
    which checkpoint tensors this rank read."""
    import rollout.models

    torch.set_num_threads(1)
    reads: list[str] = []
    real_read = rollout.models.CheckpointTensors.read

    def counting_read(self, name):
        reads.append(name)
        return real_read(self, name)

    rollout.models.CheckpointTensors.read = counting_read
    out = {}
    for (role, model), port in zip(DP2_STARTS, ports, strict=True):
        reads.clear()
        worker = _worker(role, paths[model], rank, 2)
        worker.setup("127.0.0.1", port)
        shards = {n: p.to_local().shape[0] for n, p in worker.model.named_parameters()}
        with torch.no_grad():
            logits = hal.packed_forward(worker.model, *_packed_inputs())
        state = {k: v.numpy().copy() for k, v in worker.full_state_dict().items()}
        out[role, model] = (logits.numpy().copy(), state, shards, list(reads))
        worker.shutdown()
    queue.put((rank, out))


@pytest.mark.slow
def test_dp2_start_up_reads_on_rank0_and_every_rank_computes_todays_logits(tmp_path):
    paths = {
        "tiny": "builtin:tiny",
        "odd": str(write_random_model(tmp_path / "odd", {**UNTIED, "vocab_size": 97}, seed=5)),
    }
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ports = [free_port() for _ in DP2_STARTS]
    procs = [ctx.Process(target=_start_rank, args=(r, paths, ports, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    for role, model in DP2_STARTS:
        plain = _plain(paths[model])
        expected = {k: v.numpy() for k, v in plain.state_dict().items()}
        with torch.no_grad():
            want = hal.packed_forward(plain, *_packed_inputs()).numpy()
        what = f"{role} on {model}"
        # Only rank 0 reads the checkpoint, each stored tensor once (tied weights are one).
        reads = results[0][role, model][3]
        assert len(reads) == len(set(reads)) and results[1][role, model][3] == [], what
        state = results[0][role, model][1]
        if role == "critic":
            assert not state["lm_head.weight"].any() and not state["lm_head.bias"].any()
            assert not any(name.startswith("lm_head.") for name in reads)
            expected = {k: v for k, v in expected.items() if not k.startswith("lm_head.")}
        else:
            assert state.keys() == expected.keys(), what
            for rank in (0, 1):
                logits = results[rank][role, model][0]
                np.testing.assert_array_equal(logits, want, err_msg=f"{what}, rank {rank}")
        for key, value in expected.items():
            np.testing.assert_array_equal(state[key], value, err_msg=f"{what}: {key}")
    # Each rank holds its own rows of a sharded parameter, not the whole.
    embed = "model.embed_tokens.weight"
    assert [results[r]["actor", "tiny"][2][embed] for r in (0, 1)] == [51, 51]
    assert [results[r]["actor", "odd"][2][embed] for r in (0, 1)] == [49, 48]
