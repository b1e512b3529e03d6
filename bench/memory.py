"""Peak memory of one actor update: today's path against activation checkpointing and lean
log-probs, each alone and both together, side by side in one run.

    python -m bench memory [--quick]          (or: crossrl bench memory [--quick])

The update is the shipped worker's: one ``PolicyWorker.train_mini_batch`` at dp 1 (FSDP2,
fp32 master weights, the default job's actor loss, gradient clipping, the AdamW step and its
state's first allocation) over ONE micro-batch of ``MemorySizes.tokens`` tokens, after the
step's prepare phase (``compute_logprobs`` for the old log-probs, ``compute_advantages``).
The model has Qwen2.5's 151,936-token vocabulary on a small body (hidden 256, 4 layers,
random weights written with ``rollout.models.write_random_model``), so the logits dominate as
they do at scale. The variants differ only in two config keys:

    variant        train.activation_checkpointing   train.lean_logprobs
    today          false                            false
    checkpointing  true                             false
    lean           false                            true
    both           true                             true

Each variant runs in a fresh process (a memory high-water mark and allocator caches would
otherwise carry over from the one before). The update's memory is its peak minus what was
resident just before it: on the CPU the resident set size, the peak being the kernel's VmHWM
reset right before the update (``/proc/self/clear_refs``; where it cannot be reset, the
process's lifetime peak, and the result says so); on an accelerator the HAL's allocated bytes
and ``peak_memory_bytes``. Nothing here asserts a number.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

__all__ = [
    "QUICK_SIZES",
    "SIZES",
    "SMOKE_SIZES",
    "TARGET_REDUCTION",
    "VARIANTS",
    "MemorySizes",
    "format_table",
    "measure_variant",
    "run",
]

#: How many times less update memory both together should take than today's path.
TARGET_REDUCTION = 3.0
#: variant -> (train.activation_checkpointing, train.lean_logprobs), in table order.
VARIANTS: dict[str, tuple[bool, bool]] = {
    "today": (False, False),
    "checkpointing": (True, False),
    "lean": (False, True),
    "both": (True, True),
}
#: Rows per GRPO group (``rollout.n``) of the benchmark batch.
ROWS_PER_GROUP = 4
#: Seconds one variant's process may run before it is stopped and recorded as failed.
VARIANT_TIMEOUT_S = 3600


@dataclass(frozen=True)
class MemorySizes:
    """The model and the micro-batch; every size names its unit."""

    vocab_size: int = 151936  # tokens in the vocabulary (Qwen2.5's)
    hidden_size: int = 256
    intermediate_size: int = 1024
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    tokens: int = 8192  # tokens in the one micro-batch of the update
    row_tokens: int = 1024  # tokens per row; tokens // row_tokens rows

    def shape(self) -> dict:
        """The model's config.json: Qwen2.5-0.5B's (``rollout.models.SHAPES``) with this
        body and vocabulary, and the special ids of the shipped tokenizer that
        ``write_random_model`` puts next to it (within any vocabulary size)."""
        from rollout.models import SHAPES

        body = {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "vocab_size": self.vocab_size,
            "pad_token_id": 3,
            "eos_token_id": 2,
            "bos_token_id": None,
        }
        return {**SHAPES["qwen2.5-0.5b"], **body}


SIZES = MemorySizes()
#: ``--quick``: the same model, a quarter of the tokens.
QUICK_SIZES = MemorySizes(tokens=2048, row_tokens=512)
#: The smallest form (tests): seconds per variant, same code.
SMOKE_SIZES = MemorySizes(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    tokens=256,
    row_tokens=64,
)


# ----------------------------------------------------------------------------- one variant


def _proc_status_bytes(field: str) -> int | None:
    """``VmRSS`` / ``VmHWM`` of this process from /proc/self/status (bytes), None elsewhere."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    found = re.search(rf"^{field}:\s+(\d+)\s+kB", text, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS (VmHWM) of this process; False where that is impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _proc_status_bytes("VmHWM") is not None


def _lifetime_peak_rss() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * (
        1 if sys.platform == "darwin" else 1024
    )


def _batch(sizes: MemorySizes, seed: int):
    """``tokens // row_tokens`` rows of exactly ``row_tokens`` tokens (``bench.train.make_rows``
    with no length spread), GRPO groups of ``ROWS_PER_GROUP`` with random scores."""
    from batching import StepBatch
    from bench.packed import trainer_rows
    from bench.train import make_rows

    num_rows = max(1, sizes.tokens // sizes.row_tokens)
    rows = make_rows(
        num_rows,
        vocab_size=sizes.vocab_size,
        seed=seed,
        median_tokens=sizes.row_tokens,
        sigma=0.0,
        min_tokens=sizes.row_tokens,
        max_tokens=sizes.row_tokens,
    )
    scores = np.random.default_rng(seed + 1).random(num_rows)
    return StepBatch.from_rows(trainer_rows(rows, rows_per_group=ROWS_PER_GROUP, scores=scores))


def measure_variant(
    variant: str, model_dir: str | Path, sizes: MemorySizes, seed: int = 0, device: str = "auto"
) -> dict:
    """One update of ``variant`` (a ``VARIANTS`` key) in THIS process: bytes resident before
    it, its peak, the difference, seconds, and the loss and grad norm (the four variants compute
    the same update). Run it in a fresh process; ``run`` does."""
    import hal
    from trainer.config import load_config
    from trainer.loop.cluster.group import free_port
    from trainer.loop.ranks.fsdp_worker import WorkerSpec
    from trainer.loop.ranks.policy import PolicyWorker

    checkpointing, lean = VARIANTS[variant]
    backend = hal.get_backend(device)
    cfg = load_config(
        None,
        [
            f"device={backend.name}",
            f"model.path={model_dir}",
            f"seed={seed}",
            "train.dp_size=1",
            "train.lr=1e-6",
            "train.grad_clip=1.0",
            # bf16 compute where the hardware has it, as every accelerator config trains
            f"train.param_dtype={'bfloat16' if backend.is_accelerator else 'float32'}",
            "train.reduce_dtype=float32",
            f"train.max_tokens_per_micro_batch={sizes.tokens}",
            "algorithm.use_kl_loss=false",
            "algorithm.kl_coef=0.0",
            "run.deterministic=false",
            f"train.activation_checkpointing={str(checkpointing).lower()}",
            f"train.lean_logprobs={str(lean).lower()}",
        ],
    )
    batch = _batch(sizes, seed)
    rows = list(range(batch.num_rows))
    worker = PolicyWorker(WorkerSpec(role="actor", rank=0, cfg=cfg))
    try:
        worker.setup("127.0.0.1", free_port())
        worker.load_batch([batch.to_numpy()])
        worker.set_token_field("old_logprobs", [worker.compute_logprobs([rows])])
        worker.compute_advantages()
        gc.collect()
        backend.synchronize()
        if backend.is_accelerator:
            before = backend.memory_stats()["allocated"]
            backend.reset_peak_memory()
            reset = True
            peak_source = "device peak allocated (HAL peak_memory_bytes)"
        else:
            before = _proc_status_bytes("VmRSS") or 0
            reset = _reset_peak_rss()
            peak_source = "VmHWM reset before the update" if reset else "lifetime peak RSS"
        start = time.perf_counter()
        report = worker.train_mini_batch([rows], rows)
        backend.synchronize()
        seconds = time.perf_counter() - start
        if backend.is_accelerator:
            peak = backend.peak_memory_bytes()
        else:
            peak = _proc_status_bytes("VmHWM") if reset else _lifetime_peak_rss()
    finally:
        worker.shutdown()
    return {
        "variant": variant,
        "activation_checkpointing": checkpointing,
        "lean_logprobs": lean,
        "device": backend.name,
        "param_dtype": cfg.train.param_dtype,
        "tokens": int(batch.num_tokens),
        "rows": int(batch.num_rows),
        "before_gb": before / 1e9,
        "peak_gb": peak / 1e9,
        "update_gb": (peak - before) / 1e9,
        "peak_source": peak_source,
        "seconds": seconds,
        "loss": report.values["loss"],
        "grad_norm": report.values["grad_norm"],
    }


# ----------------------------------------------------------------------------- all variants


def _in_fresh_process(variant: str, model_dir: Path, sizes: MemorySizes, seed: int) -> dict:
    """``measure_variant`` in a new Python process; its result, or ``{"error": ...}``."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [
        sys.executable,
        "-m",
        "bench.memory",
        "--variant",
        variant,
        "--model-dir",
        str(model_dir),
        "--sizes",
        json.dumps(asdict(sizes)),
        "--seed",
        str(seed),
    ]
    try:
        proc = subprocess.run(
            cmd, cwd=root, env=env, capture_output=True, text=True, timeout=VARIANT_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return {"variant": variant, "error": f"timed out after {VARIANT_TIMEOUT_S} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        # -9: killed, most likely by the kernel's out-of-memory killer
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"variant": variant, "error": f"exit {proc.returncode}: {' | '.join(tail)}"}
    return json.loads(lines[-1])


def run(quick: bool = False, sizes: MemorySizes | None = None, seed: int = 0) -> dict:
    """All ``VARIANTS`` on one random-weight model (written to a temporary directory and
    removed after), each in a fresh process. ``sizes``: None = ``QUICK_SIZES`` if ``quick``
    else ``SIZES``. Returns the sizes, one result per variant, each variant's reduction
    against today's path and whether both together meet ``TARGET_REDUCTION``."""
    import shutil

    from rollout.models import write_random_model

    sizes = sizes or (QUICK_SIZES if quick else SIZES)
    tmp = Path(tempfile.mkdtemp(prefix="crossrl-bench-memory-"))
    try:
        model_dir = write_random_model(tmp / "model", sizes.shape(), seed=seed)
        variants = {name: _in_fresh_process(name, model_dir, sizes, seed) for name in VARIANTS}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    today = variants["today"].get("update_gb")
    for result in variants.values():
        if today and result.get("update_gb"):
            result["reduction"] = today / result["update_gb"]
    both = variants["both"].get("reduction")
    norms = [v["grad_norm"] for v in variants.values() if "grad_norm" in v]
    return {
        "sizes": asdict(sizes),
        "variants": variants,
        "same_update": len(norms) == len(VARIANTS)
        and max(norms) - min(norms) <= 1e-4 * max(abs(n) for n in norms),
        "target": TARGET_REDUCTION,
        "meets_target": both is not None and both >= TARGET_REDUCTION,
    }


def format_table(res: dict) -> str:
    """One line per variant: switches, memory before / peak / update, reduction, seconds."""
    s = res["sizes"]
    first = next((v for v in res["variants"].values() if "error" not in v), {})
    lines = [
        f"one actor update (PolicyWorker, dp 1, {first.get('device', '?')}, "
        f"{first.get('param_dtype', '?')} compute): {s['tokens']:,}-token micro-batch "
        f"({first.get('rows', '?')} rows), vocabulary {s['vocab_size']:,}, hidden "
        f"{s['hidden_size']}, {s['num_hidden_layers']} layers; memory: "
        f"{first.get('peak_source', '?')}",
        f"{'variant':15s}{'act. ckpt':>10s}{'lean lp':>9s}{'before GB':>11s}{'peak GB':>10s}"
        f"{'update GB':>11s}{'vs today':>10s}{'seconds':>9s}{'grad norm':>12s}",
    ]
    for name, v in res["variants"].items():
        if "error" in v:
            lines.append(f"{name:15s} FAILED: {v['error']}")
            continue
        lines.append(
            f"{name:15s}{'on' if v['activation_checkpointing'] else 'off':>10s}"
            f"{'on' if v['lean_logprobs'] else 'off':>9s}{v['before_gb']:>11.2f}"
            f"{v['peak_gb']:>10.2f}{v['update_gb']:>11.2f}"
            f"{v.get('reduction', float('nan')):>9.1f}x{v['seconds']:>9.1f}{v['grad_norm']:>12.6f}"
        )
    both = res["variants"]["both"].get("reduction")
    verdict = "meets" if res["meets_target"] else "MISSES"
    lines.append(
        f"both together: {both or float('nan'):.1f}x less update memory than today's path; "
        f"{verdict} the {res['target']:.0f}x target; same update in every variant "
        f"(grad norms agree): {res['same_update']}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.memory [--quick]``: the table. With ``--variant`` (what ``run``
    starts): one variant in this process, its result as one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the tokens")
    parser.add_argument(
        "--tokens", type=int, help=f"tokens in the micro-batch (default {SIZES.tokens})"
    )
    parser.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant is None:
        sizes = QUICK_SIZES if args.quick else SIZES
        if args.tokens:
            sizes = replace(
                sizes, tokens=args.tokens, row_tokens=min(sizes.row_tokens, args.tokens)
            )
        print(format_table(run(sizes=sizes, seed=args.seed)))
        return 0
    sizes = MemorySizes(**json.loads(args.sizes)) if args.sizes else SIZES
    result = measure_variant(args.variant, args.model_dir, sizes, seed=args.seed)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
