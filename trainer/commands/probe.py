"""``crossrl probe``: replay recorded rollouts through the training path and fingerprint it.

Sampling makes two runs differ, so a parity check trains on the same recorded rows on both
machines: ``step_<N>.npz`` (``run.record_rollouts: true``) go through plan -> forward ->
loss -> backward -> optimizer step on whatever device the config selects, and each step's
fingerprint lands in ``<out>/fingerprint.jsonl``. ``crossrl parity`` then compares two probes.

A probe is always a fresh run (no resume) and writes no checkpoint: it exists for its
fingerprints, and a 7B model's checkpoint would cost more than the probe itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from rollout.replay import RecordingError, load_rollout, recorded_steps
from trainer.config import Config, ConfigError, load_config


class ProbeInputError(ValueError):
    """Bad ``crossrl probe`` input (rollouts directory, steps, recording vs config);
    the message names the argument, the value and the fix. The CLI exits 2 on it."""


def probe_overrides(rollouts: str | Path, steps: int, out: str | Path) -> list[str]:
    """The overrides a probe forces on the job config (after the user's own).

    No rollout engine runs, so the config's engine is replaced by ``hf`` (a probe on a node
    without vLLM must still validate); the run is fresh and records nothing.
    """
    return [
        f"train.total_steps={steps}",
        f"run.dir={out}",
        "run.resume=never",
        "run.record_rollouts=false",
        "rollout.engine=hf",
        "rollout.tensor_parallel_size=1",
    ]


def probe_config(
    config: str | None, overrides: list[str], *, rollouts: str | Path, steps: int, out: str | Path
) -> Config:
    """Validate a probe's input and return the job config it runs.

    ``config``: job YAML (None: the CPU default job). ``overrides``: the user's
    ``key.path=value`` strings. ``rollouts``: folder of ``step_<N>.npz``. ``steps``: how many
    recorded steps to replay, from step 1. ``out``: the probe's run directory.
    Raises ``ProbeInputError`` or ``ConfigError`` (both ``ValueError``).
    """
    rollouts_dir = Path(rollouts)
    if not rollouts_dir.is_dir():
        raise ProbeInputError(
            f"--rollouts {str(rollouts)!r}: no such directory; record one with "
            f"run.record_rollouts=true (it lands in RUN_DIR/rollouts)"
        )
    if steps < 1:
        raise ProbeInputError(f"--steps {steps}: must be >= 1")
    have = recorded_steps(rollouts_dir)
    missing = [s for s in range(1, steps + 1) if s not in have]
    if missing:
        present = f"steps {have[0]}..{have[-1]}" if have else "no step_<N>.npz files"
        raise ProbeInputError(
            f"--steps {steps}: {rollouts_dir} lacks step_{missing[0]}.npz (it holds {present}); "
            f"lower --steps or record more steps"
        )
    cfg = load_config(config, [*overrides, *probe_overrides(rollouts, steps, out)])
    for step in range(1, steps + 1):  # every recording now, not at step 40
        _check_recording_fits(cfg, rollouts_dir / f"step_{step}.npz")
    return cfg


def _check_recording_fits(cfg: Config, path: Path) -> None:
    """The recorded batch must be readable and hold ``train.batch_size`` prompt groups:
    mini-batches are cut by groups and the lr schedule counts optimizer steps from it."""
    try:
        arrays = load_rollout(path)
    except RecordingError as err:
        raise ProbeInputError(f"--rollouts: {err}") from None
    try:
        uid, padding = arrays["row/uid"], arrays["row/is_padding"]
    except KeyError as err:
        raise ProbeInputError(
            f"--rollouts: {path} is not a recorded rollout batch (no array {err}); "
            f"record it with run.record_rollouts=true"
        ) from None
    groups = int(np.unique(uid[~padding.astype(bool)]).size)
    if groups != cfg.train.batch_size:
        raise ProbeInputError(
            f"train.batch_size={cfg.train.batch_size}: {path} holds {groups} prompt groups; "
            f"probe with the config the rollouts were recorded with, or pass "
            f"train.batch_size={groups}"
        )


def run_probe(cfg: Config, rollouts: str | Path) -> int:
    """Replay ``cfg.train.total_steps`` recorded steps from ``rollouts``; returns the exit status
    (0 done, 1 a worker failed, 130 interrupted). Writes ``config.yaml``, ``metrics.jsonl`` and
    ``fingerprint.jsonl`` to ``cfg.run.dir`` and no checkpoint; leaves a Ray that was already
    running alone."""
    from trainer.loop.start.run import run_training

    # Absolute: the replay host is a Ray actor, whose working directory may differ.
    return run_training(
        cfg, replay_dir=str(Path(rollouts).resolve()), save_checkpoints=False, command="probe"
    )


def main(config: str | None, overrides: list[str], *, rollouts: str, steps: int, out: str) -> int:
    """``crossrl probe``: validate, then run; exit 2 on bad input."""
    try:
        cfg = probe_config(config, overrides, rollouts=rollouts, steps=steps, out=out)
    except (ProbeInputError, ConfigError) as err:
        print(f"crossrl probe: {err}", file=sys.stderr)
        return 2
    return run_probe(cfg, rollouts)
