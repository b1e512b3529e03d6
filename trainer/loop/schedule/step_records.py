"""The step's records: what the ranks report once they have trained (``end_of_step``), the
metrics line (``step_metrics``), the parity fingerprint (``step_fingerprint``) and a staged
checkpoint (``stage_checkpoint``).

``job`` is the controller's ``Trainer``: its ``cfg``, role groups, ``limits``, ``pipeline``
(None when each step samples its own rollout), ``rollout`` (the rollout host) and the step's
rollout metadata (``last_rollout``) are read here.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from batching import plan_stats
from trainer.loop.cluster.group import PendingCalls, wait_all
from trainer.loop.schedule.health import check_finite_weights

if TYPE_CHECKING:
    from trainer.loop.schedule.backlog import PendingCheckpoint
    from trainer.loop.schedule.phase_memory import PhaseMemory
    from trainer.records.timings import StepTimer

__all__ = ["end_of_step", "stage_checkpoint", "step_fingerprint", "step_metrics"]


def end_of_step(job, step: int, plan) -> dict[str, Any]:
    """After the update, in one wait: the ranks offload and the step's records are read:
    ``memory`` (``memory/<role>_peak_gb``, the largest rank's peak per role), ``counts``
    (rows and loss tokens per mini-batch, for the fingerprint) and ``checksum`` (the parity
    checksum of the weights, or None when ``run.fingerprint_every`` skips this step)."""
    from trainer.records.fingerprint import combine_param_stats

    every = job.cfg.run.fingerprint_every
    checksum = bool(every) and step % every == 0
    # One call per rank (``FSDPWorker.end_of_step``): offload, peak memory, then the
    # actor's records: rank 0 counts the mini-batches, every rank its checksum share.
    rows = [mb.rows.tolist() for mb in plan.mini_batches]
    calls = PendingCalls()
    ends = {}
    for group in job.all_groups():
        asks: list[list] = [[] for _ in group.handles]
        if group is job.actor:
            asks[0].append(("mini_batch_counts", (rows,)))
            if checksum:
                for ask in asks:
                    ask.append(("param_stats", ()))
        ends[group.role] = calls.submit(group, "end_of_step", per_rank=asks)
    results = calls.wait(job.limits.setup_s)
    ends = {role: [results[r] for r in refs] for role, refs in ends.items()}
    actor = ends[job.actor.role]
    memory = {
        f"memory/{role}_peak_gb": max(rank[0] for rank in answers) for role, answers in ends.items()
    }
    if len(actor) > 1:  # rank 0 holds what no other rank does (unsharded tensors, stores)
        memory["memory/actor_rank0_peak_gb"] = actor[0][0]
        memory["memory/actor_others_peak_gb"] = max(rank[0] for rank in actor[1:])
    return {
        "memory": memory,
        "counts": actor[0][1],
        # Each rank sums its own shards (no collective); the ranks' shares add up here.
        "checksum": combine_param_stats([rank[-1] for rank in actor]) if checksum else None,
    }


def step_metrics(
    step: int,
    meta: dict[str, Any],
    plan,
    stats: dict,
    adv_metrics: dict[str, float],
    timer: StepTimer,
    records: dict[str, Any],
    phase_memory: PhaseMemory | None,
) -> dict[str, Any]:
    """The step's metrics line: the rollout's (``meta``), the plan's, the advantages' and
    each role's update statistics (``stats``), the sections' seconds (``timer``), tokens per
    second over the whole step, each role's peak memory in GB (``records``) and each phase's
    device-wide peak (``phase_memory``, where the HAL reads it)."""
    metrics: dict[str, Any] = {
        "step": step,
        **meta["metrics"],
        **plan_stats(plan),
        "batch/max_seq_len": int(np.max(meta["seq_lens"])),
        **adv_metrics,
    }
    for role_stats in stats.values():
        metrics.update(role_stats.metrics())
    metrics.update(timer.metrics())
    metrics["throughput/tokens_per_s"] = meta["num_tokens"] / max(metrics["timing/step_s"], 1e-9)
    metrics.update(records["memory"])
    if phase_memory is not None:  # each phase's device-wide peak, where it is read
        metrics.update(phase_memory.metrics())
    return metrics


def step_fingerprint(step, plan, stats, metrics, records) -> dict[str, Any]:
    """The step's parity fingerprint (``trainer.records.fingerprint.fingerprint_of_step``)."""
    from trainer.records.fingerprint import fingerprint_of_step

    fields = {k: v for role_stats in stats.values() for k, v in role_stats.fingerprint().items()}
    return fingerprint_of_step(plan, fields, metrics, records["checksum"], records["counts"])


def stage_checkpoint(job, step: int) -> PendingCheckpoint:
    """Stage a whole checkpoint of step ``step`` (``trainer.records.checkpoint.save``),
    never of non-finite weights; ``PendingCheckpoint.commit`` makes it ``latest``. A
    lagged run's checkpoint keeps the rollouts of the next ``train.rollout_lag`` steps,
    sampled by older weights, taken as references (``RolloutPipeline.ahead``)."""
    from trainer.loop.schedule.backlog import PendingCheckpoint
    from trainer.records.checkpoint.save import stage_step

    # never commit non-finite weights over good checkpoints
    for group in job.training_groups():
        check_finite_weights(group.role, group.call("weights_finite"), step)
    ahead: dict[int, Any] = {}
    if job.pipeline is not None:  # the host is sampling later steps already
        consumed = job.last_rollout.get("prompts_consumed", step * job.cfg.train.batch_size)
        ahead = job.pipeline.ahead(step)
    else:
        (consumed,) = wait_all(
            [job.rollout.get_prompts_consumed.remote()],
            ["rollout host"],
            timeout_s=job.limits.setup_s,
            what="rollout.get_prompts_consumed",
        )
    state = {"rollout_lag": job.cfg.train.rollout_lag}  # a resume checks it
    if job.cfg.model.lora.enabled:  # the adapters, and the base they fit (resume checks)
        state["lora"] = job.lora_state
    started = time.monotonic()
    staged = stage_step(
        job.run_dir,
        step,
        job.training_groups(),
        consumed,
        state,
        timeout_s=job.limits.checkpoint_save_s,
    )
    job.limits.observe("checkpoint_save", time.monotonic() - started)  # later saves' limit
    return PendingCheckpoint(staged, ahead)
