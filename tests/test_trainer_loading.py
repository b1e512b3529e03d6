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
from trainer.workers.critic import CriticWorker
from trainer.workers.fsdp_worker import WorkerSpec
from trainer.workers.group import free_port
from trainer.workers.policy import PolicyWorker

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


# ---- dp=2: two spawned ranks over gloo -------------------------------------------------------


def _start_rank(rank: int, ports: list[int], queue) -> None:
    """Set up actor, reference and critic at dp=2 on this rank; report what each holds."""
    import rollout.models

    torch.set_num_threads(1)
    reads = []
    real_load = rollout.models.load_model

    def counting_load(*args, **kwargs):
        reads.append(args[0])
        return real_load(*args, **kwargs)

    rollout.models.load_model = counting_load
    out = {}
    for role, port in zip(("actor", "reference", "critic"), ports, strict=True):
        worker = _worker(role, "builtin:tiny", rank, 2)
        worker.setup("127.0.0.1", port)
        shards = {n: p.to_local().numel() for n, p in worker.model.named_parameters()}
        with torch.no_grad():
            logits = hal.packed_forward(worker.model, *_packed_inputs())
        state = {k: v.numpy().copy() for k, v in worker.full_state_dict().items()}
        out[role] = (logits.numpy().copy(), state, shards)
        worker.shutdown()
    queue.put((rank, out, list(reads)))


@pytest.mark.slow
def test_dp2_start_up_loads_on_rank0_and_every_rank_computes_todays_logits():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ports = [free_port() for _ in range(3)]
    procs = [ctx.Process(target=_start_rank, args=(r, ports, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, out, reads = queue.get(timeout=300)
        results[rank] = (out, reads)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    # Only rank 0 reads the checkpoint, once per role: one full copy in host memory.
    assert results[0][1] == ["builtin:tiny"] * 3
    assert results[1][1] == []
    plain = _plain("builtin:tiny")
    expected = {k: v.numpy() for k, v in plain.state_dict().items()}
    with torch.no_grad():
        want = hal.packed_forward(plain, *_packed_inputs()).numpy()
    for role in ("actor", "reference"):
        for rank in (0, 1):
            logits, _, shards = results[rank][0][role]
            np.testing.assert_array_equal(logits, want, err_msg=f"{role} rank {rank}")
        state = results[0][0][role][1]
        assert state.keys() == expected.keys()
        for key, value in expected.items():
            np.testing.assert_array_equal(state[key], value, err_msg=f"{role} {key}")
    # Each rank holds half of a sharded parameter, not the whole.
    embed = "model.embed_tokens.weight"
    assert [results[r][0]["actor"][2][embed] for r in (0, 1)] == [51 * 64, 51 * 64]
    critic = results[0][0]["critic"][1]
    assert not critic["lm_head.weight"].any()
    for key in expected:
        if not key.startswith("lm_head."):
            np.testing.assert_array_equal(critic[key], expected[key], err_msg=f"critic {key}")
