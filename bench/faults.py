"""What a lost or hung worker costs a run: seconds lost per fault, and whether the run still
ends with the fingerprints of an uninterrupted one.

    python -m bench faults [--quick]
    python -m bench.faults [--quick] [--faults 'NAME,...'] [--keys 'KEY=VALUE ...']

``--keys`` go after the job's own (the GPU tiers run ``rank-killed`` with ``device=auto
train.dp_size=1``: on one device the only rank is the last one, which the fault kills);
``--faults`` runs some of ``FAULTS`` only.

A deterministic dp-2 run of the CPU default job (``FAULT_JOB``, two colocated engine replicas)
in an agent-like environment (``SLOW_ENV``: each step a seeded 0-0.4 s wait, so a rollout
lasts about a second), 12 steps, a checkpoint every 4 (6 and 2 with --quick), runs once uninterrupted, then once per fault, each at a seeded random
moment (the step and the delay into its phase drawn from ``random.Random(seed)``):

- ``replica-killed``: engine replica 1's process killed (SIGKILL) during a rollout: its
  requests are dealt to replica 0 and a successor replaces it (no restart);
- ``rank-killed``: the last training rank's process (rank 1 at dp 2) killed (SIGKILL) during
  an update;
- ``rollout-host-killed``: the rollout host's process killed during a rollout;
- ``rank-hung``: training rank 1 made to sleep before a step, so rank 0 waits for it inside a
  collective until ``run.collective_timeout_s`` (20 s here) breaks it.

Each faulted run restarts its workers (``trainer.loop.start.restarts``) and resumes from its last
checkpoint. The figures: the extra wall seconds against the uninterrupted run (start-up
excluded from neither, so the restart's own start-up counts), the run's ``restart/down_s``
(failure to the first step after it) and ``restart/steps_redone``, and whether
``fingerprint.jsonl`` is identical. Runs happen in this process (the fault needs the
trainer's workers); nothing here asserts a time.

``Fault`` is also what tests/test_restarts.py injects faults with.
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["FAULTS", "FAULT_JOB", "SLOW_ENV", "Fault", "format_table", "run"]

#: The job every fault hits: the CPU default job at dp 2, deterministic.
FAULT_JOB = [
    "train.batch_size=4",
    "train.mini_batch_size=2",
    "rollout.n=4",
    "train.dp_size=2",
    "run.deterministic=true",
    "run.resume=never",
    "ray.in_process=false",  # a fault kills a worker's process: never the driver's own
]
#: What the bench adds: an agent-like environment (each step a seeded 0-0.4 s wait, 3 turns),
#: so a rollout lasts about a second and a kill lands inside it.
SLOW_ENV = [
    "rollout.env=rollout.envs.sleepy:SleepyEnv",
    "rollout.env_kwargs.max_delay_s=0.4",
    "rollout.env_kwargs.turns=3",
]
#: name -> (target, the Trainer method the fault waits for, extra overrides)
FAULTS = {
    "replica-killed": ("engine replica 1", "_rollout", []),
    "rank-killed": ("last actor rank", "_update", []),
    "rollout-host-killed": ("rollout host", "_rollout", []),
    "rank-hung": ("hang", "_update", ["run.collective_timeout_s=20"]),
}


class Fault:
    """Kills (SIGKILL) a worker process of the first trainer a run starts, a seeded random
    0-0.5 s into ``phase`` (``_rollout`` or ``_update``) of step ``step``; or, with ``target``
    ``hang``, makes training rank 1 sleep before that step, so rank 0 waits for it inside a
    collective. Installs itself on ``Trainer`` through ``patch`` (pytest's
    ``monkeypatch.setattr``, or ``setattr`` for the bench, undone by ``undo``)."""

    def __init__(self, patch, *, step: int, phase: str, target: str, seed: int) -> None:
        from trainer.loop.schedule.controller import Trainer
        from trainer.loop.start import launch

        self.step, self.target = step, target
        self.delay_s = random.Random(seed).uniform(0.0, 0.5)
        self.fired = threading.Event()
        self.pids: dict[str, int] = {}
        fault = self
        self.originals = {name: getattr(Trainer, name) for name in ("train_step", phase)}
        self.original_start = original_start = launch.start  # starts a trainer's workers
        original_step, original_phase = self.originals["train_step"], self.originals[phase]

        def start(trainer) -> None:
            original_start(trainer)
            if not fault.pids:  # the first trainer only: its processes' ids
                fault.pids = fault._pids(trainer)

        def train_step(trainer, step: int):
            if target == "hang" and step == fault.step and not fault.fired.is_set():
                fault.fired.set()
                trainer.actor.handles[1].__ray_call__.remote(_sleep_an_hour)
            return original_step(trainer, step)

        def in_phase(trainer, *args, **kwargs):
            step = args[-1] if phase == "_update" else args[0]
            if step == fault.step and not fault.fired.is_set() and target != "hang":
                fault.fired.set()
                threading.Thread(target=fault._kill, daemon=True).start()
            return original_phase(trainer, *args, **kwargs)

        patch(launch, "start", start)
        patch(Trainer, "train_step", train_step)
        patch(Trainer, phase, in_phase)

    def undo(self) -> None:
        """Put ``Trainer``'s own methods and ``launch.start`` back (when installed with plain
        ``setattr``)."""
        from trainer.loop.schedule.controller import Trainer
        from trainer.loop.start import launch

        for name, method in self.originals.items():
            setattr(Trainer, name, method)
        launch.start = self.original_start

    @staticmethod
    def _pids(trainer) -> dict[str, int]:
        import ray

        ranks = trainer.actor.handles
        handles = {"last actor rank": ranks[-1], "rollout host": trainer.rollout}
        if len(ranks) > 1:
            handles["actor rank 1"] = ranks[1]
        if len(trainer.replicas) > 1:
            handles["engine replica 1"] = trainer.replicas[1]
        return {name: ray.get(h.__ray_call__.remote(_pid)) for name, h in handles.items()}

    def _kill(self) -> None:
        time.sleep(self.delay_s)
        os.kill(self.pids[self.target], signal.SIGKILL)


def _pid(worker) -> int:  # noqa: ARG001 - Ray passes the actor itself
    return os.getpid()


def _sleep_an_hour(worker) -> None:  # noqa: ARG001 - Ray passes the actor itself
    time.sleep(3600)


def _train(run_dir: Path, overrides: list[str]) -> dict:
    """One run in this process: its wall seconds, fingerprints and metrics."""
    from trainer.config import load_config
    from trainer.loop.start.run import run_training
    from trainer.records.jsonl_files import read_jsonl

    cfg = load_config(None, [*overrides, f"run.dir={run_dir}"])
    started = time.monotonic()
    status = run_training(cfg)
    wall_s = time.monotonic() - started
    return {
        "status": status,
        "wall_s": wall_s,
        "fingerprints": read_jsonl(run_dir / "fingerprint.jsonl"),
        "metrics": read_jsonl(run_dir / "metrics.jsonl"),
    }


def run(
    quick: bool = False, faults: tuple[str, ...] | None = None, keys: tuple[str, ...] = ()
) -> dict:
    """The uninterrupted run, then each fault of ``faults`` (default: all of ``FAULTS``), the
    job's ``keys`` after its own; see the module docstring."""
    from trainer.config import load_config
    from trainer.loop.cluster.group import start_ray

    chosen = list(FAULTS) if faults is None else list(faults)
    unknown = [name for name in chosen if name not in FAULTS]
    if unknown or not chosen:
        raise ValueError(f"faults={chosen}: use some of {list(FAULTS)}")
    steps, save_every = (6, 2) if quick else (12, 4)
    job = [
        *FAULT_JOB,
        *SLOW_ENV,
        f"train.total_steps={steps}",
        f"run.save_every={save_every}",
        *keys,
    ]
    dp_size = load_config(None, job).train.dp_size  # a bad key fails here, in one line
    started_ray = start_ray(None, num_cpus=8)
    try:
        with tempfile.TemporaryDirectory(prefix="crossrl-faults-") as tmp:
            base = _train(Path(tmp) / "straight", job)
            rows = []
            for seed, (name, (target, phase, extra)) in enumerate(FAULTS.items(), start=1):
                if name not in chosen:
                    continue  # the seeds stay each fault's own
                step = random.Random(seed).randint(save_every + 1, steps - 1)
                fault = Fault(setattr, step=step, phase=phase, target=target, seed=seed)
                try:
                    out = _train(Path(tmp) / name, [*job, *extra])
                finally:
                    fault.undo()
                line = next((m for m in out["metrics"] if "restart/count" in m), {})
                replaced = sum(m.get("rollout/replicas_lost", 0) for m in out["metrics"])
                rows.append(
                    {
                        "fault": name,
                        "step": step,
                        "status": out["status"],
                        "lost_s": out["wall_s"] - base["wall_s"],
                        "down_s": line.get("restart/down_s"),
                        "steps_redone": line.get("restart/steps_redone"),
                        "replicas_lost": replaced,
                        "identical": out["fingerprints"] == base["fingerprints"],
                    }
                )
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    return {
        "steps": steps,
        "save_every": save_every,
        "dp_size": dp_size,
        "keys": list(keys),
        "base_wall_s": base["wall_s"],
        "rows": rows,
    }


def format_table(result: dict) -> str:
    """The faults as a markdown table."""
    lines = [
        f"dp {result.get('dp_size', 2)}, {result['steps']} steps, a checkpoint every "
        f"{result['save_every']}{''.join(f', {k}' for k in result.get('keys', []))}; "
        f"uninterrupted: {result['base_wall_s']:.1f} s",
        "",
        "| fault | at step | exit | seconds lost | restart down (s) | steps redone | replicas "
        "replaced | fingerprints |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        down = "-" if row["down_s"] is None else f"{row['down_s']:.1f}"
        redone = "-" if row["steps_redone"] is None else f"{row['steps_redone']:.0f}"
        same = "identical" if row["identical"] else "DIFFER"
        lines.append(
            f"| {row['fault']} | {row['step']} | {row['status']} | {row['lost_s']:.1f} | "
            f"{down} | {redone} | {row['replicas_lost']:.0f} | {same} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.faults``: the table (``--json``: the result)."""
    import argparse
    import json
    import shlex

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 steps, a checkpoint every 2")
    parser.add_argument("--faults", help=f"comma list of: {', '.join(FAULTS)}")
    parser.add_argument("--keys", default="", help="config keys after the job's, KEY=VALUE ...")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    faults = None if args.faults is None else tuple(f.strip() for f in args.faults.split(","))
    if faults is not None and (set(faults) - set(FAULTS) or not all(faults)):
        parser.error(f"--faults {args.faults}: a comma list of {', '.join(FAULTS)}")
    from trainer.config.errors import ConfigError

    try:
        result = run(args.quick, faults, tuple(shlex.split(args.keys)))
    except ConfigError as err:  # a bad key, in the config's own one-line words
        parser.error(f"--keys: {err}")
    print(format_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
