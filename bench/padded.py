"""The padded baseline of ``bench train``: the layout trainers use without remove-padding.

Rows in arrival order, a fixed number per micro-batch, right-padded to the micro-batch's
longest row (``[B, S]``), the model run with transformers' ``sdpa`` attention and an attention
mask. This is the baseline's own code: its forward, its log-probs and entropies read off the
``[B, S, V]`` logits, its own count of the loss normalizers. Only the per-token PPO terms and
their aggregation are the trainer's (``trainer.algorithms.losses``), so both layouts of the benchmark
optimise the same objective and their losses and gradients can be compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batching import LossNormalizers, StepBatch
from trainer.algorithms.losses import actor_loss, masked_sums

__all__ = [
    "PADDED_ROWS_PER_MICRO_BATCH",
    "PaddedMicroBatch",
    "padded_loss",
    "padded_micro_batches",
    "padded_normalizers",
]

#: Rows per padded micro-batch (verl's ``ppo_micro_batch_size_per_gpu`` in its examples: 2-16).
PADDED_ROWS_PER_MICRO_BATCH = 8


@dataclass
class PaddedMicroBatch:
    """One padded micro-batch: every field ``[B, S]``; ``attention_mask`` 1 on real tokens;
    ``loss_mask``, ``advantages`` and ``old_logprobs`` 0 on padding. Position ids are
    0..S-1 (right padding)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor


def padded_micro_batches(
    batch: StepBatch,
    rows_per_micro_batch: int = PADDED_ROWS_PER_MICRO_BATCH,
    pad_token_id: int = 0,
) -> list[PaddedMicroBatch]:
    """The remove-padding-off layout of ``batch``'s rows: in arrival order,
    ``rows_per_micro_batch`` per micro-batch, right-padded to that micro-batch's longest row.
    Token fields ``advantages`` and ``old_logprobs`` are carried over when present."""
    cu = batch.cu_seqlens.tolist()
    fields = batch.token_fields
    zeros = torch.zeros(batch.num_tokens, dtype=torch.float32)
    out = []
    for start in range(0, batch.num_rows, rows_per_micro_batch):
        picked = range(start, min(start + rows_per_micro_batch, batch.num_rows))
        width = max(cu[r + 1] - cu[r] for r in picked)
        shape = (len(picked), width)
        ids = torch.full(shape, pad_token_id, dtype=torch.int64)
        attn = torch.zeros(shape, dtype=torch.int64)
        floats = {name: torch.zeros(shape) for name in ("loss_mask", "advantages", "old_logprobs")}
        for b, r in enumerate(picked):
            lo, hi = cu[r], cu[r + 1]
            ids[b, : hi - lo] = fields["input_ids"][lo:hi]
            attn[b, : hi - lo] = 1
            for name, value in floats.items():
                value[b, : hi - lo] = fields.get(name, zeros)[lo:hi]
        out.append(PaddedMicroBatch(input_ids=ids, attention_mask=attn, **floats))
    return out


def padded_normalizers(micro_batches: list[PaddedMicroBatch]) -> LossNormalizers:
    """The baseline's own count of the mini-batch's global loss counts (every row real, its
    own trajectory)."""
    rows = sum(int(mb.input_ids.shape[0]) for mb in micro_batches)
    loss_tokens = sum(int(mb.loss_mask.sum()) for mb in micro_batches)
    tokens = sum(int(mb.attention_mask.sum()) for mb in micro_batches)
    return LossNormalizers(
        num_rows=rows, num_loss_tokens=loss_tokens, num_trajectories=rows, num_tokens=tokens
    )


def _from_previous(values: torch.Tensor) -> torch.Tensor:
    """``[B, S-1]`` values computed at positions 0..S-2, placed at the positions they predict
    (1..S-1) of a ``[B, S]`` tensor; 0 at position 0."""
    return torch.cat([values.new_zeros(values.shape[0], 1), values], dim=1)


def padded_loss(
    model, mb: PaddedMicroBatch, normalizers: LossNormalizers, cfg
) -> tuple[torch.Tensor, torch.Tensor]:
    """This padded micro-batch's share of the mini-batch actor loss (scalar) and the sum of its
    new log-probs over loss tokens: the baseline's forward and log-probs over ``[B, S]``, then
    the trainer's per-token PPO terms and aggregation over the ``B * S`` tokens (padding has
    loss mask 0)."""
    algo, temperature = cfg.algorithm, cfg.rollout.temperature
    device = next(model.parameters()).device
    ids = mb.input_ids.to(device)
    logits = model(
        input_ids=ids, attention_mask=mb.attention_mask.to(device), use_cache=False
    ).logits.float()
    # log pi(token t | tokens < t) from the logits at t - 1; 0 at t = 0 (a prompt token).
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    logprobs = _from_previous(logp.gather(-1, ids[:, 1:, None]).squeeze(-1))
    # Entropy of the distribution that predicted each token, logged as the trainer logs it.
    source = logits if algo.entropy_coef else logits.detach()
    lp_all = torch.log_softmax(source[:, :-1] / temperature, dim=-1)
    entropy = _from_previous(-(lp_all.exp() * lp_all).sum(-1))
    batch, width = ids.shape
    mask = mb.loss_mask.to(device).reshape(-1)
    cu = torch.arange(0, (batch + 1) * width, width, device=device)
    loss, terms = actor_loss(
        logprobs.reshape(-1),
        mb.old_logprobs.to(device).reshape(-1),
        mb.advantages.to(device).reshape(-1),
        mask,
        cu,
        normalizers,
        cfg,
        entropy=entropy.reshape(-1),
    )
    masked_sums(terms, mask)
    return loss, logprobs.detach().reshape(-1)[mask > 0].double().sum()
