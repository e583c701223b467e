"""`metax-operator rollout status|pause|resume|undo`: the staged driver rollout for admins.

Each command is the documented `kubectl` command made safe to type (docs/rollout-admin.md):
`pause`/`resume` set `spec.driver.upgradePolicy.pause` to true/false, `undo` sets `enableRollout`
to false (the seed's forced rollback: the runner restores the previous driver revision on every
node). `status` reads `status.upgradeStatus` and shows the steps, the wave in flight, failed,
held-back, skipped and cordoned nodes, nodes that need a reboot, and what happens next; `--watch` prints it again at every change;
`--all` adds every node's upgrade state, from the label the runner keeps on each node (one LIST of the labelled nodes).
When nothing moves it says why, each cause with the command that moves it on (`blockers`): the
runner refuses the spec (SpecValid=False), its passes fail (RunnerHealthy=False), no runner
holds the Lease, a pause (the admin's or the runner's), nodes held back by GPU work, nodes that
need a reboot; and an edit made during the rollout that the runner holds until it ends (SpecHeld).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections import Counter
from typing import NamedTuple

from kubernetes.client.exceptions import ApiException

from metax_operator.chart import upgrade_policy as policy_mod
from metax_operator.cli import bounded
from metax_operator.commands.nodes import DEFAULT_NAMESPACE
from metax_operator.conditions import CrCondition, parse_time
from metax_operator.contract import (
    CR_API_VERSION,
    CR_KIND,
    CR_NAME,
    CR_PLURAL,
    RETRY_LABEL,
    RUNNER_LEASE,
    SKIP_LABEL,
    STATE_LABEL,
)
from metax_operator.errors import UserError, UserErrors
from metax_operator.lookup import lookup
from metax_operator.rollout.status import COMPLETED, DISABLING, STEP_PAUSED, TERMINATING, NodeList, UpgradeStatus
from metax_operator.rollout.target import DRIVER, Target, targets
from metax_operator.runtime.api_failures import Backoff
from metax_operator.runtime.kube import Client, add_arguments

#: An admin at a terminal: one try per request, so a wrong kubeconfig fails at once.
AT_ONCE = Backoff(attempts=1)

POLICY_PATH = "/spec/driver/upgradePolicy"
EDIT_CR = f"kubectl edit {CR_PLURAL} {CR_NAME}"


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
    parser.add_argument(
        "--all",
        action="store_true",
        help=f"also list every node's upgrade state (its label {STATE_LABEL}); "
        "the CR's status names only the first 20 nodes of each kind",
    )
    parser.add_argument(
        "--namespace",
        "-n",
        default=os.environ.get("POD_NAMESPACE") or DEFAULT_NAMESPACE,
        help=f"the release namespace, where the runners' Lease is (default: $POD_NAMESPACE, else {DEFAULT_NAMESPACE})",
    )
    parser.add_argument("--lease-name", default=RUNNER_LEASE, help=f"the runners' Lease (default {RUNNER_LEASE})")
    _pool_argument(parser)
    add_arguments(parser)
    parser.set_defaults(func=run_status)


def _pool_argument(parser) -> None:
    parser.add_argument(
        "--pool", metavar="NAME", help="the rollout of driver pool NAME (driver.pools), not the driver DaemonSet's own"
    )


def _target(args: argparse.Namespace, cr: dict) -> Target:
    """The rollout `--pool` names (the driver's own without it); a UserError for a pool the CR has not."""
    if not getattr(args, "pool", None):
        return DRIVER
    target = Target(args.pool)
    if target.index(cr.get("spec") or {}) is None:
        names = ", ".join(t.pool for t in targets(cr.get("spec") or {}) if t.pool) or "none"
        raise UserError("--pool", f"{args.pool} is no pool of spec.driver.pools (its pools: {names})", "name one of them")
    return target


def register_pause(commands) -> None:
    _switch(commands, "pause", "stop taking down new nodes (pods already deleted finish)", "pause", True)


def register_resume(commands) -> None:
    _switch(commands, "resume", "continue after a manual pause, a failure pause or an admin's pause", "pause", False)


def register_undo(commands) -> None:
    _switch(commands, "undo", "roll back to the previous driver revision (sets enableRollout: false)", "enableRollout", False)


SUBCOMMANDS = [register_status, register_pause, register_resume, register_undo]


def _switch(commands, name: str, help_text: str, field: str, value: bool) -> None:
    parser = commands.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
    _pool_argument(parser)
    add_arguments(parser)
    parser.set_defaults(func=lambda args: run_switch(args, field, value))


def run_switch(args: argparse.Namespace, field: str, value: bool) -> int:
    api = Client.from_args(args, AT_ONCE)
    cr = _get_cr(api)
    target = _target(args, cr)
    spec = cr.get("spec") or {}
    where = target.policy_field(spec)
    if lookup(target.spec(spec), "driver", "upgradePolicy", "enableRollout") is not True and field == "pause":
        raise UserError(
            f"{where}.enableRollout",
            "is false: there is no staged rollout to pause",
            f"set enableRollout: true first (kubectl edit {CR_PLURAL} {CR_NAME})",
        )
    ops = [{"op": "add", "path": f"{POLICY_PATH}/{field}", "value": value}]
    if target != DRIVER:  # the pool's own: its upgradePolicy gets the key (or is made with it)
        index, at = target.index(spec), target.policy_pointer(spec)
        own = isinstance(spec["driver"]["pools"][index].get("upgradePolicy"), dict)
        ops = [
            {"op": "test", "path": f"/spec/driver/pools/{index}/name", "value": target.pool},
            {"op": "add", "path": f"{at}/{field}", "value": value} if own else {"op": "add", "path": at, "value": {field: value}},
        ]
    api.patch(CR_API_VERSION, CR_KIND, CR_NAME, ops, patch_type="json")
    print(f"{CR_KIND.lower()}/{CR_NAME}: {where}.{field} set to {str(value).lower()}")
    return 0


def run_status(args: argparse.Namespace) -> int:
    api = Client.from_args(args, AT_ONCE)
    shown = None
    while True:
        cr = _get_cr(api)
        leader = no_leader(api, args.namespace, args.lease_name, time.time())
        text = render(cr, args.output, leader, args.namespace, node_states(api) if args.all else None, _target(args, cr))
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


class StateRow(NamedTuple):
    """A node as `--all` lists it: its upgrade state label and whether an admin asked for a retry."""

    name: str
    state: str
    retry: bool


def node_states(api: Client) -> list[StateRow]:
    """Every node carrying the runner's state label, by name."""
    nodes = api.list("v1", "Node", label_selector=STATE_LABEL)
    rows = []
    for node in nodes:
        labels = node["metadata"].get("labels") or {}
        rows.append(StateRow(node["metadata"]["name"], labels.get(STATE_LABEL, ""), labels.get(RETRY_LABEL) == "true"))
    return sorted(rows)


def no_leader(api: Client, namespace: str, name: str, now: float) -> str | None:
    """Why no runner leads, from the Lease `name` (None while a holder renews it in time)."""
    where = f"Lease {namespace}/{name}"
    try:
        lease = api.get("coordination.k8s.io/v1", "Lease", name, namespace)
    except ApiException as err:
        if err.status in (401, 403):
            return f"unknown: you may not read the {where} ({err.status}); ask for get on leases in {namespace}"
        raise
    runner = f"kubectl -n {namespace} get pods -l app.kubernetes.io/component=runner"
    holder = ((lease or {}).get("spec") or {}).get("holderIdentity")
    if not holder and _runs_as_cronjob(api, namespace, name):
        return None  # runner.mode cronjob: each run takes the lease and releases it
    if lease is None:
        return f"no runner has ever taken the {where} (a wrong namespace? pass -n): check the runner pod, {runner}"
    spec = lease.get("spec") or {}
    holder, duration = spec.get("holderIdentity"), spec.get("leaseDurationSeconds") or 15
    renewed = parse_time(spec.get("renewTime"))
    if not holder:
        return f"the {where} is released and no runner took it over: check the runner pod, {runner}"
    if renewed is None or now - renewed > duration:
        ago = f"{now - renewed:.0f} s ago" if renewed is not None else "never"
        return (
            f"the {where}'s holder {holder} renewed it {ago} (it lasts {duration} s): that runner is gone or cut off"
            f" from the API server; a successor takes over once it expires: check the runner pods, {runner}"
        )
    return None


def _runs_as_cronjob(api: Client, namespace: str, name: str) -> bool:
    """Whether the runner is the chart's CronJob (named like the Lease); False when unreadable."""
    try:
        return api.get("batch/v1", "CronJob", name, namespace) is not None
    except ApiException:
        return False


def blockers(
    cr: dict, status: UpgradeStatus, policy: policy_mod.Policy | None, leader: str | None, namespace: str, pool: str = ""
) -> list[str]:
    """Why the rollout does not move, each with what moves it on: first what stops the runner
    itself (`Stopped: ...`), then what the rollout waits for (`Waiting: ...`); `pool` is the
    `--pool NAME` of a driver pool's rollout."""
    conditions = {c.get("type"): c for c in (cr.get("status") or {}).get("conditions") or () if isinstance(c, dict)}
    out = []
    spec = conditions.get(CrCondition.SPEC_VALID) or {}
    if spec.get("status") == "False":
        out.append(
            f"Stopped: the runner refuses the spec (SpecValid=False, {spec.get('reason')}): {spec.get('message')};"
            f" fix it: {EDIT_CR}"
        )
    health = conditions.get(CrCondition.RUNNER_HEALTHY) or {}
    if health.get("status") == "False":
        out.append(
            f"Stopped: the runner's passes fail (RunnerHealthy=False, {health.get('reason')}): {health.get('message')};"
            f" its log: kubectl -n {namespace} logs deploy/metax-operator-runner"
        )
    if leader is not None:
        out.append(f"Stopped: no runner leads: {leader}")
    held = conditions.get(CrCondition.SPEC_HELD) or {}
    if held.get("status") == "True":
        out.append(f"Held: an edit made during the rollout (SpecHeld=True): {held.get('message')}")
    if policy is None:
        return out
    sub, resume = status.step, status.resume
    if status.upgrading and resume.paused_by_runner:
        if resume.pause_reason == "failure":
            out.append(
                "Waiting: the runner paused the rollout after a failed step:"
                f" fix the failed nodes, then metax-operator rollout resume{pool}"
                f" (or retry one node's driver now: kubectl label node NODE {RETRY_LABEL}=true)"
            )
        else:
            out.append(
                f"Waiting: step {sub.current_step_index} is done and waits for the admin: metax-operator rollout resume{pool}"
            )
    elif status.upgrading and policy.pause:
        out.append(f"Waiting: paused by the admin ({policy.field}.pause: true): metax-operator rollout resume{pool}")
    if status.upgrading and resume.held.count:
        out.append(
            f"Waiting: for the GPU jobs on {_names(resume.held)} to end (held back): let them finish, take such nodes in with"
            " driver.upgradePolicy.waitForCompletion or drain (docs/rollout-admin.md), or skip one:"
            f" kubectl label node NODE {SKIP_LABEL}=true"
        )
    if status.upgrading and resume.out_of_service.count:
        out.append(
            f"Waiting: for {_names(resume.out_of_service)} out of service (cordoned by someone else, NotReady or without"
            " a driver pod) to return: the waves keep at most maxParallel plus maxUnavailable GPU nodes out of service;"
            " uncordon a node once its maintenance is over, or raise driver.upgradePolicy.maxUnavailable"
        )
    if resume.drain_start:
        draining = NodeList.of(resume.drain_start)
        out.append(
            f"Waiting: for the drain of {_names(draining)} (evictions a PodDisruptionBudget may refuse): kubectl get pdb -A"
        )
    if resume.need_reboot.count:
        out.append(
            f"Waiting: {_names(resume.need_reboot)} need a reboot (firmware upgraded): reboot each once its GPU work stopped:"
            " kubectl drain NODE --ignore-daemonsets, reboot it, kubectl uncordon NODE"
        )
    return out


def _names(nodes: NodeList) -> str:
    more = f" (+{nodes.count - len(nodes.names)} more)" if nodes.count > len(nodes.names) else ""
    return f"{nodes.count} node{'s' if nodes.count != 1 else ''} ({', '.join(nodes.names)}{more})"


def render(
    cr: dict,
    output: str = "table",
    leader: str | None = None,
    namespace: str = DEFAULT_NAMESPACE,
    nodes: list[StateRow] | None = None,
    target: Target = DRIVER,
) -> str:
    """The status of the CR's rollout of `target` (the driver DaemonSet's own, or a pool's) as a
    table (or its upgradeStatus as JSON); `leader` says why no runner leads (`no_leader`), None
    when one does; `namespace` is the release's; `nodes` (with `--all`) every node's upgrade
    state, listed after it (JSON: `{"upgradeStatus", "nodes"}`)."""
    written = target.stored(cr.get("status")) or {}
    if output == "json":
        if nodes is not None:
            return json.dumps({"upgradeStatus": written, "nodes": [row._asdict() for row in nodes]}, indent=2, sort_keys=True)
        return json.dumps(written, indent=2, sort_keys=True)
    return _table(cr, written, leader, namespace, target) + ("" if nodes is None else "\n" + _node_table(nodes))


def _node_table(nodes: list[StateRow]) -> str:
    """Every labelled node's state: the count of each state, then one row per node."""
    if not nodes:
        return f"Nodes: none carries the label {STATE_LABEL} yet (the runner writes it at its passes)"
    counts = Counter(row.state for row in nodes)
    lines = ["Nodes: " + ", ".join(f"{counts[state]} {state}" for state in sorted(counts))]
    rows = [("NODE", "STATE", "RETRY")] + [(row.name, row.state, "asked" if row.retry else "") for row in nodes]
    widths = [max(len(r[c]) for r in rows) for c in range(2)]
    lines += [f"{name.ljust(widths[0])}  {state.ljust(widths[1])}  {retry}".rstrip() for name, state, retry in rows]
    return "\n".join(lines)


def _table(cr: dict, written: dict, leader: str | None, namespace: str, target: Target) -> str:
    spec = cr.get("spec") or {}
    raw = lookup(target.spec(spec) or {}, "driver", "upgradePolicy") or {}
    where = target.policy_field(spec)
    status = UpgradeStatus.from_json(written)
    try:
        policy = dataclasses.replace(policy_mod.validate(raw, field_prefix=where), field=where)
    except (UserError, UserErrors) as err:
        lines = [f"The upgrade policy is invalid, so the runner does not act on it:\n{err}", f"Fix it: {EDIT_CR}"]
        return "\n".join(lines + blockers(cr, status, None, leader, namespace))
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
    for i, (step, wanted) in enumerate(zip(policy.steps, policy.targets(total), strict=True)):
        after = "wait for admin" if step.pause_ms is None else f"{step.pause_ms} ms"
        if state == COMPLETED or i < index:
            cell = "done"
        elif i == index and status.upgrading:
            cell = state or "-"
        else:
            cell = "pending"
        rows.append((str(i), f"{wanted} ({step.replicas})", str(min(upgraded, wanted)), after, cell))
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
    why = blockers(cr, status, policy, leader, namespace, "" if target == DRIVER else f" --pool {target.pool}")
    lines += why
    stopped = any(line.startswith("Stopped:") for line in why)
    lines.append(f"Next: {'nothing moves until the causes under Stopped are fixed' if stopped else next_action(status, policy)}")
    if target == DRIVER and (others := [t for t in targets(cr.get("spec") or {}) if t.pool]):
        lines.append("Pools (each: metax-operator rollout status --pool NAME): " + "; ".join(_pool_line(cr, t) for t in others))
    return "\n".join(lines)


def _pool_line(cr: dict, target: Target) -> str:
    """One driver pool's rollout in a few words (`-`: no runner has written it yet)."""
    stored = target.stored(cr.get("status"))
    if stored is None:
        return f"{target.pool} -"
    status = UpgradeStatus.from_json(stored)
    sub = status.step
    return f"{target.pool} {status.phase} {sub.total_upgrade_ready_replicas}/{sub.total_upgrade_replicas}"


def next_action(status: UpgradeStatus, policy: policy_mod.Policy) -> str:
    sub, resume = status.step, status.resume
    phase, state = status.phase, sub.current_step_state
    if phase in (TERMINATING, DISABLING):
        return "the runner rolls every node back to the previous revision, wave by wave"
    if not status.upgrading:
        if state == COMPLETED:
            return "nothing: the last rollout completed; a new driver version starts the next one"
        return "nothing in flight; a new driver version starts a rollout" + (
            "" if policy.enable_rollout else " that replaces every pod at once (enableRollout: false)"
        )
    if state == STEP_PAUSED and resume.paused_by_runner:
        why = "fix the failed nodes, then " if resume.pause_reason == "failure" else ""
        return f"{why}resume: metax-operator rollout resume (sets pause: false)"
    if policy.pause:
        return "paused by the admin: metax-operator rollout resume to continue"
    if state == STEP_PAUSED and sub.recheck_time:
        return f"continues on its own at {sub.recheck_time}"
    if resume.wave:
        return f"waiting for {len(resume.wave)} new pods to become Ready, then the next wave"
    return "the runner takes the next wave at its next pass"
