"""The long-tail agent workload: seconds per step when the slowest trajectory sets a step's
length, for every schedule crossrl has (the baseline the streaming rollouts of issue 36 are to
beat).

    python -m bench longtail [--quick]

The CPU default job in ``rollout.envs.longtail`` (``LONGTAIL``: heavy-tailed turns up to 6,
answers up to 6 digits, tool waits of median 20 ms up to 2 s, all seeded), run as
``crossrl train`` subprocesses (``bench.e2e.run_job``) in alternation: lag 0 with colocated
engines, and lag 1 with the engine on a CPU of its own beside the one training rank
(``bench.pipeline.LAGGED``). The figures: the median seconds per step over the steps after each
run's first, the median share of the step spent waiting for the rollout, and ``reward/mean``
over the last 5 steps. Nothing here asserts a time.
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
SCHEDULES = {
    "lag 0, colocated": [],
    "lag 1, engine of its own": [
        "rollout.engine_devices=1",
        "train.rollout_lag=1",
        "algorithm.rollout_correction=token",
    ],
}
TAIL_STEPS = 5


def run(quick: bool = False) -> dict:
    """Each schedule of ``SCHEDULES`` on ``LONGTAIL``, alternating (module docstring)."""
    from bench.e2e import run_job

    steps, rounds = (6, 1) if quick else (12, 2)
    names = list(SCHEDULES)
    order = [n for i in range(rounds) for n in (names if i % 2 == 0 else names[::-1])]
    runs: dict[str, list[list[dict]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="crossrl-longtail-") as tmp:
        for i, name in enumerate(order):
            where = Path(tmp) / f"run_{i}"
            where.mkdir()
            job = [*LONGTAIL, *SCHEDULES[name], f"train.total_steps={steps}"]
            runs[name].append(run_job(job, where)["records"])
    rows = {}
    for name, records in runs.items():
        after_first = [r for rec in records for r in rec[1:]]
        rows[name] = {
            "step_s": statistics.median(r["timing/step_s"] for r in after_first),
            "rollout_share": statistics.median(r["timing/rollout_share"] for r in after_first),
            "reward_tail": statistics.mean(
                r["reward/mean"] for rec in records for r in rec[-TAIL_STEPS:]
            ),
        }
    return {"steps": steps, "rounds": rounds, "rows": rows}


def format_table(result: dict) -> str:
    """The schedules as a markdown table, each against lag 0."""
    rows = result["rows"]
    base = rows["lag 0, colocated"]["step_s"]
    lines = [
        f"{result['steps']} steps, {result['rounds']} run(s) each, alternating",
        "",
        "| schedule | s/step | vs lag 0 | rollout share of a step | reward, last 5 steps |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['step_s']:.2f} | {row['step_s'] / base:.2f}x | "
            f"{row['rollout_share']:.2f} | {row['reward_tail']:.3f} |"
        )
    return "\n".join(lines)
