"""The packed side of ``bench train``: the trainer's own code, driven one micro-batch at a time.

``packed_loss`` is ``trainer.loop.ranks.policy.actor_micro_batch_loss``, the very function
``PolicyWorker.train_mini_batch`` runs for every micro-batch (``hal.packed_forward`` with the
HAL's varlen attention, ``packed_token_logprobs``, ``trainer.algorithms.losses`` with the
job's ``algorithm.*`` settings). The rows are a ``batching.StepBatch`` (``step_batch``), cut into
micro-batches by ``plan_minibatches`` and gathered with ``StepBatch.select``; the loss divides
by ``batching.loss_normalizers``. Old log-probs come from the same forward, as the controller's
prepare phase computes them (``set_old_logprobs``). Left out: the FSDP2 wrapper (dp 1 here;
``bench gpu`` times the whole worker).
"""

from __future__ import annotations

import torch

from batching import LossNormalizers, Row, StepBatch, plan_minibatches
from trainer.loop.ranks.forward import packed_token_logprobs
from trainer.loop.ranks.policy import actor_micro_batch_loss

__all__ = ["default_job", "packed_loss", "plan_micro_batches", "set_old_logprobs", "step_batch"]


def default_job():
    """The CPU default job's config (configs/cpu/tiny.yaml): the loss settings both layouts
    use. Nothing about this machine is checked: the benchmark needs no model path or device."""
    from trainer.config import load_config

    cfg = load_config(None, check_environment=False)
    if cfg.algorithm.use_kl_loss:
        raise ValueError(
            "algorithm.use_kl_loss=true in the default job: the train benchmark has no "
            "reference model; it times the default job's loss, which has no KL term"
        )
    return cfg


def trainer_rows(
    rows: list[dict[str, torch.Tensor]], *, rows_per_group: int = 1, scores=None
) -> list[Row]:
    """``bench.train.make_rows`` rows as the trainer's ``batching.Row``s: the prompt is the
    row's unmasked head, the response (all trained on) the rest, one step per trajectory,
    groups (``uid``) of ``rows_per_group`` consecutive rows, ``scores[i]`` as row i's score
    (0 when not given). The engine's log-probs are a constant: nothing but a logged gap
    reads them."""
    out = []
    for i, r in enumerate(rows):
        ids = r["input_ids"].tolist()
        prompt_tokens = int((r["loss_mask"] == 0).sum())
        response = ids[prompt_tokens:]
        out.append(
            Row(
                prompt_ids=ids[:prompt_tokens],
                response_ids=response,
                response_mask=[1] * len(response),
                response_logprobs=[-1.0] * len(response),
                uid=i // rows_per_group,
                trajectory_id=i,
                step_index=0,
                is_last_step=True,
                score=0.0 if scores is None else float(scores[i]),
            )
        )
    return out


def step_batch(rows: list[dict[str, torch.Tensor]]) -> StepBatch:
    """``rows`` as the trainer holds a step (``trainer_rows``, each row its own group), with
    token field ``advantages``: the row's advantage on its response tokens, 0 on the prompt
    (the layout GRPO's advantages have)."""
    batch = StepBatch.from_rows(trainer_rows(rows))
    per_row = torch.stack([r["advantage"] for r in rows]).float()
    seq_lens = torch.from_numpy(batch.seq_lens)
    batch.set_token_field("advantages", per_row.repeat_interleave(seq_lens) * batch.loss_mask)
    return batch


def plan_micro_batches(batch: StepBatch, budget_tokens: int) -> tuple[list[int], list[list[int]]]:
    """The planner's dp-1 plan of the whole batch as one mini-batch: its row indices and its
    micro-batches (lists of row indices, at most ``budget_tokens`` tokens each unless a row
    alone is longer). At dp 1 the plan has no padding row."""
    plan = plan_minibatches(
        batch.row_fields["trajectory_id"].numpy(),
        batch.seq_lens,
        mini_batch_size=batch.num_rows,
        dp_size=1,
        max_tokens_per_micro_batch=budget_tokens,
    )
    (mini,) = plan.mini_batches
    return mini.rows.tolist(), [list(members) for members in mini.micro_batches[0]]


@torch.no_grad()
def set_old_logprobs(model, batch: StepBatch, micro_batches: list[list[int]], cfg) -> None:
    """Fill ``batch``'s ``old_logprobs`` token field with ``model``'s log-probs, one packed
    micro-batch at a time, as the controller's prepare phase does
    (``PolicyWorker.compute_logprobs``)."""
    device = next(model.parameters()).device
    old = torch.zeros(batch.num_tokens, dtype=torch.float32)
    starts = batch.cu_seqlens
    for rows in micro_batches:
        mb = batch.select(rows)
        cu = mb.cu_seqlens.to(device)
        ids = mb.input_ids.to(device)
        values, _ = packed_token_logprobs(
            model,
            ids,
            mb.position_ids.to(device),
            cu,
            temperature=cfg.rollout.temperature,
            lean=cfg.train.lean_logprobs,
        )
        values = values.cpu()
        for j, r in enumerate(rows):
            lo, hi = int(mb.cu_seqlens[j]), int(mb.cu_seqlens[j + 1])
            old[int(starts[r]) : int(starts[r]) + hi - lo] = values[lo:hi]
    batch.set_token_field("old_logprobs", old)


def packed_loss(
    model, mb: StepBatch, normalizers: LossNormalizers, cfg
) -> tuple[torch.Tensor, torch.Tensor]:
    """This packed micro-batch's share of the mini-batch actor loss (scalar) and the sum of its
    new log-probs over loss tokens: ``trainer.loop.ranks.policy.actor_micro_batch_loss``, the
    function ``PolicyWorker.train_mini_batch`` runs per micro-batch, with ``cfg``'s settings."""
    device = next(model.parameters()).device
    loss, sums = actor_micro_batch_loss(model, mb, normalizers, cfg, device)
    return loss, sums["new_logprob"]
