"""The runtime reconcile of the `cluster-operator` CR into the DaemonSets the chart rendered.

Functional core, imperative shell; the mapping of the CR onto a DaemonSet is
`chart/daemonset.py`. `observe` reads the cluster into an `Observed`, whose spec is validated
once (`check_spec`); every function in `RECONCILERS` turns it into an `Outcome` (partial
DaemonSets to apply, conditions, events) without calling the API (`decide`); `apply_objects`
writes the objects, `cr_status.write` the CR's status and the events (`apply` does both). The
runner's pass (`run.Runner`) puts the staged driver rollout between the two, so that it sees the
template just applied: one pass writes the CR's status once, with the conditions,
`observedGeneration` and the rollout's `upgradeStatus` together.

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
wins over what Helm rendered), and only when needed (`field_ownership.needs_write`): a second pass over an
unchanged CR issues no request that writes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import yaml

from metax_operator.chart import pools, validation
from metax_operator.chart.daemonset import desired_daemonset, item_names, payload_containers, pod_of
from metax_operator.conditions import FALSE, TRUE, Condition, CrCondition, CrReason, Event, EventType, rfc3339
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
    POOL_ANNOTATION,
    RUNNER_FIELD_MANAGER,
)
from metax_operator.errors import UserError
from metax_operator.jsonlog import event
from metax_operator.lookup import lookup
from metax_operator.runtime import cr_status
from metax_operator.runtime.field_ownership import minimal, needs_write
from metax_operator.runtime.kube import Client
from metax_operator.runtime.object_cache import Reader
from metax_operator.runtime.observed import Apply, Observed, Outcome

log = logging.getLogger(__name__)

#: The objects of the release (the chart's `app.kubernetes.io/part-of` label).
RELEASE_SELECTOR = f"{PART_OF_LABEL}={PART_OF}"


# -- the core: pure functions of the observed state ----------------------------------------------


def reconcile_daemonsets(observed: Observed) -> Outcome:
    """Apply the CR to each DaemonSet that exists; report the spec when it is invalid."""
    out = Outcome()
    if observed.cr is None:
        return out
    errors = observed.check.errors
    if errors:
        message = "; ".join(str(e) for e in errors)
        out.conditions += [
            Condition(CrCondition.SPEC_VALID, FALSE, CrReason.INVALID_SPEC, message),
            Condition(
                CrCondition.RECONCILED,
                FALSE,
                CrReason.INVALID_SPEC,
                f"the CR is not applied to the DaemonSets until it is fixed: {message}",
            ),
        ]
        return out
    out.conditions.append(Condition(CrCondition.SPEC_VALID, TRUE, CrReason.VALID, "the spec passes validation"))
    problems = []
    for key, ds in sorted(observed.daemonsets.items()):
        try:
            desired, changed = desired_daemonset(key, ds, observed.spec)
        except UserError as err:  # the chart's annotations on the DaemonSet are broken
            problems.append(f"DaemonSet {ds['metadata']['name']}: {err}")
            continue
        if needs_write(desired, ds):
            out.applies.append(Apply(minimal(desired, ds), tuple(changed)))
    for name, ds in sorted(observed.pools.items()):
        spec = observed.pool_specs.get(name) or pools.pool_spec(observed.spec, name)
        if spec is None:  # the pool left the CR: Helm deletes its DaemonSet (check_helm_owned)
            continue
        try:
            desired, changed = desired_daemonset("driver", ds, spec)
        except UserError as err:
            problems.append(f"DaemonSet {ds['metadata']['name']}: {err}")
            continue
        if needs_write(desired, ds):
            out.applies.append(Apply(minimal(desired, ds), tuple(changed)))
    if problems:
        out.conditions.append(Condition(CrCondition.RECONCILED, FALSE, CrReason.BROKEN_DAEMONSET, "; ".join(problems)))
    else:
        out.conditions.append(Condition(CrCondition.RECONCILED, TRUE, CrReason.APPLIED, "every DaemonSet matches the CR"))
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
    needs += _pool_differences(spec, observed)
    needs += _service_differences(spec, observed.service)
    if needs:
        out.conditions.append(Condition(CrCondition.HELM_UPGRADE, TRUE, CrReason.HELM_OWNED_CHANGE, "; ".join(needs)))
    else:
        out.conditions.append(
            Condition(CrCondition.HELM_UPGRADE, FALSE, CrReason.IN_SYNC, "nothing in the CR needs helm upgrade")
        )
    return out


def _pool_differences(spec: dict, observed: Observed) -> list[str]:
    """The driver pools of the CR without a DaemonSet, and the pools' DaemonSets without a pool in
    the CR: Helm creates and deletes them."""
    if "driver" not in observed.daemonsets:
        return []
    wanted = {p.get("name") for p in pools.pools_of(spec.get("driver"))}
    added, removed = sorted(wanted - observed.pools.keys()), sorted(observed.pools.keys() - wanted)
    if not added and not removed:
        return []
    said = [f"spec.driver.pools has {', '.join(added)} without a DaemonSet"] if added else []
    said += [f"DaemonSets of pools {', '.join(removed)} are not in spec.driver.pools"] if removed else []
    return [f"{'; '.join(said)}: run helm upgrade with the pools in driver.pools (Helm creates and deletes their DaemonSets)"]


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
    if observed.cr is None or observed.check.errors:  # an invalid spec is reported, not applied
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
        out.conditions.append(Condition(CrCondition.CONFIG_VALID, FALSE, CrReason.INVALID_CONFIGMAP, "; ".join(problems)))
    else:
        out.conditions.append(Condition(CrCondition.CONFIG_VALID, TRUE, CrReason.VALID, f"{' and '.join(CONFIGMAPS)} parse"))
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


# -- the shell: read, then write what the core decided ------------------------------------------


def observe(api: Reader, namespace: str) -> Observed:
    """What a pass reads, from `api` (the runner's object cache, or a client)."""
    cr = api.get(CR_API_VERSION, CR_KIND, CR_NAME)
    daemonsets, pool_daemonsets = {}, {}
    for ds in api.list("apps/v1", "DaemonSet", namespace, label_selector=RELEASE_SELECTOR):
        annotations = ds["metadata"].get("annotations") or {}
        key, pool = annotations.get(COMPONENT_ANNOTATION), annotations.get(POOL_ANNOTATION)
        if DAEMONSETS.get(key) == ds["metadata"]["name"]:
            daemonsets[key] = ds
        elif key == "driver" and pool and ds["metadata"]["name"] == pools.daemonset_name(pool):
            pool_daemonsets[pool] = ds
    configmaps = {name: api.get("v1", "ConfigMap", name, namespace) for name in CONFIGMAPS}
    service = api.get("v1", "Service", EXPORTER_SERVICE, namespace)
    return Observed(namespace, cr, daemonsets, configmaps, service, pool_daemonsets)


def apply_objects(api: Client, applies: list[Apply], guard: Callable[[], bool]) -> list[Event]:
    """Server-side apply each partial object as the runner's field manager, the lease checked
    before each; the Events that say what was applied."""
    events = []
    for partial in applies:
        cr_status.check_lease(guard)
        api.apply(partial.body, field_manager=RUNNER_FIELD_MANAGER, force=True)
        meta = partial.body["metadata"]
        kind, name = partial.body["kind"], meta["name"]
        event(log, "apply", kind=kind, name=name, namespace=meta.get("namespace"), fields=list(partial.fields))
        fields = ", ".join(partial.fields) or "field ownership only"
        message = f"applied the CR to {kind} {name}: {fields}"
        events.append(Event(EventType.NORMAL, CrReason.APPLIED, message))
    return events


def apply(
    api: Client,
    observed: Observed,
    outcome: Outcome,
    guard: Callable[[], bool],
    clock: Callable[[], float],
    identity: str = "",
    applied: bool = True,
) -> int:
    """Write what the reconcile decided: the partial objects, then the CR's status once with the
    conditions (`cr_status.write`), then the events; the number of writes. `applied`: the outcome
    is the whole pass's for the CR's generation (False for a condition alone, such as the report of
    a failed pass). The runner's own pass puts the rollout between the objects and the status
    (`run.Runner`)."""
    events = apply_objects(api, outcome.applies, guard)
    if observed.cr is None:
        return len(outcome.applies)
    now = rfc3339(clock())
    written = cr_status.write(
        api, observed.cr, outcome.conditions, [*outcome.events, *events], guard, now, identity, applied=applied
    )
    return len(outcome.applies) + written.writes
