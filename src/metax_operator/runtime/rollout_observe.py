"""What one rollout pass observes, read from watch-fed caches (`informer.py`), never per node.

Eight caches, started once and kept across passes:
- the namespace's ControllerRevisions, kept only when a DaemonSet owns them (a few dozen);
- the driver pods (label `app.kubernetes.io/component=driver`), each projected to the engine's
  `Pod` plus its owner's uid;
- the validation pods (label `app.kubernetes.io/component=driver-validation`), each joined to the
  driver pod it validates (`validation_pod.check`);
- every running pod of the cluster, kept only when it requests a `metax-tech.com/*` resource,
  projected to a `workloads.GpuPod` (its node, and its `METAX_MACA_VERSION` values, which the
  runner's workload check reads): the GPU-workload check. Kubernetes cannot select pods by
  resource, so this one watch sees every pod change of the cluster; it reads of each only its
  containers' resources (`informer`'s lazy parse) and stores a few strings per GPU pod;
- every node, by its metadata, and the unschedulable ones (`node_cache.NodeCache`, two watches):
  whether each is unschedulable, its resourceVersion and its product labels, what a cordon reads
  before its conditional write (`cordon.cordon`), so that a wave's cordons are one request per
  node, not two, and what the state labels are compared with; and, by an index of it, the nodes
  labelled `metax-tech.com/driver-upgrade.skip=true` (kept out of the rollout), those the runner
  cordoned (`cordon.py`) and those an admin labelled `metax-tech.com/driver-upgrade.retry=true`
  (retry a failed driver); and the nodes cordoned by anyone, which the rollout counts out of
  service (`rollout.budget`);
- the Node events of namespace `default` (where node events are kept) with reason
  `NodeNeedReboot` (driver-manager, after a firmware upgrade) or `Rebooted` (the kubelet, when it
  finds a new boot id), by field selector: node name and time. A node needs a reboot while its
  latest `NodeNeedReboot` is newer than its latest `Rebooted`.

With `upgradePolicy.waitForCompletion.podSelector` set, a ninth cache follows the running pods
that match it (their nodes only); it is replaced when the selector changes.

The DaemonSet itself and the CR come from the runner's `runtime.object_cache`, which returns the
runner's own write until its watch has delivered it: the reconcile may have changed the
template a moment before in the same pass. The driver pods the runner deleted are read the same
way (`OwnDeletions`): the pass after a wave's deletions comes 0.2 s after it, and a pod whose
deletion the watch has not delivered yet is being deleted, not a live pod of the old revision to
delete again.

`Watches.observe(ds, cr, status)` turns a snapshot of them into `Cluster`: the current
revision is the `controller-revision-hash` of the newest ControllerRevision
owned by the DaemonSet's uid. The engine acts only when `caught_up`, which needs the three views to
agree, since they come from separate reads:
- the DaemonSet controller observed the latest generation;
- the newest revision in the cache holds the DaemonSet's template (its watch may lag);
- the runner's reconcile applied the CR's latest generation (`status.observedGeneration`), so the
  CR's `spec.driver`, recorded as `lastCoDriverSpec` and restored on a rollback, is the one the
  template came from.
A pod at a revision whose template differs from the newest's only in where pods may run
(`restore.same_driver`) runs the same driver: it is read as at the newest revision.
The engine's eligible nodes are the nodes of the DaemonSet's pods (on nodes the node cache has:
the pods of a deleted node stay until pod GC deletes them, tens of seconds later, and would hold a
slot of `maxParallel` and count among the upgraded), less the skipped ones, plus
the nodes of the wave in flight (whose pod may be between deletion and re-creation) while the
node cache still has them and the DaemonSet's nodeSelector still selects them (`targeted`): a
node deleted or relabelled out of the DaemonSet mid-wave never gets its pod back, and must drop
out of the wave and of N instead of failing the step. The check reads the product's labels
(`metax-tech.com/...`), which are all the chart's nodeSelector uses; a nodeSelector an admin adds
with other keys is not checked, and such a node counts as coming until its readiness timeout.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from metax_operator import workloads
from metax_operator.contract import (
    COMPONENT_LABEL,
    CORDONED_LABEL,
    LIVE_PODS,
    NODE_LABEL_PREFIX,
    POOL_LABEL,
    RETRY_LABEL,
    SKIP_LABEL,
)
from metax_operator.rollout.observation import Cluster
from metax_operator.rollout.restore import revision_template, same_driver
from metax_operator.rollout.target import DRIVER, Target
from metax_operator.runtime import cordon, validation_pod
from metax_operator.runtime.informer import Informer, Stats
from metax_operator.runtime.kube import Client
from metax_operator.runtime.node_cache import NodeCache
from metax_operator.runtime.rollout_projections import (
    DriverPod,
    Revision,
    need_reboot,
    node_event,
    pod_node,
    project_driver_pod,
    project_revision,
)
from metax_operator.runtime.watch_stream import STEADY_GATHER

DRIVER_POD_SELECTOR = f"{COMPONENT_LABEL}=driver"
NEED_REBOOT, REBOOTED = "NodeNeedReboot", "Rebooted"


class OwnDeletions:
    """The driver pods this runner deleted (uid -> when it asked) until the pod cache shows them
    being deleted or gone. Written and read by the pass's thread only."""

    def __init__(self) -> None:
        self._asked: dict[str, float] = {}

    def add(self, uids: list[str], when: float) -> None:
        self._asked.update(dict.fromkeys(uids, when))

    def __bool__(self) -> bool:
        return bool(self._asked)

    def pending(self, cached: dict[str, DriverPod]) -> dict[str, float]:
        """Those the cache `cached` (key -> pod) still holds as live; the others are forgotten."""
        if self._asked:
            live = {p.pod.uid for p in cached.values() if p.pod.deleting is None}
            self._asked = {uid: when for uid, when in self._asked.items() if uid in live}
        return dict(self._asked)


@dataclass(frozen=True)
class Snapshot:
    """One pass's view: the engine's `Cluster` and what acting on it needs."""

    observed: Cluster
    daemonset: dict
    revisions: dict[str, Revision]  # hash -> the DaemonSet's revision


class Watches:
    """The rollout's caches for `namespace`; `start()` once, `observe()` every pass."""

    def __init__(self, api: Client, namespace: str, resync: float = 1800.0):
        self.api, self.resync = api, resync
        self.started = False
        self.waited: Informer | None = None
        core = api.resource("v1", "Pod")
        apps = lambda kind: api.resource("apps/v1", kind)  # noqa: E731
        self.revisions = Informer(
            api,
            apps("ControllerRevision").path(namespace=namespace),
            project=project_revision,
            resync=resync,
            name="controllerrevisions",
        )
        self.driver_pods = Informer(
            api,
            core.path(namespace=namespace),
            label_selector=DRIVER_POD_SELECTOR,
            project=project_driver_pod,
            resync=resync,
            name="driver-pods",
        )
        self.validation_pods = Informer(
            api,
            core.path(namespace=namespace),
            label_selector=validation_pod.SELECTOR,
            project=validation_pod.check,
            resync=resync,
            name="validation-pods",
        )
        self.gpu_pods = Informer(
            api,
            "/api/v1/pods",
            field_selector=LIVE_PODS,
            project=workloads.gpu_pod,
            gather=STEADY_GATHER,
            resync=resync,
            name="gpu-workloads",
        )
        self.deleted = OwnDeletions()
        self.nodes = NodeCache(api, resync)
        self.skipped = self.nodes.labelled(SKIP_LABEL)
        self.cordoned = self.nodes.labelled(CORDONED_LABEL)
        self.retry = self.nodes.labelled(RETRY_LABEL)
        self.pooled = self.nodes.labelled(POOL_LABEL)  # the nodes of the driver pools
        events = "/api/v1/namespaces/default/events"
        self.reboot_asked = Informer(
            api,
            events,
            field_selector=f"involvedObject.kind=Node,reason={NEED_REBOOT}",
            project=node_event,
            resync=resync,
            name="node-need-reboot",
        )
        self.rebooted = Informer(
            api,
            events,
            field_selector=f"involvedObject.kind=Node,reason={REBOOTED}",
            project=node_event,
            resync=resync,
            name="node-rebooted",
        )
        self.all = (
            self.revisions,
            self.driver_pods,
            self.validation_pods,
            self.gpu_pods,
            *self.nodes.informers,
            self.reboot_asked,
            self.rebooted,
        )

    def start(self) -> Watches:
        """Start every cache, once."""
        if not self.started:
            for informer in self.all:
                informer.start()
            self.started = True
        return self

    def wait_for(self, selector: str) -> Informer | None:
        """The cache of running pods matching `selector` (started, or replaced when the selector
        changed; None and stopped when it is empty)."""
        current = self.waited
        if current is not None and current.label_selector != selector:
            current.stop()
            current = None
        if current is None and selector:
            current = Informer(
                self.api,
                "/api/v1/pods",
                label_selector=selector,
                field_selector=LIVE_PODS,
                project=pod_node,
                resync=self.resync,
                name="wait-for-completion",
            ).start()
        self.waited = current
        return current

    def synced(self) -> bool:
        return all(i.synced for i in self.all)

    def failing(self) -> list[str]:
        """The caches whose last LIST or WATCH failed: their contents may be stale."""
        return [i.name for i in self.all if i.state == "failing"]

    def wait_synced(self, timeout: float) -> bool:
        return all(i.wait_synced(timeout) for i in self.all)

    def stop(self) -> None:
        for informer in (*self.all, *([self.waited] if self.waited else [])):
            informer.stop()

    def changes(self) -> tuple[int, ...]:
        """How often each cache a rollout at rest reads has changed (`Informer.changes`; the nodes
        by their labels): not the GPU pods nor the waited-for ones, which change nothing then
        (`rollout.rest`)."""
        at_rest = (self.revisions, self.driver_pods, self.validation_pods, self.nodes, self.reboot_asked, self.rebooted)
        return tuple(cache.changes for cache in at_rest)

    def stats(self) -> Stats:
        total = Stats()
        for informer in self.all:
            for name in ("list_requests", "watch_requests", "events", "bytes", "relists"):
                setattr(total, name, getattr(total, name) + getattr(informer.stats, name))
        return total

    def observe(
        self,
        ds: dict,
        cr: dict,
        status: dict | None,
        spec: dict | None = None,
        target: Target = DRIVER,
        elsewhere: frozenset[str] = frozenset(),
    ) -> Snapshot:
        """The snapshot for one pass of `target`'s rollout, with its DaemonSet `ds` as just read,
        the CR `cr`, the spec the pass acts on (`freeze.in_force`; the CR's own by default) and
        the GPU nodes out of service in any rollout (`elsewhere`)."""
        waited = self.waited.snapshot().values() if self.waited else ()
        driver_pods = self.driver_pods.snapshot()
        return build(
            ds,
            self.revisions.snapshot().values(),
            driver_pods.values(),
            (p.node for p in self.gpu_pods.snapshot().values() if p.node and p.workload),
            cr,
            status,
            skipped=self.skipped.snapshot().values(),
            cordoned=self.cordoned.snapshot().values(),
            unschedulable=self.nodes.cordoned(),
            retry=self.retry.snapshot().values(),
            waited=(node for node in waited if node),
            need_reboot=need_reboot(self.reboot_asked.snapshot().values(), self.rebooted.snapshot().values()),
            nodes=self.nodes.snapshot(),
            spec=spec,
            checks=self.validation_pods.snapshot().values(),
            deleted=self.deleted.pending(driver_pods),
            target=target,
            elsewhere=elsewhere,
        )

    def gpu_pods_on(self, nodes: set[str]) -> list[workloads.GpuPod]:
        """The GPU workload pods the cache holds on `nodes` (what a drain evicts: not a DaemonSet's
        pods nor static ones, as `kubectl drain --ignore-daemonsets`)."""
        return [p for p in self.gpu_pods.snapshot().values() if p.node in nodes and p.workload]


def build(
    ds: dict,
    revisions,
    driver_pods,
    gpu_nodes,
    cr: dict,
    status: dict | None,
    skipped=(),
    cordoned=(),
    unschedulable=(),
    retry=(),
    waited=(),
    need_reboot=(),
    nodes=None,
    spec: dict | None = None,
    checks=(),
    deleted: dict[str, float] | None = None,
    target: Target = DRIVER,
    elsewhere: frozenset[str] = frozenset(),
) -> Snapshot:
    """The pure part of `observe` (also what the unit tests call). `spec` is the spec the pass acts
    on (the CR's own by default), `cr` the CR as stored. `nodes` maps each node's name to its
    `cordon.NodeState` (a snapshot of the node cache); without it every pod and wave node is
    kept. `checks` are the validation pods, as (driver pod uid, `Check`), each joined to its
    driver pod; `deleted` the pods the runner deleted that the cache holds as live (uid -> when
    it asked), counted as being deleted since then. With `nodes`, the nodes the runner cordoned,
    skipped, retried or has in the wave count only where `target` owns them (its pool label)."""
    uid = ds["metadata"]["uid"]
    spec = (cr.get("spec") or {}) if spec is None else spec
    own = {r.hash: r for r in sorted((r for r in revisions if r.owner_uid == uid), key=lambda r: r.number)}
    newest = max(own.values(), key=lambda r: r.number) if own else None
    cr_status = cr.get("status") or {}
    caught_up = (
        newest is not None
        and revision_template(newest.data) == ds["spec"]["template"]
        and (ds.get("status") or {}).get("observedGeneration", 0) >= ds["metadata"].get("generation", 0)
        and cr_status.get("observedGeneration") == (cr.get("metadata") or {}).get("generation")
    )
    # A pod on a node the DaemonSet no longer selects (deleted, or relabelled) is the DaemonSet
    # controller's to delete: it is no node of the rollout's, and never counted failed.
    selector = product_selector(ds)
    pods = tuple(
        p.pod
        for p in driver_pods
        if p.owner_uid == uid and p.pod.node and (nodes is None or targeted(selector, nodes.get(p.pod.node)))
    )
    same = same_driver({h: r.data for h, r in own.items()}, newest.hash if newest else None)
    if len(same) > 1:
        pods = tuple(dataclasses.replace(p, revision=newest.hash) if p.revision in same else p for p in pods)
    if checks := dict(checks):
        pods = tuple(dataclasses.replace(p, check=checks[p.uid]) if p.uid in checks else p for p in pods)
    if deleted:
        pods = tuple(dataclasses.replace(p, deleting=deleted[p.uid]) if p.uid in deleted else p for p in pods)
    wave = (((status or {}).get("resume") or {}).get("wave")) or []
    if nodes is not None:
        wave = [n for n in wave if targeted(selector, nodes.get(n)) and owned(target, nodes.get(n))]
        cordoned, retry, skipped = ([n for n in names if owned(target, nodes.get(n))] for names in (cordoned, retry, skipped))
    skipped = frozenset(skipped)
    observed = Cluster(
        current_revision=newest.hash if newest else "",
        same_driver=same,
        elsewhere=frozenset(elsewhere),
        caught_up=caught_up,
        nodes=(frozenset(p.node for p in pods) - skipped) | frozenset(wave),
        pods=pods,
        gpu_busy_nodes=frozenset(gpu_nodes),
        wait_busy_nodes=frozenset(waited),
        skipped=skipped,
        cordoned=frozenset(cordoned),
        unschedulable=frozenset(unschedulable),
        retry=frozenset(retry),
        need_reboot=frozenset(need_reboot),
        template=canonical(ds["spec"]["template"]),
        driver_spec=canonical(spec.get("driver") or {}),
        revisions={h: r.data for h, r in own.items()},
        daemonset=ds,
        cr_spec=spec,
        stored_driver=((target.spec(cr.get("spec") or {}) or {}).get("driver")) or {},
    )
    return Snapshot(observed, ds, own)


def product_selector(ds: dict) -> frozenset[tuple[str, str]]:
    """The product labels (`metax-tech.com/...`) of the DaemonSet's nodeSelector, as the node
    cache keeps a node's labels: what `targeted` reads."""
    selector = (ds["spec"]["template"].get("spec") or {}).get("nodeSelector") or {}
    return frozenset((k, v) for k, v in selector.items() if k.startswith(NODE_LABEL_PREFIX))


def targeted(selector: frozenset[tuple[str, str]], node: cordon.NodeState | None) -> bool:
    """Whether the node exists and carries the DaemonSet's `product_selector`."""
    return node is not None and selector <= node.labels


def owned(target: Target, node: cordon.NodeState | None) -> bool:
    """Whether the node is `target`'s (a node the cache does not have is the driver's own)."""
    return target.owns(dict(node.labels)) if node is not None else target.pool is None


def canonical(obj) -> str:
    """Compact JSON with sorted keys: what `lastAppliedSpec`/`lastCoDriverSpec` record."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))
