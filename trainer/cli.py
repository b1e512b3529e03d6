"""The ``crossrl`` command line: train, devices, layout, doctor, plot, probe, parity, export,
bench.

This module builds the parser and dispatches: what each subcommand does is in
``trainer.commands.entry`` (and the modules of ``trainer/commands/`` it calls; ``bench`` is
reached by name, ``trainer.commands.entry.UPPER_COMMANDS``). Every subcommand validates its
input before starting anything heavy; a bad argument or config exits with status 2 and one
message naming the key, the bad value and the fix.
"""

from __future__ import annotations

import argparse
import sys

from trainer.commands import entry


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every ``crossrl`` subcommand."""
    from trainer.commands.export import DEFAULT_MAX_SHARD_MB  # light: no torch at import

    parser = argparse.ArgumentParser(prog="crossrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run a training job (default: configs/cpu/tiny.yaml)")
    train.add_argument("--config", default=None, help="job YAML; omitted: the CPU default job")
    train.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. train.lr=1e-5")
    train.set_defaults(func=entry.train)

    devices = sub.add_parser("devices", help="what the device layer sees")
    devices.set_defaults(func=entry.devices)

    layout = sub.add_parser(
        "layout",
        help="which process runs on which device of which node, without starting anything; "
        "exit 2 when the layout cannot work",
    )
    layout.add_argument("--config", default=None, help="job YAML; omitted: the CPU default job")
    layout.add_argument("--nodes", type=int, default=None, help="nodes in the cluster (default: 1)")
    layout.add_argument(
        "--devices-per-node",
        type=int,
        default=None,
        help="devices of the config's type per node (default: what this machine has when the "
        "device is here, else enough for train.dp_size)",
    )
    layout.add_argument(
        "--device-memory-gb",
        type=float,
        default=None,
        help="memory of one device in GB (1e9 bytes) for the memory budget (default: this "
        "machine's device when it has the config's type, else hal.DEFAULT_DEVICE_MEMORY_BYTES)",
    )
    layout.add_argument(
        "--measure",
        nargs="?",
        const=0,
        type=int,
        default=None,
        metavar="LAYERS",
        help="also run one step of the config under torch's FSDPMemTracker with fake tensors "
        "(no device, no memory) and print it beside the budget's update phase; LAYERS cuts "
        "the model to that many decoder layers (default: all, minutes at 7B)",
    )
    layout.add_argument(
        "overrides", nargs="*", help="key.path=value overrides, e.g. train.dp_size=4"
    )
    layout.set_defaults(func=entry.layout)

    doctor = sub.add_parser(
        "doctor",
        help="is this node ready? versions, env settings, devices, Ray, a smoke test; "
        "exit 0 when every check passes",
    )
    doctor.add_argument("--config", default=None, help="job YAML; omitted: the CPU default job")
    doctor.add_argument(
        "--no-smoke", action="store_true", help="skip the smoke tests on the device (fast)"
    )
    doctor.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. device=auto")
    doctor.set_defaults(func=entry.doctor)

    plot = sub.add_parser("plot", help="PNG curves from RUN_DIR/metrics.jsonl")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None, help="output folder (default: RUN_DIR/plots)")
    plot.add_argument(
        "--compare",
        nargs="+",
        default=[],
        metavar="OTHER_RUN",
        help="other run directories drawn on the same panels (e.g. another train.rollout_lag)",
    )
    plot.set_defaults(func=entry.plot)

    probe = sub.add_parser(
        "probe",
        help="replay recorded rollouts through training; write fingerprints for `crossrl parity`",
    )
    probe.add_argument("--config", default=None, help="job YAML; omitted: the CPU default job")
    probe.add_argument(
        "--rollouts", required=True, help="folder of step_<N>.npz (a run's RUN_DIR/rollouts)"
    )
    probe.add_argument("--steps", type=int, required=True, help="recorded steps to replay")
    probe.add_argument("--out", required=True, help="the probe's run directory")
    probe.add_argument(
        "overrides", nargs="*", help="key.path=value overrides, e.g. train.dp_size=8"
    )
    probe.set_defaults(func=entry.probe)

    parity = sub.add_parser("parity", help="compare two runs' fingerprints; exit 0 when they agree")
    parity.add_argument("run_a")
    parity.add_argument("run_b")
    parity.add_argument(
        "--rtol",
        type=float,
        default=None,
        help="relative tolerance (default: by train.param_dtype)",
    )
    parity.add_argument(
        "--atol",
        type=float,
        default=None,
        help="absolute tolerance (default: by train.param_dtype)",
    )
    parity.add_argument(
        "--steps", type=int, default=None, help="compare steps 1..STEPS only (default: every step)"
    )
    parity.add_argument(
        "--failures-only", action="store_true", help="print only the disagreeing rows of the table"
    )
    parity.set_defaults(func=entry.parity)

    export = sub.add_parser(
        "export",
        help="write a run's trained actor as a Hugging Face model directory (docs/export.md)",
    )
    export.add_argument("run_dir", help="the run directory (run.dir of `crossrl train`)")
    export.add_argument("out_dir", help="a new directory for the model (never overwritten)")
    export.add_argument(
        "--step", type=int, default=None, help="checkpoint step_<N> to export (default: latest)"
    )
    export.add_argument(
        "--max-shard-mb",
        type=float,
        default=DEFAULT_MAX_SHARD_MB,
        help="largest safetensors file in MB (1e6 bytes); bigger models are sharded",
    )
    export.add_argument(
        "--merged",
        action="store_true",
        help="a LoRA run (model.lora): write the base with the adapters folded in as a whole "
        "model, not a peft adapter directory",
    )
    export.set_defaults(func=entry.export)

    bench = sub.add_parser("bench", help="benchmarks (see docs/benchmarks.md)")
    bench.add_argument("which", nargs="*", default=["all"])
    bench.add_argument("--quick", action="store_true", help="smaller workloads")
    bench.add_argument("--out", default=None, help="results JSON (default ./bench-results.json)")
    bench.set_defaults(func=entry.bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``crossrl`` console script; returns the process exit status."""
    from trainer.loop.startup import begin_at_process_start

    begin_at_process_start()  # `crossrl train` reports its start-up from the process start
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad arguments already
        return int(exc.code or 0)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
