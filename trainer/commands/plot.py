"""``crossrl plot RUN_DIR [--compare OTHER_RUN ...]``: PNG curves from ``<run_dir>/metrics.jsonl``
(and the other runs', on the same panels).

matplotlib is an optional dependency (the ``plot`` extra) and is imported only here, lazily.
Figures are drawn with the Agg canvas directly (no pyplot), so plotting never changes the
process-wide matplotlib backend and works without a display.
"""

from __future__ import annotations

import io
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollout.files import atomic_write_bytes
from trainer.records.jsonl_files import read_error_line, read_jsonl
from trainer.records.metrics import METRICS_FILE

PLOT_DIR = "plots"
DEFAULT_KEYS = (
    "reward/mean",
    "actor/loss",
    "actor/grad_norm",
    "batch/token_efficiency",
    "timing/step_s",
)
_SMOOTH_MIN_POINTS = 20  # below this a moving average hides more than it shows


class PlotDependencyError(ImportError, ValueError):
    """matplotlib is missing. Also a ValueError so ``crossrl plot`` reports it as bad input."""


def _figure_class() -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401 - Agg present
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotDependencyError(
            "crossrl plot needs matplotlib, a dependency of crossrl that is missing here: "
            "pip install matplotlib"
        ) from None
    return Figure


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) where ``key`` holds a finite number; null/missing points are skipped."""
    steps, values = [], []
    for rec in records:
        value = rec.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(rec["step"])
            values.append(float(value))
    return steps, values


def _moving_average(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _draw(ax: Any, key: str, runs: list[tuple[str, list[int], list[float]]]) -> None:
    """One panel: ``key`` of each run, ``(label, steps, values)``, in its own colour (the
    label only in the legend when there are several runs)."""
    ax.set_title(key, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    if not any(steps for _, steps, _ in runs):
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    several = len(runs) > 1
    for i, (label, steps, values) in enumerate(runs):
        color = f"C{i}"
        name = f"{label}: " if several else ""
        if len(steps) >= _SMOOTH_MIN_POINTS:
            ax.plot(steps, values, color=color, alpha=0.35, linewidth=1, label=f"{name}raw")
            window = max(2, len(steps) // 10)
            ax.plot(
                steps,
                _moving_average(values, window),
                color=color,
                linewidth=2,
                label=f"{name}mean of {window}",
            )
        elif steps:
            ax.plot(steps, values, color=color, marker="o", markersize=3, label=label)
    if several or any(len(steps) >= _SMOOTH_MIN_POINTS for _, steps, _ in runs):
        ax.legend(fontsize=8)


def _save(fig: Any, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return atomic_write_bytes(path, buf.getvalue())


def validation_keys(records: list[dict]) -> list[str]:
    """The ``val/*`` metrics a run logged (validation,
    ``trainer.loop.engines.validation_rollouts``): ``val/reward_mean`` first, then ``val/pass@k``
    and the per-data-source means."""
    found = {k for rec in records for k in rec if k.startswith("val/")}
    first = [k for k in ("val/reward_mean",) if k in found]
    passes = sorted(k for k in found if k.startswith("val/pass@"))
    sources = sorted(k for k in found if k.startswith("val/reward_mean/"))
    return first + passes + sources


def _read_run(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl records, in step order; the errors ``plot_run`` documents."""
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.exists():
        hint = "" if run_dir.is_dir() else f" ({run_dir} does not exist)"
        raise FileNotFoundError(
            f"{metrics_path} not found{hint}; pass a run dir (run.dir) of a run that has "
            "finished at least one step"
        )
    try:
        records = read_jsonl(metrics_path, allow_torn_tail=True)
    except (UnicodeDecodeError, OSError) as err:  # e.g. a directory named metrics.jsonl
        raise ValueError(read_error_line(metrics_path, err, "the run's metrics file")) from None
    if not records:
        raise ValueError(f"{metrics_path} has no steps yet; plot again after the first step")
    for lineno, rec in enumerate(records, start=1):
        if not isinstance(rec.get("step"), int) or isinstance(rec.get("step"), bool):
            raise ValueError(f"{metrics_path}: record {lineno} has no integer 'step': {rec!r:.80}")
    return sorted(records, key=lambda r: r["step"])


def _labels(dirs: list[Path]) -> list[str]:
    """Legend names of the runs: each directory's name, with its parent's where two names
    are the same (``lag0/run`` and ``lag1/run``)."""
    names = [d.name for d in dirs]
    if len(set(names)) == len(names):
        return names
    return [f"{d.parent.name}/{d.name}" for d in dirs]


def plot_run(
    run_dir: str | os.PathLike,
    out_dir: str | os.PathLike | None = None,
    keys: Sequence[str] | None = None,
    compare: Sequence[str | os.PathLike] = (),
) -> list[Path]:
    """Write one PNG per metric in ``keys`` plus ``overview.png`` (all in a grid).
    ``compare``: other runs drawn on the same panels, each in its own colour and labelled by
    its directory's name (``_labels``; e.g. the same job at another ``train.rollout_lag``).

    ``keys`` None: ``DEFAULT_KEYS`` plus the validation curves the run has (``val/reward_mean``,
    ``val/pass@k``, ``val/reward_mean/<data_source>``); validation points are drawn at the steps
    that validated (step 0: before training).

    Reads ``<run_dir>/metrics.jsonl``; writes to ``out_dir`` (default ``<run_dir>/plots``).
    File names are the keys with ``/`` replaced by ``_`` (``reward_mean.png``). A key with no
    finite value in any step gets no PNG of its own (its overview panel says "no data").
    Returns the written paths, overview last. Raises FileNotFoundError when metrics.jsonl is
    missing, ValueError when it is empty or malformed, PlotDependencyError without matplotlib.
    """
    run_dir = Path(run_dir)
    records = _read_run(run_dir)
    others = [(Path(d), _read_run(Path(d))) for d in compare]
    if keys is None:
        keys = [*DEFAULT_KEYS, *validation_keys(records)]
    if isinstance(keys, str):
        keys = [keys]
    if not keys:
        raise ValueError("keys is empty; name at least one metric, e.g. reward/mean")
    Figure = _figure_class()
    out = Path(out_dir) if out_dir is not None else run_dir / PLOT_DIR
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file in the way, or no permission
        raise ValueError(
            f"--out {out}: cannot be made a directory ({err.strerror or err}); pass another --out"
        ) from None

    written: list[Path] = []
    runs = list(
        zip(_labels([run_dir, *(d for d, _ in others)]), [records, *(r for _, r in others)])
    )
    series = {key: [(name, *_series(recs, key)) for name, recs in runs] for key in keys}
    for key, drawn in series.items():
        if not any(steps for _, steps, _ in drawn):
            continue
        fig = Figure(figsize=(6, 4))
        _draw(fig.add_subplot(1, 1, 1), key, drawn)
        fig.tight_layout()
        written.append(_save(fig, out / (key.replace("/", "_") + ".png")))

    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig = Figure(figsize=(4.5 * ncols, 3.2 * nrows))
    for i, (key, drawn) in enumerate(series.items()):
        _draw(fig.add_subplot(nrows, ncols, i + 1), key, drawn)
    title = f"{run_dir.name}: {len(records)} steps"
    if others:
        title = f"{' vs '.join(name for name, _ in runs)}: {len(records)} steps"
    fig.suptitle(title)
    fig.tight_layout()
    written.append(_save(fig, out / "overview.png"))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trainer.commands.plot RUN_DIR [OUT_DIR]``; prints the written paths."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= len(args) <= 2:
        print("usage: python -m trainer.commands.plot RUN_DIR [OUT_DIR]", file=sys.stderr)
        return 2
    try:
        paths = plot_run(args[0], args[1] if len(args) == 2 else None)
    except (FileNotFoundError, ValueError) as err:
        print(f"plot: {err}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
