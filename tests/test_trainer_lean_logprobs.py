"""Lean log-probs (``train.lean_logprobs``): per-token log-probs and entropies from the final
hidden states through the LM head a chunk at a time give the values and gradients of the
full-logits path, never build a ``[tokens, vocab]`` tensor, and stay right under FSDP2 at
dp 2 (the head and the tied embedding belong to the root's parameter group).

Tolerances (fp32): values within 1e-6 (+1e-6 relative); gradients per element within 1e-6
(+1e-6 relative) for the actor loss, and within 1e-5 of each gradient's size for an O(1)
weighted sum: both paths add the same products in another order (the head's matmul is split
into chunks), which moves float32 sums by a few ulp, never more.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

import hal
from batching import Row, StepBatch, loss_normalizers
from rollout.models import load_model
from trainer.config import load_config
from trainer.loop.cluster.group import free_port
from trainer.loop.ranks.forward import packed_token_logprobs

#: Rows of 1 and 2 tokens between longer ones: row starts inside chunks and at chunk edges.
ROW_LENS = (1, 2, 7, 1, 13, 2, 30, 9)


def _packed(lens=ROW_LENS, vocab=102, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    ids = torch.randint(3, vocab, (int(cu[-1]),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lens])
    return ids, pos, cu


@pytest.fixture(scope="module")
def small():
    hal.register_attention()
    model = load_model("builtin:small", seed=4, attn_implementation=hal.ATTN_IMPLEMENTATION)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the head is tied
    model.train()
    return model


def _rel_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).double().norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_tokens", [5, None])  # several chunks; as many as fit the budget
def test_lean_values_and_gradients_equal_the_full_logits_path(small, temperature, chunk_tokens):
    ids, pos, cu = _packed()
    gen = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(ids.numel(), generator=gen), torch.randn(ids.numel(), generator=gen)
    out = {}
    for lean in (False, True):
        small.zero_grad(set_to_none=True)
        lp, ent = packed_token_logprobs(
            small,
            ids,
            pos,
            cu,
            temperature=temperature,
            lean=lean,
            entropy_grad=True,
            chunk_tokens=chunk_tokens,
        )
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        grads = {n: p.grad.clone() for n, p in small.named_parameters()}
        out[lean] = (lp.detach(), ent.detach(), grads)
    (lp0, ent0, g0), (lp1, ent1, g1) = out[False], out[True]
    starts = cu[:-1].long()
    assert bool((lp1[starts] == 0).all()) and bool((ent1[starts] == 0).all())
    assert bool((lp1[1:] < 0).sum() == ids.numel() - len(ROW_LENS))  # every other token: a log-prob
    torch.testing.assert_close(lp1, lp0, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent1, ent0, atol=1e-6, rtol=1e-6)
    assert g0.keys() == g1.keys() and "model.embed_tokens.weight" in g0  # the tied head's grad
    for name in g0:
        assert _rel_distance(g1[name], g0[name]) <= 1e-5, name
        scale = float(g0[name].abs().max())
        assert float((g1[name] - g0[name]).abs().max()) <= 1e-5 * scale + 1e-7, name


def test_entropy_carries_gradient_only_when_asked(small):
    ids, pos, cu = _packed()
    lp, ent = packed_token_logprobs(small, ids, pos, cu, entropy_grad=False)
    assert lp.requires_grad and not ent.requires_grad
    lp, ent = packed_token_logprobs(small, ids, pos, cu, entropy_grad=True)
    assert ent.requires_grad


def _actor_cfg(*overrides: str):
    return load_config(
        None,
        [
            "device=cpu",
            "rollout.temperature=0.7",
            "algorithm.entropy_coef=0.01",
            "algorithm.clip_ratio_high=0.28",
            "algorithm.use_kl_loss=false",
            *overrides,
        ],
    )


def _batch(vocab: int = 102, seed: int = 0, lens=ROW_LENS) -> StepBatch:
    """Rows of ``lens`` tokens (the last ``n // 2`` of each a response), random ids, old
    log-probs off the policy so that some ratios clip."""
    rnd = random.Random(seed)
    rows = []
    for i, n in enumerate(lens):
        prompt = max(1, n - n // 2) if n > 1 else 1
        resp = [rnd.randrange(3, vocab) for _ in range(max(1, n - prompt))]
        rows.append(
            Row(
                prompt_ids=[rnd.randrange(3, vocab) for _ in range(prompt)],
                response_ids=resp,
                response_mask=[1] * len(resp),
                response_logprobs=[-rnd.random() * 4 for _ in resp],
                uid=i // 2,
                trajectory_id=i,
                step_index=0,
                is_last_step=True,
                score=float(i % 3),
            )
        )
    batch = StepBatch.from_rows(rows)
    batch.set_token_field("old_logprobs", batch.token_fields["rollout_logprobs"])
    gen = torch.Generator().manual_seed(seed)
    batch.set_token_field("advantages", torch.randn(batch.num_tokens, generator=gen))
    return batch


def test_the_actor_loss_and_its_gradients_do_not_depend_on_the_path(small):
    from trainer.loop.ranks.policy import actor_micro_batch_loss

    batch = _batch()
    normalizers = loss_normalizers(batch, list(range(batch.num_rows)))
    out = {}
    for lean in (False, True):
        cfg = _actor_cfg(f"train.lean_logprobs={str(lean).lower()}")
        small.zero_grad(set_to_none=True)
        loss, sums = actor_micro_batch_loss(small, batch, normalizers, cfg, torch.device("cpu"))
        loss.backward()
        out[lean] = (loss.detach(), sums, {n: p.grad.clone() for n, p in small.named_parameters()})
    (loss0, sums0, g0), (loss1, sums1, g1) = out[False], out[True]
    torch.testing.assert_close(loss1, loss0, atol=1e-7, rtol=1e-6)
    for key in ("entropy", "new_logprob", "pg_loss", "clipped"):
        torch.testing.assert_close(sums1[key], sums0[key], atol=1e-6, rtol=1e-6, msg=key)
    assert float(sums0["clipped"]) > 0  # the clipped branch is exercised
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-6, rtol=1e-6, msg=name)
    assert float(g0["model.embed_tokens.weight"].norm()) > 0


class _LargestOutput(TorchDispatchMode):
    """Records the largest number of elements any op (forward or backward) produced."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


#: A model whose [tokens, vocab] logits dwarf its weights and activations, as a real LM's do.
WIDE_VOCAB = {
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 6000,
    "tie_word_embeddings": True,
    "pad_token_id": 3,
    "eos_token_id": 2,
}


def test_no_tokens_by_vocab_tensor_exists_on_the_lean_path(tmp_path):
    from rollout.models import write_random_model

    hal.register_attention()
    model = load_model(
        write_random_model(tmp_path / "wide", WIDE_VOCAB),
        attn_implementation=hal.ATTN_IMPLEMENTATION,
    )
    model.train()
    ids, pos, cu = _packed(vocab=WIDE_VOCAB["vocab_size"])
    full = ids.numel() * WIDE_VOCAB["vocab_size"]
    assert max(p.numel() for p in model.parameters()) < full / 2
    largest = {}
    for lean in (False, True):
        model.zero_grad(set_to_none=True)
        with _LargestOutput() as probe:  # forward and backward
            lp, ent = packed_token_logprobs(
                model, ids, pos, cu, lean=lean, entropy_grad=True, chunk_tokens=8
            )
            (lp.sum() + ent.sum()).backward()
        largest[lean] = probe.largest
    assert largest[False] >= full  # the whole logits (and their gradient)
    # Lean: nothing larger than a weight or one 8-token chunk's logits.
    assert largest[True] <= max(max(p.numel() for p in model.parameters()), 8 * 6000)


def test_a_model_that_rescales_its_logits_is_refused_by_name():
    hal.register_attention()
    model = load_model("builtin:tiny", attn_implementation=hal.ATTN_IMPLEMENTATION)
    model.config.final_logit_softcapping = 30.0
    ids, pos, cu = _packed((3, 4))
    with pytest.raises(ValueError, match="train.lean_logprobs=false"):
        packed_token_logprobs(model, ids, pos, cu)
    lp, _ = packed_token_logprobs(model, ids, pos, cu, lean=False)
    assert lp.shape == ids.shape


# ----------------------------------------------------------------------------- FSDP2, dp 2


def _run_rank(rank: int, world: int, port_by_path: dict, arrays, queue) -> None:
    from trainer.loop.ranks.fsdp_worker import WorkerSpec
    from trainer.loop.ranks.policy import PolicyWorker

    torch.set_num_threads(1)
    results = {}
    for lean, port in port_by_path.items():
        cfg = _actor_cfg(
            f"train.dp_size={world}",
            "model.path=builtin:small",
            "seed=2",
            "train.grad_clip=null",  # clipping would rescale the gradients compared here
            "run.deterministic=false",
            f"train.lean_logprobs={str(lean).lower()}",
        )
        worker = PolicyWorker(WorkerSpec(role="actor", rank=rank, cfg=cfg))
        worker.setup("127.0.0.1", port)
        worker.load_batch([arrays])
        rows = list(range(rank, worker.batch.num_rows, world))  # this rank's share
        micro_batches = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
        logprobs = worker.compute_logprobs(micro_batches)
        report = worker.train_mini_batch(micro_batches, list(range(worker.batch.num_rows)))
        # Whole gradients: every rank takes part in gathering its shards. numpy, not torch:
        # a torch tensor goes through the queue as shared memory that dies with this process.
        grads = {n: p.grad.full_tensor().numpy().copy() for n, p in worker.model.named_parameters()}
        worker.shutdown()
        results[lean] = (logprobs, dict(report.values), grads)
    queue.put((rank, results))


@pytest.mark.slow
def test_fsdp2_at_dp2_gives_the_full_logits_paths_gradients():
    world = 2
    arrays = _batch(lens=(1, 2, 9, 17, 2, 12, 1, 25, 6, 11)).to_numpy()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ports = {False: free_port(), True: free_port()}
    procs = [
        ctx.Process(target=_run_rank, args=(r, world, ports, arrays, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    per_rank = dict(queue.get(timeout=300) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    for rank in range(world):
        (rows0, lp0), m0, g0 = per_rank[rank][False]
        (rows1, lp1), m1, g1 = per_rank[rank][True]
        assert rows0.tolist() == rows1.tolist()
        np.testing.assert_allclose(lp1, lp0, atol=1e-6, rtol=1e-6)
        assert m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-6)
        assert m1["loss"] == pytest.approx(m0["loss"], rel=1e-6, abs=1e-9)
        assert "lm_head.weight" not in g0 and "model.embed_tokens.weight" in g0  # tied head
        for name in g0:
            np.testing.assert_allclose(g1[name], g0[name], atol=1e-6, rtol=1e-6, err_msg=name)
    # Both ranks hold the same reduced gradient (the head's included), and it is not zero.
    for name in per_rank[0][True][2]:
        np.testing.assert_array_equal(per_rank[1][True][2][name], per_rank[0][True][2][name])
    assert float(np.abs(per_rank[0][True][2]["model.embed_tokens.weight"]).max()) > 0
