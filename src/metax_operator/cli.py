"""The `metax-operator` command: one entry point, a subcommand per job.

Each command module exposes `register(subparsers)` which adds its subcommand and
sets `func` (called with the parsed args; returns the exit status); `COMMANDS` says which
module registers which subcommand.

Every mistake a user can make ends in one line `error: <what>: <problem>; <fix>` and exit
status 1: a bad option (`Parser.error`), a number out of range (`bounded`), a `UserError` from a
command, a kubeconfig that cannot be loaded or an API server that cannot be reached or refuses
(`runtime.api_failures.api_problem`). Anything else is a bug and keeps its stack trace.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys

from metax_operator.errors import UserError

# Each subcommand and the module that registers it, in the order `--help` lists them. Only the
# module of the command being run is imported (several pull in the kubernetes client, which takes
# about a second to import); `--help` and a mistyped command import them all.
COMMANDS = {
    "preflight": "hooks.preflight",
    "upgrade-crds": "hooks.upgrade_crds",
    "bootstrap": "hooks.bootstrap",
    "rollback-hold": "hooks.rollback_hold",
    "cleanup": "hooks.cleanup",
    "test": "hooks.test",
    "postrender": "chart.postrender",
    "run": "runtime.run",
    "wait-for": "runtime.wait_for",
    "schema": "chart.generate",
    "validate": "chart.validate",
    "images": "chart.image_list",
    "rollout": "commands.rollout",
    "nodes": "commands.nodes",
    "gather": "commands.gather",
    "check-node": "commands.check_node",
}


class Parser(argparse.ArgumentParser):
    """argparse's parser, its errors one line (argparse prints the usage and exits 2)."""

    def error(self, message: str):
        raise UserError(self.prog, message, f"see {self.prog} --help")


def bounded(kind: type, low: float, high: float):
    """An argparse type: an int or float (`kind`) from `low` to `high`; nan and inf refused."""
    noun = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"{text} is not {noun} from {low:g} to {high:g}")
        return value

    return parse


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with `argv` whose first word is a known command, only that command's."""
    parser = Parser(prog="metax-operator", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    wanted = [COMMANDS[argv[0]]] if argv and argv[0] in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for module in wanted:
        importlib.import_module(f"metax_operator.{module}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser(argv).parse_args(argv)
        return int(args.func(args) or 0)
    except UserError as err:
        return _report(err)
    except Exception as err:  # only the API's failures are the user's; the rest re-raised
        failures = sys.modules.get("metax_operator.runtime.api_failures")  # imported only by the commands that use the API
        problem = failures.api_problem(err) if failures else None
        if problem is None:
            raise
        return _report(problem)


def _report(err: UserError) -> int:
    for line in str(err).splitlines():
        print(f"error: {line}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
