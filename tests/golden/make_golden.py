"""Regenerate the golden parity references (run from anywhere, on a CPU):

    python tests/golden/make_golden.py            # fingerprints from the committed rollouts
    python tests/golden/make_golden.py --record   # also re-record the rollouts first

``tiny_rollouts/step_<N>.npz``: a few steps of the tiny CPU job, recorded with
``run.record_rollouts=true`` (compressed npz, about 5 KB a step).
``tiny_cpu_fp32/``: ``fingerprint.jsonl`` and ``config.yaml`` of a CPU float32 probe of those
rollouts (dp 1). ``tests/test_parity_probe.py`` replays them and must match within the float32
tolerance. Regenerate the fingerprints only when a change to the trainer is meant to change
the numbers, and say so in the commit.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROLLOUTS = HERE / "tiny_rollouts"
FINGERPRINTS = HERE / "tiny_cpu_fp32"
STEPS = 3
#: The tiny CPU job (configs/cpu/tiny.yaml), cut down so a step is a second and a recording KB.
OVERRIDES = [
    "device=cpu",
    "train.batch_size=4",
    "train.mini_batch_size=2",
    "rollout.n=4",
    "train.dp_size=1",
    "train.param_dtype=float32",
    "train.reduce_dtype=float32",
    "run.deterministic=true",
    "run.fingerprint_every=1",
]


def record(tmp: Path) -> None:
    """Run the tiny job for ``STEPS`` steps with recording on; keep its rollouts."""
    from trainer.config import load_config
    from trainer.loop.start.run import run_training

    run_dir = tmp / "record"
    cfg = load_config(
        None,
        [
            *OVERRIDES,
            f"train.total_steps={STEPS}",
            f"run.dir={run_dir}",
            "run.resume=never",
            "run.record_rollouts=true",
        ],
    )
    if run_training(cfg) != 0:
        sys.exit("recording failed")
    shutil.rmtree(ROLLOUTS, ignore_errors=True)
    ROLLOUTS.mkdir()
    for step in range(1, STEPS + 1):
        shutil.copy(run_dir / "rollouts" / f"step_{step}.npz", ROLLOUTS)


def fingerprint(tmp: Path) -> None:
    """Probe the committed rollouts on the CPU in float32; keep fingerprints and config."""
    from trainer.commands.probe import probe_config, run_probe

    out = tmp / "probe"
    cfg = probe_config(None, OVERRIDES, rollouts=ROLLOUTS, steps=STEPS, out=out)
    if run_probe(cfg, ROLLOUTS) != 0:
        sys.exit("probe failed")
    FINGERPRINTS.mkdir(exist_ok=True)
    shutil.copy(out / "fingerprint.jsonl", FINGERPRINTS)
    # The probe's run.dir was a temp folder; the committed copy names the golden folder instead.
    text = (out / "config.yaml").read_text().replace(str(out), "tests/golden/tiny_cpu_fp32")
    (FINGERPRINTS / "config.yaml").write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="re-record the rollouts first")
    args = parser.parse_args()
    from trainer.loop.cluster.group import start_ray

    start_ray(None, num_cpus=8)
    with tempfile.TemporaryDirectory() as tmp:
        if args.record or not ROLLOUTS.is_dir():
            record(Path(tmp))
        fingerprint(Path(tmp))
    print(f"wrote {ROLLOUTS} and {FINGERPRINTS}")


if __name__ == "__main__":
    main()
