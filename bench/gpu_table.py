"""``bench.gpu``'s table: the measured peak, each timed update's MFU with what each op ran,
the profiler tables, and the rollout rate."""

from __future__ import annotations

__all__ = ["format_table"]


def format_table(res: dict) -> str:
    """Peak, MFU and peak memory of both update settings, and the rollout rate, or the reason
    the benchmark was skipped."""
    if res.get("skipped"):
        return f"skipped: {res['reason']}"
    p, r = res["peak"], res["rollout"]
    first = next(iter(res["update"].values()))
    lines = [
        f"{res['backend']} {res['device_names'][0]}: {res['model']}",
        f"measured bf16 matmul peak ({p['n']}^3): {p['tflops']:.1f} TFLOP/s",
        f"actor update (PolicyWorker, fp32 master weights, bf16 compute, {res['attention']}): "
        f"{first['rows']} rows, {first['tokens']:,} tokens, {first['micro_batches']} "
        f"micro-batches <= {first['budget_tokens']} tokens",
    ]
    for u in res["update"].values():
        ac = "on: " if u["activation_checkpointing"] else "off:"
        ops = ", ".join(f"{op} {name}" for op, name in u["kernel_report"].items())
        lines.append(
            f"  activation checkpointing {ac} kernels {u['kernels']} ({ops}): "
            f"median {u['median_s']:.3f} s, "
            f"{u['tokens_per_s']:,.0f} tokens/s, {u['achieved_tflops']:.1f} TFLOP/s, "
            f"MFU {u['mfu']:.1%}, peak memory {u['peak_memory_gb']:.1f} GB"
        )
    for u in res["update"].values():
        if u.get("profile_table"):
            lines += [
                f"torch.profiler, one update with activation checkpointing on, kernels "
                f"{u['kernels']}:",
                u["profile_table"],
            ]
    lines.append(
        f"HF engine rollout ({r['attention']}): {r['prompts']} prompts x {r['prompt_tokens']} "
        f"tokens, {r['new_tokens']} new tokens each: {r['tokens_per_s']:,.0f} generated "
        f"tokens/s, peak memory {r['peak_memory_gb']:.1f} GB"
    )
    return "\n".join(lines)
