"""`metax-operator rollout ...`: the staged driver rollout from the admin's terminal.

`rollout simulate` is a dry run of a policy on N nodes with no failures. Further subcommands
(status, pause, resume, undo) join by adding their `register_*` function to `SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import json

from metax_operator.chart import upgrade_policy as policy_mod
from metax_operator.cli import bounded
from metax_operator.commands import rollout_admin as admin
from metax_operator.errors import UserError
from metax_operator.rollout.budget import step_waves
from metax_operator.rollout.simulate import Result, simulate
from metax_operator.yamltext import load_one, read_text

#: The most nodes `simulate` models (it keeps every node's pods in memory: ~250 MB at this size).
MAX_NODES = 100_000
#: The most node-waves (nodes x waves) `simulate` takes on: about a minute of computing.
MAX_WORK = 2_000_000


def register(subparsers) -> None:
    parser = subparsers.add_parser("rollout", help="staged driver rollout tools", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="rollout_command", required=True)
    for add in SUBCOMMANDS:
        add(commands)


def register_simulate(commands) -> None:
    parser = commands.add_parser(
        "simulate",
        help="dry-run an upgrade policy on N nodes",
        description="Show, step by step, the batches a policy deletes and the pauses it takes on N "
        "nodes, with no failures, and estimate the duration.",
    )
    parser.add_argument("--nodes", type=bounded(int, 1, MAX_NODES), required=True, help=f"number of GPU nodes (1 to {MAX_NODES})")
    parser.add_argument(
        "--policy",
        required=True,
        metavar="FILE",
        help="YAML with an upgradePolicy mapping, or values/CR YAML holding driver.upgradePolicy or spec.driver.upgradePolicy",
    )
    parser.add_argument("--output", choices=("table", "json"), default="table")
    parser.add_argument(
        "--ready-latency",
        type=bounded(float, 0.001, 86400),
        default=60.0,
        metavar="SECONDS",
        help="seconds a new driver pod takes to become Ready (default 60, at most a day)",
    )
    parser.add_argument(
        "--interval",
        type=bounded(float, 0.1, 3600),
        default=5.0,
        metavar="SECONDS",
        help="seconds between runner passes (default 5, 0.1 to 3600)",
    )
    parser.set_defaults(func=run_simulate)


SUBCOMMANDS = [register_simulate, *admin.SUBCOMMANDS]


def run_simulate(args: argparse.Namespace) -> int:
    raw, prefix = load_policy(args.policy)
    policy = policy_mod.validate(raw, field_prefix=prefix, nodes=args.nodes)
    waves = wave_count(policy, args.nodes)
    if waves * args.nodes > MAX_WORK:
        raise UserError(
            "--nodes",
            f"{args.nodes} nodes in {waves} waves is more than this dry run computes (nodes x waves at most {MAX_WORK:,})",
            "simulate fewer nodes (percentages keep the shape of the steps) or a larger maxParallel",
        )
    result = simulate(policy, args.nodes, ready_latency=args.ready_latency, interval=args.interval)
    if args.output == "json":
        print(json.dumps(result.as_json()))
    else:
        print(_table(result, policy, args))
    return 0


def wave_count(policy: policy_mod.Policy, nodes: int) -> int:
    """The waves the policy deletes pods in on `nodes` nodes with no failure."""
    return sum(step_waves(policy, nodes))


def load_policy(path: str) -> tuple[object, str]:
    """The upgradePolicy mapping in FILE and its field path (for error messages)."""
    doc = load_one(read_text(path, "give a readable YAML file with --policy"), path)
    if not isinstance(doc, dict):
        raise UserError(
            "--policy",
            f"{path} does not hold a mapping",
            "write an upgradePolicy mapping, or values/CR YAML with driver.upgradePolicy",
        )
    for where, keys in (
        ("spec.driver.upgradePolicy", ("spec", "driver", "upgradePolicy")),
        ("driver.upgradePolicy", ("driver", "upgradePolicy")),
        ("upgradePolicy", ("upgradePolicy",)),
    ):
        node = doc
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            return node, where
    return doc, "upgradePolicy"


def _table(result: Result, policy: policy_mod.Policy, args: argparse.Namespace) -> str:
    rows = [("step", "target", "deletions", "after", "ready at")]
    for rec in result.steps:
        after = "wait for admin" if rec.after == "manual" else f"pause {_duration(rec.after / 1000)}"
        rows.append(
            (
                str(rec.step),
                str(rec.target),
                ", ".join(map(str, rec.deletions)) or "-",
                after,
                "+" + _duration(rec.ready) if rec.ready is not None else "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        f"Staged driver rollout of {args.nodes} nodes: maxParallel {policy.max_parallel}, "
        f"pod Ready after {_duration(args.ready_latency)}, runner pass every {_duration(args.interval)}"
    ]
    if not policy.enable_rollout:
        lines.append("(enableRollout is false in this policy: shown as if it were true)")
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip() for row in rows]
    manual = sum(1 for rec in result.steps if rec.after == "manual")
    waves = sum(len(rec.deletions) for rec in result.steps)
    lines.append(
        f"Estimated duration: {_duration(result.end_time)} ({waves} waves"
        + (f", plus the admin's time to answer {manual} manual pauses)" if manual else ")")
    )
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "") + (f"{secs}s" if secs else "")
    return text or "0s"
