"""``python -m trainer.config``: print a resolved config, or regenerate docs/config.md."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from trainer.config.docs import update_config_doc
from trainer.config.errors import ConfigError
from trainer.config.loading import load_config


def main_check(argv: Sequence[str] | None = None) -> int:
    """``python -m trainer.config [--config FILE] [--no-env-check] [key=value ...]``: print the
    resolved config and return 0, or print the error and return 2.
    ``--write-docs PATH`` regenerates the key reference in PATH instead."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--write-docs"] and len(args) == 2:
        changed = update_config_doc(args[1])
        print(f"{args[1]}: {'updated' if changed else 'up to date'}")
        return 0
    path = None
    check_env = True
    overrides = []
    it = iter(args)
    for arg in it:
        if arg == "--config":
            path = next(it, None)
            if path is None:
                print("config error: --config needs a FILE", file=sys.stderr)
                return 2
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg == "--no-env-check":
            check_env = False
        else:
            overrides.append(arg)
    try:
        cfg = load_config(path, overrides, check_environment=check_env)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    print(cfg.to_yaml(), end="")
    return 0
