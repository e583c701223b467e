"""The runtime reconcile of the `cluster-operator` CR into the DaemonSets the chart rendered.

Functional core, imperative shell; the mapping of the CR onto a DaemonSet is
`chart/daemonset.py`. `observe` reads the cluster into an `Observed`; every function
in `RECONCILERS` turns it into an `Outcome` (partial DaemonSets to apply, conditions, events)
without calling the API (`decide`); `apply` writes. The staged driver rollout (a `RolloutStep`,
`rollout_pass.py`) decides between the applies and the status write, so that it sees the
template just applied, and acts after it: one pass writes the CR's status once, with the
conditions, `observedGeneration` and the rollout's `upgradeStatus` together (`write_status`).

What the runner governs on a DaemonSet, and nothing else (Helm owns the rest, and only Helm
creates or deletes objects):
- the pod's `nodeSelector`, `affinity`, `tolerations`: the podTemplateSpec rules of `merge.py`
  over the base the chart recorded in the `gpu.metax-tech.com/scheduling-base` annotation and the
  inputs from the CR (`spec.podTemplateSpec`, `spec.<component>.podTemplateSpec`, the deprecated
  `spec.tolerations`), exactly as the post-renderer computes them at render time;
- the environment variables the chart renders from CR fields (`daemonset.ENV`), only where the chart put
  them: log level/format, the driver's deployPolicy and firmware options, gpu-device's
  healthyInterval, the MXMACA payload list;
- payload images: the driver's `payload` init container
  (`<payload.registry or registry>/<payload.name>:<payload.version>`) and MXMACA's `payload-N`
  init containers (`<payload.registry or registry>/<IMAGE>`);
- the driver's `updateStrategy`: always `OnDelete` (`contract.DRIVER_UPDATE_STRATEGY`), put back
  if anything else wrote another one (an older chart's release restored by `helm rollback`);
- the other components' `updateStrategy` (`contract.COMPONENT_UPDATE_STRATEGY`), which the chart
  leaves out: put back after the pre-rollback hook's `OnDelete`, with the CR's fields in one write.

Beside the DaemonSets: the `driver-config` and `metax-vfio-config` ConfigMaps get `spec.driver.config`
and `spec.vfioManager.vfioConfig` when those change in the CR (`reconcile_configmaps`; an admin's
edit of the ConfigMap itself stays until then), and a CR change only `helm upgrade` can make is
reported as the condition HelmUpgradeRequired naming the field (`check_helm_owned`: `deploy`,
the driver's payload init container, the MXMACA image count, the exporter Service's type and
ports).

Writes are server-side applies as field manager `metax-operator-runner` with `force` (the CR
wins over what Helm rendered), and only when needed (`needs_write`): a second pass over an
unchanged CR issues no request that writes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import yaml
from kubernetes.client.exceptions import ApiException

from metax_operator.chart import validation
from metax_operator.chart.daemonset import covers, desired_daemonset, item_names, payload_containers, pod_of, scheduling_inputs
from metax_operator.chart.merge import merge_scheduling
from metax_operator.contract import (
    COMPONENT_ANNOTATION,
    CONFIGMAP_KEYS,
    CONFIGMAPS,
    CR_API_VERSION,
    CR_APPLIED_ANNOTATION,
    CR_KIND,
    CR_NAME,
    DAEMONSETS,
    DEFAULT_DEPLOY,
    DRIVER_PAYLOAD_CONTAINER,
    EXPORTER_SERVICE,
    PART_OF,
    PART_OF_LABEL,
    RUNNER_FIELD_MANAGER,
)
from metax_operator.errors import UserError, UserErrors
from metax_operator.jsonlog import event
from metax_operator.lookup import lookup
from metax_operator.rollout import freeze
from metax_operator.rollout.status import Condition, rfc3339, transition_time
from metax_operator.runtime.kube import Client, api_problem
from metax_operator.runtime.object_cache import Reader

log = logging.getLogger("metax_operator.runtime.reconcile")

#: Events about the cluster-scoped CR must live here (API server rule for cluster-scoped objects).
EVENT_NAMESPACE = "default"
#: The objects of the release (the chart's `app.kubernetes.io/part-of` label).
RELEASE_SELECTOR = f"{PART_OF_LABEL}={PART_OF}"


# Condition types on the CR (metav1.Condition), with the status that means "all is well".
SPEC_VALID = "SpecValid"
CONFIG_VALID = "ConfigMapsValid"
RECONCILED = "Reconciled"
HELM_UPGRADE = "HelmUpgradeRequired"
WORKLOADS_VALID = "WorkloadsValid"  # set by workloads.check
RUNNER_HEALTHY = "RunnerHealthy"  # how the runner's last pass ended (`pass_condition`)
FORBIDDEN, API_ERROR, PASS_FAILED = PASS_FAILURES = ("Forbidden", "APIError", "PassFailed")  # its reasons when False
HEALTHY = {
    SPEC_VALID: "True",
    CONFIG_VALID: "True",
    RECONCILED: "True",
    HELM_UPGRADE: "False",
    WORKLOADS_VALID: "True",
    RUNNER_HEALTHY: "True",
    freeze.SPEC_HELD: "False",
}


@dataclass
class Observed:
    """What one pass reads: the CR, the component DaemonSets (by values key), the ConfigMaps."""

    namespace: str
    cr: dict | None
    daemonsets: dict[str, dict] = field(default_factory=dict)
    configmaps: dict[str, dict | None] = field(default_factory=dict)
    service: dict | None = None  # the exporter's Service

    @property
    def spec(self) -> dict:
        return (self.cr or {}).get("spec") or {}


@dataclass(frozen=True)
class Apply:
    """A partial object to server-side apply, and the fields it changes (for the log and event)."""

    body: dict
    fields: tuple[str, ...]


@dataclass
class Outcome:
    """What a reconciler wants: partial objects to apply, conditions to set, events to emit."""

    applies: list[Apply] = field(default_factory=list)
    conditions: list[Condition] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)

    def extend(self, other: Outcome) -> None:
        self.applies += other.applies
        self.conditions += other.conditions
        self.events += other.events


# -- the core: pure functions of the observed state ----------------------------------------------


def spec_errors(spec: dict) -> list[UserError]:
    """Problems of the CR spec: the shared validation rules, then the podTemplateSpec inputs
    (the global podTemplateSpec is checked once per component: each problem is kept once)."""
    errors: list[UserError] = []
    checks = [lambda: validation.validate_cr_spec(spec)]
    checks += [lambda key=key: merge_scheduling(scheduling_inputs(spec, key), prefix="spec.") for key in DAEMONSETS]
    for check in checks:
        try:
            check()
        except UserErrors as err:
            errors += err.errors
        except UserError as err:
            errors.append(err)
    return list({str(e): e for e in errors}.values())


def reconcile_daemonsets(observed: Observed) -> Outcome:
    """Apply the CR to each DaemonSet that exists; report the spec when it is invalid."""
    out = Outcome()
    if observed.cr is None:
        return out
    errors = spec_errors(observed.spec)
    if errors:
        message = "; ".join(str(e) for e in errors)
        out.conditions += [
            Condition(SPEC_VALID, "False", "InvalidSpec", message),
            Condition(
                RECONCILED, "False", "InvalidSpec", f"the CR is not applied to the DaemonSets until it is fixed: {message}"
            ),
        ]
        return out
    out.conditions.append(Condition(SPEC_VALID, "True", "Valid", "the spec passes validation"))
    problems = []
    for key, ds in sorted(observed.daemonsets.items()):
        try:
            desired, changed = desired_daemonset(key, ds, observed.spec)
        except UserError as err:  # the chart's annotations on the DaemonSet are broken
            problems.append(f"DaemonSet {ds['metadata']['name']}: {err}")
            continue
        if needs_write(desired, ds):
            out.applies.append(Apply(minimal(desired, ds), tuple(changed)))
    if problems:
        out.conditions.append(Condition(RECONCILED, "False", "BrokenDaemonSet", "; ".join(problems)))
    else:
        out.conditions.append(Condition(RECONCILED, "True", "Applied", "every DaemonSet matches the CR"))
    return out


def check_helm_owned(observed: Observed) -> Outcome:
    """Report CR changes only `helm upgrade` can make: a flipped `deploy`, a changed pod structure."""
    out = Outcome()
    if observed.cr is None:
        return out
    spec = observed.spec
    needs = []
    for key, name in DAEMONSETS.items():
        wanted = (spec.get(key) or {}).get("deploy", DEFAULT_DEPLOY[key])
        exists = key in observed.daemonsets
        if bool(wanted) != exists:
            needs.append(
                f"spec.{key}.deploy is {str(bool(wanted)).lower()} but DaemonSet {name} "
                f"{'does not exist' if wanted else 'exists'}: run helm upgrade with "
                f"--set {key}.deploy={str(bool(wanted)).lower()} (the runner never creates or "
                f"deletes what Helm owns)"
            )
    driver = observed.daemonsets.get("driver")
    if driver is not None:
        has_payload = DRIVER_PAYLOAD_CONTAINER in item_names(pod_of(driver).get("initContainers"))
        policy = (spec.get("driver") or {}).get("deployPolicy")
        if policy is not None and (policy == "Never") == has_payload:
            needs.append(
                f"spec.driver.deployPolicy is {policy} but DaemonSet {DAEMONSETS['driver']} "
                f"{'has' if has_payload else 'has no'} payload init container: run helm upgrade "
                f"with --set driver.deployPolicy={policy}"
            )
    maca = observed.daemonsets.get("maca")
    images = lookup(spec, "maca", "payload", "images")
    if maca is not None and images is not None:
        count = len(payload_containers(pod_of(maca)))
        if count != len(images):
            needs.append(
                f"spec.maca.payload.images lists {len(images)} images but DaemonSet {DAEMONSETS['maca']} has "
                f"{count} payload init containers: run helm upgrade with the new maca.payload.images"
            )
    needs += _service_differences(spec, observed.service)
    if needs:
        out.conditions.append(Condition(HELM_UPGRADE, "True", "HelmOwnedChange", "; ".join(needs)))
    else:
        out.conditions.append(Condition(HELM_UPGRADE, "False", "InSync", "nothing in the CR needs helm upgrade"))
    return out


def _service_differences(spec: dict, service: dict | None) -> list[str]:
    """Where the exporter's Service differs from `spec.exporter.service`: its type and ports are
    Helm's to change (a type change rebuilds the Service), so the runner reports them."""
    wanted = (spec.get("exporter") or {}).get("service") or {}
    if service is None or not wanted:
        return []
    live = service.get("spec") or {}
    port = (live.get("ports") or [{}])[0]
    kind = wanted.get("type", "ClusterIP")
    have = {"type": live.get("type", "ClusterIP"), "externalName": live.get("externalName") or ""}
    want = {"type": kind, "externalName": wanted.get("externalName") or "" if kind == "ExternalName" else ""}
    if wanted.get("port") is not None and kind in validation.SERVICE_TYPES_WITH_PORT:
        have["port"] = port.get("nodePort" if kind == "NodePort" else "port")
        want["port"] = wanted["port"]
    return [
        f"spec.exporter.service.{key} is {json.dumps(want[key])} but Service {EXPORTER_SERVICE} has "
        f"{json.dumps(have[key])}: run helm upgrade with the same exporter.service.{key}"
        for key in want
        if want[key] != have[key]
    ]


def reconcile_configmaps(observed: Observed) -> Outcome:
    """Write a CR field into its ConfigMap key when the field changed since the runner last wrote
    it (`CR_APPLIED_ANNOTATION`): an admin's edit of the ConfigMap itself stays until the CR field
    changes (seed §3.2.6: admins edit these ConfigMaps in place). The first pass only records."""
    out = Outcome()
    if observed.cr is None or spec_errors(observed.spec):  # an invalid spec is reported, not applied
        return out
    for name in CONFIGMAPS:
        cm = observed.configmaps.get(name)
        if cm is None:
            continue
        try:
            recorded = json.loads((cm["metadata"].get("annotations") or {})[CR_APPLIED_ANNOTATION])
        except (KeyError, ValueError):
            recorded = None
        record, data, changed = {}, {}, []
        for key in CONFIGMAP_KEYS:
            if key.configmap != name:
                continue
            value = lookup(observed.spec, *key.field)
            record[key.key] = json.dumps(value, sort_keys=True)
            if recorded is not None and recorded.get(key.key) != record[key.key]:
                content = value or key.empty()  # as the chart writes it (templates/*/configmap.yaml)
                data[key.key] = yaml.safe_dump({key.wrap: content} if key.wrap else content, sort_keys=False)
                changed.append("spec." + ".".join(key.field))
        if recorded != record:
            body = {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": name,
                    "namespace": observed.namespace,
                    "annotations": {CR_APPLIED_ANNOTATION: json.dumps(record, sort_keys=True)},
                },
            }
            if data:
                body["data"] = data
            out.applies.append(Apply(body, tuple(changed)))
    return out


def check_configmaps(observed: Observed) -> Outcome:
    """Report broken admin edits of `driver-config` and `metax-vfio-config` (the shared parsers)."""
    out = Outcome()
    if observed.cr is None:
        return out
    problems: list[str] = []
    for name, cm in observed.configmaps.items():
        if cm is not None:
            problems += [str(e) for e in validation.configmap_problems(name, cm.get("data"))]
    if problems:
        out.conditions.append(Condition(CONFIG_VALID, "False", "InvalidConfigMap", "; ".join(problems)))
    else:
        out.conditions.append(Condition(CONFIG_VALID, "True", "Valid", f"{' and '.join(CONFIGMAPS)} parse"))
    return out


#: One pass = these, in order. Each takes the observed state and returns what it wants done.
RECONCILERS: list[Callable[[Observed], Outcome]] = [
    reconcile_daemonsets,
    reconcile_configmaps,
    check_helm_owned,
    check_configmaps,
]


def decide(observed: Observed, reconcilers=RECONCILERS) -> Outcome:
    """What every reconciler wants for `observed`, together."""
    out = Outcome()
    for reconcile in reconcilers:
        out.extend(reconcile(observed))
    return out


def needs_write(desired: dict, live: dict) -> bool:
    """Whether applying `desired` would change anything.

    Write when the live object lacks a desired value, or when the runner still owns a field it no
    longer wants (an apply without it lets the API server remove it). A field Helm rendered with
    the same value (after a post-rendered install) needs no write.
    """
    owned = owned_fields(live, RUNNER_FIELD_MANAGER)
    return not covers(live.get("spec"), desired["spec"]) or not covers(desired["spec"], owned.get("spec"))


def minimal(desired: dict, live: dict) -> dict:
    """`desired` cut to the fields the live object lacks plus those the runner already owns.

    Owning no more than it must keeps the runner out of Helm's way: a field it co-owned at an
    equal value would make the next server-side `helm upgrade` (Helm 4) that changes it conflict.
    Owned fields stay in, or the API server would remove them.
    """
    want, have = desired["spec"]["template"]["spec"], pod_of(live)
    owned_spec = owned_fields(live, RUNNER_FIELD_MANAGER).get("spec") or {}
    owned = pod_of({"spec": owned_spec})
    pod = {
        f: v
        for f, v in want.items()
        if f not in ("containers", "initContainers") and (f in owned or not covers(have.get(f), v, f))
    }
    for kind in ("containers", "initContainers"):
        live_items = {c["name"]: c for c in have.get(kind) or []}
        owned_items = {c.get("name"): c for c in owned.get(kind) or []}
        items = []
        for item in want.get(kind) or []:
            live_item, owned_item = live_items.get(item["name"], {}), owned_items.get(item["name"], {})
            kept = {}
            if "image" in item and ("image" in owned_item or live_item.get("image") != item["image"]):
                kept["image"] = item["image"]
            env = [
                e
                for e in item.get("env") or []
                if e["name"] in item_names(owned_item.get("env")) or not covers(live_item.get("env"), [e])
            ]
            if env:
                kept["env"] = env
            if kept:
                items.append({"name": item["name"], **kept})
        if items:
            pod[kind] = items
    spec: dict[str, Any] = {"template": {"spec": pod}}
    strategy = desired["spec"].get("updateStrategy")
    if strategy is not None and (
        "updateStrategy" in owned_spec or not covers((live.get("spec") or {}).get("updateStrategy"), strategy)
    ):
        spec["updateStrategy"] = strategy
    return {**desired, "spec": spec}


def owned_fields(obj: dict, manager: str) -> dict:
    """The part of `obj` that `manager` owns by apply (its managedFields entry projected on obj)."""
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") == manager and entry.get("operation") == "Apply":
            return _project(obj, entry.get("fieldsV1") or {})
    return {}


def _project(value: Any, fields: dict) -> Any:
    """`value` restricted to a fieldsV1 set: `f:` fields, `k:` keyed items, `v:` set values."""
    if not fields:
        return value
    if isinstance(value, dict):
        return {
            name[2:]: _project(value[name[2:]], sub)
            for name, sub in fields.items()
            if name.startswith("f:") and name[2:] in value
        }
    if isinstance(value, list):
        out = []
        for name, sub in fields.items():
            if name.startswith("k:"):
                key = json.loads(name[2:])
                out += [
                    _project(item, sub)
                    for item in value
                    if isinstance(item, dict) and all(item.get(k) == v for k, v in key.items())
                ]
            elif name.startswith("v:") and json.loads(name[2:]) in value:
                out.append(json.loads(name[2:]))
        return out
    return value


def pass_condition(failure: BaseException | None) -> Condition:
    """RunnerHealthy for how a pass ended: False with the failure in one line and its fix (a
    permission the runner lacks shows in `kubectl describe`, not only in the runner's log)."""
    if failure is None:
        return Condition(RUNNER_HEALTHY, "True", "PassSucceeded", "the runner's last pass succeeded")
    retry = "the runner retries with backoff"
    if isinstance(failure, ApiException) and failure.status in (401, 403):
        problem = api_problem(failure)
        fix = "give the runner's ServiceAccount that permission back: helm upgrade renders its RBAC (templates/runner/rbac.yaml)"
        return Condition(RUNNER_HEALTHY, "False", FORBIDDEN, f"{problem.field}: {problem.problem}; {fix}; {retry}")
    if isinstance(failure, UserError):
        reason, text = PASS_FAILED, str(failure)
    elif (problem := api_problem(failure)) is not None:
        reason, text = API_ERROR, str(problem)
    else:
        reason, text = PASS_FAILED, f"{type(failure).__name__}: {failure}"
    return Condition(RUNNER_HEALTHY, "False", reason, f"{' '.join(text.split())}; {retry}")


# -- the shell: read, then write what the core decided ------------------------------------------


class LostLeadership(Exception):
    """The lease was lost in the middle of a pass: stop writing at once."""


def check_lease(guard: Callable[[], bool]) -> None:
    """Raise LostLeadership unless `guard` says the lease is still held: called before every write."""
    if not guard():
        raise LostLeadership("the lease was lost: stopping before the next write")


class RolloutStep(Protocol):
    """The staged rollout's part of a pass (`rollout_pass.RolloutPass`): `decide` after the
    applies, on the CR the pass observed (None: nothing to do this pass), the `upgradeStatus`
    its plan writes, then `act` on the CR as written."""

    def decide(self, cr: dict) -> Any: ...

    def upgrade_status(self, plan: Any) -> dict: ...

    def act(self, cr: dict, plan: Any) -> int: ...


def observe(api: Reader, namespace: str) -> Observed:
    """What a pass reads, from `api` (the runner's object cache, or a client)."""
    cr = api.get(CR_API_VERSION, CR_KIND, CR_NAME)
    daemonsets = {}
    for ds in api.list("apps/v1", "DaemonSet", namespace, label_selector=RELEASE_SELECTOR):
        key = (ds["metadata"].get("annotations") or {}).get(COMPONENT_ANNOTATION)
        if DAEMONSETS.get(key) == ds["metadata"]["name"]:
            daemonsets[key] = ds
    configmaps = {name: api.get("v1", "ConfigMap", name, namespace) for name in CONFIGMAPS}
    return Observed(namespace, cr, daemonsets, configmaps, api.get("v1", "Service", EXPORTER_SERVICE, namespace))


def merge_conditions(
    existing: list[dict], wanted: list[Condition], generation: int | None, now: str
) -> tuple[list[dict], list[Condition]]:
    """`existing` with the `wanted` conditions set (others kept), and the ones that changed.

    `lastTransitionTime` moves only when a condition's status changes (metav1.Condition rules).
    """
    result = [dict(c) for c in existing]
    changed = []
    for want in wanted:
        old = next((c for c in result if c.get("type") == want.type), None)
        new = {
            "type": want.type,
            "status": want.status,
            "reason": want.reason,
            "message": want.message[:32768],
            "observedGeneration": generation,
            "lastTransitionTime": transition_time(old.get("status"), old.get("lastTransitionTime"), want.status, now)
            if old
            else now,
        }
        if old is None:
            result.append(new)
        else:
            result[result.index(old)] = new
        if old is None or (old.get("status"), old.get("reason"), old.get("message")) != (
            want.status,
            want.reason,
            new["message"],
        ):
            changed.append(want)
    return result, changed


def transition_events(changed: list[Condition], first: set[str]) -> list[tuple[str, str, str]]:
    """Events for condition changes: Warning when a condition goes bad, Normal when it recovers.

    A condition set for the first time (`first`) and healthy is not worth an event.
    """
    events = []
    for c in changed:
        healthy = HEALTHY.get(c.type) == c.status
        if healthy and c.type in first:
            continue
        events.append(("Normal" if healthy else "Warning", c.reason, f"{c.type}={c.status}: {c.message}"))
    return events


def apply(
    api: Client,
    observed: Observed,
    outcome: Outcome,
    guard: Callable[[], bool],
    clock: Callable[[], float],
    identity: str = "",
    applied: bool = True,
    rollout: RolloutStep | None = None,
) -> int:
    """Write what the pass decided; the number of writes. In order: the partial objects, the
    rollout's decision (`rollout`, on the objects just applied), the CR's status once
    (`write_status`), the events, then the rollout's actions. Checks `guard` before every write
    and raises LostLeadership when it says the lease is gone; `clock` gives the time of the
    status and the events (seconds since the epoch, as every clock of the runner). `applied`: the outcome is the
    whole pass's for the CR's generation, which `status.observedGeneration` then records (False
    for a condition alone, such as the report of a failed pass)."""
    writes = 0
    events = list(outcome.events)
    for partial in outcome.applies:
        check_lease(guard)
        api.apply(partial.body, field_manager=RUNNER_FIELD_MANAGER, force=True)
        writes += 1
        meta = partial.body["metadata"]
        fields = ", ".join(partial.fields) or "field ownership only"
        event(
            log,
            "apply",
            kind=partial.body["kind"],
            name=meta["name"],
            namespace=meta.get("namespace"),
            fields=list(partial.fields),
        )
        events.append(("Normal", "Applied", f"applied the CR to {partial.body['kind']} {meta['name']}: {fields}"))
    if observed.cr is None:
        return writes
    plan = rollout.decide(observed.cr) if rollout is not None else None
    upgrade_status = rollout.upgrade_status(plan) if plan is not None else None
    now = rfc3339(clock())
    written = write_status(api, observed.cr, outcome.conditions, guard, now, applied=applied, upgrade_status=upgrade_status)
    writes += written.writes
    for kind, reason, message in [*events, *written.events]:
        check_lease(guard)
        writes += emit_event(api, observed.cr, kind, reason, message, now, identity)
    if plan is not None and written.cr is not None:
        writes += rollout.act(written.cr, plan)
    return writes


@dataclass
class StatusWrite:
    """What `write_status` did: the CR as it now stands (None after a conflict), the writes (0 or
    1) and the events of the conditions that changed."""

    cr: dict | None
    writes: int = 0
    events: list[tuple[str, str, str]] = field(default_factory=list)


def write_status(
    api: Client,
    cr: dict,
    conditions: list[Condition],
    guard: Callable[[], bool],
    now: str,
    applied: bool = True,
    upgrade_status: dict | None = None,
) -> StatusWrite:
    """The CR's status as one pass leaves it: `conditions` set (`merge_conditions`),
    `observedGeneration` when `applied`, the rollout's `upgradeStatus` when given; written as one
    PUT of the status subresource carrying the resourceVersion the pass read, and only when it
    differs from the status read."""
    status = cr.get("status") or {}
    generation = cr["metadata"].get("generation")
    existing = status.get("conditions") or []
    merged, changed = merge_conditions(existing, conditions, generation, now)
    wanted = dict(status)
    if merged != existing:
        wanted["conditions"] = merged
    if applied:
        wanted["observedGeneration"] = generation
    if upgrade_status is not None:
        wanted["upgradeStatus"] = upgrade_status
    if wanted == status:
        return StatusWrite(cr)
    check_lease(guard)
    body = {**json.loads(json.dumps(cr)), "status": wanted}
    path = api.resource(CR_API_VERSION, CR_KIND).path(CR_NAME, subresource="status")
    try:
        written = api.call("PUT", path, body=body)
    except ApiException as err:
        if err.status != 409:
            raise
        # The CR changed since it was read: this status was planned from the spec of generation
        # `generation`, which may no longer be the CR's. Writing it under the new generation would
        # claim a spec this pass never applied, and the rollout's decision is stale too: the next
        # pass decides again (and acts on nothing before).
        event(log, "status-conflict", msg="the CR changed since it was read: its status waits for the next pass")
        return StatusWrite(None)
    if changed:
        event(log, "set-conditions", changed=[f"{c.type}={c.status}({c.reason})" for c in changed])
    first = {c.type for c in conditions} - {c["type"] for c in existing}
    return StatusWrite(written, 1, transition_events(changed, first))


def emit_event(
    api: Client,
    cr: dict,
    kind: str,
    reason: str,
    message: str,
    now: str,
    identity: str = "",
    component: str = RUNNER_FIELD_MANAGER,
) -> bool:
    """A core/v1 Event about the CR (what `kubectl describe clusteroperator` shows) from `component`
    (the runner, or the bootstrap hook). The API server keeps events of cluster-scoped objects in
    namespace `default`. Best effort, as client-go's recorder: a failed event is logged, never
    fails the pass."""
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{CR_NAME}.", "namespace": EVENT_NAMESPACE},
        "involvedObject": {"apiVersion": CR_API_VERSION, "kind": CR_KIND, "name": CR_NAME, "uid": cr["metadata"].get("uid")},
        "type": kind,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": component},
        "reportingComponent": component,
        "reportingInstance": identity or component,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        api.call("POST", api.resource("v1", "Event").path(namespace=EVENT_NAMESPACE), body=body)
    except Exception as err:  # noqa: BLE001 - events are best effort
        event(
            log,
            "event-failed",
            logging.WARNING,
            type=kind,
            reason=reason,
            msg=message,
            error=f"{type(err).__name__}: {getattr(err, 'reason', err)}",
        )
        return False
    event(log, "event", type=kind, reason=reason, msg=message)
    return True
