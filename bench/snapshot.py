"""The weight push to engines of their own: seconds and peak host memory per step, this
checkout against another (the code before a change), measured side by side.

    python -m bench.snapshot --before DIR [--rounds N] [--shape qwen2.5-0.5b] [--steps N]

A lagged job (``rollout.engine_devices=1``, ``train.rollout_lag=1``) on ``builtin:small``
at ``train.dp_size=2``: each step ends with the push of the new weights into Ray's object
store (``Trainer.snapshot_weights``), which is the ``sync`` phase of a lagged step
(``timing/sync_s``). Runs alternate between the two checkouts (A B B A ...), each a
``crossrl train`` subprocess (``bench.e2e.run_job``); the figures are, per checkout, the median
over runs of the median ``timing/sync_s`` over each run's steps after its first, the median
step, and the ranks' peak memory (``memory/actor_peak_gb``, the largest rank's). Nothing here
asserts a time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

__all__ = ["SNAPSHOT_JOB", "format_table", "measure"]

#: The lagged job whose sync phase is the snapshot push.
SNAPSHOT_JOB = [
    "model.path=builtin:small",
    "train.dp_size=2",
    "rollout.engine_devices=1",
    "train.rollout_lag=1",
    "algorithm.rollout_correction=token",
    "train.batch_size=4",
    "train.mini_batch_size=2",
    "rollout.n=4",
    "run.resume=never",
]
KEYS = ("timing/sync_s", "timing/step_s", "memory/actor_peak_gb")


def measure(
    workdir: Path, before: str | None, rounds: int = 2, shape: str | None = None, steps: int = 6
) -> dict:
    """Per checkout (``after``: this one; ``before``: the one at ``before``), the medians of
    ``KEYS`` (module docstring). ``shape``: a ``rollout.models.SHAPES`` name (e.g.
    ``qwen2.5-0.5b``) whose random weights replace ``builtin:small``; ``steps``: per run."""
    from bench.e2e import run_job

    job = [*SNAPSHOT_JOB, f"train.total_steps={steps}"]
    if shape is not None:
        from rollout.models import write_random_model

        job.append(f"model.path={write_random_model(workdir / 'model', shape)}")
    sources = {"after": None, **({"before": before} if before else {})}
    order = []
    for i in range(rounds):
        names = list(sources)
        order += names if i % 2 == 0 else names[::-1]
    per_run: dict[str, list[dict[str, float]]] = {name: [] for name in sources}
    for i, name in enumerate(order):
        where = workdir / f"{name}_{i}"
        where.mkdir(parents=True)
        records = run_job(job, where, source=sources[name])["records"][1:]
        per_run[name].append({k: statistics.median(r[k] for r in records) for k in KEYS})
    return {
        name: {k: statistics.median(run[k] for run in runs) for k in KEYS}
        for name, runs in per_run.items()
    }


def format_table(result: dict) -> str:
    """The medians as a markdown table, with after / before where both ran."""
    lines = ["| code | sync s/step | step s | ranks' peak GB |", "|---|---|---|---|"]
    for name, row in result.items():
        lines.append(
            f"| {name} | {row['timing/sync_s']:.3f} | {row['timing/step_s']:.3f} | "
            f"{row['memory/actor_peak_gb']:.2f} |"
        )
    if "before" in result:
        ratio = result["after"]["timing/sync_s"] / result["before"]["timing/sync_s"]
        lines.append(f"\nsync after / before: {ratio:.2f}")
    return "\n".join(lines)


def main() -> None:
    """``python -m bench.snapshot --before DIR``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="another checkout to measure beside this one")
    parser.add_argument("--rounds", type=int, default=2, help="alternations (A B, B A, ...)")
    parser.add_argument("--shape", help="random weights of this shape (e.g. qwen2.5-0.5b)")
    parser.add_argument("--steps", type=int, default=6, help="steps per run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="crossrl-snapshot-") as tmp:
        result = measure(Path(tmp), args.before, args.rounds, args.shape, args.steps)
        print(format_table(result))


if __name__ == "__main__":
    main()
