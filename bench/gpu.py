"""Accelerator benchmark: MFU of the shipped actor update and the rollout host's HF engine.

    python -m bench gpu [--quick]

Runs only where ``hal.get_backend("auto")`` finds an accelerator; on a CPU
it returns ``{"skipped": True, "reason": ...}`` and prints why, never a made-up number.

Everything timed is the code the trainer ships, on a Qwen2.5-0.5B-shaped model with random
weights written once with ``rollout.models.write_random_model``:

- ``peak``: the card's measured dense bf16 matmul rate (best of several square matmuls), the
  denominator of MFU. Measured, not the datasheet figure, as the issue asks.
- ``update``: one ``trainer.loop.ranks.policy.PolicyWorker.train_mini_batch`` at dp 1 (FSDP2
  in-process): fp32 master weights, bf16 compute through FSDP2 mixed precision (fp32 gradient
  reduction), the HAL's varlen attention over planner micro-batches of packed rows, the
  clipped PPO loss on GRPO advantages, gradient clipping and the AdamW step. Rows are
  log-normal in length, as in ``bench.train``; the whole batch is one mini-batch. Timed twice,
  with activation checkpointing on and off (``train.activation_checkpointing``), each with its
  peak device memory. MFU = model FLOPs / seconds / peak, with model FLOPs = 3 x forward
  (6 per matmul parameter per token, lm_head included, plus causal attention
  6 * sum(len^2) * heads * head_dim per layer); the forward that activation checkpointing
  recomputes is not counted, so it shows as a lower MFU. The shipped setting (checkpointing
  on) is timed twice more with the reference kernel set (``train.kernels=reference``): the
  fused set's gain, measured side by side (``UPDATES``).
- ``rollout``: the rollout host's engine (``trainer.loop.engines.rollout_host.RolloutHost.setup``):
  the model loaded in bf16 with its default attention, ``make_engine("hf", ...)``, sampling
  ``new_tokens`` for a batch of random prompts; generated tokens per second.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

import hal
from bench.gpu_table import format_table
from rollout.models import SHAPES

__all__ = [
    "UPDATE_OVERRIDES",
    "QWEN25_05B",
    "GpuSizes",
    "format_table",
    "make_batch",
    "measure",
    "model_flops_per_update",
    "run",
]

#: Qwen2.5-0.5B's architecture (config.json of Qwen/Qwen2.5-0.5B), weights random.
QWEN25_05B = SHAPES["qwen2.5-0.5b"]
#: The timed update's job, on top of the default job: the shipped GRPO loss (token-mean,
#: clip-higher, no KL, no entropy bonus), fp32 master weights with bf16 compute.
UPDATE_OVERRIDES = (
    "train.dp_size=1",
    "train.lr=1e-6",
    "train.grad_clip=1.0",
    "train.param_dtype=bfloat16",
    "train.reduce_dtype=float32",
    "algorithm.loss_agg=token-mean",
    "algorithm.clip_ratio_high=0.28",
    "algorithm.kl_coef=0.0",
    "algorithm.entropy_coef=0.0",
    "run.deterministic=false",
)
#: The timed updates: (key, activation checkpointing, train.kernels). The shipped setting,
#: checkpointing on, runs with the device's fused kernels and with the reference set.
UPDATES = (
    ("ac_on", True, "auto"),
    ("ac_off", False, "auto"),
    ("ac_on_reference", True, "reference"),
)
#: With ``--compile``, one more: checkpointing off (``train.compile_blocks`` refuses it on),
#: the fused set and every decoder layer through ``torch.compile``.
COMPILED = ("ac_off_compiled", False, "auto")
#: Rows per GRPO group (``rollout.n``): the batch's uids come in groups of this many rows.
ROWS_PER_GROUP = 8


@dataclass(frozen=True)
class GpuSizes:
    """How much work each part does; every size names its unit."""

    matmul_n: int = 8192  # side of the square bf16 matmuls that measure the peak
    matmul_iters: int = 20
    rows: int = 256  # rows per actor update
    median_row_tokens: float = 512.0
    max_row_tokens: int = 4096
    # planner micro-batch budget; the fp32 log-softmax of 8k x 152k logits is already 5 GB
    budget_tokens: int = 8192
    update_repeats: int = 5  # timed updates per activation-checkpointing setting
    rollout_prompts: int = 64
    prompt_tokens: int = 256
    new_tokens: int = 256


# quick keeps the 8192^3 matmuls: smaller ones understate the peak and so overstate the MFU
SIZES = {False: GpuSizes(), True: GpuSizes(rows=64, update_repeats=3, new_tokens=64)}


def _timed(backend, fn) -> float:
    backend.synchronize()
    start = time.perf_counter()
    fn()
    backend.synchronize()
    return time.perf_counter() - start


def _free(backend) -> None:
    """Return freed device memory, so the next part starts from an empty card."""
    gc.collect()
    backend.empty_cache()


def measure_peak(backend, n: int, iters: int) -> dict:
    """Best dense bf16 matmul rate on the backend's device: ``{"tflops": ..., "n": n}``."""
    device = backend.device(0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    torch.matmul(a, b)  # warm-up: kernel selection, workspace allocation
    best = min(_timed(backend, lambda: torch.matmul(a, b)) for _ in range(iters))
    return {"tflops": 2 * n**3 / best / 1e12, "n": n, "best_s": best}


def _matmul_params(model: torch.nn.Module, config) -> int:
    """Parameters that take part in a matmul per token: every Linear weight in the decoder
    layers plus the lm_head (counted even when tied to the embedding). Sharded (FSDP2)
    weights count their full size."""
    layers = sum(
        m.weight.numel()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and "lm_head" not in name
    )
    return layers + config.vocab_size * config.hidden_size


def model_flops_per_update(matmul_params: int, config, row_lens: list[int]) -> float:
    """Training FLOPs (forward + backward = 3 x forward) of one pass over rows of
    ``row_lens`` tokens: 2 per matmul parameter per token, plus causal attention
    (QK^T and AV, half the square) 2 * len^2 * heads * head_dim per layer."""
    tokens = sum(row_lens)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attn = 2 * sum(n * n for n in row_lens) * config.num_attention_heads * head_dim
    forward = 2 * matmul_params * tokens + config.num_hidden_layers * attn
    return 3.0 * forward


@contextlib.contextmanager
def _model_dir(shape: str | dict, seed: int, model_dir: str | Path | None) -> Iterator[Path]:
    """The random-weight model directory the benchmark loads.

    ``model_dir`` that exists: reused as it is (``shape`` is then ignored). ``model_dir`` that
    does not exist yet: written there and kept, so the next run skips the write (seconds for
    0.5B weights). None: written into a temporary directory that is deleted afterwards.
    """
    from rollout.models import write_random_model

    if model_dir is not None:
        path = Path(model_dir).expanduser()
        if not (path / "config.json").is_file():
            write_random_model(path, shape, seed=seed)
        yield path
        return
    tmp = Path(tempfile.mkdtemp(prefix="crossrl-bench-gpu-"))
    try:
        yield write_random_model(tmp / "model", shape, seed=seed)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def make_batch(sizes: GpuSizes, vocab_size: int, seed: int = 0):
    """The update's batch: ``sizes.rows`` rows of ``bench.train.make_rows`` (log-normal lengths
    in tokens, random ids), each a ``batching.Row`` whose prompt is the row's unmasked head and
    whose response (all trained on) is the rest; GRPO groups of ``ROWS_PER_GROUP`` rows with a
    random score per row, one step per trajectory."""
    from batching import StepBatch
    from bench.packed import trainer_rows
    from bench.train import make_rows

    rows = make_rows(
        sizes.rows,
        vocab_size=vocab_size,
        seed=seed,
        median_tokens=sizes.median_row_tokens,
        max_tokens=sizes.max_row_tokens,
    )
    scores = np.random.default_rng(seed + 1).random(len(rows))
    return StepBatch.from_rows(trainer_rows(rows, rows_per_group=ROWS_PER_GROUP, scores=scores))


def _one_mini_batch(batch, budget_tokens: int):
    """The planner's dp-1 plan with every group in one mini-batch (``budget_tokens`` tokens per
    micro-batch), as the controller plans a step whose ``mini_batch_size`` is the batch."""
    from batching import plan_minibatches

    uids = batch.row_fields["uid"].numpy()
    plan = plan_minibatches(
        batch.row_fields["trajectory_id"].numpy(),
        batch.seq_lens,
        mini_batch_size=len(np.unique(uids)),
        dp_size=1,
        max_tokens_per_micro_batch=budget_tokens,
        group_ids=uids,
    )
    (mini,) = plan.mini_batches
    return mini


def measure_update(
    backend,
    model_dir: Path,
    batch,
    sizes: GpuSizes,
    peak_tflops: float,
    *,
    activation_checkpointing: bool,
    kernels: str = "auto",
    seed: int = 0,
    profile: bool = False,
    compile_blocks: bool = False,
) -> dict:
    """Time ``PolicyWorker.train_mini_batch`` on ``batch`` (one mini-batch) at dp 1: median
    seconds of ``sizes.update_repeats`` updates after one warm-up, tokens/s, MFU against
    ``peak_tflops`` and the worker's peak memory (GB) over those updates. ``kernels``:
    ``train.kernels`` (the fused set, ``auto``, or the ``reference``); what each op ran is
    ``kernel_report``, read after the updates (a kernel that fell back shows). ``profile``: one
    more update under ``torch.profiler`` (the HAL's activities), its top operators by device
    time (host time where the profiler sees no device) as ``profile_table``."""
    from trainer.config import load_config
    from trainer.loop.cluster.group import free_port
    from trainer.loop.ranks.fsdp_worker import WorkerSpec
    from trainer.loop.ranks.policy import PolicyWorker

    cfg = load_config(
        None,
        [
            *UPDATE_OVERRIDES,
            f"device={backend.name}",
            f"model.path={model_dir}",
            f"seed={seed}",
            f"train.activation_checkpointing={str(activation_checkpointing).lower()}",
            f"train.kernels={kernels}",
            f"train.compile_blocks={str(compile_blocks).lower()}",
        ],
    )
    worker = PolicyWorker(WorkerSpec(role="actor", rank=0, cfg=cfg))
    try:
        facts = worker.setup("127.0.0.1", free_port())
        worker.load_batch([batch.to_numpy()])
        mini = _one_mini_batch(batch, sizes.budget_tokens)
        micro_batches = mini.micro_batches[0]
        # Old logprobs = the current policy's, as the controller's prepare phase computes them.
        worker.set_token_field("old_logprobs", [worker.compute_logprobs(micro_batches)])
        worker.compute_advantages()
        rows = mini.rows.tolist()
        metrics: dict = {}

        def update() -> None:
            metrics.update(worker.train_mini_batch(micro_batches, rows).values)

        worker.peak_memory_gb()  # start a fresh peak: the update's, not setup's or prepare's
        update()  # warm-up: kernels, allocator, AdamW state
        seconds = [_timed(backend, update) for _ in range(sizes.update_repeats)]
        peak_memory_gb = worker.peak_memory_gb()
        table = _profiled(backend, update) if profile else None
        kernel_report = worker.kernels.report()
        lens = [int(batch.seq_lens[r]) for mb in micro_batches for r in mb if r >= 0]
        config = worker.model.config
        flops = model_flops_per_update(_matmul_params(worker.model, config), config, lens)
    finally:
        worker.shutdown()
        # Drop weights, gradients and AdamW state now: the next part needs the memory.
        worker.model = worker.optimizer = worker.scheduler = worker.batch = None
        _free(backend)
    upd_s = statistics.median(seconds)
    return {
        "activation_checkpointing": activation_checkpointing,
        "kernels": kernels,
        "kernel_report": kernel_report,
        "params": facts["num_params"],
        "rows": len(lens),
        "tokens": sum(lens),
        "micro_batches": len(micro_batches),
        "budget_tokens": sizes.budget_tokens,
        "seconds": seconds,
        "median_s": upd_s,
        "tokens_per_s": sum(lens) / upd_s,
        "model_tflops_per_update": flops / 1e12,
        "achieved_tflops": flops / upd_s / 1e12,
        "mfu": flops / upd_s / 1e12 / peak_tflops,
        "peak_memory_gb": peak_memory_gb,
        "grad_norm": metrics["grad_norm"],
        "profile_table": table,
    }


def _profiled(backend, fn, rows: int = 15) -> str:
    """``fn`` once under ``torch.profiler``: the top ``rows`` operators by self time on the
    device (on the host where the profiler records no device activity)."""
    from torch.profiler import profile

    activities = backend.profiler_activities()
    with profile(activities=activities) as prof:
        fn()
        backend.synchronize()
    key = "self_device_time_total" if len(activities) > 1 else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def measure_rollout(backend, model_dir: Path, sizes: GpuSizes, seed: int = 0) -> dict:
    """Generated tokens/s of the HF engine built as the rollout host builds it, on
    ``sizes.rollout_prompts`` random prompts of ``sizes.prompt_tokens`` tokens, each sampling
    exactly ``sizes.new_tokens`` tokens."""
    from rollout.engines import GenerationRequest, SamplingParams, make_engine
    from rollout.models import load_model
    from rollout.tokenizer import load_tokenizer

    model = load_model(model_dir, dtype="bfloat16", seed=seed, device=backend.device(0))
    model.eval()
    engine = make_engine("hf", model, load_tokenizer(model_dir))
    gen = torch.Generator().manual_seed(seed)
    vocab_size = model.config.vocab_size
    requests = [
        GenerationRequest(
            # ids from 4: the first ids of the shipped vocabulary are special (pad, eos)
            prompt_ids=torch.randint(4, vocab_size, (sizes.prompt_tokens,), generator=gen).tolist(),
            seed=seed + i,
        )
        for i in range(sizes.rollout_prompts)
    ]
    # No stop token: every request generates exactly new_tokens, so the count is the work.
    sampling = SamplingParams(max_new_tokens=sizes.new_tokens, temperature=1.0)
    engine.generate(requests[:2], SamplingParams(max_new_tokens=4))  # warm-up
    backend.reset_peak_memory()
    results = []
    gen_s = _timed(backend, lambda: results.extend(engine.generate(requests, sampling)))
    peak_memory_gb = backend.peak_memory_bytes() / 1e9
    generated = sum(len(r.token_ids) for r in results)
    return {
        "engine": "hf",
        "attention": model.config._attn_implementation,
        "prompts": len(requests),
        "prompt_tokens": sizes.prompt_tokens,
        "new_tokens": sizes.new_tokens,
        "generated_tokens": generated,
        "seconds": gen_s,
        "tokens_per_s": generated / gen_s,
        "peak_memory_gb": peak_memory_gb,
    }


def measure(
    backend,
    sizes: GpuSizes,
    shape: str | dict = "qwen2.5-0.5b",
    seed: int = 0,
    model_dir: str | Path | None = None,
    profile: bool = False,
    compile_blocks: bool = False,
) -> dict:
    """Peak, actor-update MFU (``UPDATES``: activation checkpointing on and off with the fused
    kernels, on with the reference set) and rollout tokens/s on ``backend``'s device (no
    accelerator check: the caller decides; a CPU backend with a tiny ``shape`` dict
    exercises the code). ``shape``: a ``rollout.models.SHAPES`` name or a config.json dict;
    ``model_dir``: see ``_model_dir``; ``profile``: the profiler table of the shipped
    setting's updates (activation checkpointing on, both kernel sets, ``measure_update``);
    ``compile_blocks``: the ``COMPILED`` update too."""
    peak = measure_peak(backend, sizes.matmul_n, sizes.matmul_iters)
    threads = torch.get_num_threads()  # the worker sets its own thread count; restored below
    try:
        with _model_dir(shape, seed, model_dir) as directory:
            vocab_size = json.loads((directory / "config.json").read_text())["vocab_size"]
            batch = make_batch(sizes, vocab_size, seed)
            update = {
                key: measure_update(
                    backend,
                    directory,
                    batch,
                    sizes,
                    peak["tflops"],
                    activation_checkpointing=on,
                    kernels=kernels,
                    seed=seed,
                    profile=profile and on,
                    compile_blocks=key == COMPILED[0],
                )
                for key, on, kernels in UPDATES + ((COMPILED,) if compile_blocks else ())
            }
            _free(backend)  # the update's memory, before the engine loads
            rollout = measure_rollout(backend, directory, sizes, seed)
            _free(backend)
    finally:
        torch.set_num_threads(threads)
    return {
        "skipped": False,
        "backend": backend.name,
        "device_names": backend.device_names(),
        "model": (shape if isinstance(shape, str) else "custom") + ", random weights",
        # read after the updates: a kernel that failed and fell back shows here
        "attention": f"{hal.ATTN_IMPLEMENTATION}: {backend.attention_impl_name}",
        "sizes": asdict(sizes),
        "peak": peak,
        "update": update,
        "rollout": rollout,
    }


def run(
    quick: bool = False,
    shape: str = "qwen2.5-0.5b",
    model_dir: str | Path | None = None,
    profile: bool = False,
    compile_blocks: bool = False,
) -> dict:
    """The accelerator benchmark on ``hal.get_backend("auto")``; ``{"skipped": True,
    "reason": ...}`` when that is a CPU. ``shape``, ``model_dir``, ``profile``,
    ``compile_blocks``: ``measure``."""
    backend = hal.get_backend("auto")
    if not backend.is_accelerator:
        return {
            "skipped": True,
            "reason": (
                f"no accelerator: hal.get_backend('auto') picked {backend.name!r} "
                f"(available: {hal.available_backends()}); run `crossrl bench gpu` on a node "
                "with an accelerator"
            ),
        }
    return measure(
        backend,
        SIZES[quick],
        shape,
        model_dir=model_dir,
        profile=profile,
        compile_blocks=compile_blocks,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rows, repeats and tokens")
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--model-dir", help="a model directory of that shape to reuse or fill")
    parser.add_argument("--profile", action="store_true", help="a torch.profiler table too")
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument(
        "--compile", action="store_true", help="one more update with train.compile_blocks"
    )
    args = parser.parse_args()
    res = run(
        quick=args.quick,
        shape=args.shape,
        model_dir=args.model_dir,
        profile=args.profile,
        compile_blocks=args.compile,
    )
    print(format_table(res))
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
