"""The `metax-operator` command: one entry point, a subcommand per job.

Each command module exposes `register(subparsers)` which adds its subcommand and
sets `func` (called with the parsed args; returns the exit status).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .errors import UserError

# Modules that contribute subcommands, in the order `--help` lists them.
COMMAND_MODULES = [
    "hooks.preflight",
    "hooks.upgrade_crds",
    "hooks.bootstrap",
    "hooks.cleanup",
    "hooks.smoke",
    "postrender",
    "runner",
    "waitfor",
    "schema",
    "validate_cmd",
    "rollout_cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metax-operator", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"metax_operator.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as err:
        for line in str(err).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
