"""The long-tail agent workload: seconds per step when the slowest trajectory sets a step's
length, for every schedule crossrl has, and what streaming rollouts (issue 36) buy.

    python -m bench longtail [--quick]
    python -m bench.longtail [--steps 30] [--seeds 4] [--schedules 'NAME; ...']

The CPU default job in ``rollout.envs.longtail`` (``LONGTAIL``: heavy-tailed turns up to 6,
answers up to 6 digits, tool waits of median 20 ms up to 2 s, all seeded), run as
``crossrl train`` subprocesses (``bench.e2e.run_job``), every schedule once per seed, their order
alternating from seed to seed: lag 0 with colocated engines; lag 1 with the engine on a CPU of
its own beside the one training rank (``bench.pipeline.LAGGED``); streaming
(``train.max_staleness`` s = 1 and 2) on the same engine of its own, with and without partial
rollouts, and s = 1 with partial rollouts on the colocated engine (held while the rank
trains). The figures: the median seconds per step over the steps after each run's first, the
median share of a step spent waiting for its rollout, and ``reward/mean`` over the last 5 steps
(mean and standard deviation over the seeds). Nothing here asserts a time.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

__all__ = ["LONGTAIL", "format_table", "run"]

#: The workload: the long-tail environment at its defaults.
LONGTAIL = [
    "rollout.env=rollout.envs.longtail:LongTailEnv",
    "rollout.max_turns=6",
    "run.resume=never",
]
#: name -> the overrides of each schedule.
OWN_ENGINE = ["rollout.engine_devices=1", "algorithm.rollout_correction=token"]
SCHEDULES = {
    "lag 0, colocated": [],
    "lag 1, engine of its own": [*OWN_ENGINE, "train.rollout_lag=1"],
    "stream s=1, partial": [*OWN_ENGINE, "train.max_staleness=1", "rollout.partial_rollout=true"],
    "stream s=1, whole": [*OWN_ENGINE, "train.max_staleness=1", "rollout.partial_rollout=false"],
    "stream s=2, partial": [*OWN_ENGINE, "train.max_staleness=2", "rollout.partial_rollout=true"],
    "stream s=2, whole": [*OWN_ENGINE, "train.max_staleness=2", "rollout.partial_rollout=false"],
    "stream s=1, partial, colocated": [
        "algorithm.rollout_correction=token",
        "train.max_staleness=1",
        "rollout.partial_rollout=true",
    ],
}
TAIL_STEPS = 5


def run(
    quick: bool = False,
    *,
    steps: int | None = None,
    seeds: int | None = None,
    schedules: list[str] | None = None,
) -> dict:
    """Each schedule of ``SCHEDULES`` (or ``schedules``) on ``LONGTAIL`` for ``seeds`` seeds of
    ``steps`` steps (defaults: 30 and 4; ``quick``: 6 and 1), alternating (module docstring)."""
    from bench.e2e import run_job

    steps = steps or (6 if quick else 30)
    seeds = seeds or (1 if quick else 4)
    names = schedules or list(SCHEDULES)
    runs: dict[str, list[list[dict]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="crossrl-longtail-") as tmp:
        for seed in range(seeds):
            for name in names if seed % 2 == 0 else names[::-1]:
                where = Path(tmp) / f"{len(runs[name])}-{name.replace(' ', '_')}"
                where.mkdir()
                job = [*LONGTAIL, *SCHEDULES[name], f"train.total_steps={steps}", f"seed={seed}"]
                runs[name].append(run_job(job, where)["records"])
    rows = {}
    for name, records in runs.items():
        after_first = [r for rec in records for r in rec[1:]]
        tails = [statistics.mean(r["reward/mean"] for r in rec[-TAIL_STEPS:]) for rec in records]
        dropped = [r.get("stream/groups_dropped", 0.0) for r in after_first]
        rows[name] = {
            "step_s": statistics.median(r["timing/step_s"] for r in after_first),
            "rollout_share": statistics.median(r["timing/rollout_share"] for r in after_first),
            "reward_tail": statistics.mean(tails),
            "reward_tail_std": statistics.stdev(tails) if len(tails) > 1 else 0.0,
            "groups_dropped_per_step": statistics.mean(dropped),
            "partial_token_share": statistics.mean(
                r.get("stream/partial_token_share", 0.0) for r in after_first
            ),
        }
    return {"steps": steps, "seeds": seeds, "rows": rows}


def format_table(result: dict) -> str:
    """The schedules as a markdown table, each against lag 0 and lag 1 where they ran."""
    rows = result["rows"]
    base = rows.get("lag 0, colocated", {}).get("step_s")
    lag1 = rows.get("lag 1, engine of its own", {}).get("step_s")
    lines = [
        f"{result['steps']} steps x {result['seeds']} seed(s) per schedule, alternating",
        "",
        "| schedule | s/step | vs lag 0 | vs lag 1 | rollout share of a step | groups dropped "
        "/ step | partial-rollout tokens | reward, last 5 steps (mean +- sd over seeds) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        vs0 = f"{row['step_s'] / base:.2f}x" if base else "-"
        vs1 = f"{row['step_s'] / lag1:.2f}x" if lag1 else "-"
        lines.append(
            f"| {name} | {row['step_s']:.2f} | {vs0} | {vs1} | {row['rollout_share']:.2f} | "
            f"{row['groups_dropped_per_step']:.1f} | {row['partial_token_share']:.2f} | "
            f"{row['reward_tail']:.3f} +- {row['reward_tail_std']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.longtail``: the table, and the result as JSON (``--json``)."""
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 steps, 1 seed")
    parser.add_argument("--steps", type=int, help="training steps per run (default 30)")
    parser.add_argument("--seeds", type=int, help="seeds per schedule (default 4)")
    parser.add_argument("--schedules", help=f"semicolon list of: {'; '.join(SCHEDULES)}")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    # the names hold commas ("lag 0, colocated"): they are separated by semicolons
    names = [n.strip() for n in (args.schedules or "").split(";") if n.strip()] or None
    bad = [n for n in names or [] if n not in SCHEDULES]
    if bad:
        print(
            f"bench.longtail: --schedules {bad[0]!r} unknown; use {list(SCHEDULES)}",
            file=sys.stderr,
        )
        return 2
    res = run(args.quick, steps=args.steps, seeds=args.seeds, schedules=names)
    print(format_table(res))
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
