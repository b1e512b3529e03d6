"""Per-step metrics: ``metrics.jsonl``, ``fingerprint.jsonl``, TensorBoard, wandb and a progress
bar. ``run.loggers`` picks the optional ones (``MetricsLogger.for_run``).

Steps count optimizer steps from 1: the line with ``"step": k`` describes the k-th step, and
checkpoint ``step_<k>`` holds the state after it. A run resumed from ``step_<k>`` opens its
loggers with ``start_step=k``: lines with step > k came from the lost future of the crashed
run and are removed before the resumed run writes them again, so each step appears once.

A fresh run that validates before training (``run.val_before_train``) writes one line with
``"step": 0`` holding only ``val/*`` metrics.

Each line is flushed and fsynced as it is written, so a crash loses at most the line being
written; a torn last line is dropped (with a warning) when the file is reopened on resume.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.records.jsonl_files import truncate_jsonl

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
FINGERPRINT_FILE = "fingerprint.jsonl"
TENSORBOARD_DIR = "tensorboard"

# The keys every metrics.jsonl line carries at least (DESIGN.md "Run directory").
REQUIRED_KEYS = (
    "step",
    "reward/mean",
    "batch/num_rows",
    "batch/num_padding_rows",
    "batch/token_efficiency",
    "batch/dp_imbalance",
    "batch/max_seq_len",
    "actor/loss",
    "actor/grad_norm",
    "timing/step_s",
    "throughput/tokens_per_s",
)


# --------------------------------------------------------------------------- value cleaning


def _scalar(key: str, value: Any, step: int) -> int | float | None:
    """A finite JSON number (or None) from a Python/numpy/torch scalar."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor | np.ndarray):
        numel = value.numel() if isinstance(value, torch.Tensor) else value.size
        if numel != 1:
            raise ValueError(
                f"metric {key!r} at step {step} is an array of shape {tuple(value.shape)}; "
                "log a scalar (e.g. .mean() or .item())"
            )
        value = value.item()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        log.warning("metric %r at step %d is %s: written as null", key, step, value)
        return None
    raise ValueError(
        f"metric {key!r} at step {step} is a {type(value).__name__} ({value!r:.60}); "
        "metrics must be int/float scalars (put text in the log, not in metrics.jsonl)"
    )


def _nested(key: str, value: Any, step: int) -> Any:
    """Fingerprint values: scalars, strings, and lists/dicts of them (tensors -> lists)."""
    if isinstance(value, str) or value is None:
        return value
    if isinstance(value, torch.Tensor):
        value = value.detach().to("cpu").double().numpy()
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            return _scalar(key, value.item(), step)
        return [_nested(key, v, step) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _nested(f"{key}.{k}", v, step) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_nested(key, v, step) for v in value]
    return _scalar(key, value, step)


# --------------------------------------------------------------------------- writers


class _JsonlWriter:
    """Append-only jsonl with one fsync per line and truncation on resume."""

    def __init__(self, path: Path, start_step: int) -> None:
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(
                f"start_step must be an int >= 0 (the step of the checkpoint resumed from, 0 "
                f"for a fresh run), got {start_step!r}"
            )
        self.path = path
        self.start_step = start_step
        self.last_step = start_step
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = truncate_jsonl(path, start_step)
        if kept:
            log.info("%s: kept %d lines up to step %d", path, kept, start_step)
        self._fh = open(path, "a", encoding="utf-8")  # held open for the whole run

    def _check_step(self, step: Any) -> int:
        if isinstance(step, np.integer):
            step = int(step)
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"{self.path.name}: step must be an int, got {step!r}")
        if step <= self.last_step:
            raise ValueError(
                f"{self.path.name}: step {step} is not after the last step written "
                f"({self.last_step}); steps count from 1 and increase, and a resumed run "
                "passes start_step=<checkpoint step>"
            )
        return step

    def _write(self, record: dict) -> None:
        line = json.dumps(record, allow_nan=False, separators=(",", ":"))
        self._fh.write(line + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.last_step = record["step"]

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()


class FingerprintLogger(_JsonlWriter):
    """Writes ``<run_dir>/fingerprint.jsonl``: per step, the plan digest and numeric
    fingerprints (logprob sums, losses, grad norms, parameter checksums) for parity checks."""

    def __init__(self, run_dir: str | os.PathLike, *, start_step: int = 0) -> None:
        super().__init__(Path(run_dir) / FINGERPRINT_FILE, start_step)

    def log(self, step: int, fingerprint: Mapping[str, Any]) -> dict:
        """Append one line ``{"step": step, **fingerprint}``; tensors become (nested) lists of
        floats, non-finite values null. Returns the record written."""
        step = self._check_step(step)
        record: dict[str, Any] = {"step": step}
        for key, value in fingerprint.items():
            if key == "step":
                continue
            record[str(key)] = _nested(str(key), value, step)
        self._write(record)
        return record

    def __enter__(self) -> FingerprintLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MetricsLogger(_JsonlWriter):
    """Writes ``<run_dir>/metrics.jsonl``, mirrors scalars to TensorBoard and wandb, and drives
    a progress bar (step, reward, validation reward, tokens/s, ETA).

    ``total_steps``: optimizer steps in the run (the bar's length). ``start_step``: the
    checkpoint step resumed from (0 for a fresh run); later lines are removed. TensorBoard
    logs go to ``<run_dir>/tensorboard`` when ``tensorboard`` is True and the package imports
    (else skipped silently; for a training run the config check makes a missing package
    named in ``run.loggers`` an error before anything starts).
    ``wandb_project``: log to wandb too (its ``WANDB_MODE``, e.g. offline, is honoured), with
    ``wandb_config`` as the run's config; the wandb run id is fixed by the run directory, so a
    resumed run continues the same wandb run.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        total_steps: int,
        tensorboard: bool = True,
        *,
        start_step: int = 0,
        progress: bool = True,
        wandb_project: str | None = None,
        wandb_config: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 0:
            raise ValueError(
                f"total_steps must be an int >= 0 (optimizer steps), got {total_steps!r}"
            )
        super().__init__(Path(run_dir) / METRICS_FILE, start_step)
        self.total_steps = total_steps
        self._wrote = False
        self._val_postfix: str | None = None
        self._tb = (
            _open_tensorboard(Path(run_dir) / TENSORBOARD_DIR, start_step) if tensorboard else None
        )
        self._wandb = (
            _open_wandb(Path(run_dir), wandb_project, wandb_config)
            if wandb_project is not None
            else None
        )
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=total_steps,
            initial=min(start_step, total_steps),
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=not progress,
        )

    @classmethod
    def for_run(cls, cfg: Any, run_dir: str | os.PathLike, *, start_step: int) -> MetricsLogger:
        """The logger a training run uses: ``cfg.run.loggers`` (a ``trainer.config.Config``)
        picks TensorBoard and wandb; metrics.jsonl is always written."""
        loggers = cfg.run.loggers
        return cls(
            run_dir,
            cfg.train.total_steps,
            tensorboard="tensorboard" in loggers,
            start_step=start_step,
            wandb_project=cfg.run.wandb_project if "wandb" in loggers else None,
            wandb_config=cfg.model_dump(mode="json") if "wandb" in loggers else None,
        )

    def _check_step(self, step: Any) -> int:
        # Step 0 is the validation before training of a fresh run, written before step 1.
        if step == 0 and self.start_step == 0 and not self._wrote:
            return 0
        return super()._check_step(step)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict:
        """Append ``{"step": step, **metrics}`` as one line (flushed and fsynced).

        Values: Python/numpy/torch scalars, converted to int/float; NaN/inf are written as
        null with a warning; None is written as null. Anything else is a ValueError naming
        the key. Returns the record written.
        """
        step = self._check_step(step)
        record: dict[str, Any] = {"step": step}
        for key, value in metrics.items():
            if not isinstance(key, str):
                raise ValueError(f"metric names must be str, got {key!r} at step {step}")
            if key == "step":
                if value != step:
                    raise ValueError(f"metrics['step']={value!r} disagrees with step={step}")
                continue
            record[key] = _scalar(key, value, step)
        self._write(record)
        self._wrote = True
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and value is not None:
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            scalars = {k: v for k, v in record.items() if k != "step" and v is not None}
            self._wandb.log(scalars, step=step)
        self._update_bar(record)
        return record

    def _update_bar(self, record: dict) -> None:
        postfix = {}
        if record.get("reward/mean") is not None:
            postfix["reward"] = f"{record['reward/mean']:.3f}"
        if record.get("val/reward_mean") is not None:
            self._val_postfix = f"{record['val/reward_mean']:.3f}"
        if self._val_postfix is not None:  # the latest validation stays in view
            postfix["val"] = self._val_postfix
        if record.get("throughput/tokens_per_s") is not None:
            postfix["tok/s"] = f"{record['throughput/tokens_per_s']:.0f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(max(0, min(record["step"], self.total_steps) - self._bar.n))

    def close(self) -> None:
        """Close the file, the TensorBoard writer and the progress bar (idempotent)."""
        super().close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        self._bar.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: The pip extra that installs each optional logger, and the module it needs.
OPTIONAL_LOGGERS = {"tensorboard": "tensorboard", "wandb": "wandb"}


def _open_tensorboard(log_dir: Path, start_step: int) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        log.debug("tensorboard is not installed: TensorBoard logging skipped")
        return None
    # purge_step drops events a crashed run wrote after the checkpoint we resume from.
    return SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1 if start_step else None)


def _open_wandb(run_dir: Path, project: str, config: Mapping[str, Any] | None) -> Any:
    try:
        import wandb
    except ImportError:
        raise ValueError(
            "run.loggers includes wandb, which is not installed: pip install 'crossrl[wandb]' "
            "or remove wandb from run.loggers"
        ) from None
    import hashlib

    # One wandb run per run directory: a resumed run continues it instead of starting anew.
    run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
    return wandb.init(
        project=project,
        name=run_dir.name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        config=dict(config or {}),
    )
