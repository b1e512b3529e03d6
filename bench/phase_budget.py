"""Each phase's measured device memory in a finished run against ``crossrl layout``'s budget.

    python -m bench.phase_budget RUN_DIR [--json FILE]

Reads ``RUN_DIR/config.yaml`` and ``metrics.jsonl``: the per-phase device peaks the controller
records where the HAL reads device-wide use (``memory/device_<phase>_gb``,
``trainer.loop.schedule.phase_memory``) and each role's own allocator peak
(``memory/<role>_peak_gb``), and builds the budget of that very config on its device
(``trainer.loop.plan.memory_report.budget_for_cli``). Phases are matched as the budget names them:

    budget phase   measured phases (the controller's StepTimer sections)
    rollout        rollout
    update         prepare, update (the reference and old log-probs, then the updates)
    weight push    push (inside sync, after the ranks released the update's memory);
                   sync where a run has no push phase (engines of their own, older runs)

The measured figure is the largest over the steps after the first (step 1 carries kernel
selection and allocator warm-up; printed apart). The target the GPU issue sets: the estimate
within 15 % of each measured peak and never below it by more than 5 %. Run where the run ran
(the budget reads the device's size there and ``model.path``'s ``config.json``), or pass the
device's size (``--device-memory-gb``) where ``model.path`` is readable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["PHASES", "compare", "format_table"]

#: budget phase -> the controller's timed sections measured against it
PHASES = {"rollout": ("rollout",), "update": ("prepare", "update"), "weight push": ("push",)}
#: what stands in for a phase that a run did not record
FALLBACK = {"push": ("sync",)}
#: the estimate may exceed the measured peak by this share, and fall short by LOW
HIGH, LOW = 0.15, 0.05


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl there; give a finished run's directory")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compare(run_dir: Path, device_memory_gb: float | None = None) -> dict:
    """The run's measured phase peaks beside its budget: ``{"phases": [...], "roles": {...}}``,
    each phase with ``estimate_gb``, ``measured_gb`` (steps after the first), ``first_step_gb``
    and ``ratio`` (estimate / measured). ``device_memory_gb``: the device's size where the run
    ran, when this machine is not that one (``crossrl layout --device-memory-gb``)."""
    from trainer.config import load_config
    from trainer.loop.plan.memory_report import budget_for_cli

    records = _records(run_dir)
    cfg = load_config(run_dir / "config.yaml", check_environment=False)
    budget = budget_for_cli(cfg, device_memory_gb=device_memory_gb)
    if budget is None:
        raise ValueError(f"model.path={cfg.model.path!r}: no config.json there, so no budget")
    later = records[1:] or records

    def peak(rows: list[dict], sections: tuple[str, ...]) -> float | None:
        values = [
            r[f"memory/device_{s}_gb"]
            for r in rows
            for s in sections
            if f"memory/device_{s}_gb" in r
        ]
        return max(values) if values else None

    phases = []
    for name, sections in PHASES.items():
        if not any(f"memory/device_{s}_gb" in r for r in records for s in sections):
            sections = tuple(x for s in sections for x in FALLBACK.get(s, (s,)))
        estimate = budget.phase(name).total / 1e9
        measured = peak(later, sections)
        ratio = estimate / measured if measured else None
        phases.append(
            {
                "phase": name,
                "sections": list(sections),
                "estimate_gb": estimate,
                "measured_gb": measured,
                "first_step_gb": peak(records[:1], sections),
                "ratio": ratio,
                "within_target": None if ratio is None else (1 - LOW <= ratio <= 1 + HIGH),
            }
        )
    roles = {
        key[len("memory/") : -len("_peak_gb")]: max(r[key] for r in later if key in r)
        for key in sorted({k for r in later for k in r})
        if key.startswith("memory/") and key.endswith("_peak_gb")
    }
    return {
        "run_dir": str(run_dir),
        "device": budget.device,
        "device_memory_gb": budget.device_memory_bytes / 1e9,
        "memory_source": budget.memory_source,
        "steps": len(records),
        "phases": phases,
        "role_peaks_gb": roles,
    }


def format_table(res: dict) -> str:
    """The comparison as a markdown table."""

    def gb(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [
        f"{res['run_dir']}: {res['steps']} steps on {res['device']} "
        f"({res['device_memory_gb']:.1f} GB, {res['memory_source']}); GB = 1e9 bytes",
        "",
        "| budget phase | measured as | estimate GB | measured GB (steps 2+) | step 1 GB "
        "| estimate / measured | within -5 %..+15 % |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in res["phases"]:
        ok = "-" if p["within_target"] is None else ("yes" if p["within_target"] else "no")
        ratio = "-" if p["ratio"] is None else f"{p['ratio']:.2f}"
        lines.append(
            f"| {p['phase']} | {', '.join(p['sections'])} | {p['estimate_gb']:.2f} "
            f"| {gb(p['measured_gb'])} | {gb(p['first_step_gb'])} | {ratio} | {ok} |"
        )
    if res["role_peaks_gb"]:
        lines += ["", "each process's own allocator peak per step (largest over steps 2+), GB:"]
        lines += [f"  {role}: {value:.2f}" for role, value in res["role_peaks_gb"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--json", type=Path, help="also write the comparison here")
    parser.add_argument("--device-memory-gb", type=float, help="the run's device size, if not here")
    args = parser.parse_args(argv)
    try:
        res = compare(args.run_dir, args.device_memory_gb)
    except (OSError, ValueError) as exc:
        print(f"phase_budget: {exc}", file=sys.stderr)
        return 2
    print(format_table(res))
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
