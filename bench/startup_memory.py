"""Peak host memory of a dp-rank training start-up: ``PolicyWorker.setup`` (process group, model
built, sharded and loaded, optimizer) on every rank of one node, CPU backend.

    python -m bench.startup_memory [--baseline-tree DIR] [--dp 2] [--layers 12] [--model-dir D]

Each rank is a spawned process; it reports its resident set size (RSS) after the imports and
its peak RSS at the end of ``setup``, in MB (1e6 bytes). The start-up's own memory is the
difference. ``--baseline-tree`` runs the same start-up with another checkout's trainer (e.g.
the commit before meta-device loading) side by side in this invocation. The model is a random
Qwen2-shaped one written once (``rollout.models.write_random_model``) into ``--model-dir`` or a
temporary directory, stored in bf16 like published checkpoints (``--dtype``): the trainer
loads fp32 master weights, so each full read is a private fp32 copy. (A float32 file that
``from_pretrained`` memory-maps is shared page cache, counted in every rank's RSS.)
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

#: ~100M parameters at 12 layers (0.4 GB in fp32): big enough to see copies of the model.
SHAPE = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}


def _rss_mb() -> float:
    """This process's resident set size now (Linux), in MB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 1e6


def _rank(rank: int, dp: int, port: int, model_dir: str, tree: str | None, queue) -> None:
    if tree:  # import the trainer from the other checkout
        sys.path.insert(0, tree)
    import torch

    from trainer.config import load_config
    from trainer.loop.ranks.fsdp_worker import WorkerSpec
    from trainer.loop.ranks.policy import PolicyWorker

    torch.set_num_threads(1)
    cfg = load_config(None, ["device=cpu", f"train.dp_size={dp}", f"model.path={model_dir}"])
    worker = PolicyWorker(WorkerSpec(role="actor", rank=rank, cfg=cfg))
    base = _rss_mb()
    start = time.perf_counter()
    facts = worker.setup("127.0.0.1", port)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6  # Linux: KiB
    worker.shutdown()
    queue.put((rank, {"base_mb": base, "peak_mb": peak, "setup_s": seconds, **facts}))


def measure(model_dir: str, dp: int, tree: str | None = None) -> dict:
    """Start ``dp`` ranks on ``model_dir``; per-rank and summed memory figures."""
    import torch.multiprocessing as mp

    from trainer.loop.cluster.group import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, dp, port, model_dir, tree, queue)) for r in range(dp)
    ]
    for p in procs:
        p.start()
    ranks = dict(queue.get(timeout=1200) for _ in procs)
    for p in procs:
        p.join(timeout=120)
    ranks = [ranks[r] for r in range(dp)]
    return {
        "tree": tree or "this checkout",
        "ranks": ranks,
        "num_params": ranks[0]["num_params"],
        "sum_peak_mb": sum(r["peak_mb"] for r in ranks),
        "sum_own_mb": sum(r["peak_mb"] - r["base_mb"] for r in ranks),
    }


def format_table(results: list[dict]) -> str:
    """Markdown table: one line per tree, peak RSS per rank, the start-up's own share."""
    lines = [
        "| trainer | params | rank: RSS after imports -> peak (MB) | sum of peaks (MB) "
        "| start-up's own, summed (MB) | setup s (rank 0) |",
        "|---|---|---|---|---|---|",
    ]
    for res in results:
        per_rank = ", ".join(
            f"{i}: {r['base_mb']:.0f} -> {r['peak_mb']:.0f}" for i, r in enumerate(res["ranks"])
        )
        lines.append(
            f"| {res['tree']} | {res['num_params'] / 1e6:.0f}M | {per_rank} "
            f"| {res['sum_peak_mb']:.0f} | {res['sum_own_mb']:.0f} "
            f"| {res['ranks'][0]['setup_s']:.1f} |"
        )
    if len(results) == 2:
        ratio = results[0]["sum_own_mb"] / max(results[1]["sum_own_mb"], 1e-9)
        lines.append(f"\nstart-up's own host memory, {results[0]['tree']} / this: {ratio:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line; prints the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.startup_memory", description=__doc__)
    parser.add_argument("--baseline-tree", default=None, help="another checkout to compare with")
    parser.add_argument("--dp", type=int, default=2, help="ranks on this node")
    parser.add_argument("--layers", type=int, default=12, help="decoder layers of the model")
    parser.add_argument("--model-dir", default=None, help="reuse (or write) the model here")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="stored weights' dtype (published checkpoints are bf16; the trainer loads fp32)",
    )
    args = parser.parse_args(argv)
    from rollout.models import write_random_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_dir or Path(tmp) / "model")
        if not (model_dir / "config.json").is_file():
            shape = {**SHAPE, "num_hidden_layers": args.layers}
            write_random_model(model_dir, shape, dtype=args.dtype)
        results = []
        if args.baseline_tree:
            results.append(measure(str(model_dir), args.dp, args.baseline_tree))
        results.append(measure(str(model_dir), args.dp))
    print(format_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
