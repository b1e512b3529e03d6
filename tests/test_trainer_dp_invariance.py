"""The same recorded mini-batch gives the same update for any dp size, micro-batch budget or
padding: the property that lets an 8-GPU and a 16-NPU node reproduce each other.

Each layout runs the real ``PolicyWorker`` (FSDP2 over gloo) in spawned processes, one per
rank, on a fixed synthetic batch of the tiny model, once per ``loss_agg`` mode, and returns
the parameters after one optimizer step.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from batching import LOSS_AGG_MODES, Row, StepBatch, plan_minibatches
from trainer.loop.cluster.group import free_port

MODEL = "builtin:tiny"
#: The job each layout trains: the default CPU job's tiny model with a loss that exercises
#: clipping (clip-higher) and the entropy bonus, no KL.
JOB = [
    "device=cpu",
    f"model.path={MODEL}",
    "seed=1",
    "train.lr=1e-3",
    "train.grad_clip=null",
    "train.param_dtype=float32",
    "algorithm.clip_ratio_low=0.2",
    "algorithm.clip_ratio_high=0.28",
    "algorithm.clip_ratio_c=3.0",
    "algorithm.kl_coef=0.0",
    "algorithm.use_kl_loss=false",
    "algorithm.entropy_coef=0.01",
    "algorithm.loss_agg_horizon=16",
    "run.deterministic=false",
]


def _recorded_batch() -> StepBatch:
    """A multi-turn GRPO batch: 3 prompts x 4 samples, 1-3 steps each, random tokens."""
    rnd = random.Random(5)
    rows = []
    for uid in range(3):
        for sample in range(4):
            traj = uid * 4 + sample
            turns = rnd.randint(1, 3)
            score = rnd.random()
            for step in range(turns):
                prompt = [rnd.randrange(3, 90) for _ in range(rnd.randint(3, 12))]
                resp = [rnd.randrange(3, 90) for _ in range(rnd.randint(2, 9))]
                mask = [1] * len(resp)
                mask[-1] = rnd.choice([0, 1])
                rows.append(
                    Row(
                        prompt_ids=prompt,
                        response_ids=resp,
                        response_mask=mask,
                        response_logprobs=[-rnd.random() * 3 * m for m in mask],
                        uid=uid,
                        trajectory_id=traj,
                        step_index=step,
                        is_last_step=step == turns - 1,
                        score=score,
                    )
                )
    batch = StepBatch.from_rows(rows)
    # Old logprobs a little off the current policy, so some ratios clip.
    gen = torch.Generator().manual_seed(3)
    old = batch.token_fields["rollout_logprobs"] + 0.3 * torch.randn(
        batch.num_tokens, generator=gen
    )
    batch.set_token_field("old_logprobs", old * batch.loss_mask)
    return batch


def _run_rank(rank: int, world: int, ports: list[int], budget, pad: bool, arrays, queue) -> None:
    from trainer.config import load_config
    from trainer.loop.ranks.fsdp_worker import WorkerSpec
    from trainer.loop.ranks.policy import PolicyWorker

    torch.set_num_threads(1)
    batch = StepBatch.from_numpy(arrays)
    plan = plan_minibatches(
        batch.row_fields["trajectory_id"].numpy(),
        batch.seq_lens,
        mini_batch_size=3,
        dp_size=world,
        max_tokens_per_micro_batch=budget,
        group_ids=batch.row_fields["uid"].numpy(),
    )
    (mini,) = plan.mini_batches
    micro_batches = mini.micro_batches[rank]
    if pad:  # a padding row in every micro-batch, and a micro-batch of padding alone
        micro_batches = [mb + [-1] for mb in micro_batches] + [[-1]]
    results = {}
    for i, mode in enumerate(LOSS_AGG_MODES):
        cfg = load_config(None, [*JOB, f"train.dp_size={world}", f"algorithm.loss_agg={mode}"])
        worker = PolicyWorker(WorkerSpec(role="actor", rank=rank, cfg=cfg))
        worker.setup("127.0.0.1", ports[i])
        worker.load_batch([arrays])
        worker.compute_advantages()
        report = worker.train_mini_batch(micro_batches, mini.rows.tolist())
        metrics = {**report.values, "loss_tokens": report.loss_tokens}
        state = {k: v.numpy().copy() for k, v in worker.full_state_dict().items()}
        worker.shutdown()
        results[mode] = (state, metrics)
    queue.put((rank, results))


def _train(world: int, budget, pad: bool = False) -> dict:
    arrays = _recorded_batch().to_numpy()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ports = [free_port() for _ in LOSS_AGG_MODES]
    procs = [
        ctx.Process(target=_run_rank, args=(r, world, ports, budget, pad, arrays, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    per_rank = dict(queue.get(timeout=300) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    # Rank 0's parameters (all ranks hold the same full state); loss shares add over ranks.
    out = {}
    for mode, (state, metrics) in per_rank[0].items():
        metrics = dict(metrics, loss=sum(per_rank[r][mode][1]["loss"] for r in range(world)))
        out[mode] = (state, metrics)
    return out


@pytest.fixture(scope="module")
def layouts():
    return {
        "dp1": _train(1, None),
        "dp2": _train(2, None),
        "dp2_budget64": _train(2, 64),
        "dp1_padded": _train(1, None, pad=True),
    }


def _assert_same_params(a: dict, b: dict, rtol: float = 1e-5) -> None:
    """Relative L2 distance of the whole parameter vectors.

    Not per element: a parameter whose true gradient is 0 (a key-projection bias: softmax
    ignores a shift shared by all keys) gets float noise as gradient, which Adam's first
    step scales to +-lr whatever its size.
    """
    assert a.keys() == b.keys()
    va = np.concatenate([a[k].ravel().astype(np.float64) for k in sorted(a)])
    vb = np.concatenate([b[k].ravel().astype(np.float64) for k in sorted(b)])
    rel = np.linalg.norm(va - vb) / np.linalg.norm(va)
    assert rel <= rtol, f"relative parameter distance {rel:.3g} > {rtol}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_update_independent_of_dp_and_micro_batches(layouts, mode):
    base_state, base_metrics = layouts["dp1"][mode]
    for name in ("dp2", "dp2_budget64"):
        state, metrics = layouts[name][mode]
        _assert_same_params(base_state, state)
        # The gradient itself (before Adam's per-element normalisation) and the loss agree.
        assert metrics["grad_norm"] == pytest.approx(base_metrics["grad_norm"], rel=1e-5)
        assert metrics["loss"] == pytest.approx(base_metrics["loss"], rel=1e-5, abs=1e-9)
    # The step really moved the weights (otherwise equality would prove nothing).
    from rollout.models import load_model

    initial = load_model(MODEL, dtype="float32", seed=1).state_dict()
    moved = max(float(np.abs(base_state[k] - initial[k].numpy()).max()) for k in base_state)
    assert moved > 1e-4  # lr 1e-3: Adam's first step moves ~lr


@pytest.mark.slow
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_padding_rows_change_nothing(layouts, mode):
    base_state, base_metrics = layouts["dp1"][mode]
    state, metrics = layouts["dp1_padded"][mode]
    _assert_same_params(base_state, state, rtol=1e-6)
    # Every metric sum (loss, clip fraction, KL, entropy, token counts) is unchanged.
    for key, value in base_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_padding_rows_do_not_move_accuracy_metrics():
    from batching import response_length_mean, trajectory_score_mean

    batch = _recorded_batch()
    padded = batch.select(list(range(batch.num_rows)) + [-1, -1, -1])
    assert padded.num_rows == batch.num_rows + 3
    assert trajectory_score_mean(padded) == trajectory_score_mean(batch)
    assert response_length_mean(padded) == response_length_mean(batch)


@pytest.mark.slow
def test_loss_modes_differ(layouts):
    """Sanity: the four aggregation modes are really different losses on this batch."""
    states = [
        layouts["dp1"][m][0][
            "lm_head.weight"
            if "lm_head.weight" in layouts["dp1"][m][0]
            else "model.embed_tokens.weight"
        ]
        for m in LOSS_AGG_MODES
    ]
    assert not np.allclose(states[0], states[1])
