"""Planner benchmark: crossrl's `plan_minibatches` against a baseline of the kind public
trainers use, side by side on one seeded agentic workload.

    python -m bench.planner [--quick]

Workload: 100k trajectories of 1-20 turns (one row per turn, ~1M rows), long-tailed row
lengths 50-16k tokens (log-normal, clipped), rows shuffled; dp 16, 256 trajectories per
mini-batch, 32k-token micro-batch budget. Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import heapq
import time

import numpy as np

from batching import plan_minibatches

__all__ = ["baseline_plan", "format_table", "make_workload", "run"]


def make_workload(
    num_trajectories: int, seed: int = 0, max_turns: int = 20
) -> tuple[np.ndarray, np.ndarray]:
    """(trajectory id per row, tokens per row), rows shuffled."""
    rng = np.random.default_rng(seed)
    turns = rng.integers(1, max_turns + 1, num_trajectories)
    traj = np.repeat(np.arange(num_trajectories, dtype=np.int64), turns)
    lens = np.exp(rng.normal(np.log(600.0), 1.0, traj.size))
    lens = np.clip(lens, 50, 16384).astype(np.int64)
    perm = rng.permutation(traj.size)
    return traj[perm], lens[perm]


def baseline_plan(
    trajectory_ids: list[int], seq_lens: list[int], mini_batch_size: int, dp_size: int, budget: int
) -> list[list[list[list[int]]]]:
    """What public trainers typically do, in pure Python: trajectories chunked into
    mini-batches in arrival order; per mini-batch, rows sorted by length and dealt to ranks
    with a greedy min-heap; per rank, sequential greedy micro-batches (a new one whenever the
    next row would overflow the budget); ranks with fewer micro-batches get padding rows."""
    rows_of: dict[int, list[int]] = {}
    for i, t in enumerate(trajectory_ids):
        rows_of.setdefault(t, []).append(i)
    trajs = list(rows_of)
    out = []
    for start in range(0, len(trajs), mini_batch_size):
        rows = [i for t in trajs[start : start + mini_batch_size] for i in rows_of[t]]
        rows.sort(key=lambda i: -seq_lens[i])
        heap = [(0, r) for r in range(dp_size)]
        ranks: list[list[int]] = [[] for _ in range(dp_size)]
        for i in rows:
            load, r = heapq.heappop(heap)
            ranks[r].append(i)
            heapq.heappush(heap, (load + seq_lens[i], r))
        micro_of_rank = []
        for rank_rows in ranks:
            micros: list[list[int]] = []
            tokens = budget + 1
            for i in rank_rows:
                if tokens + seq_lens[i] > budget:
                    micros.append([])
                    tokens = 0
                micros[-1].append(i)
                tokens += seq_lens[i]
            micro_of_rank.append(micros)
        k = max(1, max(len(m) for m in micro_of_rank))
        out.append([m + [[-1]] * (k - len(m)) for m in micro_of_rank])
    return out


def layout_stats(layout: list[list[list[list[int]]]], seq_lens: np.ndarray) -> dict[str, float]:
    """Balance and efficiency of a `[mini_batch][rank][k] -> rows` layout (-1 = padding row,
    2 tokens). lockstep_efficiency: mean rank tokens / sum over k of the slowest rank's
    micro-batch k, i.e. how much of the step ranks spend computing rather than waiting."""
    lens = seq_lens.tolist()
    imb, lockstep, padding, computed, micro_max = [], [], 0, 0, 0
    mb_tokens = []
    for ranks in layout:
        per_micro = [[sum(lens[i] if i >= 0 else 2 for i in mc) for mc in rank] for rank in ranks]
        rank_tokens = [sum(m) for m in per_micro]
        mean = sum(rank_tokens) / len(rank_tokens)
        imb.append(max(rank_tokens) / mean)
        k = max(len(m) for m in per_micro)
        slowest = sum(max(m[j] if j < len(m) else 0 for m in per_micro) for j in range(k))
        lockstep.append(mean / slowest)
        padding += sum(1 for rank in ranks for mc in rank for i in mc if i < 0)
        computed += sum(rank_tokens)
        micro_max = max(micro_max, k)
        mb_tokens.append(sum(rank_tokens))
    return {
        "mini_batches": len(layout),
        "dp_imbalance_mean": float(np.mean(imb)),
        "dp_imbalance_worst": float(np.max(imb)),
        "lockstep_efficiency": float(np.mean(lockstep)),
        "token_efficiency": float(seq_lens.sum() / computed),
        "padding_rows": padding,
        "micro_batches_per_rank_max": micro_max,
        "mini_batch_token_spread": float(max(mb_tokens) / np.mean(mb_tokens)),
    }


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def run(quick: bool = False) -> dict:
    """Run both planners on the workload; returns {"workload": ..., "crossrl": ..., "baseline":
    ...} with times in seconds (wall and process CPU) and layout statistics."""
    num_traj = 10_000 if quick else 100_000
    mini_batch_size, dp, budget = 256, 16, 32_768
    traj, lens = make_workload(num_traj)
    plan, wall, cpu = _timed(
        lambda: plan_minibatches(
            traj,
            lens,
            mini_batch_size=mini_batch_size,
            dp_size=dp,
            max_tokens_per_micro_batch=budget,
        )
    )
    ours = {"plan_wall_s": wall, "plan_cpu_s": cpu}
    ours.update(layout_stats([mb.micro_batches for mb in plan.mini_batches], lens))
    traj_l, lens_l = traj.tolist(), lens.tolist()
    layout, wall, cpu = _timed(lambda: baseline_plan(traj_l, lens_l, mini_batch_size, dp, budget))
    base = {"plan_wall_s": wall, "plan_cpu_s": cpu}
    base.update(layout_stats(layout, lens))
    return {
        "workload": {
            "rows": int(lens.size),
            "trajectories": num_traj,
            "tokens": int(lens.sum()),
            "dp_size": dp,
            "mini_batch_size": mini_batch_size,
            "budget_tokens": budget,
        },
        "crossrl": ours,
        "baseline": base,
    }


def format_table(res: dict) -> str:
    """The workload line, crossrl next to the baseline, and the speed ratio (CPU time)."""
    w = res["workload"]
    lines = [
        f"{w['rows']:,} rows, {w['trajectories']:,} trajectories, {w['tokens']:,} tokens; "
        f"dp {w['dp_size']}, {w['mini_batch_size']} trajectories per mini-batch, "
        f"{w['budget_tokens']:,}-token micro-batches",
        f"{'':34s}{'crossrl':>12s}{'baseline':>12s}",
    ]
    keys = [
        ("plan_wall_s", "planning time, wall (s)", "{:.3f}"),
        ("plan_cpu_s", "planning time, CPU (s)", "{:.3f}"),
        ("mini_batches", "mini-batches", "{}"),
        ("dp_imbalance_mean", "dp imbalance, mean (max/mean)", "{:.5f}"),
        ("dp_imbalance_worst", "dp imbalance, worst", "{:.5f}"),
        ("lockstep_efficiency", "lockstep efficiency", "{:.4f}"),
        ("token_efficiency", "token efficiency", "{:.5f}"),
        ("padding_rows", "padding rows", "{}"),
        ("micro_batches_per_rank_max", "micro-batches per rank, max", "{}"),
        ("mini_batch_token_spread", "mini-batch tokens, max/mean", "{:.4f}"),
    ]
    for key, label, fmt in keys:
        a, b = fmt.format(res["crossrl"][key]), fmt.format(res["baseline"][key])
        lines.append(f"{label:34s}{a:>12s}{b:>12s}")
    speed = res["baseline"]["plan_cpu_s"] / res["crossrl"]["plan_cpu_s"]
    lines.append(f"crossrl plans {speed:.1f}x faster (CPU time, same run)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10k trajectories instead of 100k")
    print(format_table(run(quick=parser.parse_args().quick)))


if __name__ == "__main__":
    main()
