"""crossrl benchmarks: one table per benchmark, every result in one JSON file.

    python -m bench [planner|stepwise|rollout|train|e2e|pipeline|faults|longtail|gpu|memory|head|moe|peer|all ...] [--quick] [--out FILE]
    crossrl bench [which ...] [--quick]

``peer`` (crossrl vs TRL's GRPOTrainer) needs the optional ``bench`` extra and is not part of
``all``; without TRL, asking for it exits 2 with the install line.

Every figure that counts is a ratio measured side by side in the same process (or the same
invocation), with the machine described next to it; see docs/benchmarks.md. Nothing here
asserts a time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from bench.machine import cpu_load, cpu_pressure, describe_machine, machine_line
from rollout.files import atomic_write_text

__all__ = ["BENCHMARKS", "DEFAULT_OUT", "main", "run_benchmarks"]

DEFAULT_OUT = "bench-results.json"
EXIT_BAD_INPUT = 2


def _planner():
    from bench import planner

    return planner.run, planner.format_table


def _stepwise():
    from bench import stepwise

    return stepwise.run, stepwise.format_table


def _rollout():
    from bench import rollout

    return rollout.run, rollout.format_table


def _train():
    from bench import train

    return train.run, train.format_table


def _longtail():
    from bench import longtail

    return longtail.run, longtail.format_table


def _faults():
    from bench import faults

    return faults.run, faults.format_table


def _e2e():
    from bench import e2e

    return e2e.run, e2e.format_table


def _pipeline():
    from bench import pipeline

    return pipeline.run, pipeline.format_table


def _gpu():
    from bench import gpu

    return gpu.run, gpu.format_table


def _memory():
    from bench import memory

    return memory.run, memory.format_table


def _head():
    from bench import head

    return head.run, head.format_table


def _moe():
    from bench import moe

    return moe.run, moe.format_table


def _peer():
    from bench import peer

    return peer.run, peer.format_table


#: name -> (title, loader of (run(quick) -> dict, format_table(dict) -> str)), in `all` order.
BENCHMARKS: dict[str, tuple[str, Callable]] = {
    "planner": ("mini-batch planner vs a greedy baseline", _planner),
    "stepwise": ("row shapes of multi-turn rollouts under four layouts", _stepwise),
    "rollout": ("multi-turn rollout wall time: async agent loop vs lockstep", _rollout),
    "train": ("actor update: packed varlen rows vs padded micro-batches", _train),
    "e2e": ("seconds per step of the default job, dp 1 and dp 2", _e2e),
    "pipeline": ("fixed-lag pipeline: lag 1 vs lag 0 seconds per step, reward curves", _pipeline),
    "faults": ("a worker killed or hung mid-run: seconds lost per fault, fingerprints", _faults),
    "longtail": ("long-tail agent workload: seconds per step at lag 0 and lag 1", _longtail),
    "gpu": ("accelerator: MFU of the actor update, HF rollout tokens/s", _gpu),
    "memory": (
        "actor update memory: activation checkpointing and lean log-probs, alone and together",
        _memory,
    ),
    "head": ("the LM head's log-prob + entropy: fused head vs reference chunks", _head),
    "moe": ("a mixture's experts: the device's grouped-GEMM kernel vs eager experts", _moe),
    "peer": ("crossrl vs TRL's GRPOTrainer: seconds per step of the same job", _peer),
}
#: Benchmarks left out of ``all``, with why: they need an optional extra.
NOT_IN_ALL: dict[str, str] = {"peer": "needs the bench extra (TRL)"}


def _conditions() -> dict:
    return {"load": cpu_load(), "cpu_pressure": cpu_pressure()}


def run_benchmarks(names: list[str], quick: bool, echo: Callable[[str], None] = print) -> dict:
    """Run the named benchmarks in order, echoing each table as it completes.

    Returns ``{"machine": ..., "quick": ..., "benchmarks": {name: {"title", "seconds",
    "before", "after", "result" | "error"}}}``; ``before``/``after`` hold the load average and
    CPU pressure around the benchmark. A benchmark that raises is recorded with its error and
    the others still run.
    """
    machine = describe_machine()
    echo(f"machine: {machine_line(machine)}")
    out: dict = {"machine": machine, "quick": quick, "benchmarks": {}}
    for name in names:
        title, loader = BENCHMARKS[name]
        echo(f"\n== {name}: {title}{' (--quick)' if quick else ''} ==")
        entry: dict = {"title": title, "before": _conditions()}
        start = time.perf_counter()
        try:
            run, format_table = loader()
            entry["result"] = run(quick=quick)
            echo(format_table(entry["result"]))
        except Exception as exc:  # one broken benchmark must not hide the others' results
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()
            echo(f"FAILED: {entry['error']}")
        entry["seconds"] = time.perf_counter() - start
        entry["after"] = _conditions()
        echo(f"({name}: {entry['seconds']:.1f} s)")
        out["benchmarks"][name] = entry
    return out


def _write_json(path: Path, data: dict) -> None:
    """Write atomically: a reader never sees half a results file."""
    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=False) + "\n")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "which",
        nargs="*",
        default=["all"],
        help=f"benchmarks to run: {', '.join(BENCHMARKS)} or all (default: all; all leaves out "
        f"{', '.join(NOT_IN_ALL)})",
    )
    parser.add_argument("--quick", action="store_true", help="smaller workloads (a few minutes)")
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help=f"results JSON file (default: ./{DEFAULT_OUT})"
    )
    return parser.parse_args(argv)


def _resolve(which: list[str]) -> list[str]:
    """Benchmark names in run order, `all` expanded, duplicates dropped; ValueError otherwise."""
    allowed = [*BENCHMARKS, "all"]
    bad = [w for w in which if w not in allowed]
    if bad:
        raise ValueError(
            f"unknown benchmark {bad[0]!r}; choose from {', '.join(allowed)} "
            "(e.g. `crossrl bench train --quick`)"
        )
    wanted = set(which) - {"all"}
    if "all" in which or not which:
        wanted |= set(BENCHMARKS) - set(NOT_IN_ALL)
    return [name for name in BENCHMARKS if name in wanted]


def main(argv: list[str] | None = None) -> int:
    """``python -m bench`` / ``crossrl bench``: returns 0 when every benchmark ran, 1 when one
    failed (its error is in the results file), 2 on a bad argument."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parse(argv)
    except SystemExit as exc:  # argparse already printed the usage error
        return int(exc.code or 0)
    try:
        names = _resolve(args.which)
    except ValueError as err:
        print(f"crossrl bench: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if "peer" in names:
        from bench.peer import TRL_MISSING, trl_available

        if not trl_available():
            print(TRL_MISSING, file=sys.stderr)
            return EXIT_BAD_INPUT
    results = run_benchmarks(names, args.quick)
    results["command"] = " ".join(["python -m bench", *argv])
    out = Path(args.out)
    _write_json(out, results)
    print(f"\nresults: {out.resolve()}")
    return 1 if any("error" in b for b in results["benchmarks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
