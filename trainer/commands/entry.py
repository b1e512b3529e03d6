"""What each ``crossrl`` subcommand does with its parsed arguments; ``trainer/cli.py`` builds
the parser and dispatches here. Each returns the process exit status; a bad argument or
config exits 2 with one message naming the key, the bad value and the fix."""

from __future__ import annotations

import argparse
import sys

EXIT_BAD_INPUT = 2


def devices(args: argparse.Namespace) -> int:
    """``crossrl devices``."""
    from hal import describe
    from hal.cli_devices import format_devices

    print(format_devices(describe()))
    return 0


def layout(args: argparse.Namespace) -> int:
    """``crossrl layout``."""
    from trainer.config import ConfigError, load_config
    from trainer.loop.plan.auto_sizes import resolve_auto_sizes
    from trainer.loop.plan.layout import LayoutError, layout_for_cli, prompt_sharing_rule
    from trainer.loop.plan.layout_text import format_layout
    from trainer.loop.plan.memory_report import budget_for_cli, format_budget

    try:
        # The cluster's config is read on any machine: no check of this one's devices or files.
        cfg = load_config(args.config, args.overrides, check_environment=False)
        layout = layout_for_cli(cfg, nodes=args.nodes, devices_per_node=args.devices_per_node)
        cfg, sized = resolve_auto_sizes(
            cfg, lambda trial: budget_for_cli(trial, layout, args.device_memory_gb)
        )
        budget = budget_for_cli(cfg, layout, args.device_memory_gb)
    except (ConfigError, LayoutError) as err:
        print(f"crossrl layout: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_layout(layout))
    if sized:
        print(sized)
    print(prompt_sharing_rule(cfg, layout.device))
    if cfg.model.lora.enabled:
        from trainer.loop.plan.lora_layout import format_lora
        from trainer.loop.plan.model_shape import model_shape

        shape = model_shape(cfg.model.path)
        print(format_lora(cfg, shape, shape.num_params if shape is not None else None))
    print(format_budget(budget, cfg))
    if args.measure is not None:
        from trainer.loop.ranks.memory_tracker import format_comparison, track_step

        if args.measure < 0:
            print(
                f"crossrl layout: --measure={args.measure}: must be >= 1 layers, or 0 / "
                "nothing for all of them",
                file=sys.stderr,
            )
            return EXIT_BAD_INPUT
        try:
            step = track_step(cfg, layers=args.measure or None)
        except ValueError as err:
            print(f"crossrl layout --measure: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT
        print(format_comparison(cfg, step))
    return 0


def doctor(args: argparse.Namespace) -> int:
    """``crossrl doctor``."""
    from trainer.commands.doctor import format_rows, run_doctor
    from trainer.config import ConfigError

    try:
        rows, code = run_doctor(args.config, args.overrides, smoke=not args.no_smoke)
    except ConfigError as err:
        print(f"crossrl doctor: config error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_rows(rows))
    return code


def train(args: argparse.Namespace) -> int:
    """``crossrl train``."""
    from trainer.config import ConfigError, load_config
    from trainer.loop.cluster.startup import CLOCK

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"crossrl train: config error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    CLOCK.done("config")
    from trainer.loop.start.run import run_training

    CLOCK.done("imports")
    return run_training(cfg)


def plot(args: argparse.Namespace) -> int:
    """``crossrl plot``."""
    from trainer.commands.plot import plot_run

    try:
        paths = plot_run(args.run_dir, args.out, compare=args.compare)
    except (FileNotFoundError, ValueError) as err:
        print(f"crossrl plot: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for path in paths:
        print(path)
    return 0


def probe(args: argparse.Namespace) -> int:
    """``crossrl probe``."""
    from trainer.commands.probe import main as probe_main

    return probe_main(
        args.config, args.overrides, rollouts=args.rollouts, steps=args.steps, out=args.out
    )


def parity(args: argparse.Namespace) -> int:
    """``crossrl parity``."""
    from trainer.commands.parity import ParityInputError, compare_runs, format_report

    try:
        report = compare_runs(
            args.run_a, args.run_b, rtol=args.rtol, atol=args.atol, steps=args.steps
        )
    except ParityInputError as err:
        print(f"crossrl parity: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_report(report, only_failures=args.failures_only))
    return 0 if report.agree else 1


def export(args: argparse.Namespace) -> int:
    """``crossrl export``."""
    from trainer.commands.export import ExportError, export_run

    try:
        out = export_run(
            args.run_dir,
            args.out_dir,
            step=args.step,
            max_shard_mb=args.max_shard_mb,
            merged=args.merged,
        )
    except ExportError as err:
        print(f"crossrl export: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(out)
    return 0


#: Commands that live above the trainer (``bench`` measures it): reached by name at call
#: time, so nothing in trainer/ imports a floor above its own.
UPPER_COMMANDS = {"bench": "bench.__main__:main"}


def upper_command(name: str):
    """The ``module:function`` that ``UPPER_COMMANDS`` names for ``name``, imported now."""
    import importlib

    module, _, function = UPPER_COMMANDS[name].partition(":")
    return getattr(importlib.import_module(module), function)


def bench(args: argparse.Namespace) -> int:
    """``crossrl bench``."""
    argv = list(args.which) + (["--quick"] if args.quick else [])
    return upper_command("bench")(argv + (["--out", args.out] if args.out else []))
