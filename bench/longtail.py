"""The long-tail agent workload: seconds per step when the slowest trajectory sets a step's
length, for every schedule crossrl has, on more than one shape of tail, each beside the same
run with the tools' latency taken out.

    python -m bench longtail [--quick]
    python -m bench.longtail [--steps 30] [--seeds 4] [--schedules 'NAME; ...']
        [--shapes 'NAME; ...'] [--no-latency-free]

The CPU job in ``rollout.envs.longtail`` (``LONGTAIL``), run as ``crossrl train`` subprocesses
(``bench.e2e.run_job``), every (shape, schedule, latency) once per seed, their order alternating
from seed to seed. The shapes (``SHAPES``): heavy-tailed turns up to 6 with a tool wait drawn
per step (median 20 ms, up to 2 s: the default); few turns (up to 3) with one wait per
episode, drawn from a heavier tail (a slow sandbox stays slow); many turns (up to 12). The
schedules (``SCHEDULES``): lag 0 with colocated engines; lag 1 with the engine on a CPU of its
own (``bench.pipeline.LAGGED``); streaming (``train.max_staleness``) s = 1 and 2 on the same
engine of its own, with and without partial rollouts, and s = 1 with partial rollouts on the
colocated engine. Each also runs with the tools' latency taken out (``NO_LATENCY``): how much
of the tail a schedule hides is its time over that run's. The figures: the median seconds per
step over the steps after each run's first, the median share of a step spent waiting for its
rollout, and ``reward/mean`` over the last 5 steps (mean and standard deviation over the
seeds); the least favourable ratios close the table. Nothing here asserts a time.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

__all__ = ["LONGTAIL", "SHAPES", "SCHEDULES", "format_table", "run"]

#: The workload: the long-tail environment (its shape's keys come after these).
LONGTAIL = [
    "rollout.env=rollout.envs.longtail:LongTailEnv",
    "rollout.max_turns=6",
    "run.resume=never",
]
#: shape of the tail -> the environment's keys (``rollout.env_kwargs``) and the turn cap.
SHAPES = {
    "per-step waits, up to 6 turns": [],
    "per-episode waits, up to 3 turns": [
        "rollout.max_turns=3",
        "rollout.env_kwargs.max_turns=3",
        "rollout.env_kwargs.delay_per=episode",
        "rollout.env_kwargs.median_delay_s=0.1",
    ],
    "many turns, up to 12": [
        "rollout.max_turns=12",
        "rollout.env_kwargs.max_turns=12",
        "rollout.env_kwargs.turn_alpha=0.8",
    ],
}
#: The tools answer at once: the same job without its latency.
NO_LATENCY = ["rollout.env_kwargs.median_delay_s=0", "rollout.env_kwargs.max_delay_s=0"]
#: name -> the overrides of each schedule.
OWN_ENGINE = ["rollout.engine_devices=1", "algorithm.rollout_correction=token"]
SCHEDULES = {
    "lag 0, colocated": [],
    "lag 1, engine of its own": [*OWN_ENGINE, "train.rollout_lag=1"],
    "stream s=1, partial": [*OWN_ENGINE, "train.max_staleness=1", "rollout.partial_rollout=true"],
    "stream s=1, whole": [*OWN_ENGINE, "train.max_staleness=1", "rollout.partial_rollout=false"],
    "stream s=2, partial": [*OWN_ENGINE, "train.max_staleness=2", "rollout.partial_rollout=true"],
    "stream s=2, whole": [*OWN_ENGINE, "train.max_staleness=2", "rollout.partial_rollout=false"],
    # the default before rollout.env_concurrency=auto: 64 environment calls at once
    "stream s=1, partial, 64 env calls": [
        *OWN_ENGINE,
        "train.max_staleness=1",
        "rollout.partial_rollout=true",
        "rollout.env_concurrency=64",
    ],
    # run.deterministic=false: each group's turns join the engine's batch as they come, not
    # in waves (a stream promises no identical runs either way: docs/cluster.md)
    "stream s=1, partial, continuous": [
        *OWN_ENGINE,
        "train.max_staleness=1",
        "rollout.partial_rollout=true",
        "run.deterministic=false",
    ],
    # ... with the agent loops in two processes of their own (rollout.agent_workers)
    "stream s=1, partial, continuous, 2 agent workers": [
        *OWN_ENGINE,
        "train.max_staleness=1",
        "rollout.partial_rollout=true",
        "run.deterministic=false",
        "rollout.agent_workers=2",
    ],
    "lag 0, colocated, 2 agent workers": ["rollout.agent_workers=2"],
    "stream s=1, partial, colocated": [
        "algorithm.rollout_correction=token",
        "train.max_staleness=1",
        "rollout.partial_rollout=true",
    ],
}
#: What runs when no schedule is named: lag 0, a fixed lag and the stream.
DEFAULT_SCHEDULES = ["lag 0, colocated", "lag 1, engine of its own", "stream s=1, partial"]
TAIL_STEPS = 5


def job_keys(shape: str, schedule: str, latency: bool) -> list[str]:
    """The overrides of one run: the workload, its shape, the schedule, and (``latency``
    False) the tools answering at once."""
    return [*LONGTAIL, *SHAPES[shape], *SCHEDULES[schedule], *([] if latency else NO_LATENCY)]


def _row(records: list[list[dict]]) -> dict:
    """One run kind's figures over its seeds' records."""
    after_first = [r for rec in records for r in rec[1:]]
    tails = [statistics.mean(r["reward/mean"] for r in rec[-TAIL_STEPS:]) for rec in records]
    dropped = [r.get("stream/groups_dropped", 0.0) for r in after_first]
    return {
        "step_s": statistics.median(r["timing/step_s"] for r in after_first),
        "rollout_share": statistics.median(r["timing/rollout_share"] for r in after_first),
        "reward_tail": statistics.mean(tails),
        "reward_tail_std": statistics.stdev(tails) if len(tails) > 1 else 0.0,
        "groups_dropped_per_step": statistics.mean(dropped),
        "partial_token_share": statistics.mean(
            r.get("stream/partial_token_share", 0.0) for r in after_first
        ),
    }


def run(
    quick: bool = False,
    *,
    steps: int | None = None,
    seeds: int | None = None,
    schedules: list[str] | None = None,
    shapes: list[str] | None = None,
    latency_free: bool = True,
) -> dict:
    """Each schedule (default ``DEFAULT_SCHEDULES``) on each shape (default all of
    ``SHAPES``), with the tools' latency and, ``latency_free``, without it, for ``seeds``
    seeds of ``steps`` steps (defaults: 30 and 4; ``quick``: 6 and 1), alternating. Returns
    ``rows[shape][schedule]`` (with ``free_step_s``, the latency-free run's, when run)."""
    from bench.e2e import run_job

    steps = steps or (6 if quick else 30)
    seeds = seeds or (1 if quick else 4)
    kinds = [
        (shape, name, latency)
        for shape in shapes or list(SHAPES)
        for name in schedules or DEFAULT_SCHEDULES
        for latency in ((True, False) if latency_free else (True,))
    ]
    runs: dict[tuple, list[list[dict]]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory(prefix="crossrl-longtail-") as tmp:
        for seed in range(seeds):
            for kind in kinds if seed % 2 == 0 else kinds[::-1]:
                where = Path(tmp) / f"{seed}-{abs(hash(kind))}"
                where.mkdir()
                job = [*job_keys(*kind), f"train.total_steps={steps}", f"seed={seed}"]
                runs[kind].append(run_job(job, where)["records"])
    rows: dict[str, dict[str, dict]] = {}
    for (shape, name, latency), records in runs.items():
        if latency:
            rows.setdefault(shape, {})[name] = _row(records)
    for (shape, name, latency), records in runs.items():
        if not latency:
            rows[shape][name]["free_step_s"] = _row(records)["step_s"]
    return {"steps": steps, "seeds": seeds, "rows": rows}


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value and base else "-"


def format_table(result: dict) -> str:
    """The schedules of each shape as one markdown table, each against lag 0 and lag 1 of its
    shape and against its own latency-free run; the least favourable ratios last."""
    lines = [
        f"{result['steps']} steps x {result['seeds']} seed(s) per run, alternating",
        "",
        "| tail shape | schedule | s/step | vs lag 0 | vs lag 1 | vs itself without the tools' "
        "latency | rollout share of a step | groups dropped / step | partial-rollout tokens | "
        "reward, last 5 steps (mean +- sd over seeds) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    worst: dict[str, tuple[float, str]] = {}
    for shape, rows in result["rows"].items():
        base = rows.get("lag 0, colocated", {}).get("step_s")
        lag1 = rows.get("lag 1, engine of its own", {}).get("step_s")
        for name, row in rows.items():
            free = row.get("free_step_s")
            lines.append(
                f"| {shape} | {name} | {row['step_s']:.2f} | {_ratio(row['step_s'], base)} | "
                f"{_ratio(row['step_s'], lag1)} | {_ratio(row['step_s'], free)} | "
                f"{row['rollout_share']:.2f} | {row['groups_dropped_per_step']:.1f} | "
                f"{row['partial_token_share']:.2f} | "
                f"{row['reward_tail']:.3f} +- {row['reward_tail_std']:.3f} |"
            )
            for what, ratio in (("vs lag 0", base), ("vs itself without latency", free)):
                if name.startswith("stream") and ratio:
                    value = row["step_s"] / ratio
                    if value > worst.get(what, (0.0, ""))[0]:
                        worst[what] = (value, f"{shape}, {name}")
    for what, (value, where) in worst.items():
        lines.append(f"\nleast favourable stream {what}: {value:.2f}x ({where})")
    return "\n".join(lines)


def _names(text: str | None, known: dict, flag: str) -> list[str] | None:
    """Semicolon-separated names (they hold commas) checked against ``known``."""
    names = [n.strip() for n in (text or "").split(";") if n.strip()] or None
    bad = [n for n in names or [] if n not in known]
    if bad:
        raise ValueError(f"bench.longtail: {flag} {bad[0]!r} unknown; use {list(known)}")
    return names


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.longtail``: the table, and the result as JSON (``--json``)."""
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 steps, 1 seed")
    parser.add_argument("--steps", type=int, help="training steps per run (default 30)")
    parser.add_argument("--seeds", type=int, help="seeds per run kind (default 4)")
    parser.add_argument("--schedules", help=f"semicolon list of: {'; '.join(SCHEDULES)}")
    parser.add_argument("--shapes", help=f"semicolon list of: {'; '.join(SHAPES)}")
    parser.add_argument(
        "--no-latency-free", action="store_true", help="skip the runs without the tools' latency"
    )
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    try:
        schedules = _names(args.schedules, SCHEDULES, "--schedules")
        shapes = _names(args.shapes, SHAPES, "--shapes")
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    res = run(
        args.quick,
        steps=args.steps,
        seeds=args.seeds,
        schedules=schedules,
        shapes=shapes,
        latency_free=not args.no_latency_free,
    )
    print(format_table(res))
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
