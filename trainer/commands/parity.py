"""Comparing two runs' parity fingerprints: ``crossrl parity RUN_A RUN_B`` (DESIGN.md,
"Cross-device parity").

``compare_runs`` reads both run directories (``read_run``), picks a tolerance by the runs'
``train.param_dtype`` (``DEFAULT_TOLERANCES``) unless one is given, and compares step by step:
the exact entries of a fingerprint (``trainer.records.fingerprint.EXACT_FIELDS``) must be equal, the
numeric ones and the parameter checksums must agree within the tolerance. ``format_report``
prints the side-by-side table and the verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.files import undecodable
from trainer.records.fingerprint import CHECKSUM_FIELD, EXACT_FIELDS, NUMERIC_FIELDS


@dataclass(frozen=True)
class Tolerance:
    """Two numbers a, b agree when ``|a - b| <= atol + rtol * scale``; ``scale`` is
    ``max(|a|, |b|)``, or for a checksum sum the larger sum of magnitudes."""

    rtol: float
    atol: float


#: Per ``train.param_dtype``. docs/parity.md gives the reasoning and the measured margins.
#: float32: eps 1.2e-7; different kernels / reduction orders / dp sizes give relative
#: differences of ~1e-6 after a few optimizer steps on the CPU; rtol leaves room for the longer
#: reductions and fused kernels of accelerators over a short probe.
#: bfloat16: eps 3.9e-3 (8-bit mantissa); two bf16 runs differ by about the bf16-vs-fp32
#: difference, which is a few 1e-3 relative on logprobs and a few % on grad norms.
DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(rtol=1e-4, atol=1e-5),
    "bfloat16": Tolerance(rtol=5e-2, atol=1e-3),
}


class ParityInputError(ValueError):
    """A run directory or fingerprint file that cannot be compared (missing, malformed, or
    without the steps asked for). ``crossrl parity`` exits 2 on it."""


@dataclass
class RunRecord:
    """What ``compare_runs`` reads of one run directory."""

    path: Path
    fingerprints: dict[int, dict[str, Any]]
    config: dict[str, Any] | None

    def setting(self, dotted: str, default: Any = None) -> Any:
        """A value of the run's ``config.yaml`` by dotted key (``train.param_dtype``)."""
        node: Any = self.config or {}
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node


@dataclass
class Comparison:
    """One compared value: ``field`` is dotted for checksum entries
    (``param_checksum.__all__.sq``)."""

    step: int
    field: str
    a: Any
    b: Any
    ok: bool
    diff: float | None = None
    allowed: float | None = None

    @property
    def used(self) -> float | None:
        """Share of the tolerance this value uses: ``|a-b| / allowed`` (> 1 fails); None for
        exact fields."""
        if self.diff is None or not self.allowed:
            return None
        return self.diff / self.allowed


@dataclass
class ParityReport:
    """The outcome of ``compare_runs``: every comparison in step and field order."""

    run_a: RunRecord
    run_b: RunRecord
    tolerance: Tolerance
    tolerance_source: str
    comparisons: list[Comparison] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def agree(self) -> bool:
        """True when every compared value agrees (and there was something to compare)."""
        return bool(self.comparisons) and all(c.ok for c in self.comparisons)

    @property
    def first_divergence(self) -> Comparison | None:
        """The earliest disagreeing value (lowest step, then field order), or None."""
        return next((c for c in self.comparisons if not c.ok), None)


def read_run(run_dir: str | Path) -> RunRecord:
    """Read ``fingerprint.jsonl`` (and ``config.yaml`` when present) of a run directory.

    Raises ``ParityInputError`` naming the path when the directory or fingerprint file is
    missing or malformed, or a step appears twice.
    """
    from trainer.records.jsonl_files import MetricsFileError, read_error_line, read_jsonl
    from trainer.records.metrics import FINGERPRINT_FILE

    path = Path(run_dir)
    if not path.is_dir():
        raise ParityInputError(
            f"{path}: not a run directory; pass the run.dir of a train or "
            f"probe run (it holds {FINGERPRINT_FILE})"
        )
    fp_path = path / FINGERPRINT_FILE
    try:
        records = read_jsonl(fp_path)
    except (FileNotFoundError, MetricsFileError) as err:
        raise ParityInputError(
            f"{err} (a run writes {FINGERPRINT_FILE} as it trains; run `crossrl probe` to make one)"
        ) from None
    except (UnicodeDecodeError, OSError) as err:  # e.g. a directory named fingerprint.jsonl
        raise ParityInputError(
            read_error_line(fp_path, err, "the run's fingerprint file")
        ) from None
    by_step: dict[int, dict[str, Any]] = {}
    for rec in records:
        step = rec.get("step")
        if not isinstance(step, int) or step in by_step:
            raise ParityInputError(
                f"{path / FINGERPRINT_FILE}: step {step!r} is missing, not "
                f"an integer or repeated; the file is damaged"
            )
        by_step[step] = rec
    if not by_step:
        raise ParityInputError(f"{path / FINGERPRINT_FILE}: empty; the run wrote no step")
    config = None
    config_path = path / "config.yaml"
    if config_path.is_file():
        import yaml

        try:
            config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as err:
            raise ParityInputError(f"{config_path}: {undecodable(config_path, err)}") from None
        except yaml.YAMLError as err:
            flat = " ".join(str(err).split())
            raise ParityInputError(f"{config_path}: not YAML ({flat})") from None
        if not isinstance(config, dict):
            raise ParityInputError(f"{config_path}: not a config mapping")
    return RunRecord(path=path, fingerprints=by_step, config=config)


def default_tolerance(run_a: RunRecord, run_b: RunRecord) -> tuple[Tolerance, str]:
    """The looser default of the two runs' ``train.param_dtype`` and a line saying why.

    A bf16 run compared with an fp32 one (e.g. against the fp32 CPU golden file) gets the bf16
    tolerance: the fp32 run is then the more exact reference. Raises ``ParityInputError`` when
    a run has no ``config.yaml`` or an unknown dtype (pass ``--rtol`` and ``--atol`` then).
    """
    picked: list[tuple[Tolerance, str]] = []
    for run in (run_a, run_b):
        if run.config is None:
            raise ParityInputError(
                f"{run.path / 'config.yaml'}: missing, so the run's train.param_dtype is "
                f"unknown; copy config.yaml along with fingerprint.jsonl, or pass --rtol and --atol"
            )
        dtype = str(run.setting("train.param_dtype", "float32"))
        if dtype not in DEFAULT_TOLERANCES:
            raise ParityInputError(
                f"{run.path / 'config.yaml'}: train.param_dtype={dtype!r} has no default "
                f"tolerance (known: {', '.join(DEFAULT_TOLERANCES)}); pass --rtol and --atol"
            )
        picked.append((DEFAULT_TOLERANCES[dtype], dtype))
    (tol_a, dtype_a), (tol_b, dtype_b) = picked
    tol = Tolerance(rtol=max(tol_a.rtol, tol_b.rtol), atol=max(tol_a.atol, tol_b.atol))
    dtypes = dtype_a if dtype_a == dtype_b else f"{dtype_a} vs {dtype_b}"
    return tol, f"default for train.param_dtype {dtypes}"


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}." if isinstance(value, dict) else f"{prefix}{key}"))
    return out


def job_differences(run_a: RunRecord, run_b: RunRecord) -> list[tuple[str, Any, Any]]:
    """Config keys whose values differ between the two runs, other than layout keys
    (``trainer.config.LAYOUT_KEYS``: device, dp size, micro-batch budget, ...) and the run's
    own bookkeeping (``run.*``, ``ray.*``). Empty when a config is missing. A key that one
    run's config lacks (written before the key existed) counts as its default value."""
    from trainer.config import LAYOUT_KEYS
    from trainer.config.schema import Config

    if run_a.config is None or run_b.config is None:
        return []
    defaults = _flat(Config().model_dump(mode="python"))
    fa = {**defaults, **_flat(run_a.config)}
    fb = {**defaults, **_flat(run_b.config)}
    skip = ("run.", "ray.")
    return [
        (key, fa.get(key), fb.get(key))
        for key in sorted(set(fa) | set(fb))
        if key not in LAYOUT_KEYS and not key.startswith(skip) and fa.get(key) != fb.get(key)
    ]


def compare_runs(
    run_a: str | Path | RunRecord,
    run_b: str | Path | RunRecord,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    steps: int | None = None,
) -> ParityReport:
    """Compare two runs' fingerprints step by step.

    Exact fields must be equal; numeric fields must satisfy ``Tolerance``; ``rtol`` / ``atol``
    override the dtype defaults one by one. ``steps``: compare steps 1..steps only (both runs
    must have them); None compares every step, and a step present in one run only is a
    disagreement. A parameter checksum is compared where both runs have one (its cadence,
    ``run.fingerprint_every``, may differ). Raises ``ParityInputError`` on unreadable input.
    """
    a = run_a if isinstance(run_a, RunRecord) else read_run(run_a)
    b = run_b if isinstance(run_b, RunRecord) else read_run(run_b)
    for name, value in (("--rtol", rtol), ("--atol", atol)):
        if value is not None and not (value >= 0 and math.isfinite(value)):
            raise ParityInputError(f"{name} {value!r}: must be a finite number >= 0")
    if rtol is not None and atol is not None:
        tol, source = Tolerance(rtol=rtol, atol=atol), "given on the command line"
    else:
        tol, source = default_tolerance(a, b)
        if rtol is not None or atol is not None:
            tol = Tolerance(
                rtol=tol.rtol if rtol is None else rtol, atol=tol.atol if atol is None else atol
            )
            source += ", partly overridden on the command line"
    report = ParityReport(run_a=a, run_b=b, tolerance=tol, tolerance_source=source)
    for key, va, vb in job_differences(a, b):
        report.notes.append(
            f"config: {key} is {va!r} in A but {vb!r} in B (not a layout key: "
            f"the runs are not the same job unless that is intended)"
        )

    if steps is not None:
        if steps < 1:
            raise ParityInputError(f"--steps {steps}: must be >= 1")
        for run in (a, b):
            missing = [s for s in range(1, steps + 1) if s not in run.fingerprints]
            if missing:
                raise ParityInputError(
                    f"{run.path}: has no fingerprint for step(s) {missing[:5]}; it recorded "
                    f"steps {min(run.fingerprints)}..{max(run.fingerprints)}; lower --steps"
                )
        step_list = list(range(1, steps + 1))
    else:
        step_list = sorted(set(a.fingerprints) | set(b.fingerprints))

    for step in step_list:
        fa, fb = a.fingerprints.get(step), b.fingerprints.get(step)
        if fa is None or fb is None:
            where = a.path if fa is None else b.path
            report.comparisons.append(
                Comparison(step, "step", fa is not None, fb is not None, ok=False)
            )
            report.notes.append(f"step {step}: no fingerprint in {where}")
            continue
        report.comparisons.extend(_compare_step(step, fa, fb, tol, report.notes))
    return report


def _compare_exact(step: int, name: str, fa: dict, fb: dict) -> Comparison:
    """Field ``name`` must be present in both fingerprints and equal."""
    ok = name in fa and name in fb and fa[name] == fb[name]
    return Comparison(step, name, fa.get(name), fb.get(name), ok=ok)


def _compare_step(
    step: int, fa: dict, fb: dict, tol: Tolerance, notes: list[str]
) -> list[Comparison]:
    out: list[Comparison] = []
    known = {"step", *EXACT_FIELDS, *NUMERIC_FIELDS, CHECKSUM_FIELD}
    for name in EXACT_FIELDS:
        if name in fa or name in fb:
            out.append(_compare_exact(step, name, fa, fb))
    for name in NUMERIC_FIELDS:
        if name in fa or name in fb:
            out.append(
                _compare_number(
                    step, name, fa.get(name), fb.get(name), tol, present=name in fa and name in fb
                )
            )
    if CHECKSUM_FIELD in fa and CHECKSUM_FIELD in fb:
        out.extend(_compare_checksum(step, fa[CHECKSUM_FIELD], fb[CHECKSUM_FIELD], tol))
    elif CHECKSUM_FIELD in fa or CHECKSUM_FIELD in fb:
        notes.append(
            f"step {step}: parameter checksum in one run only (run.fingerprint_every "
            f"differs); not compared"
        )
    # Fields this version does not know (a newer trainer) are compared exactly if both have them.
    out.extend(_compare_exact(step, name, fa, fb) for name in sorted((set(fa) | set(fb)) - known))
    return out


def _compare_number(
    step: int,
    name: str,
    a: Any,
    b: Any,
    tol: Tolerance,
    *,
    present: bool,
    scale: float | None = None,
) -> Comparison:
    if not present:
        return Comparison(step, name, a, b, ok=False)
    if a is None or b is None:  # null = a non-finite value was logged
        return Comparison(step, name, a, b, ok=a is None and b is None)
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return Comparison(step, name, a, b, ok=a == b)
    diff = abs(float(a) - float(b))
    if scale is None:
        scale = max(abs(float(a)), abs(float(b)))
    allowed = tol.atol + tol.rtol * scale
    return Comparison(step, name, a, b, ok=diff <= allowed, diff=diff, allowed=allowed)


def _compare_checksum(step: int, ca: Any, cb: Any, tol: Tolerance) -> list[Comparison]:
    out: list[Comparison] = []
    if not isinstance(ca, dict) or not isinstance(cb, dict):
        return [Comparison(step, CHECKSUM_FIELD, ca, cb, ok=ca == cb)]
    for pname in sorted(set(ca) | set(cb)):
        va, vb = ca.get(pname), cb.get(pname)
        prefix = f"{CHECKSUM_FIELD}.{pname}"
        if not isinstance(va, dict) or not isinstance(vb, dict):
            # An older checksum format (a bare float per parameter) or a parameter of one run only.
            out.append(
                _compare_number(
                    step, prefix, va, vb, tol, present=va is not None and vb is not None
                )
            )
            continue
        # A sum of mixed-sign values is judged at the scale of its magnitudes.
        abs_scale = max(
            abs(float(va.get("abs", 0.0) or 0.0)), abs(float(vb.get("abs", 0.0) or 0.0))
        )
        for key in sorted(set(va) | set(vb)):
            scale = abs_scale if key == "sum" and abs_scale else None
            out.append(
                _compare_number(
                    step,
                    f"{prefix}.{key}",
                    va.get(key),
                    vb.get(key),
                    tol,
                    present=key in va and key in vb,
                    scale=scale,
                )
            )
    return out


# ----------------------------------------------------------------------------- report


def _describe_run(run: RunRecord) -> str:
    keys = ("device", "train.dp_size", "train.param_dtype", "run.deterministic")
    if run.config is None:
        return f"{run.path} (no config.yaml)"
    return f"{run.path} (" + ", ".join(f"{k}={run.setting(k)}" for k in keys) + ")"


def _cell(value: Any, width: int = 20) -> str:
    if isinstance(value, float):
        text = f"{value:.9g}"
    elif isinstance(value, str) and len(value) > width:
        text = value[: width - 3] + "..."
    elif isinstance(value, list) and len(str(value)) > width:
        text = f"[{len(value)} items]"
    else:
        text = str(value)
    return text[:width]


def tolerance_used_by_field(comparisons: list[Comparison]) -> dict[str, float]:
    """Largest share of the tolerance each numeric field used over all steps
    (checksum entries grouped under ``param_checksum``), in first-seen order."""
    out: dict[str, float] = {}
    for c in comparisons:
        if c.used is None:
            continue
        name = CHECKSUM_FIELD if c.field.startswith(CHECKSUM_FIELD + ".") else c.field
        out[name] = max(out.get(name, 0.0), c.used)
    return out


def _tolerance_used_summary(comparisons: list[Comparison]) -> list[str]:
    used = tolerance_used_by_field(comparisons)
    if not used:
        return []
    width = max(len(name) for name in used)
    lines = ["largest share of the tolerance used, per field:"]
    lines += [f"  {name:<{width}}  {share:7.1%}" for name, share in used.items()]
    return [*lines, ""]


def format_report(report: ParityReport, *, only_failures: bool = False) -> str:
    """The side-by-side table of a ``ParityReport`` and a closing verdict, as text."""
    tol = report.tolerance
    lines = [
        f"A: {_describe_run(report.run_a)}",
        f"B: {_describe_run(report.run_b)}",
        f"tolerance: |a-b| <= atol + rtol*scale with rtol={tol.rtol:g}, atol={tol.atol:g} "
        f"({report.tolerance_source})",
        "",
        f"{'step':>4}  {'field':<44} {'A':>20} {'B':>20} {'|a-b|':>10} {'allowed':>10} "
        f"{'used':>7}  ok",
    ]
    for c in report.comparisons:
        if only_failures and c.ok:
            continue
        diff = "" if c.diff is None else f"{c.diff:.3g}"
        allowed = "exact" if c.allowed is None else f"{c.allowed:.3g}"
        used = "" if c.used is None else f"{c.used:.1%}"
        lines.append(
            f"{c.step:>4}  {c.field[:44]:<44} {_cell(c.a):>20} {_cell(c.b):>20} "
            f"{diff:>10} {allowed:>10} {used:>7}  {'ok' if c.ok else 'FAIL'}"
        )
    lines.append("")
    if not only_failures:
        lines += _tolerance_used_summary(report.comparisons)
    lines += report.notes
    first = report.first_divergence
    compared = len(report.comparisons)
    if first is None and compared:
        steps = sorted({c.step for c in report.comparisons})
        lines.append(f"AGREE: {compared} values over steps {steps[0]}..{steps[-1]} match")
    elif first is None:
        lines.append("DISAGREE: nothing to compare")
    else:
        failed = sum(not c.ok for c in report.comparisons)
        detail = f"A={_cell(first.a, 70)} B={_cell(first.b, 70)}"
        if first.diff is not None:
            detail += f" |a-b|={first.diff:.3g} > allowed {first.allowed:.3g}"
        lines.append(
            f"DISAGREE: first divergence at step {first.step}, field {first.field}: "
            f"{detail} ({failed} of {compared} values differ)"
        )
    return "\n".join(lines)
