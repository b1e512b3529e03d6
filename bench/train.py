"""Actor-update throughput: packed varlen rows versus ``[batch, max_len]`` padded micro-batches.

    python -m bench train [--quick]

One update = forward + backward over every micro-batch of one mini-batch, then one AdamW step
(fp32, the HAL's device; a CPU here). The same rows, drawn from a long-tailed length
distribution (log-normal, clipped to 16-1024 tokens), are laid out two ways:

- ``packed``: crossrl's path. ``plan_minibatches`` puts rows into micro-batches under a token
  budget (first-fit decreasing); each micro-batch is one packed row run through
  ``hal.packed_forward`` with the HAL's varlen attention. No token is padding.
- ``padded``: the layout trainers use without remove-padding. Rows in arrival order, a fixed
  number per micro-batch, right-padded to the micro-batch's longest row, and the model run with
  transformers' ``sdpa`` attention and an attention mask.

Both compute the same loss: token-mean, over response tokens of the whole mini-batch, of the
log-prob objective ``-A_row * log pi(token)`` (``batching.aggregate_loss`` with global
normalizers). The two layouts start every repeat from identical weights and optimizer state, so
their losses must agree to float rounding; the benchmark checks that on every repeat (and the
gradients on the first) and reports both. Within a repeat the two layouts' micro-batches run
interleaved (each timed on its own), so a burst of load from another process on a shared machine
hits both alike; the figure that counts is the median of the per-repeat time ratios. Nothing
here asserts a time.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import hal
from batching import LossNormalizers, aggregate_loss, plan_minibatches

__all__ = [
    "LOSS_TOLERANCE",
    "TARGET_SPEEDUP",
    "MicroBatch",
    "format_table",
    "make_rows",
    "packed_micro_batches",
    "padded_micro_batches",
    "packed_loss",
    "padded_loss",
    "row_normalizers",
    "compare",
    "run",
]

#: Packed throughput the issue asks for, as a multiple of the padded throughput.
TARGET_SPEEDUP = 1.5
#: Largest allowed |loss_packed - loss_padded| on the same weights (fp32).
LOSS_TOLERANCE = 1e-5
#: Micro-batch token budget of the packed layout: the default job's
#: ``train.max_tokens_per_micro_batch`` (configs/cpu/tiny.yaml).
PACKED_BUDGET_TOKENS = 2048
#: Rows per padded micro-batch (verl's ``ppo_micro_batch_size_per_gpu`` in its examples: 2-16).
PADDED_ROWS_PER_MICRO_BATCH = 8
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


@dataclass
class MicroBatch:
    """Tensors of one micro-batch in one layout.

    packed: ``input_ids``/``position_ids``/``loss_mask``/``advantages`` are ``[T]``,
    ``cu_seqlens`` ``[R+1]`` token offsets, ``attention_mask`` None.
    padded: the same fields ``[B, S]`` (``position_ids`` None: 0..S-1), ``attention_mask``
    ``[B, S]`` (1 = real token), ``cu_seqlens`` None.
    ``computed_tokens``: tokens the model runs over (padding included).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    position_ids: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None

    @property
    def computed_tokens(self) -> int:
        return int(self.input_ids.numel())


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


def packed_micro_batches(
    rows: list[dict[str, torch.Tensor]], budget_tokens: int = PACKED_BUDGET_TOKENS
) -> list[MicroBatch]:
    """crossrl's layout: the planner's micro-batches (one mini-batch, one rank, at most
    ``budget_tokens`` tokens each unless a row alone is longer), each one packed row."""
    lens = [int(r["input_ids"].numel()) for r in rows]
    plan = plan_minibatches(
        list(range(len(rows))),
        lens,
        mini_batch_size=len(rows),
        dp_size=1,
        max_tokens_per_micro_batch=budget_tokens,
    )
    out = []
    for mb in plan.mini_batches:
        for members in mb.micro_batches[0]:
            picked = [rows[i] for i in members if i >= 0]  # dp 1: the plan has no padding row
            seg = [int(r["input_ids"].numel()) for r in picked]
            out.append(
                MicroBatch(
                    input_ids=torch.cat([r["input_ids"] for r in picked]),
                    loss_mask=torch.cat([r["loss_mask"] for r in picked]),
                    advantages=torch.cat([r["advantage"].expand(n) for r, n in zip(picked, seg)]),
                    position_ids=torch.cat([torch.arange(n) for n in seg]),
                    cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(seg)])),
                )
            )
    return out


def padded_micro_batches(
    rows: list[dict[str, torch.Tensor]],
    rows_per_micro_batch: int = PADDED_ROWS_PER_MICRO_BATCH,
    pad_token_id: int = 0,
) -> list[MicroBatch]:
    """The remove-padding-off layout: rows in arrival order, ``rows_per_micro_batch`` per
    micro-batch, right-padded to that micro-batch's longest row (``[B, S]``)."""
    out = []
    for start in range(0, len(rows), rows_per_micro_batch):
        picked = rows[start : start + rows_per_micro_batch]
        width = max(int(r["input_ids"].numel()) for r in picked)
        shape = (len(picked), width)
        ids = torch.full(shape, pad_token_id, dtype=torch.int64)
        attn = torch.zeros(shape, dtype=torch.int64)
        mask = torch.zeros(shape, dtype=torch.float32)
        adv = torch.zeros(shape, dtype=torch.float32)
        for b, r in enumerate(picked):
            n = int(r["input_ids"].numel())
            ids[b, :n], attn[b, :n], mask[b, :n] = r["input_ids"], 1, r["loss_mask"]
            adv[b, :n] = r["advantage"]
        out.append(MicroBatch(input_ids=ids, loss_mask=mask, advantages=adv, attention_mask=attn))
    return out


def row_normalizers(rows: list[dict[str, torch.Tensor]]) -> LossNormalizers:
    """Global loss counts of ``rows`` as one mini-batch (every row real, its own trajectory)."""
    loss_tokens = int(sum(int(r["loss_mask"].sum()) for r in rows))
    return LossNormalizers(
        num_rows=len(rows), num_loss_tokens=loss_tokens, num_trajectories=len(rows)
    )


def _next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log pi(token t | tokens < t) at position t along the last sequence axis; 0 at t = 0.
    logits ``[..., S, V]``, input_ids ``[..., S]`` -> ``[..., S]``."""
    lp = torch.log_softmax(logits[..., :-1, :].float(), dim=-1)
    lp = lp.gather(-1, input_ids[..., 1:, None]).squeeze(-1)
    return torch.cat([lp.new_zeros(*lp.shape[:-1], 1), lp], dim=-1)


def packed_loss(model, mb: MicroBatch, normalizers: LossNormalizers) -> torch.Tensor:
    """This packed micro-batch's share of the mini-batch loss (scalar)."""
    logits = hal.packed_forward(model, mb.input_ids, mb.position_ids, mb.cu_seqlens)
    # The first token of a row got its "log-prob" from the previous row's last logit; its loss
    # mask is 0 (a prompt token), and where() keeps that value out of the loss and gradient.
    logp = _next_token_logprobs(logits, mb.input_ids)
    token_loss = torch.where(mb.loss_mask > 0, -mb.advantages * logp, 0.0)
    return aggregate_loss(token_loss, mb.loss_mask, mb.cu_seqlens, normalizers, "token-mean")


def padded_loss(model, mb: MicroBatch, normalizers: LossNormalizers) -> torch.Tensor:
    """This padded micro-batch's share of the mini-batch loss (scalar)."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
    logp = _next_token_logprobs(logits, mb.input_ids)
    token_loss = torch.where(mb.loss_mask > 0, -mb.advantages * logp, 0.0).reshape(-1)
    batch, width = mb.input_ids.shape
    cu = torch.arange(0, (batch + 1) * width, width)
    return aggregate_loss(token_loss, mb.loss_mask.reshape(-1), cu, normalizers, "token-mean")


LossFn = Callable[[torch.nn.Module, MicroBatch, LossNormalizers], torch.Tensor]


def _schedule(counts: dict[str, int], first: str) -> list[tuple[str, int]]:
    """Micro-batches of all layouts in one interleaved order: each layout's k-th of n at
    fraction (k + 0.5) / n of the way, ties to ``first``. A burst of load from another process
    then lands on both layouts alike instead of on whichever ran during it."""
    events = [
        ((k + 0.5) / n, name != first, name, k) for name, n in counts.items() for k in range(n)
    ]
    return [(name, k) for _, _, name, k in sorted(events)]


def _interleaved_update(layouts: dict, normalizers, first: str, on_grads=None) -> dict:
    """One actor update of every layout, micro-batches interleaved (see ``_schedule``), each
    followed by its own AdamW step. Returns {layout: (loss, wall s, process CPU s)}; only each
    layout's own forward/backward/step is timed. ``on_grads(name, model)`` runs before the
    steps, untimed."""
    sync = hal.get_backend("auto").synchronize
    wall = dict.fromkeys(layouts, 0.0)
    cpu = dict.fromkeys(layouts, 0.0)
    loss = dict.fromkeys(layouts, 0.0)

    def timed(name: str, fn) -> None:
        sync()
        w, c = time.perf_counter(), time.process_time()
        fn()
        sync()
        wall[name] += time.perf_counter() - w
        cpu[name] += time.process_time() - c

    for _mbs, _model, opt, _fn in layouts.values():
        opt.zero_grad(set_to_none=True)
    counts = {name: len(layout[0]) for name, layout in layouts.items()}
    for name, k in _schedule(counts, first):
        mbs, model, _opt, loss_fn = layouts[name]

        def step(mb=mbs[k], model=model, loss_fn=loss_fn, name=name) -> None:
            value = loss_fn(model, mb, normalizers)
            value.backward()
            loss[name] += float(value.detach())

        timed(name, step)
    if on_grads is not None:
        for name, (_mbs, model, _opt, _fn) in layouts.items():
            on_grads(name, model)
    for name in sorted(layouts, key=lambda n: n != first):
        timed(name, layouts[name][2].step)
    return {name: (loss[name], wall[name], cpu[name]) for name in layouts}


def _warm_up(model, micro_batches, loss_fn: LossFn, normalizers) -> None:
    """First calls pay one-off costs (allocator growth, lazy init); keep them out of the
    timings with one untimed forward + backward of the first micro-batch."""
    loss_fn(model, micro_batches[0], normalizers).backward()
    model.zero_grad(set_to_none=True)


def _grad_vector(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _copy_state(src_model, src_opt, dst_model, dst_opt) -> None:
    """Make dst start the next repeat exactly where src is (weights and AdamW moments)."""
    with torch.no_grad():
        for d, s in zip(dst_model.parameters(), src_model.parameters()):
            d.copy_(s)
    # deepcopy: load_state_dict would otherwise share the moment tensors between the two
    dst_opt.load_state_dict(copy.deepcopy(src_opt.state_dict()))


def _length_stats(lens: np.ndarray) -> dict[str, float]:
    return {
        "min": int(lens.min()),
        "median": float(np.median(lens)),
        "mean": float(lens.mean()),
        "p90": float(np.percentile(lens, 90)),
        "max": int(lens.max()),
    }


def _layout_stats(micro_batches: list[MicroBatch], real_tokens: int) -> dict[str, float]:
    computed = [mb.computed_tokens for mb in micro_batches]
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
    """Packed vs padded actor updates of ``model_name`` on ``num_rows`` rows, ``repeats``
    interleaved times. Returns layout statistics, per-repeat seconds and losses, the median
    tokens/s (real tokens per second) of each layout and the median speedup
    (padded seconds / packed seconds of the same repeat)."""
    from rollout.models import load_model

    if repeats < 1:
        raise ValueError(f"repeats={repeats}: need at least 1 repeat")
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
    lens = np.array([int(r["input_ids"].numel()) for r in rows])
    real_tokens = int(lens.sum())
    normalizers = row_normalizers(rows)

    def to_device(mbs: list[MicroBatch]) -> list[MicroBatch]:
        for mb in mbs:
            for name, value in vars(mb).items():
                if isinstance(value, torch.Tensor) and name != "cu_seqlens":
                    setattr(mb, name, value.to(device))
        return mbs

    layouts = {
        "packed": (
            to_device(packed_micro_batches(rows, budget_tokens)),
            packed_model,
            torch.optim.AdamW(packed_model.parameters(), lr=lr),
            packed_loss,
        ),
        "padded": (
            to_device(padded_micro_batches(rows, rows_per_micro_batch, config.pad_token_id or 0)),
            padded_model,
            torch.optim.AdamW(padded_model.parameters(), lr=lr),
            padded_loss,
        ),
    }
    for mbs, model, _opt, loss_fn in layouts.values():
        _warm_up(model, mbs, loss_fn, normalizers)
    grads: dict[str, torch.Tensor] = {}
    seconds: dict[str, list[float]] = {"packed": [], "padded": []}
    cpu_seconds: dict[str, list[float]] = {"packed": [], "padded": []}
    losses: dict[str, list[float]] = {"packed": [], "padded": []}

    def keep_grads(name: str, model) -> None:
        grads[name] = _grad_vector(model).clone()

    for rep in range(repeats):
        # Alternate which layout goes first, so neither always gets the warmer cache.
        timings = _interleaved_update(
            layouts,
            normalizers,
            first="packed" if rep % 2 == 0 else "padded",
            on_grads=keep_grads if rep == 0 else None,
        )
        for name, (loss, wall, cpu) in timings.items():
            seconds[name].append(wall)
            cpu_seconds[name].append(cpu)
            losses[name].append(loss)
        _copy_state(packed_model, layouts["packed"][2], padded_model, layouts["padded"][2])

    ratios = [pad / pack for pack, pad in zip(seconds["packed"], seconds["padded"])]
    cpu_ratios = [pad / pack for pack, pad in zip(cpu_seconds["packed"], cpu_seconds["padded"])]
    loss_diff = max(abs(a - b) for a, b in zip(losses["packed"], losses["padded"]))
    grad_diff = float((grads["packed"] - grads["padded"]).abs().max())
    result = {
        "model": model_name,
        "params": sum(p.numel() for p in packed_model.parameters()),
        "rows": num_rows,
        "repeats": repeats,
        "real_tokens": real_tokens,
        "loss_tokens": normalizers.num_loss_tokens,
        "row_tokens": _length_stats(lens),
        "optimizer": f"AdamW lr {lr}",
        "dtype": str(next(packed_model.parameters()).dtype).replace("torch.", ""),
        "device": str(device),
        "loss": {
            "packed": losses["packed"],
            "padded": losses["padded"],
            "max_abs_diff": loss_diff,
            "tolerance": LOSS_TOLERANCE,
            "identical": loss_diff <= LOSS_TOLERANCE,
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
        ("packed", {"budget_tokens": budget_tokens, "attention": hal.ATTN_IMPLEMENTATION}),
        ("padded", {"rows_per_micro_batch": rows_per_micro_batch, "attention": "sdpa"}),
    ):
        stats = _layout_stats(layouts[name][0], real_tokens)
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
            "loss": "token-mean over response tokens of -A_row * log pi(token)",
            "update": "forward + backward over all micro-batches + one AdamW step",
        },
        "models": models,
    }


def format_table(res: dict) -> str:
    """The benchmark's results as a plain-text table (one block per model)."""
    lines = [
        f"rows: {res['workload']['lengths']}; loss: {res['workload']['loss']}; "
        f"{res['torch_threads']} torch thread(s)",
        f"{'':30s}{'packed':>14s}{'padded':>14s}",
    ]
    for m in res["models"]:
        p, q, s, loss = m["packed"], m["padded"], m["speedup"], m["loss"]
        lt = m["row_tokens"]
        lines.append(
            f"\n{m['model']} ({m['params'] / 1e6:.2f}M params, {m['dtype']}, {m['device']}): "
            f"{m['rows']} rows, {m['real_tokens']:,} tokens (row length median {lt['median']:.0f}, "
            f"mean {lt['mean']:.0f}, max {lt['max']}), {m['repeats']} interleaved repeats"
        )
        table = [
            ("micro-batches", f"{p['micro_batches']}", f"{q['micro_batches']}"),
            (
                "micro-batch rule",
                f"<= {p['budget_tokens']} tok",
                f"{q['rows_per_micro_batch']} rows",
            ),
            ("computed tokens", f"{p['computed_tokens']:,}", f"{q['computed_tokens']:,}"),
            ("token efficiency", f"{p['token_efficiency']:.3f}", f"{q['token_efficiency']:.3f}"),
            (
                "tokens per micro-batch, mean",
                f"{p['mean_micro_batch_tokens']:.0f}",
                f"{q['mean_micro_batch_tokens']:.0f}",
            ),
            (
                "update seconds, median",
                f"{statistics.median(p['seconds']):.3f}",
                f"{statistics.median(q['seconds']):.3f}",
            ),
            ("tokens/s (real), median", f"{p['tokens_per_s']:.0f}", f"{q['tokens_per_s']:.0f}"),
            ("loss, first repeat", f"{loss['packed'][0]:.7f}", f"{loss['padded'][0]:.7f}"),
            (
                "grad norm, first repeat",
                f"{loss['grad_norm_packed']:.6f}",
                f"{loss['grad_norm_padded']:.6f}",
            ),
        ]
        lines += [f"{label:30s}{a:>14s}{b:>14s}" for label, a, b in table]
        verdict = "meets" if s["meets_target"] else "MISSES"
        lines.append(
            f"packed / padded throughput: median {s['median']:.2f}x "
            f"(min {s['min']:.2f}, max {s['max']:.2f}); {verdict} the {s['target']}x target; "
            f"process CPU time ratio median {s['cpu_time_median']:.2f}x"
        )
        same = "identical" if loss["identical"] else "DIFFERENT"
        lines.append(
            f"losses {same}: max |packed - padded| {loss['max_abs_diff']:.2e} over "
            f"{m['repeats']} repeats (tolerance {loss['tolerance']:.0e}); "
            f"max |grad diff| {loss['grad_max_abs_diff']:.2e}"
        )
    return "\n".join(lines)


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
