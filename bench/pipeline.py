"""The fixed-lag pipeline: seconds per step at ``train.rollout_lag=1`` against lag 0 on the same
devices, and the default job's reward curve at both lags.

    python -m bench pipeline [--quick]

1. ``slow_tool``: the rollout benchmark's workload (``bench rollout``: 16 prompts x n 8 x 4
   turns on ``builtin:tiny``, every environment step a seeded 0-200 ms wait, ``sleepy``) as a
   training job, the engine on a CPU of its own (``rollout.engine_devices=1``) beside one
   training rank, at lag 0 and lag 1: the same devices in total, only the schedule differs.
   Runs alternate (lag0 lag1 lag1 lag0 ... without --quick), each a ``crossrl train``
   subprocess (``bench.e2e.run_job``); the figure is the ratio of the median seconds per step
   over the steps after each run's first (target: at most 0.6).
2. ``reward``: the CPU default job for 30 steps (10 with --quick) at lag 0 and lag 1, seeds 1
   to 4 (1 and 2 with --quick): ``reward/mean`` averaged over the last 5 steps, so the lag's
   effect can be read against the seed-to-seed spread; with ``--keep`` the run directories
   stay for ``crossrl plot``.
3. ``validation`` (``--validation``, alone): what a validation costs a lagged run. A
   single-turn job (``bench.peer``'s prompt file, its reward after a seeded 0-0.5 s wait
   (``slow_recall_reward``: a slow judge), 16 prompts x n 8, 32 new tokens, 5 epochs of 8
   optimizer steps per step, so the ranks train longer than the engine samples) at lag 1
   for 8 steps, with ``run.val_every=2`` (four
   validations of 32 prompts x 4) and without, 3 alternating rounds; the figure is the extra wall seconds per validation (each run's
   wall time less its start-up, ``timing/startup_s``).
   ``--before DIR`` runs the same jobs, alternating, from another checkout too (e.g. a
   ``git worktree`` of the commit before a change), so the two are measured side by side.
Nothing here asserts a time.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
import zlib
from pathlib import Path

__all__ = ["LAGGED", "SLOW_TOOL", "format_table", "run"]

#: Engines on a device of their own, with the importance weights a lag needs.
LAGGED = ["rollout.engine_devices=1", "algorithm.rollout_correction=token", "run.resume=never"]
#: ``bench rollout``'s workload as a training job.
SLOW_TOOL = [
    "rollout.env=rollout.envs.sleepy:SleepyEnv",
    "rollout.env_kwargs={turns: 4, max_delay_s: 0.2}",
    "rollout.max_turns=4",
    "rollout.max_new_tokens=8",
    "train.batch_size=16",
    "train.mini_batch_size=8",
    "rollout.n=8",
]
#: Steps the reward curves average over, at the end of each run.
TAIL_STEPS = 5
#: Seeds of the reward runs (the run-to-run noise is their spread); --quick takes two.
SEEDS = (1, 2, 3, 4)


def _job(overrides: list[str], where: Path) -> dict:
    """``bench.e2e.run_job`` in the folder ``where``, made first."""
    from bench.e2e import run_job

    where.mkdir(parents=True, exist_ok=True)
    return run_job(overrides, where)


def _slow_tool(quick: bool, workdir: Path) -> dict:
    from bench.e2e import summarise_runs

    steps, order = (3, (0, 1)) if quick else (6, (0, 1, 1, 0))
    runs: dict[int, list] = {0: [], 1: []}
    commands = {}
    for i, lag in enumerate(order):
        job = _job(
            [*LAGGED, *SLOW_TOOL, f"train.total_steps={steps}", f"train.rollout_lag={lag}"],
            workdir / f"slow_tool_{i}",
        )
        runs[lag].append(job["records"])
        commands[lag] = job["command"]
    summary = {lag: summarise_runs(records) for lag, records in runs.items()}
    return {
        "steps": steps,
        "order": list(order),
        "commands": {f"lag{k}": v for k, v in commands.items()},
        "lag0": summary[0],
        "lag1": summary[1],
        "ratio": summary[1]["step_s"] / summary[0]["step_s"],
    }


def _reward(quick: bool, workdir: Path, keep: Path | None) -> dict:
    steps, seeds = (10, (1, 2)) if quick else (30, SEEDS)
    out: dict = {"steps": steps, "seeds": list(seeds), "runs": {}}
    for seed in seeds:
        for lag in (0, 1):
            name = f"lag{lag}_seed{seed}"
            where = (keep or workdir) / name
            job = _job(
                [*LAGGED, f"train.total_steps={steps}", f"train.rollout_lag={lag}", f"seed={seed}"],
                where,
            )
            rewards = [r["reward/mean"] for r in job["records"]]
            out["runs"][name] = {
                "command": job["command"],
                "run_dir": str(where / "run") if keep else None,
                "reward_tail": statistics.fmean(rewards[-TAIL_STEPS:]),
                "reward_first": rewards[0],
            }
    tail = {name: r["reward_tail"] for name, r in out["runs"].items()}
    for lag in (0, 1):
        values = [tail[f"lag{lag}_seed{s}"] for s in seeds]
        out[f"lag{lag}_mean"] = statistics.fmean(values)
        out[f"lag{lag}_std"] = statistics.stdev(values)
    out["lag_gap"] = [tail[f"lag1_seed{s}"] - tail[f"lag0_seed{s}"] for s in seeds]
    return out


def slow_recall_reward(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
    """``bench.peer:recall_reward`` after a wait of 0 to ``SLOW_REWARD_MAX_S`` seconds, seeded
    by the reply (a judge or a sandbox as slow as ``bench rollout``'s tools), so a rollout and
    a validation take long enough for the schedule around them to show."""
    from bench.peer_task import recall_reward

    time.sleep(random.Random(zlib.crc32(solution_str.encode())).uniform(0.0, SLOW_REWARD_MAX_S))
    return recall_reward(data_source, solution_str, ground_truth, extra_info)


#: The longest wait of ``slow_recall_reward``, in seconds.
SLOW_REWARD_MAX_S = 0.5

#: ``validation``: the job, and the validation keys it runs with and without.
VAL_STEPS = 8
VAL_EVERY = 2


def _validation_keys(workdir: Path) -> tuple[list[str], list[str]]:
    from bench.peer_task import write_prompts

    train = write_prompts(workdir / "train.jsonl", seed=1)
    val = write_prompts(workdir / "val.jsonl", seed=2, rows=32)
    job = [
        *LAGGED,
        "train.rollout_lag=1",
        f"data.source={train}",
        "rollout.env=single_turn",
        "reward.function=bench.pipeline:slow_recall_reward",
        "rollout.max_turns=1",
        "rollout.max_new_tokens=32",
        "train.batch_size=16",
        "train.mini_batch_size=2",
        "train.ppo_epochs=5",
        "rollout.n=8",
        f"train.total_steps={VAL_STEPS}",
        "run.save_every=0",
    ]
    val_keys = [f"data.val_source={val}", f"run.val_every={VAL_EVERY}", "rollout.val_n=4"]
    return job, val_keys


def validation_cost(workdir: Path, before: str | None = None, rounds: int = 3) -> dict:
    """Part 3 (module docstring): per code (``after``: this checkout; ``before``: the
    checkout at ``before``, when given), the median wall seconds after start-up of the job
    with and without validation over ``rounds`` alternating rounds, and the extra seconds
    per validation."""
    from bench.e2e import run_job

    job, val_keys = _validation_keys(workdir)
    sources = {"after": None, **({"before": before} if before else {})}
    walls: dict[str, dict[str, list[float]]] = {code: {"plain": [], "val": []} for code in sources}
    for i in range(rounds):
        for code, source in sources.items():
            for kind in ("plain", "val") if i % 2 == 0 else ("val", "plain"):
                keys = [*job, *(val_keys if kind == "val" else [])]
                where = workdir / f"{code}_{kind}_{i}"
                where.mkdir(parents=True)
                job_run = run_job(keys, where, source=source)
                # The process's wall time less its start-up (most of it, and the noisiest).
                startup = job_run["records"][0].get("timing/startup_s", 0.0)
                walls[code][kind].append(job_run["wall_s"] - startup)
    validations = VAL_STEPS // VAL_EVERY
    out: dict = {"rounds": rounds, "validations": validations, "steps": VAL_STEPS}
    for code, w in walls.items():
        plain, val = statistics.median(w["plain"]), statistics.median(w["val"])
        out[code] = {
            "plain_s": plain,
            "val_s": val,
            "per_validation_s": (val - plain) / validations,
        }
    return out


def run(quick: bool = False, keep: str | None = None) -> dict:
    """Both measurements (module docstring); ``keep``: a folder that keeps the reward runs'
    directories (for ``crossrl plot``), else they go with a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="crossrl-bench-pipeline-") as tmp:
        workdir = Path(tmp)
        return {
            "slow_tool": _slow_tool(quick, workdir),
            "reward": _reward(quick, workdir, Path(keep) if keep else None),
        }


def format_table(res: dict) -> str:
    """The two measurements as text tables."""
    slow = res["slow_tool"]
    lines = [
        f"slow-tool job, {slow['steps']} steps per run, runs in order "
        f"{' '.join(f'lag{k}' for k in slow['order'])}:",
        f"{'':6} {'step_s':>8} {'rollout_s':>10} {'prepare_s':>10} {'update_s':>9} {'sync_s':>7}",
    ]
    for lag in ("lag0", "lag1"):
        s = slow[lag]
        sec = {name: v["median_s"] for name, v in s["sections"].items()}
        lines.append(
            f"{lag:6} {s['step_s']:8.2f} {sec['rollout']:10.2f} {sec['prepare']:10.2f} "
            f"{sec['update']:9.2f} {sec['sync']:7.2f}"
        )
    lines.append(f"lag1 / lag0 seconds per step: {slow['ratio']:.2f}x (target <= 0.6x)")
    rew = res["reward"]
    lines.append(f"default job, reward/mean over the last {TAIL_STEPS} of {rew['steps']} steps:")
    for name, r in rew["runs"].items():
        lines.append(f"  {name:12} {r['reward_tail']:.3f} (step 1: {r['reward_first']:.3f})")
    lines.append(
        f"  lag0 {rew['lag0_mean']:.3f} +- {rew['lag0_std']:.3f}, lag1 {rew['lag1_mean']:.3f} "
        f"+- {rew['lag1_std']:.3f} (mean +- std over seeds {rew['seeds']}); lag1 - lag0 per "
        f"seed: {', '.join(f'{g:+.3f}' for g in rew['lag_gap'])}"
    )
    return "\n".join(lines)


def main() -> None:
    """``python -m bench.pipeline [--quick] [--keep DIR]``: run and print the tables."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--keep", help="keep the reward runs' directories here")
    parser.add_argument(
        "--validation", action="store_true", help="only part 3: a validation's cost at lag 1"
    )
    parser.add_argument("--before", help="part 3 also from this checkout (the code before)")
    args = parser.parse_args()
    if args.validation:
        with tempfile.TemporaryDirectory(prefix="crossrl-bench-val-") as tmp:
            print(format_validation(validation_cost(Path(tmp), args.before)))
        return
    print(format_table(run(quick=args.quick, keep=args.keep)))


def format_validation(res: dict) -> str:
    """Part 3 as a text table."""
    lines = [
        f"lag-1 single-turn job, {res['steps']} steps, {res['validations']} validations, "
        f"median of {res['rounds']} alternating runs each (wall seconds after start-up):",
        f"{'code':8} {'no val':>8} {'val':>8} {'per validation':>15}",
    ]
    for code in ("before", "after"):
        if code in res:
            r = res[code]
            lines.append(
                f"{code:8} {r['plain_s']:8.2f} {r['val_s']:8.2f} {r['per_validation_s']:15.2f}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
