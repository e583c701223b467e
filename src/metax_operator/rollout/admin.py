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

from metax_operator.rollout import policy as policy_mod
from metax_operator.runtime import reconcile
from metax_operator.rollout import engine
from metax_operator.rollout.cordon import SKIP_LABEL
from metax_operator.cli import bounded
from metax_operator.errors import UserError, UserErrors
from metax_operator.runtime.kube import Backoff, Client, add_arguments

#: An admin at a terminal: one try per request, so a wrong kubeconfig fails at once.
AT_ONCE = Backoff(attempts=1)

POLICY_PATH = "/spec/driver/upgradePolicy"


def register_status(commands) -> None:
    parser = commands.add_parser("status", help="show the driver rollout: steps, wave, failed nodes, next action",
                                 description="Show the staged driver rollout from the cluster-operator CR.")
    parser.add_argument("--watch", "-w", action="store_true", help="print again at every change (Ctrl-C stops)")
    parser.add_argument("--interval", type=bounded(float, 0.1, 3600), default=2.0,
                        help="seconds between reads with --watch (default 2)")
    parser.add_argument("--output", "-o", choices=("table", "json"), default="table")
    add_arguments(parser)
    parser.set_defaults(func=run_status)


def register_pause(commands) -> None:
    _switch(commands, "pause", "stop taking down new nodes (pods already deleted finish)", "pause", True)


def register_resume(commands) -> None:
    _switch(commands, "resume", "continue after a manual pause, a failure pause or an admin's pause", "pause", False)


def register_undo(commands) -> None:
    _switch(commands, "undo", "roll back to the previous driver revision (sets enableRollout: false)",
            "enableRollout", False)


SUBCOMMANDS = [register_status, register_pause, register_resume, register_undo]


def _switch(commands, name: str, help_text: str, field: str, value: bool) -> None:
    parser = commands.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
    add_arguments(parser)
    parser.set_defaults(func=lambda args: run_switch(args, field, value))


def run_switch(args: argparse.Namespace, field: str, value: bool) -> int:
    api = Client.from_args(args, AT_ONCE)
    cr = _get_cr(api)
    if (((cr.get("spec") or {}).get("driver") or {}).get("upgradePolicy") or {}).get("enableRollout") is not True \
            and field == "pause":
        raise UserError("spec.driver.upgradePolicy.enableRollout", "is false: there is no staged rollout to pause",
                        "set enableRollout: true first (kubectl edit clusteroperators cluster-operator)")
    api.patch(reconcile.CR_API_VERSION, reconcile.CR_KIND, reconcile.CR_NAME,
              [{"op": "add", "path": f"{POLICY_PATH}/{field}", "value": value}], patch_type="json")
    print(f"clusteroperator/{reconcile.CR_NAME}: spec.driver.upgradePolicy.{field} set to {str(value).lower()}")
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
    cr = api.get(reconcile.CR_API_VERSION, reconcile.CR_KIND, reconcile.CR_NAME)
    if cr is None:
        raise UserError("clusteroperators/cluster-operator", "does not exist",
                        "install the chart (its bootstrap hook creates it) or check --kubeconfig/--context")
    return cr


def render(cr: dict, output: str = "table") -> str:
    """The status of the CR's rollout as a table (or its upgradeStatus as JSON)."""
    status = (cr.get("status") or {}).get("upgradeStatus") or {}
    if output == "json":
        return json.dumps(status, indent=2, sort_keys=True)
    raw = ((cr.get("spec") or {}).get("driver") or {}).get("upgradePolicy") or {}
    try:
        policy = policy_mod.validate(raw, field_prefix="spec.driver.upgradePolicy")
    except (UserError, UserErrors) as err:
        return f"The upgrade policy is invalid, so the runner does not act on it:\n{err}"
    sub = status.get("status") or {}
    resume = status.get("resume") or {}
    total = sub.get("totalUpgradeReplicas") or 0
    upgraded = sub.get("totalUpgradeReadyReplicas") or 0
    index, state = sub.get("currentStepIndex") or 0, sub.get("currentStepState") or ""
    lines = [f"Phase: {status.get('phase') or '-'}   upgrading: {str(bool(status.get('upgrading'))).lower()}   "
             f"revision {sub.get('lastPodSpecRevision') or '-'} -> {sub.get('upgradingPodSpecRevision') or '-'}   "
             f"upgraded {upgraded}/{total}   pause: {str(policy.pause).lower()}   "
             f"enableRollout: {str(policy.enable_rollout).lower()}"]
    rows = [("STEP", "TARGET", "UPGRADED", "AFTER", "STATE")]
    for i, (step, target) in enumerate(zip(policy.steps, policy.targets(total), strict=True)):
        after = "wait for admin" if step.pause_ms is None else f"{step.pause_ms} ms"
        if state == engine.COMPLETED or i < index:
            cell = "done"
        elif i == index and status.get("upgrading"):
            cell = state or "-"
        else:
            cell = "pending"
        rows.append((str(i), f"{target} ({step.replicas})", str(min(upgraded, target)), after, cell))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip() for row in rows]
    if resume.get("wave"):
        lines.append(f"Wave ({resume.get('waveKind') or 'upgrade'}, since {resume.get('waveStartTime', '-')}): "
                     + ", ".join(resume["wave"]))
    for key, label in (("failedNodes", "Failed nodes"), ("heldNodes", "Held back (GPU workloads)"),
                       ("skippedNodes", f"Skipped (label {SKIP_LABEL}=true)"),
                       ("cordonedNodes", "Cordoned by the runner"),
                       ("needRebootNodes", "Need a reboot (NodeNeedReboot: firmware upgraded)")):
        count = resume.get(key.replace("Nodes", "NodeCount")) or 0
        if count:
            more = f" (+{count - len(resume[key])} more)" if count > len(resume[key]) else ""
            lines.append(f"{label}: {count}: {', '.join(resume[key])}{more}")
    failed = next((c for c in status.get("condition") or [] if c.get("type") == "Failed"
                   and c.get("status") == "True"), None)
    if failed:
        lines.append(f"Failed: {failed.get('reason')}: {failed.get('message')}")
    lines.append(f"Message: {status.get('message') or '-'}")
    lines.append(f"Next: {next_action(status, policy)}")
    return "\n".join(lines)


def next_action(status: dict, policy: policy_mod.Policy) -> str:
    sub = status.get("status") or {}
    resume = status.get("resume") or {}
    phase, state = status.get("phase"), sub.get("currentStepState")
    if phase in (engine.TERMINATING, engine.DISABLING):
        return "the runner rolls every node back to the previous revision, wave by wave"
    if not status.get("upgrading"):
        if state == engine.COMPLETED:
            return "nothing: the last rollout completed; a new driver version starts the next one"
        return "nothing in flight; a new driver version starts a rollout" + (
            "" if policy.enable_rollout else " that replaces every pod at once (enableRollout: false)")
    if state == engine.STEP_PAUSED and resume.get("pausedByRunner"):
        why = "fix the failed nodes, then " if resume.get("pauseReason") == "failure" else ""
        return f"{why}resume: metax-operator rollout resume (sets pause: false)"
    if policy.pause:
        return "paused by the admin: metax-operator rollout resume to continue"
    if state == engine.STEP_PAUSED and sub.get("recheckTime"):
        return f"continues on its own at {sub['recheckTime']}"
    if resume.get("wave"):
        return f"waiting for {len(resume['wave'])} new pods to become Ready, then the next wave"
    return "the runner takes the next wave at its next pass"
