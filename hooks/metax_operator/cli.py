"""The `metax-operator` command: one entry point, a subcommand per job.

Each command module exposes `register(subparsers)` which adds its subcommand and
sets `func` (called with the parsed args; returns the exit status); `COMMANDS` says which
module registers which subcommand.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .errors import UserError

# Each subcommand and the module that registers it, in the order `--help` lists them. Only the
# module of the command being run is imported (several pull in the kubernetes client, which takes
# about a second to import); `--help` and a mistyped command import them all.
COMMANDS = {
    "preflight": "hooks.preflight",
    "upgrade-crds": "hooks.upgrade_crds",
    "bootstrap": "hooks.bootstrap",
    "cleanup": "hooks.cleanup",
    "test": "hooks.smoke",
    "postrender": "postrender",
    "run": "runner",
    "wait-for": "waitfor",
    "schema": "schema",
    "validate": "validate_cmd",
    "rollout": "rollout_cli",
    "nodes": "node_view",
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with `argv` whose first word is a known command, only that command's."""
    parser = argparse.ArgumentParser(prog="metax-operator", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    wanted = [COMMANDS[argv[0]]] if argv and argv[0] in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for module in wanted:
        importlib.import_module(f"metax_operator.{module}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as err:
        for line in str(err).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
