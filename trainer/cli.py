"""The ``crossrl`` command line: train, devices, layout, doctor, plot, probe, parity, export,
bench.

Every subcommand validates its input before starting anything heavy; a bad argument or
config exits with status 2 and one message naming the key, the bad value and the fix.
"""

from __future__ import annotations

import argparse
import sys

EXIT_BAD_INPUT = 2


def _cmd_devices(args: argparse.Namespace) -> int:
    from hal import describe
    from hal.cli_devices import format_devices

    print(format_devices(describe()))
    return 0


def _cmd_layout(args: argparse.Namespace) -> int:
    from trainer.config import ConfigError, load_config
    from trainer.layout import (
        LayoutError,
        budget_for_cli,
        format_layout,
        layout_for_cli,
        prompt_sharing_rule,
    )
    from trainer.memory_budget import format_budget

    try:
        # The cluster's config is read on any machine: no check of this one's devices or files.
        cfg = load_config(args.config, args.overrides, check_environment=False)
        layout = layout_for_cli(cfg, nodes=args.nodes, devices_per_node=args.devices_per_node)
        budget = budget_for_cli(cfg, layout, args.device_memory_gb)
    except (ConfigError, LayoutError) as err:
        print(f"crossrl layout: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_layout(layout))
    print(prompt_sharing_rule(cfg, layout.device))
    print(format_budget(budget, cfg))
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from trainer.config import ConfigError
    from trainer.doctor import format_rows, run_doctor

    try:
        rows, code = run_doctor(args.config, args.overrides, smoke=not args.no_smoke)
    except ConfigError as err:
        print(f"crossrl doctor: config error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_rows(rows))
    return code


def _cmd_train(args: argparse.Namespace) -> int:
    from trainer.config import ConfigError, load_config
    from trainer.startup import CLOCK

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"crossrl train: config error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    CLOCK.done("config")
    from trainer.run import run_training

    CLOCK.done("imports")
    return run_training(cfg)


def _cmd_plot(args: argparse.Namespace) -> int:
    from trainer.plot import plot_run

    try:
        paths = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as err:
        print(f"crossrl plot: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for path in paths:
        print(path)
    return 0


def _cmd_probe(args: argparse.Namespace) -> int:
    from trainer.probe import main as probe_main

    return probe_main(
        args.config, args.overrides, rollouts=args.rollouts, steps=args.steps, out=args.out
    )


def _cmd_parity(args: argparse.Namespace) -> int:
    from trainer.parity import ParityInputError, compare_runs, format_report

    try:
        report = compare_runs(
            args.run_a, args.run_b, rtol=args.rtol, atol=args.atol, steps=args.steps
        )
    except ParityInputError as err:
        print(f"crossrl parity: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_report(report, only_failures=args.failures_only))
    return 0 if report.agree else 1


def _cmd_export(args: argparse.Namespace) -> int:
    from trainer.export import ExportError, export_run

    try:
        out = export_run(args.run_dir, args.out_dir, step=args.step, max_shard_mb=args.max_shard_mb)
    except ExportError as err:
        print(f"crossrl export: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(out)
    return 0


#: Commands that live above the trainer (``bench`` measures it): reached by name at call
#: time, so nothing in trainer/ imports a floor above its own.
UPPER_COMMANDS = {"bench": "bench.__main__:main"}


def _upper_command(name: str):
    """The ``module:function`` that ``UPPER_COMMANDS`` names for ``name``, imported now."""
    import importlib

    module, _, function = UPPER_COMMANDS[name].partition(":")
    return getattr(importlib.import_module(module), function)


def _cmd_bench(args: argparse.Namespace) -> int:
    argv = list(args.which) + (["--quick"] if args.quick else [])
    return _upper_command("bench")(argv + (["--out", args.out] if args.out else []))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every ``crossrl`` subcommand."""
    from trainer.export import DEFAULT_MAX_SHARD_MB  # light: no torch at import

    parser = argparse.ArgumentParser(prog="crossrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run a training job (default: configs/cpu/tiny.yaml)")
    train.add_argument("--config", default=None, help="job YAML; omitted: the CPU default job")
    train.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. train.lr=1e-5")
    train.set_defaults(func=_cmd_train)

    devices = sub.add_parser("devices", help="what the device layer sees")
    devices.set_defaults(func=_cmd_devices)

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
        "machine's device when it has the config's type, else 80 for cuda, 64 for npu)",
    )
    layout.add_argument(
        "overrides", nargs="*", help="key.path=value overrides, e.g. train.dp_size=4"
    )
    layout.set_defaults(func=_cmd_layout)

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
    doctor.set_defaults(func=_cmd_doctor)

    plot = sub.add_parser("plot", help="PNG curves from RUN_DIR/metrics.jsonl")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None, help="output folder (default: RUN_DIR/plots)")
    plot.set_defaults(func=_cmd_plot)

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
    probe.set_defaults(func=_cmd_probe)

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
    parity.set_defaults(func=_cmd_parity)

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
    export.set_defaults(func=_cmd_export)

    bench = sub.add_parser("bench", help="benchmarks (see docs/benchmarks.md)")
    bench.add_argument("which", nargs="*", default=["all"])
    bench.add_argument("--quick", action="store_true", help="smaller workloads")
    bench.add_argument("--out", default=None, help="results JSON (default ./bench-results.json)")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``crossrl`` console script; returns the process exit status."""
    from trainer.startup import begin_at_process_start

    begin_at_process_start()  # `crossrl train` reports its start-up from the process start
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad arguments already
        return int(exc.code or 0)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
