"""The step's training half, between its rollout and the hand-over of the devices:

    plan_step -> prepare (old / reference log-probs, values, advantages) -> update

``plan_step`` is the mini-batch plan (``batching.plan_minibatches``), the same on every rank;
``prepare`` and ``update`` submit every rank's calls as one chain per worker
(``PendingCalls``) and wait once. ``job`` is the controller's ``Trainer``: its ``cfg``,
``actor`` / ``ref`` / ``critic`` groups, ``limits``, ``nonfinite`` streak and the step's
rollout metadata (``last_rollout``) are read here.
"""

from __future__ import annotations

from typing import Any

from batching import plan_minibatches
from trainer.config import Config
from trainer.loop.cluster.group import PendingCalls
from trainer.loop.ranks.step_stats import StepStats
from trainer.loop.schedule.health import check_finite_weights

__all__ = ["old_from_update", "plan_step", "prepare", "update"]


def plan_step(cfg: Config, meta: dict[str, Any]):
    """The mini-batch plan of a rollout's rows (``meta``: its metadata): whole groups per
    mini-batch (``train.mini_batch_size`` groups), balanced ranks, the same on every rank."""
    train = cfg.train
    return plan_minibatches(
        meta["trajectory_ids"],
        meta["seq_lens"],
        mini_batch_size=train.mini_batch_size,
        dp_size=train.dp_size,
        max_tokens_per_micro_batch=train.max_tokens_per_micro_batch,
        group_ids=meta["group_ids"],
    )


def old_from_update(cfg: Config) -> bool:
    """Whether the step's first mini-batch takes its old log-probs from its own update
    (``train.old_logprobs_from_update``): not when something reads them before the update
    (``algorithm.rollout_correction``, a KL reward penalty), nor under a rollout lag, where
    the update's weights are not those that sampled (the recomputed old log-probs are the
    proximal policy of decoupled PPO)."""
    algo = cfg.algorithm
    kl_penalty = algo.kl_coef > 0 and not algo.use_kl_loss
    return (
        cfg.train.old_logprobs_from_update
        and not cfg.train.rollout_lag
        and algo.rollout_correction == "none"
        and not kl_penalty
    )


def rank_micro_batches(dp_size: int, minis) -> list[list[list[int]]]:
    """Per rank (of ``dp_size``), its micro-batches of the mini-batches ``minis``, in order."""
    return [[mb for mini in minis for mb in mini.micro_batches[r]] for r in range(dp_size)]


def busiest_rank_tokens(job, plan) -> int:
    """Tokens of the step's rows on the rank that holds the most (an update's limit)."""
    lens = job.last_rollout["seq_lens"]
    ranks = rank_micro_batches(job.cfg.train.dp_size, plan.mini_batches)
    return max(sum(int(lens[i]) for mb in mbs for i in mb) for mbs in ranks)


def prepare(job, plan, batch_ref: list) -> dict[str, float]:
    """Old / reference logprobs and values on every rank's rows, then advantages; returns
    the advantages' metrics. Submitted as one chain per worker (``PendingCalls``) and waited
    for once. With ``old_from_update`` the first mini-batch's old log-probs come with its
    update."""
    dp = job.cfg.train.dp_size
    # every micro-batch of each rank across all mini-batches: the no-grad passes
    rank_mbs = rank_micro_batches(dp, plan.mini_batches)
    from_update = old_from_update(job.cfg)
    old_mbs = rank_micro_batches(dp, plan.mini_batches[1:]) if from_update else rank_mbs
    calls = PendingCalls()
    for group in job.all_groups():
        calls.submit(group, "load_batch", batch_ref)
    pieces = {"old_logprobs": calls.submit(job.actor, "compute_logprobs", per_rank=old_mbs)}
    if job.ref is not None:
        pieces["ref_logprobs"] = calls.submit(job.ref, "compute_logprobs", per_rank=rank_mbs)
    elif job.cfg.algorithm.kl_coef > 0:  # LoRA: the actor with its adapters off
        pieces["ref_logprobs"] = calls.submit(job.actor, "compute_ref_logprobs", per_rank=rank_mbs)
    if job.critic is not None:
        pieces["values"] = calls.submit(job.critic, "compute_values", per_rank=rank_mbs)
    # every training worker gets the full token fields computed piecewise by the ranks
    for field, piece_refs in pieces.items():
        for group in job.training_groups():
            calls.submit(group, "set_token_field", field, piece_refs)
    advantages = [
        calls.submit(g, "compute_advantages", not from_update) for g in job.training_groups()
    ]
    results = calls.wait(job.limits.update_s(busiest_rank_tokens(job, plan)))
    return results[advantages[0][0]]


def update(job, plan, step: int) -> tuple[dict[str, StepStats], dict[str, float]]:
    """``train.ppo_epochs`` passes over the plan's mini-batches, one optimizer step each, all
    submitted at once (each worker runs them in order); then a stop if any weights are
    non-finite. Returns each training role's statistics of the whole step, and the
    engine-vs-trainer metrics when the old log-probs were completed by the update."""
    groups = job.training_groups()
    from_update = old_from_update(job.cfg)
    calls = PendingCalls()
    steps = []  # (role, refs of one mini-batch), in order
    for epoch in range(job.cfg.train.ppo_epochs):
        for m, mini in enumerate(plan.mini_batches):
            rows, per_rank = mini.rows.tolist(), list(mini.micro_batches)
            for g in groups:
                first = from_update and g is job.actor and epoch == 0 and m == 0
                args = (rows, True) if first else (rows,)
                refs = calls.submit(g, "train_mini_batch", *args, per_rank=per_rank)
                steps.append((g.role, refs))
    finite = [(g.role, calls.submit(g, "weights_finite")) for g in groups]
    mismatch = []
    if from_update:
        rank_mbs = rank_micro_batches(job.cfg.train.dp_size, plan.mini_batches)
        mismatch = calls.submit(job.actor, "rollout_mismatch_sums", per_rank=rank_mbs)
    results = calls.wait(job.limits.update_s(busiest_rank_tokens(job, plan)))
    totals = {g.role: StepStats(g.role) for g in groups}
    for role, refs in steps:
        reports = [results[r] for r in refs]
        totals[role].add_update(reports)
        job.nonfinite.observe(role, reports[0], step)
    # Stop before non-finite weights reach the rollout engine or a checkpoint.
    for role, refs in finite:
        check_finite_weights(role, [results[r] for r in refs], step)
    if not mismatch:
        return totals, {}
    from trainer.algorithms.rollout_correction import mismatch_from_sums

    return totals, mismatch_from_sums([results[r] for r in mismatch])
