"""Optimizer and learning-rate schedule, counted in optimizer steps."""

from __future__ import annotations

import math

import torch


def lr_factor(
    step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float
) -> float:
    """Multiplier of the base LR at optimizer step ``step`` (0-based).

    Linear warm-up over ``warmup_steps`` optimizer steps, then constant or cosine decay to
    ``min_lr_ratio`` at ``total_steps`` optimizer steps.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"lr_schedule={schedule!r}: allowed are 'constant' and 'cosine'")
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    params,
    *,
    lr: float,
    weight_decay: float,
    warmup_steps: int,
    total_steps: int,
    schedule: str,
    min_lr_ratio: float,
    options: dict[str, bool] | None = None,
):
    """AdamW with a ``LambdaLR`` over :func:`lr_factor`; returns ``(optimizer, scheduler)``.
    ``options``: its kernel (``hal.kernels.KernelSet.optimizer_options``: ``fused`` or, the
    reference, ``foreach``)."""
    kernel = options or {"foreach": True}
    optimizer = torch.optim.AdamW(
        params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999), eps=1e-8, **kernel
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(
            s,
            warmup_steps=warmup_steps,
            total_steps=total_steps,
            schedule=schedule,
            min_lr_ratio=min_lr_ratio,
        ),
    )
    return optimizer, scheduler


def reapply_hyperparameters(optimizer, scheduler, *, lr: float, weight_decay: float) -> None:
    """After loading a checkpoint's optimizer and scheduler state: the job's own base LR and
    weight decay instead of the checkpoint's (a run resumed with a changed ``train.lr`` or
    ``train.weight_decay`` trains with it), the schedule's position (its optimizer-step count)
    and the optimizer's moments kept."""
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    rates = [lr * fn(scheduler.last_epoch) for fn in scheduler.lr_lambdas]
    for group, rate in zip(optimizer.param_groups, rates):
        group["initial_lr"] = lr
        group["lr"] = rate
        group["weight_decay"] = weight_decay
    scheduler._last_lr = rates
