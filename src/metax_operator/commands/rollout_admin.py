"""`metax-operator rollout status|pause|resume|undo`: the staged driver rollout for admins.

Each command is the documented `kubectl` command made safe to type (docs/rollout-admin.md):
`pause`/`resume` set `spec.driver.upgradePolicy.pause` to true/false, `undo` sets `enableRollout`
to false (the seed's forced rollback: the runner restores the previous driver revision on every
node). `status` reads `status.upgradeStatus` and shows the steps, the wave in flight, failed,
held-back, skipped and cordoned nodes, nodes that need a reboot, and what happens next; `--watch` prints it again at every change.
"""

from __future__ import annotations

import argparse
import json
import time

from metax_operator.chart import upgrade_policy as policy_mod
from metax_operator.cli import bounded
from metax_operator.contract import CR_API_VERSION, CR_KIND, CR_NAME, CR_PLURAL, SKIP_LABEL
from metax_operator.errors import UserError, UserErrors
from metax_operator.lookup import lookup
from metax_operator.rollout import status as rollout
from metax_operator.runtime.kube import Backoff, Client, add_arguments

#: An admin at a terminal: one try per request, so a wrong kubeconfig fails at once.
AT_ONCE = Backoff(attempts=1)

POLICY_PATH = "/spec/driver/upgradePolicy"


def register_status(commands) -> None:
    parser = commands.add_parser(
        "status",
        help="show the driver rollout: steps, wave, failed nodes, next action",
        description="Show the staged driver rollout from the cluster-operator CR.",
    )
    parser.add_argument("--watch", "-w", action="store_true", help="print again at every change (Ctrl-C stops)")
    parser.add_argument(
        "--interval", type=bounded(float, 0.1, 3600), default=2.0, help="seconds between reads with --watch (default 2)"
    )
    parser.add_argument("--output", "-o", choices=("table", "json"), default="table")
    add_arguments(parser)
    parser.set_defaults(func=run_status)


def register_pause(commands) -> None:
    _switch(commands, "pause", "stop taking down new nodes (pods already deleted finish)", "pause", True)


def register_resume(commands) -> None:
    _switch(commands, "resume", "continue after a manual pause, a failure pause or an admin's pause", "pause", False)


def register_undo(commands) -> None:
    _switch(commands, "undo", "roll back to the previous driver revision (sets enableRollout: false)", "enableRollout", False)


SUBCOMMANDS = [register_status, register_pause, register_resume, register_undo]


def _switch(commands, name: str, help_text: str, field: str, value: bool) -> None:
    parser = commands.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
    add_arguments(parser)
    parser.set_defaults(func=lambda args: run_switch(args, field, value))


def run_switch(args: argparse.Namespace, field: str, value: bool) -> int:
    api = Client.from_args(args, AT_ONCE)
    cr = _get_cr(api)
    if lookup(cr, "spec", "driver", "upgradePolicy", "enableRollout") is not True and field == "pause":
        raise UserError(
            "spec.driver.upgradePolicy.enableRollout",
            "is false: there is no staged rollout to pause",
            f"set enableRollout: true first (kubectl edit {CR_PLURAL} {CR_NAME})",
        )
    api.patch(
        CR_API_VERSION, CR_KIND, CR_NAME, [{"op": "add", "path": f"{POLICY_PATH}/{field}", "value": value}], patch_type="json"
    )
    print(f"{CR_KIND.lower()}/{CR_NAME}: spec.driver.upgradePolicy.{field} set to {str(value).lower()}")
    return 0


def run_status(args: argparse.Namespace) -> int:
    api = Client.from_args(args, AT_ONCE)
    shown = None
    while True:
        text = render(_get_cr(api), args.output)
        if text != shown:
            if args.watch and shown is not None:
                print()
            print(text, flush=True)
            shown = text
        if not args.watch:
            return 0
        try:
            time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0


def _get_cr(api: Client) -> dict:
    cr = api.get(CR_API_VERSION, CR_KIND, CR_NAME)
    if cr is None:
        raise UserError(
            f"{CR_PLURAL}/{CR_NAME}",
            "does not exist",
            "install the chart (its bootstrap hook creates it) or check --kubeconfig/--context",
        )
    return cr


def render(cr: dict, output: str = "table") -> str:
    """The status of the CR's rollout as a table (or its upgradeStatus as JSON)."""
    written = (cr.get("status") or {}).get("upgradeStatus") or {}
    if output == "json":
        return json.dumps(written, indent=2, sort_keys=True)
    raw = lookup(cr, "spec", "driver", "upgradePolicy") or {}
    try:
        policy = policy_mod.validate(raw, field_prefix="spec.driver.upgradePolicy")
    except (UserError, UserErrors) as err:
        return f"The upgrade policy is invalid, so the runner does not act on it:\n{err}"
    status = rollout.UpgradeStatus.from_json(written)
    sub, resume = status.step, status.resume
    total, upgraded = sub.total_upgrade_replicas, sub.total_upgrade_ready_replicas
    index, state = sub.current_step_index, sub.current_step_state or ""
    lines = [
        f"Phase: {status.phase}   upgrading: {str(status.upgrading).lower()}   "
        f"revision {sub.last_pod_spec_revision or '-'} -> {sub.upgrading_pod_spec_revision or '-'}   "
        f"upgraded {upgraded}/{total}   pause: {str(policy.pause).lower()}   "
        f"enableRollout: {str(policy.enable_rollout).lower()}"
    ]
    rows = [("STEP", "TARGET", "UPGRADED", "AFTER", "STATE")]
    for i, (step, target) in enumerate(zip(policy.steps, policy.targets(total), strict=True)):
        after = "wait for admin" if step.pause_ms is None else f"{step.pause_ms} ms"
        if state == rollout.COMPLETED or i < index:
            cell = "done"
        elif i == index and status.upgrading:
            cell = state or "-"
        else:
            cell = "pending"
        rows.append((str(i), f"{target} ({step.replicas})", str(min(upgraded, target)), after, cell))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip() for row in rows]
    if resume.wave:
        lines.append(f"Wave ({resume.wave_kind or 'upgrade'}, since {resume.wave_start_time or '-'}): " + ", ".join(resume.wave))
    for nodes, label in (
        (resume.failed, "Failed nodes"),
        (resume.held, "Held back (GPU workloads)"),
        (resume.skipped, f"Skipped (label {SKIP_LABEL}=true)"),
        (resume.cordoned, "Cordoned by the runner"),
        (resume.need_reboot, "Need a reboot (NodeNeedReboot: firmware upgraded)"),
    ):
        if nodes.count:
            more = f" (+{nodes.count - len(nodes.names)} more)" if nodes.count > len(nodes.names) else ""
            lines.append(f"{label}: {nodes.count}: {', '.join(nodes.names)}{more}")
    failed = next((c for c in status.conditions if c.type == "Failed" and c.status == "True"), None)
    if failed:
        lines.append(f"Failed: {failed.reason}: {failed.message}")
    lines.append(f"Message: {status.message or '-'}")
    lines.append(f"Next: {next_action(status, policy)}")
    return "\n".join(lines)


def next_action(status: rollout.UpgradeStatus, policy: policy_mod.Policy) -> str:
    sub, resume = status.step, status.resume
    phase, state = status.phase, sub.current_step_state
    if phase in (rollout.TERMINATING, rollout.DISABLING):
        return "the runner rolls every node back to the previous revision, wave by wave"
    if not status.upgrading:
        if state == rollout.COMPLETED:
            return "nothing: the last rollout completed; a new driver version starts the next one"
        return "nothing in flight; a new driver version starts a rollout" + (
            "" if policy.enable_rollout else " that replaces every pod at once (enableRollout: false)"
        )
    if state == rollout.STEP_PAUSED and resume.paused_by_runner:
        why = "fix the failed nodes, then " if resume.pause_reason == "failure" else ""
        return f"{why}resume: metax-operator rollout resume (sets pause: false)"
    if policy.pause:
        return "paused by the admin: metax-operator rollout resume to continue"
    if state == rollout.STEP_PAUSED and sub.recheck_time:
        return f"continues on its own at {sub.recheck_time}"
    if resume.wave:
        return f"waiting for {len(resume.wave)} new pods to become Ready, then the next wave"
    return "the runner takes the next wave at its next pass"
