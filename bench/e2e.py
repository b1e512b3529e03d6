"""End to end: seconds per step of the default job, split into rollout / prepare / update / sync.

    python -m bench e2e [--quick]

Runs ``crossrl train`` (the CPU default job, configs/cpu/tiny.yaml) as a subprocess in a fresh
run directory under a temporary folder, once with ``train.dp_size=1`` and once with
``train.dp_size=2`` (twice each, in the order dp1 dp2 dp2 dp1, without --quick), and
summarises their metrics.jsonl: the median seconds of every ``timing/<section>_s`` over the
steps after each run's first (which pays for warm-up and is reported on its own), each
section's share of the summed step time, and the median ``throughput/tokens_per_s``.

Then the weight sync alone (``sync_run``): the trainer at ``train.dp_size=2`` on
``builtin:small`` (two engine replicas), one step's sync timed again and again through the
in-node shared-memory handoff and through the earlier object-store path, alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = [
    "SECTIONS",
    "format_table",
    "run",
    "run_job",
    "summarise_metrics",
    "summarise_runs",
    "sync_run",
]

#: Timed sections of a step, in the order the controller runs them; ``other`` is the rest.
SECTIONS = ("rollout", "prepare", "update", "sync", "other")
#: A run that takes longer than this (seconds) is stopped and reported as failed.
TIMEOUT_S = 1800


def summarise_runs(runs: list[list[dict]]) -> dict:
    """Per-step timing summary of one or more runs of the same job (each a metrics.jsonl as a
    list of per-step dicts), steps pooled after dropping each run's first step.

    Returns ``runs``, ``steps`` (pooled steady steps), ``first_step_s`` (median over runs of the
    first step), ``step_s`` (median seconds over the pooled steps; all steps when a run has
    only one), ``sections`` {name: {median_s, share}} where share is the section's summed
    seconds over the summed step seconds, and ``tokens_per_s`` (median). Raises ValueError
    when a run has no record with ``timing/step_s``.
    """
    steady, firsts, rewards = [], [], []
    for records in runs:
        timed = [r for r in records if "timing/step_s" in r]
        if not timed:
            raise ValueError(
                "metrics.jsonl has no record with timing/step_s; was the run cut short before "
                "its first step finished?"
            )
        steady += timed[1:] if len(timed) > 1 else timed
        firsts.append(timed[0]["timing/step_s"])
        rewards.append((timed[0].get("reward/mean"), timed[-1].get("reward/mean")))
    total = sum(r["timing/step_s"] for r in steady)
    sections = {}
    for name in SECTIONS:
        values = [r.get(f"timing/{name}_s", 0.0) for r in steady]
        sections[name] = {
            "median_s": statistics.median(values),
            "share": sum(values) / total if total > 0 else 0.0,
        }
    tokens = [r["throughput/tokens_per_s"] for r in steady if "throughput/tokens_per_s" in r]
    return {
        "runs": len(runs),
        "steps": len(steady),
        "first_step_s": statistics.median(firsts),
        "step_s": statistics.median(r["timing/step_s"] for r in steady),
        "sections": sections,
        "tokens_per_s": statistics.median(tokens) if tokens else None,
        "reward_first": rewards[0][0],
        "reward_last": rewards[0][1],
    }


def summarise_metrics(records: list[dict]) -> dict:
    """``summarise_runs`` of a single run's metrics.jsonl records."""
    return summarise_runs([records])


def run_job(
    overrides: list[str],
    workdir: Path,
    timeout_s: float = TIMEOUT_S,
    *,
    source: str | None = None,
) -> dict:
    """Run ``crossrl train <overrides>`` (keys, and flags such as ``--config=FILE``) in a
    fresh run directory under ``workdir``;
    ``source``: another checkout whose crossrl runs instead of this one (the working
    directory, and first on ``PYTHONPATH`` for the Ray workers it starts), to time a change
    against the code before it in one run. A cluster joined through ``ray.address`` runs its
    own workers' code, not the checkout's: compare checkouts on a local Ray.

    Returns ``records`` (its metrics.jsonl, one dict per step), ``wall_s`` (the whole process:
    start-up, Ray, steps, shutdown) and ``command``. Raises RuntimeError with the log's tail
    when the run fails.
    """
    run_dir = workdir / "run"
    flags = [o for o in overrides if o.startswith("--")]  # e.g. --config=FILE, before the keys
    keys = [o for o in overrides if not o.startswith("--")]
    args = ["train", *flags, f"run.dir={run_dir}", *keys]
    cmd = [sys.executable, "-m", "trainer.cli", *args]
    log_path = workdir / "train.log"
    env = dict(os.environ, RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"))
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            proc = subprocess.run(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=timeout_s,
                check=False,
                # ``python -m`` puts the working directory first on sys.path, before
                # PYTHONPATH: run from the other checkout, or this one's code runs.
                cwd=source,
            )
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            returncode = None
    wall = time.perf_counter() - start
    if returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-2000:]
        why = f"timed out after {timeout_s:.0f} s" if returncode is None else f"exit {returncode}"
        raise RuntimeError(f"crossrl {' '.join(args)} failed ({why}); log tail:\n{tail}")
    metrics_path = run_dir / "metrics.jsonl"
    records = [
        json.loads(line)
        for line in metrics_path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    command = "crossrl " + " ".join(a for a in args if not a.startswith("run.dir="))
    return {"records": records, "wall_s": wall, "command": command}


#: The sync benchmark's job: the CPU default job at dp 2 on the 19M-parameter model.
SYNC_OVERRIDES = ["train.dp_size=2", "model.path=builtin:small", "run.resume=never"]


def sync_run(repeats: int = 10) -> dict:
    """Seconds of one step's weight sync at dp 2 on builtin:small, both ways in one run.

    Starts Ray and the trainer once (two ranks, two engine replicas), then times
    ``Trainer.sync_weights`` ``repeats`` times per path, alternating (shared memory first,
    then the object store, and so on), after one untimed warm-up each. Returns medians,
    minimums, the ratio object-store / shared-memory, the parameter count and the bucket
    count of one sync.
    """
    from trainer.config import load_config
    from trainer.loop.cluster.group import start_ray
    from trainer.loop.schedule.controller import Trainer
    from trainer.loop.start import launch

    with tempfile.TemporaryDirectory(prefix="crossrl-bench-sync-") as tmp:
        cfg = load_config(None, [*SYNC_OVERRIDES, f"run.dir={tmp}"])
        started = start_ray(None, num_cpus=8)
        trainer = Trainer(cfg, Path(tmp))
        try:
            launch.start(trainer)
            times: dict[str, list[float]] = {"shared_memory": [], "object_store": []}
            for i in range(repeats + 1):
                for path, via_store in (("shared_memory", False), ("object_store", True)):
                    t0 = time.perf_counter()
                    trainer.sync_weights(via_object_store=via_store)
                    if i:  # the first round maps buffers and warms caches
                        times[path].append(time.perf_counter() - t0)
            params = sum(info["num_params"] for info in trainer.actor.setup_info[:1])
        finally:
            trainer.shutdown()
            if started:
                import ray

                ray.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "job": "configs/cpu/tiny.yaml with " + " ".join(SYNC_OVERRIDES),
        "repeats": repeats,
        "params": params,
        "median_s": med,
        "min_s": {k: min(v) for k, v in times.items()},
        "object_store_over_shared_memory": med["object_store"] / med["shared_memory"],
    }


def run(quick: bool = False) -> dict:
    """The default job at dp 1 and dp 2: ``{"steps": N, "order": [...], "runs": {"dp1": ...,
    "dp2": ...}, "dp2_over_dp1_step_s": ratio}``. Quick: one run each of 10 steps. Full: 30
    steps, runs in the order dp1, dp2, dp2, dp1, steps pooled per dp size, so a slow spell on
    a shared machine does not land on one side only."""
    steps = 10 if quick else 30
    order = [1, 2] if quick else [1, 2, 2, 1]
    jobs: dict[int, list[dict]] = {1: [], 2: []}
    for dp in order:
        with tempfile.TemporaryDirectory(prefix=f"crossrl-bench-e2e-dp{dp}-") as tmp:
            overrides = [f"train.total_steps={steps}", f"train.dp_size={dp}"]
            jobs[dp].append(run_job(overrides, Path(tmp)))
    runs = {}
    for dp, done in jobs.items():
        summary = summarise_runs([job["records"] for job in done])
        summary["wall_s"] = statistics.median(job["wall_s"] for job in done)
        summary["command"] = done[0]["command"]
        runs[f"dp{dp}"] = summary
    return {
        "job": "configs/cpu/tiny.yaml (the CPU default job)",
        "steps": steps,
        "order": [f"dp{dp}" for dp in order],
        "runs": runs,
        "dp2_over_dp1_step_s": runs["dp2"]["step_s"] / runs["dp1"]["step_s"],
        "sync": sync_run(repeats=5 if quick else 10),
    }


def format_table(res: dict) -> str:
    """Seconds per step by section, dp 1 next to dp 2."""
    runs = res["runs"]
    names = list(runs)
    lines = [
        f"{res['job']}, {res['steps']} steps per run, runs in order {', '.join(res['order'])}; "
        f"medians over steps 2..{res['steps']} of every run",
        f"{'section':22s}" + "".join(f"{n + ' s/step':>13s}{'share':>8s}" for n in names),
    ]
    for section in SECTIONS:
        cells = "".join(
            f"{runs[n]['sections'][section]['median_s']:13.3f}"
            f"{runs[n]['sections'][section]['share']:8.1%}"
            for n in names
        )
        lines.append(f"{section:22s}{cells}")
    rows = [
        ("step (median)", lambda r: f"{r['step_s']:13.3f}{'':8s}"),
        ("first step", lambda r: f"{r['first_step_s']:13.3f}{'':8s}"),
        ("tokens/s (median)", lambda r: f"{r['tokens_per_s'] or 0:13.0f}{'':8s}"),
        ("process wall (s)", lambda r: f"{r['wall_s']:13.1f}{'':8s}"),
        (
            "reward first -> last",
            lambda r: f"{r['reward_first']:6.3f}->{r['reward_last']:5.3f}{'':8s}",
        ),
    ]
    for label, cell in rows:
        lines.append(f"{label:22s}" + "".join(cell(runs[n]) for n in names))
    lines.append(f"dp2 / dp1 seconds per step: {res['dp2_over_dp1_step_s']:.2f}x")
    if "sync" in res:
        lines += ["", format_sync(res["sync"])]
    return "\n".join(lines)


def format_sync(sync: dict) -> str:
    """The sync benchmark: seconds per sync by path, and their ratio."""
    lines = [
        f"weight sync, {sync['job']} ({sync['params'] / 1e6:.1f}M params), "
        f"{sync['repeats']} syncs per path, alternating",
        f"{'path':40s}{'median s':>10s}{'min s':>10s}",
    ]
    names = {
        "shared_memory": "in-node shared memory (each rank -> its replica)",
        "object_store": "Ray object store (the earlier path)",
    }
    for key, label in names.items():
        lines.append(f"{label:40s}{sync['median_s'][key]:10.3f}{sync['min_s'][key]:10.3f}")
    lines.append(f"object store / shared memory: {sync['object_store_over_shared_memory']:.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 steps per run instead of 30")
    parser.add_argument("--sync-only", action="store_true", help="only the weight-sync part")
    args = parser.parse_args()
    if args.sync_only:
        print(format_sync(sync_run(repeats=5 if args.quick else 10)))
    else:
        print(format_table(run(quick=args.quick)))


if __name__ == "__main__":
    main()
