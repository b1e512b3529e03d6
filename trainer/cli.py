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
import re
import sys

from trainer.commands import entry


def _add_overrides(parser: argparse.ArgumentParser, example: str) -> None:
    """The ``key.path=value`` overrides of a subcommand; ``main`` lets them stand anywhere
    among its flags (``split_overrides``)."""
    parser.add_argument(
        "overrides",
        nargs="*",
        help=f"key.path=value overrides, before, between or after the flags, e.g. {example}",
    )
    parser.set_defaults(takes_overrides=True)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every ``crossrl`` subcommand."""
    from trainer.commands.export import DEFAULT_MAX_SHARD_MB  # light: no torch at import

    parser = argparse.ArgumentParser(prog="crossrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run a training job (default: configs/cpu/tiny.yaml)")
    train.add_argument("--config", default=None, help="job YAML; omitted: the CPU default job")
    _add_overrides(train, "train.lr=1e-5")
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
    _add_overrides(layout, "train.dp_size=4")
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
    _add_overrides(doctor, "device=auto")
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
    _add_overrides(probe, "train.dp_size=8")
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
    parser.set_defaults(subcommands=sub.choices)  # for split_overrides: each one's flags
    return parser


# The key of an override as trainer.config.loading.parse_override reads it: ``a.b_c=``.
_OVERRIDE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*=")


def split_overrides(
    parser: argparse.ArgumentParser, tokens: list[str]
) -> tuple[list[str], list[str]]:
    """Split one subcommand's arguments into ``(flags, overrides)`` so flags and
    ``key.path=value`` overrides may come in any order, as in verl's and SkyRL's CLIs:
    ``--nodes 8 model.path=M --devices-per-node 8 train.dp_size=64``. A ``key.path=value``
    token is an override unless it is the value of a flag that needs one (``--config a=b.yaml``);
    a flag with an optional value (``--measure``) never takes an override as its value.
    Overrides keep their typed order (the last of a repeated key wins). Tokens after ``--``
    stay with the flags, where argparse reads them as positionals."""
    needs_value: dict[str, int] = {}  # flag -> values it consumes
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list of its flags
        if action.nargs is None or isinstance(action.nargs, int):
            for option in action.option_strings:
                needs_value[option] = 1 if action.nargs is None else action.nargs
    flags: list[str] = []
    overrides: list[str] = []
    pending = 0  # values still owed to the flag just read
    for index, token in enumerate(tokens):
        if token == "--":
            flags.extend(tokens[index:])
            break
        if pending:
            flags.append(token)
            pending -= 1
        elif token.startswith("-"):
            flags.append(token)
            if "=" not in token:
                pending = needs_value.get(_flag_name(token, needs_value), 0)
        elif _OVERRIDE.match(token):
            overrides.append(token)
        else:
            flags.append(token)
    return flags, overrides


def _flag_name(token: str, flags: dict[str, int]) -> str:
    """``token`` as argparse resolves it: itself, or the one flag it abbreviates."""
    if token in flags:
        return token
    matches = [flag for flag in flags if flag.startswith(token)]
    return matches[0] if len(matches) == 1 else token


def _unknown_argument(sub: argparse.ArgumentParser, token: str) -> str:
    """One line for a token that is neither a flag of ``sub`` nor a ``key.path=value``."""
    flags = [a.option_strings[-1] for a in sub._actions if a.option_strings]  # noqa: SLF001
    return (
        f"{sub.prog}: unrecognized argument {token!r}; the flags are {', '.join(flags)}, and "
        "an override is key.path=value (e.g. train.lr=1e-5)"
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``crossrl`` console script; returns the process exit status."""
    from trainer.loop.cluster.startup import begin_at_process_start

    begin_at_process_start()  # `crossrl train` reports its start-up from the process start
    parser = build_parser()
    tokens = list(sys.argv[1:] if argv is None else argv)
    sub = parser.get_default("subcommands").get(tokens[0] if tokens else None)
    try:
        if sub is not None and sub.get_default("takes_overrides"):
            flags, overrides = split_overrides(sub, tokens[1:])
            args, unknown = parser.parse_known_args([tokens[0], *flags])
            if unknown:
                print(_unknown_argument(sub, unknown[0]), file=sys.stderr)
                return entry.EXIT_BAD_INPUT
            args.overrides = [*args.overrides, *overrides]
        else:
            args = parser.parse_args(tokens)
    except SystemExit as exc:  # argparse exits 2 on bad arguments already
        return int(exc.code or 0)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
