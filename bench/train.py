"""Actor-update throughput: the trainer's packed path versus ``[batch, max_len]`` padded
micro-batches.

    python -m bench train [--quick]

One update = forward + backward over every micro-batch of one mini-batch, gradient clipping,
then one AdamW step (``trainer.loop.ranks.optim.build_optimizer``), fp32 on the HAL's device (a CPU
here), with the CPU default job's actor loss (configs/cpu/tiny.yaml: clipped PPO surrogate,
token-mean). The same rows (log-normal lengths, clipped to 16-1024 tokens) laid out two ways:

- ``packed`` (``bench.packed``): the trainer's own code. ``StepBatch`` rows, planner
  micro-batches under 2048 tokens (the default job's budget), ``batching.loss_normalizers``,
  and per micro-batch the calls ``PolicyWorker.train_mini_batch`` makes (``hal.packed_forward``
  with the varlen attention, ``packed_token_logprobs``, ``trainer.algorithms.losses``). No token is padding.
- ``padded`` (``bench.padded``): the baseline's own code, the layout without remove-padding:
  8 rows per micro-batch, right-padded, ``sdpa`` attention with a mask; the same per-token loss.

Both start every repeat from identical weights, so losses, mean log-probs (every repeat) and
gradients (first repeat) must agree to float rounding; the benchmark checks and reports them.
The two layouts' micro-batches run interleaved (each timed on its own), so a burst of load on a
shared machine hits both alike; the figure that counts is the median of the per-repeat time
ratios. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import hal
from batching import LossNormalizers, loss_normalizers
from bench.packed import default_job, packed_loss, plan_micro_batches, set_old_logprobs, step_batch
from bench.padded import (
    PADDED_ROWS_PER_MICRO_BATCH,
    padded_loss,
    padded_micro_batches,
    padded_normalizers,
)
from bench.train_table import format_table

__all__ = [
    "LOSS_TOLERANCE",
    "TARGET_SPEEDUP",
    "compare",
    "format_table",
    "make_rows",
    "run",
]

#: Packed throughput the issue asks for, as a multiple of the padded throughput.
TARGET_SPEEDUP = 1.5
#: Largest allowed |packed - padded| of the mini-batch loss and of the mean log-prob over loss
#: tokens, on the same weights (fp32).
LOSS_TOLERANCE = 1e-5
#: Micro-batch token budget of the packed layout: the default job's
#: ``train.max_tokens_per_micro_batch`` (configs/cpu/tiny.yaml).
PACKED_BUDGET_TOKENS = 2048
#: torch intra-op threads while timing on a CPU. One: on a small machine shared with other jobs,
#: two OpenMP threads spin at every barrier whenever the other one is descheduled, and a 0.2 s
#: update took 8 s (measured here, CPU time = wall time); one thread degrades only in proportion.
CPU_THREADS = 1
#: First ids of the builtin vocabulary are special (pad=3, eos=2); random text avoids them.
_FIRST_TEXT_ID = 4

# (model, rows, repeats) per mode. Sized so --quick stays under about a minute on 2 cores.
_PLANS = {
    True: (("builtin:tiny", 64, 5), ("builtin:small", 16, 3)),
    False: (("builtin:tiny", 256, 7), ("builtin:small", 64, 5)),
}


def make_rows(
    num_rows: int,
    *,
    vocab_size: int,
    seed: int = 0,
    median_tokens: float = 96.0,
    sigma: float = 1.0,
    min_tokens: int = 16,
    max_tokens: int = 1024,
) -> list[dict[str, torch.Tensor]]:
    """``num_rows`` synthetic rows with log-normal lengths (tokens) clipped to
    ``[min_tokens, max_tokens]``: each a dict of ``input_ids`` ``[L]``, ``loss_mask`` ``[L]``
    (1 on the response: the last 40-80 % of the row) and ``advantage`` (a scalar: one per row,
    as GRPO gives)."""
    if num_rows < 1:
        raise ValueError(f"num_rows={num_rows}: need at least 1 row")
    rng = np.random.default_rng(seed)
    lens = np.exp(rng.normal(np.log(median_tokens), sigma, num_rows))
    lens = np.clip(np.round(lens), min_tokens, max_tokens).astype(np.int64)
    rows = []
    for n in lens.tolist():
        prompt = int(np.clip(round(n * rng.uniform(0.2, 0.6)), 1, n - 1))
        mask = torch.zeros(n, dtype=torch.float32)
        mask[prompt:] = 1.0
        ids = torch.from_numpy(rng.integers(_FIRST_TEXT_ID, vocab_size, n).astype(np.int64))
        rows.append(
            {
                "input_ids": ids,
                "loss_mask": mask,
                "advantage": torch.tensor(float(rng.normal()), dtype=torch.float32),
            }
        )
    return rows


# ----------------------------------------------------------------------------- timing


@dataclass
class _Layout:
    """One side of the comparison: its micro-batches, model, optimizer, loss and counts."""

    micro_batches: list
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    loss_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # packed_loss or padded_loss
    normalizers: LossNormalizers


def _schedule(counts: dict[str, int], first: str) -> list[tuple[str, int]]:
    """Micro-batches of all layouts in one interleaved order: each layout's k-th of n at
    fraction (k + 0.5) / n of the way, ties to ``first``. A burst of load from another process
    then lands on both layouts alike instead of on whichever ran during it."""
    events = [
        ((k + 0.5) / n, name != first, name, k) for name, n in counts.items() for k in range(n)
    ]
    return [(name, k) for _, _, name, k in sorted(events)]


def _interleaved_update(
    layouts: dict[str, _Layout], cfg, first: str, on_grads=None
) -> dict[str, tuple[float, float, float, float]]:
    """One actor update of every layout, micro-batches interleaved (see ``_schedule``), each
    followed by its own gradient clipping (``train.grad_clip``), AdamW and lr-schedule step, as
    the worker's ``run_micro_batches`` ends. Returns {layout: (loss, new log-prob sum over loss
    tokens, wall s, process CPU s)}; only each layout's own work is timed.
    ``on_grads(name, model)`` runs before the steps, untimed."""
    sync = hal.get_backend("auto").synchronize
    wall = dict.fromkeys(layouts, 0.0)
    cpu = dict.fromkeys(layouts, 0.0)
    loss = dict.fromkeys(layouts, 0.0)
    logprob = dict.fromkeys(layouts, 0.0)
    max_norm = cfg.train.grad_clip or math.inf

    def timed(name: str, fn) -> None:
        sync()
        w, c = time.perf_counter(), time.process_time()
        fn()
        sync()
        wall[name] += time.perf_counter() - w
        cpu[name] += time.process_time() - c

    for layout in layouts.values():
        layout.optimizer.zero_grad(set_to_none=True)
    counts = {name: len(layout.micro_batches) for name, layout in layouts.items()}
    for name, k in _schedule(counts, first):
        layout = layouts[name]

        def forward_backward(layout=layout, mb=layout.micro_batches[k], name=name) -> None:
            value, lp_sum = layout.loss_fn(layout.model, mb, layout.normalizers, cfg)
            value.backward()
            loss[name] += float(value.detach())
            logprob[name] += float(lp_sum)

        timed(name, forward_backward)
    if on_grads is not None:
        for name, layout in layouts.items():
            on_grads(name, layout.model)

    def step(layout: _Layout) -> None:
        torch.nn.utils.clip_grad_norm_(layout.model.parameters(), max_norm)
        layout.optimizer.step()
        layout.scheduler.step()

    for name in sorted(layouts, key=lambda n: n != first):
        timed(name, lambda layout=layouts[name]: step(layout))
    return {name: (loss[name], logprob[name], wall[name], cpu[name]) for name in layouts}


def _warm_up(layout: _Layout, cfg) -> None:
    """First calls pay one-off costs (allocator growth, lazy init); keep them out of the
    timings with one untimed forward + backward of the first micro-batch."""
    value, _ = layout.loss_fn(layout.model, layout.micro_batches[0], layout.normalizers, cfg)
    value.backward()
    layout.model.zero_grad(set_to_none=True)


def _grad_vector(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _copy_state(src: _Layout, dst: _Layout) -> None:
    """Make dst start the next repeat exactly where src is (weights and AdamW moments)."""
    with torch.no_grad():
        for d, s in zip(dst.model.parameters(), src.model.parameters()):
            d.copy_(s)
    # deepcopy: load_state_dict would otherwise share the moment tensors between the two
    dst.optimizer.load_state_dict(copy.deepcopy(src.optimizer.state_dict()))


def _length_stats(lens: np.ndarray) -> dict[str, float]:
    return {
        "min": int(lens.min()),
        "median": float(np.median(lens)),
        "mean": float(lens.mean()),
        "p90": float(np.percentile(lens, 90)),
        "max": int(lens.max()),
    }


def _layout_stats(micro_batches: list, real_tokens: int) -> dict[str, float]:
    # Tokens the model runs over, padding included ([T] packed, [B, S] padded).
    computed = [int(mb.input_ids.numel()) for mb in micro_batches]
    return {
        "micro_batches": len(micro_batches),
        "computed_tokens": int(sum(computed)),
        "token_efficiency": real_tokens / sum(computed),
        "mean_micro_batch_tokens": float(np.mean(computed)),
        "max_micro_batch_tokens": int(max(computed)),
    }


def compare(
    model_name: str,
    num_rows: int,
    repeats: int,
    *,
    seed: int = 0,
    lr: float = 1e-5,
    budget_tokens: int = PACKED_BUDGET_TOKENS,
    rows_per_micro_batch: int = PADDED_ROWS_PER_MICRO_BATCH,
) -> dict:
    """The trainer's packed update vs the padded baseline on ``model_name`` and ``num_rows``
    rows, ``repeats`` interleaved times. Returns layout statistics, per-repeat seconds, losses
    and mean log-probs, the median tokens/s (real tokens per second) of each layout and the
    median speedup (padded seconds / packed seconds of the same repeat)."""
    from rollout.models import load_model
    from trainer.loop.ranks.optim import build_optimizer

    if repeats < 1:
        raise ValueError(f"repeats={repeats}: need at least 1 repeat")
    cfg = default_job()
    hal.register_attention()
    device = hal.get_backend("auto").device(0)
    packed_model = load_model(
        model_name, seed=seed, attn_implementation=hal.ATTN_IMPLEMENTATION, device=device
    )
    padded_model = load_model(model_name, seed=seed, attn_implementation="sdpa", device=device)
    packed_model.train()
    padded_model.train()
    config = packed_model.config
    rows = make_rows(num_rows, vocab_size=config.vocab_size, seed=seed)
    batch = step_batch(rows)
    lens = batch.seq_lens
    real_tokens = int(lens.sum())
    mini_rows, micro_rows = plan_micro_batches(batch, budget_tokens)
    set_old_logprobs(packed_model, batch, micro_rows, cfg)

    def layout(model, micro_batches, loss_fn, normalizers) -> _Layout:
        optimizer, scheduler = build_optimizer(
            model.parameters(),
            lr=lr,
            weight_decay=cfg.train.weight_decay,
            warmup_steps=0,
            total_steps=repeats + 1,
            schedule="constant",
            min_lr_ratio=1.0,
        )
        return _Layout(micro_batches, model, optimizer, scheduler, loss_fn, normalizers)

    padded_mbs = padded_micro_batches(batch, rows_per_micro_batch, config.pad_token_id or 0)
    layouts = {
        "packed": layout(
            packed_model,
            [batch.select(r) for r in micro_rows],
            packed_loss,
            loss_normalizers(batch, mini_rows),
        ),
        "padded": layout(padded_model, padded_mbs, padded_loss, padded_normalizers(padded_mbs)),
    }
    for side in layouts.values():
        _warm_up(side, cfg)
    grads: dict[str, torch.Tensor] = {}
    seconds: dict[str, list[float]] = {"packed": [], "padded": []}
    cpu_seconds: dict[str, list[float]] = {"packed": [], "padded": []}
    losses: dict[str, list[float]] = {"packed": [], "padded": []}
    logprob_means: dict[str, list[float]] = {"packed": [], "padded": []}
    loss_tokens = layouts["packed"].normalizers.num_loss_tokens

    def keep_grads(name: str, model) -> None:
        grads[name] = _grad_vector(model).clone()

    for rep in range(repeats):
        # Alternate which layout goes first, so neither always gets the warmer cache.
        timings = _interleaved_update(
            layouts,
            cfg,
            first="packed" if rep % 2 == 0 else "padded",
            on_grads=keep_grads if rep == 0 else None,
        )
        for name, (loss, lp_sum, wall, cpu) in timings.items():
            seconds[name].append(wall)
            cpu_seconds[name].append(cpu)
            losses[name].append(loss)
            logprob_means[name].append(lp_sum / max(1, loss_tokens))
        _copy_state(layouts["packed"], layouts["padded"])

    ratios = [pad / pack for pack, pad in zip(seconds["packed"], seconds["padded"])]
    cpu_ratios = [pad / pack for pack, pad in zip(cpu_seconds["packed"], cpu_seconds["padded"])]
    loss_diff = max(abs(a - b) for a, b in zip(losses["packed"], losses["padded"]))
    logprob_diff = max(abs(a - b) for a, b in zip(logprob_means["packed"], logprob_means["padded"]))
    grad_diff = float((grads["packed"] - grads["padded"]).abs().max())
    same_counts = layouts["packed"].normalizers == layouts["padded"].normalizers
    algo = cfg.algorithm
    result = {
        "model": model_name,
        "params": sum(p.numel() for p in packed_model.parameters()),
        "rows": num_rows,
        "repeats": repeats,
        "real_tokens": real_tokens,
        "loss_tokens": loss_tokens,
        "row_tokens": _length_stats(lens),
        "optimizer": f"AdamW lr {lr}, weight decay {cfg.train.weight_decay}, "
        f"grad clip {cfg.train.grad_clip}",
        "objective": f"PPO clipped surrogate (clip {algo.clip_ratio_low}/{algo.clip_ratio_high}, "
        f"dual clip {algo.clip_ratio_c}), {algo.loss_agg}, entropy coef {algo.entropy_coef}",
        "dtype": str(next(packed_model.parameters()).dtype).replace("torch.", ""),
        "device": str(device),
        "loss": {
            "packed": losses["packed"],
            "padded": losses["padded"],
            "max_abs_diff": loss_diff,
            "logprob_mean_packed": logprob_means["packed"],
            "logprob_mean_padded": logprob_means["padded"],
            "logprob_max_abs_diff": logprob_diff,
            "normalizers_agree": same_counts,
            "tolerance": LOSS_TOLERANCE,
            "identical": loss_diff <= LOSS_TOLERANCE
            and logprob_diff <= LOSS_TOLERANCE
            and same_counts,
            "grad_max_abs_diff": grad_diff,
            "grad_norm_packed": float(grads["packed"].norm()),
            "grad_norm_padded": float(grads["padded"].norm()),
        },
        "speedup": {
            "per_repeat": ratios,
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
            "target": TARGET_SPEEDUP,
            "meets_target": statistics.median(ratios) >= TARGET_SPEEDUP,
            "cpu_time_per_repeat": cpu_ratios,
            "cpu_time_median": statistics.median(cpu_ratios),
        },
    }
    for name, extra in (
        (
            "packed",
            {
                "budget_tokens": budget_tokens,
                "attention": hal.ATTN_IMPLEMENTATION,
                "code": "trainer (PolicyWorker.train_mini_batch's per-micro-batch calls)",
            },
        ),
        (
            "padded",
            {
                "rows_per_micro_batch": rows_per_micro_batch,
                "attention": "sdpa",
                "code": "baseline (bench.padded)",
            },
        ),
    ):
        stats = _layout_stats(layouts[name].micro_batches, real_tokens)
        stats.update(extra)
        stats["seconds"] = seconds[name]
        stats["cpu_seconds"] = cpu_seconds[name]
        stats["tokens_per_s"] = real_tokens / statistics.median(seconds[name])
        result[name] = stats
    return result


def run(quick: bool = False, threads: int | None = CPU_THREADS) -> dict:
    """Packed vs padded on the builtin tiny and small models; ``{"models": [compare(...)...]}``
    plus the workload description. ``quick``: fewer rows and repeats (about a minute).
    ``threads``: torch intra-op threads during the run on a CPU (None: leave torch's setting)."""
    previous = torch.get_num_threads()
    on_cpu = not hal.get_backend("auto").is_accelerator
    if threads is not None and on_cpu:
        torch.set_num_threads(threads)
    try:
        models = [compare(name, rows, repeats) for name, rows, repeats in _PLANS[quick]]
    finally:
        torch.set_num_threads(previous)
    return {
        "torch_threads": threads if threads is not None and on_cpu else previous,
        "workload": {
            "lengths": "log-normal, median 96 tokens, sigma 1.0, clipped to 16-1024 tokens",
            "response": "last 40-80 % of each row carries the loss",
            "loss": "the default job's actor loss (trainer.algorithms.losses), one advantage per row",
            "packed": "the trainer's code: StepBatch, planner, loss_normalizers, "
            "hal.packed_forward, packed_token_logprobs, trainer.algorithms.losses",
            "update": "forward + backward over all micro-batches + grad clip + one AdamW step",
        },
        "models": models,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rows and repeats")
    parser.add_argument(
        "--threads", type=int, default=CPU_THREADS, help="torch threads on a CPU (0: torch's own)"
    )
    args = parser.parse_args()
    print(format_table(run(quick=args.quick, threads=args.threads or None)))


if __name__ == "__main__":
    main()
