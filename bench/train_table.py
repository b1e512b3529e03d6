"""``bench.train``'s table: per model, packed against padded: micro-batches, computed tokens,
token efficiency, update seconds and tokens/s, the throughput ratio against its target, and
how far the two layouts' losses, log-probs and gradients differ."""

from __future__ import annotations

import statistics

__all__ = ["format_table"]


def format_table(res: dict) -> str:
    """The benchmark's results as a plain-text table (one block per model)."""
    lines = [
        f"rows: {res['workload']['lengths']}; loss: {res['workload']['loss']}; "
        f"{res['torch_threads']} torch thread(s)",
        f"packed: {res['workload'].get('packed', 'crossrl layout')}",
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
            ("loss, last repeat", f"{loss['packed'][-1]:.7f}", f"{loss['padded'][-1]:.7f}"),
        ]
        if "logprob_mean_packed" in loss:
            table.append(
                (
                    "mean log-prob, last repeat",
                    f"{loss['logprob_mean_packed'][-1]:.7f}",
                    f"{loss['logprob_mean_padded'][-1]:.7f}",
                )
            )
        table.append(
            (
                "grad norm, first repeat",
                f"{loss['grad_norm_packed']:.6f}",
                f"{loss['grad_norm_padded']:.6f}",
            )
        )
        lines += [f"{label:30s}{a:>14s}{b:>14s}" for label, a, b in table]
        verdict = "meets" if s["meets_target"] else "MISSES"
        lines.append(
            f"packed / padded throughput: median {s['median']:.2f}x "
            f"(min {s['min']:.2f}, max {s['max']:.2f}); {verdict} the {s['target']}x target; "
            f"process CPU time ratio median {s['cpu_time_median']:.2f}x"
        )
        same = "identical" if loss["identical"] else "DIFFERENT"
        lines.append(
            f"losses {same}: max |packed - padded| {loss['max_abs_diff']:.2e} (loss), "
            f"{loss.get('logprob_max_abs_diff', float('nan')):.2e} (mean log-prob) over "
            f"{m['repeats']} repeats (tolerance {loss['tolerance']:.0e}); "
            f"max |grad diff| {loss['grad_max_abs_diff']:.2e}"
        )
    return "\n".join(lines)
