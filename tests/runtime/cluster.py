"""The fake cluster around the runner: the whole `runtime.run.Runner` (its Helm hold, freeze,
reconcile and rollout) on the fake API server of tests/fakeapi.py, which holds the chart's objects
as the real helm3 renders them (`chart`, once per process), and the parts of a cluster the runner
meets, each a small model the test moves between the runner's passes:

- `DaemonSetController`: a ControllerRevision per template (a template seen before re-uses its
  revision, renumbered the newest), `status.observedGeneration`; for the driver (`OnDelete`) a pod
  at the current revision for each node it selects that has none, the pods of a node it no longer
  selects deleted, those of a deleted node removed (pod GC);
- the node lifecycle controller: a node reported NotReady has its pods marked not Ready;
- `Kubelet`: a new pod turns Running and Ready, but on a node whose driver fails (`failing`),
  where it never gets Ready and restarts again and again; the runner's validation pods pass, but
  fail on a node whose validation fails (`invalid`) and run for ever on one where it hangs
  (`hanging`); a pod being deleted is removed (its grace period over). A slow kubelet is one not
  synced; a NotReady node's kubelet does nothing (cut off: its pods stay as they are, those being
  deleted too);
- `Workloads`: GPU jobs (owned by a Job, or bare), a DaemonSet's GPU pod, pods matching the wait
  selector (with or without a GPU), PodDisruptionBudgets that allow no eviction;
- `Helm`: the release's values and revision; `upgrade` runs the bootstrap hook (which writes the
  values into the CR, creating it if it is gone, and the release revision the runner's hold
  reads), `apply` is Helm applying the release to the DaemonSets after its hooks;
- `Admin`: `kubectl patch` of the CR (JSON patches, as the docs tell), of nodes; its deletion;
- the runner (`Cluster.runner`): its lease (held, lost, or lapsing after a number of checks),
  restarted with fresh caches, and `run_pass`, which starts a pass once the runner's caches hold
  every change, so that a pass reads the cluster as it is.

The test's own writes go through an exempt client (`KUBECTL`): the faults a test injects for the
runner never hit them; its reads look at the fake server's store (`FakeApi.objects`) between the
runner's passes, never changing what they read. Times are one clock, `Cluster.now`, which only
the test moves.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import itertools
import json
from dataclasses import dataclass

from kubernetes.client.exceptions import ApiException

from metax_operator import workloads
from metax_operator.conditions import parse_time, rfc3339
from metax_operator.contract import (
    BOOTSTRAP_FIELD_MANAGER,
    COMPONENT_LABEL,
    GPU_NODE_LABEL,
    GPU_RESOURCE,
    HELM_APPLY_WAIT,
    RELEASE_REVISION_ANNOTATION,
    SKIP_LABEL,
    VALIDATES_LABEL,
    VALIDATION_COMPONENT,
)
from metax_operator.runtime import run
from metax_operator.runtime.cr_status import LostLeadership
from metax_operator.runtime.object_cache import NotReady
from tests.fakeapi import FakeApi
from tests.helm import render_chart
from tests.runtime.test_reconcile import VALUES, deep_update
from tests.waiting import eventually

NS = "metax-operator"
CR = "/apis/gpu.metax-tech.com/v1/clusteroperators/cluster-operator"
DAEMONSETS = f"/apis/apps/v1/namespaces/{NS}/daemonsets"
DRIVER = f"{DAEMONSETS}/metax-driver"
REVISIONS = f"/apis/apps/v1/namespaces/{NS}/controllerrevisions"
PODS = f"/api/v1/namespaces/{NS}/pods"
NODES = "/api/v1/nodes"
WORK = "ml"  # the namespace of the GPU jobs
JOBS = f"/api/v1/namespaces/{WORK}/pods"
BUDGETS = f"/apis/policy/v1/namespaces/{WORK}/poddisruptionbudgets"
#: The driver versions a test sets: the values' first, then newer ones.
VERSIONS = (VALUES["driver"]["payload"]["version"], "2.33.0.1", "2.34.0.2")
#: The label the wait selector (`waitForCompletion.podSelector`) of a test's policy matches.
TRAINING = ("app", "training")
WAIT_SELECTOR = "=".join(TRAINING)
T0 = 1_800_000_000.0
#: The user agent of the test's own client (the DaemonSet controller, the kubelet, Helm, the admin).
KUBECTL = "kubectl"
REVISION_LABEL = "controller-revision-hash"
#: What the API server defaults a DaemonSet's update strategy to when the manifest has none.
DEFAULT_STRATEGY = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}


def chart(pools: list[dict] | None = None) -> tuple[dict, ...]:
    """The chart's DaemonSets, ConfigMaps and Service for the tests' values (with `pools` as
    `driver.pools`), as helm3 renders them (rendered once per process and pools)."""
    return _chart(json.dumps(pools or [], sort_keys=True))


@functools.cache
def _chart(pools: str) -> tuple[dict, ...]:
    values = deep_update(copy.deepcopy(VALUES), {"driver": {"pools": json.loads(pools)}}) if json.loads(pools) else VALUES
    return tuple(obj for obj in render_chart(values) if obj["kind"] in ("DaemonSet", "ConfigMap", "Service"))


def path_of(obj: dict) -> str:
    kind, name = obj["kind"], obj["metadata"]["name"]
    return {
        "DaemonSet": f"{DAEMONSETS}/{name}",
        "ConfigMap": f"/api/v1/namespaces/{NS}/configmaps/{name}",
        "Service": f"/api/v1/namespaces/{NS}/services/{name}",
    }[kind]


def template_hash(template: dict) -> str:
    """A pod template's revision hash (the DaemonSet controller's own is a hash of it too)."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def validation(pod: dict) -> bool:
    """Whether the pod is one of the runner's validation pods."""
    return labels(pod).get(COMPONENT_LABEL) == VALIDATION_COMPONENT


def node_status(ready: bool) -> dict:
    """A GPU node's status as its kubelet reports it: its Ready condition, 8 GPUs."""
    gpus = {GPU_RESOURCE: "8"}
    return {"conditions": [{"type": "Ready", "status": str(ready)}], "capacity": gpus, "allocatable": dict(gpus)}


def labels(obj: dict) -> dict:
    return (obj.get("metadata") or {}).get("labels") or {}


def owner(obj: dict) -> str:
    """The name of the object's first owner."""
    return (((obj.get("metadata") or {}).get("ownerReferences") or [{}])[0]).get("name", "")


def images(pod_spec: dict, kind: str) -> list[dict]:
    """A pod template's containers of `kind` as a pod made from it keeps them here: their names
    and images (no decision reads more of a driver pod's spec)."""
    return [{"name": c["name"], "image": c["image"]} for c in pod_spec.get(kind) or []]


def payload_version(template: dict) -> str:
    """The driver version a driver pod template installs (its payload image's tag)."""
    image = next(c["image"] for c in template["spec"]["initContainers"] if c["name"] == "payload")
    return image.rsplit(":", 1)[1]


def schedulable(pod_spec: dict, node_labels: dict) -> bool:
    """Whether a pod template's nodeSelector and required node affinity admit a node's labels."""
    if any(node_labels.get(k) != v for k, v in (pod_spec.get("nodeSelector") or {}).items()):
        return False
    affinity = ((pod_spec.get("affinity") or {}).get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    terms = (affinity or {}).get("nodeSelectorTerms") or []
    return not terms or any(all(_admits(e, node_labels) for e in t.get("matchExpressions") or []) for t in terms)


def _admits(expression: dict, node_labels: dict) -> bool:
    key, values = expression["key"], expression.get("values") or []
    return {
        "In": lambda: node_labels.get(key) in values,
        "NotIn": lambda: node_labels.get(key) not in values,
        "Exists": lambda: key in node_labels,
        "DoesNotExist": lambda: key not in node_labels,
    }[expression["operator"]]()


class DaemonSetController:
    """The DaemonSet controller, for the release's DaemonSets; pods for the driver's (its own and
    each driver pool's) only (the other components' pods are no input of any decision of the
    runner)."""

    def __init__(self, api: FakeApi, kubectl, clock):
        self.api, self.kubectl, self.clock = api, kubectl, clock
        self.serial = itertools.count()
        self.hashes: dict[tuple[str, str], str] = {}  # (path, resourceVersion) -> its template's hash

    def revisions(self, ds: str = "metax-driver") -> dict[str, dict]:
        """hash -> the ControllerRevision of DaemonSet `ds`."""
        return {
            obj["metadata"]["labels"][REVISION_LABEL]: obj
            for path, obj in self.api.objects.items()
            if path.startswith(REVISIONS + "/") and owner(obj) == ds
        }

    def current(self, ds: str = "metax-driver") -> str:
        """The template's revision hash of driver DaemonSet `ds`."""
        return self.hash(f"{DAEMONSETS}/{ds}")

    def hash(self, path: str) -> str:
        """The revision hash of the template of the DaemonSet at `path` (worked out once a version)."""
        ds = self.api.objects[path]
        key = (path, ds["metadata"]["resourceVersion"])
        if key not in self.hashes:
            self.hashes[key] = template_hash(ds["spec"]["template"])
        return self.hashes[key]

    def sync(self) -> None:
        for path in sorted(p for p in self.api.objects if p.startswith(DAEMONSETS + "/")):
            self._revision(path)
        for ds in self.drivers():
            self._driver_pods(ds)

    def drivers(self) -> list[str]:
        """The driver DaemonSets: the driver's own, then each pool's."""
        prefix = f"{DAEMONSETS}/metax-driver"
        return sorted(path.rsplit("/", 1)[1] for path in self.api.objects if path == prefix or path.startswith(prefix + "-pool-"))

    def _revision(self, path: str) -> None:
        """The template's ControllerRevision, created or renumbered the newest; then the
        generation observed."""
        ds = self.api.objects[path]
        name, template = ds["metadata"]["name"], ds["spec"]["template"]
        current, revisions = self.hash(path), self.revisions(name)
        newest = max((r["revision"] for r in revisions.values()), default=0)
        if current not in revisions:
            owner = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": name, "uid": ds["metadata"]["uid"], "controller": True}
            revision = {
                "apiVersion": "apps/v1",
                "kind": "ControllerRevision",
                "metadata": {
                    "name": f"{name}-{current}",
                    "namespace": NS,
                    "labels": {REVISION_LABEL: current},
                    "ownerReferences": [owner],
                },
                "revision": newest + 1,
                "data": {"spec": {"template": {**copy.deepcopy(template), "$patch": "replace"}}},
            }
            self.kubectl.call("POST", REVISIONS, body=revision)
        elif revisions[current]["revision"] != newest:
            renumbered = {**revisions[current], "revision": newest + 1}
            self.kubectl.call("PUT", f"{REVISIONS}/{name}-{current}", body=renumbered)
        if (ds.get("status") or {}).get("observedGeneration") != ds["metadata"]["generation"]:
            ds = self.api.get(path)
            ds.setdefault("status", {})["observedGeneration"] = ds["metadata"]["generation"]
            self.kubectl.call("PUT", path + "/status", body=ds)

    def selected(self, ds: str = "metax-driver") -> set[str]:
        """The nodes driver DaemonSet `ds`'s nodeSelector and node affinity select."""
        spec = self.api.objects[f"{DAEMONSETS}/{ds}"]["spec"]["template"]["spec"]
        return {
            path.rsplit("/", 1)[1]
            for path, node in self.api.objects.items()
            if path.startswith(NODES + "/") and schedulable(spec, labels(node))
        }

    def driver_pods(self, ds: str = "metax-driver") -> dict[str, list[dict]]:
        """node -> the pods of driver DaemonSet `ds` on it (a deleted one still terminating among them)."""
        pods: dict[str, list[dict]] = {}
        for path, pod in sorted(self.api.objects.items()):
            if path.startswith(PODS + "/metax-driver-") and not validation(pod) and owner(pod) == ds:
                pods.setdefault(pod["spec"]["nodeName"], []).append(pod)
        return pods

    def _driver_pods(self, ds_name: str) -> None:
        """OnDelete: a pod for each selected node without one (not while its old one terminates);
        the pods of a node no longer selected deleted; those of a node gone removed (pod GC)."""
        ds = self.api.objects[f"{DAEMONSETS}/{ds_name}"]
        template, current = ds["spec"]["template"], self.current(ds_name)
        nodes, selected, pods = self.nodes(), self.selected(ds_name), self.driver_pods(ds_name)
        for node in sorted(selected - set(pods)):
            name = f"{ds_name}-{node}-{next(self.serial)}"
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": NS,
                    "labels": {**labels(template), REVISION_LABEL: current},
                    "creationTimestamp": rfc3339(self.clock()),
                    "ownerReferences": [
                        {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": ds_name, "uid": ds["metadata"]["uid"]}
                    ],
                },
                "spec": {"nodeName": node, **{kind: images(template["spec"], kind) for kind in ("initContainers", "containers")}},
                "status": {"phase": "Pending"},
            }
            self.kubectl.call("POST", PODS, body=pod)
        for node, on_node in pods.items():
            for pod in on_node:
                if node not in nodes:
                    self.api.delete(f"{PODS}/{pod['metadata']['name']}")  # pod GC: the node is gone
                elif node not in selected and not pod["metadata"].get("deletionTimestamp"):
                    self.kubectl.delete("v1", "Pod", pod["metadata"]["name"], NS)

    def nodes(self) -> set[str]:
        return {path.rsplit("/", 1)[1] for path in self.api.objects if path.startswith(NODES + "/")}


class Kubelet:
    """Every node's kubelet: pods start, and Ready but on the nodes whose driver fails; the
    runner's validation pods pass, but on the nodes whose validation fails or hangs; pods being
    deleted are removed."""

    def __init__(self, api: FakeApi, kubectl):
        self.api, self.kubectl = api, kubectl
        self.failing: set[str] = set()  # nodes whose driver pod never gets Ready (a crash loop)
        self.invalid: set[str] = set()  # nodes whose validation pods fail (the driver left no GPU)
        self.hanging: set[str] = set()  # nodes whose validation pods run and never end

    def sync(self, node: str | None = None) -> None:
        """The kubelet of `node` (every node's by default) catches up; a validation pod whose
        driver pod is gone goes too (the garbage collector: the driver pod owns it)."""
        uids = {p["metadata"].get("uid") for p in self.api.objects.values()}
        cut_off = {
            path.rsplit("/", 1)[1]
            for path, obj in self.api.objects.items()
            if path.startswith(NODES + "/") and obj.get("status") and not workloads.ready(obj)
        }
        for path, pod in sorted(self.api.objects.items()):
            if not path.startswith(("/api/v1/namespaces/")) or "/pods/" not in path:
                continue
            if validation(pod) and labels(pod).get(VALIDATES_LABEL) not in uids:
                self.api.delete(path)
            elif (node is not None and pod["spec"].get("nodeName") != node) or pod["spec"].get("nodeName") in cut_off:
                continue
            elif pod["metadata"].get("deletionTimestamp"):
                self.api.delete(path)
            elif validation(pod):
                if (pod.get("status") or {}).get("phase", "Pending") == "Pending":
                    self._validate(path, pod)
            elif path.startswith(PODS + "/metax-driver-") and not workloads.ready(pod):
                self._start(path, pod)

    def _validate(self, path: str, pod: dict) -> None:
        """A validation pod runs: it passes, fails saying why, or hangs (Running)."""
        pod = copy.deepcopy(pod)
        node = pod["spec"]["nodeName"]
        if node in self.hanging:
            pod["status"] = {"phase": "Running"}
        elif node in self.invalid:
            ended = {"terminated": {"exitCode": 1, "message": "no PCI device is bound to the metax driver (nor to vfio-pci)"}}
            pod["status"] = {"phase": "Failed", "containerStatuses": [{"name": "check-node", "state": ended}]}
        else:
            pod["status"] = {"phase": "Succeeded"}
        self.kubectl.call("PUT", path + "/status", body=pod)

    def _start(self, path: str, pod: dict) -> None:
        pod = copy.deepcopy(pod)
        failing = pod["spec"]["nodeName"] in self.failing
        restarts = (pod["status"].get("containerStatuses") or [{}])[0].get("restartCount", -1) + 1 if failing else 0
        pod["status"] = {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "False" if failing else "True"}],
            "containerStatuses": [{"name": "driver-manager", "restartCount": restarts, "ready": not failing}],
        }
        self.kubectl.call("PUT", path + "/status", body=pod)


class Workloads:
    """The pods that are not the driver's on the GPU nodes."""

    def __init__(self, api: FakeApi, kubectl):
        self.api, self.kubectl = api, kubectl
        self.serial = itertools.count()

    def start(self, node: str, gpu: bool = True, waited: bool = False, owner: str = "Job", guarded: bool = False) -> str:
        """A pod running on `node`: requesting a GPU or not, matching the wait selector or not,
        owned by a Job, a DaemonSet or nothing (`owner` ""), its eviction refused by a
        PodDisruptionBudget (`guarded`). Its name."""
        name = f"work-{node}-{next(self.serial)}"
        resources = {"limits": {"metax-tech.com/gpu": "1"}} if gpu else {}
        meta = {"name": name, "namespace": WORK, "labels": {"work": name, **(dict([TRAINING]) if waited else {})}}
        if owner:
            meta["ownerReferences"] = [
                {"apiVersion": "batch/v1" if owner == "Job" else "apps/v1", "kind": owner, "name": "w", "uid": "w"}
            ]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "work", "resources": resources}]},
            "status": {"phase": "Running"},
        }
        self.kubectl.call("POST", JOBS, body=pod)
        if guarded:
            budget = {
                "metadata": {"name": name},
                "spec": {"selector": {"matchLabels": {"work": name}}},
                "status": {"disruptionsAllowed": 0},
            }
            self.kubectl.call("POST", BUDGETS, body=budget)
        return name

    def running(self) -> dict[str, dict]:
        """name -> each work pod not being deleted."""
        return {
            pod["metadata"]["name"]: pod
            for path, pod in sorted(self.api.objects.items())
            if path.startswith(JOBS + "/") and not pod["metadata"].get("deletionTimestamp")
        }

    def end(self, name: str) -> None:
        """The pod's work ends (it succeeds and is cleaned up), and its budget goes."""
        for path in (f"{JOBS}/{name}", f"{BUDGETS}/{name}"):
            if path in self.api.objects:
                self.api.delete(path)


class Helm:
    """The release: its values (the driver version and upgrade policy the bootstrap hook writes)
    and its revision."""

    def __init__(self, cluster: Cluster, policy: dict, pools: list[dict] | None = None):
        self.cluster = cluster
        self.version, self.policy, self.pools = VERSIONS[0], copy.deepcopy(policy), copy.deepcopy(pools or [])
        self.revision = 1  # what `helm install` renders the DaemonSets with
        self.written_version = None  # the version the bootstrap last wrote into the CR

    def values_spec(self) -> dict:
        """The CR's spec the values give."""
        driver = {"payload": {"version": self.version}, "upgradePolicy": self.policy}
        return deep_update(copy.deepcopy(VALUES), {"driver": {**driver, **({"pools": self.pools} if self.pools else {})}})

    def upgrade(self, version: str | None = None) -> bool:
        """`helm upgrade` (with `--set driver.payload.version=VERSION`): its bootstrap hook writes
        the values into the CR as a three-way merge (the version only when the values changed it
        since its last write; a CR gone is created from the values), and the new release revision
        with its time. A version change during a rollout is refused by the hook (the freeze):
        nothing is written. Whether the upgrade went through its hooks."""
        if version not in (None, self.cluster.cr_version()) and self.cluster.cr() is not None and self.cluster.upgrading():
            return False
        self.version = version or self.version
        self.revision += 1
        self.bootstrap()
        return True

    def bootstrap(self) -> None:
        """The bootstrap hook of the release revision: the values written into the CR."""
        api = self.cluster.api
        cr = api.get(CR)
        wrote = {"manager": BOOTSTRAP_FIELD_MANAGER, "operation": "Apply", "time": rfc3339(self.cluster.now)}
        meta = {
            "name": "cluster-operator",
            "annotations": {RELEASE_REVISION_ANNOTATION: str(self.revision)},
            "managedFields": [wrote],
        }
        if cr is None:
            cr = {"apiVersion": "gpu.metax-tech.com/v1", "kind": "ClusterOperator", "metadata": {**meta, "generation": 1}}
            cr["spec"] = self.values_spec()
            cr["metadata"]["uid"] = f"cr-uid-{self.revision}"
        else:
            before = copy.deepcopy(cr["spec"])
            if self.version != self.written_version:
                cr["spec"]["driver"]["payload"]["version"] = self.version
            cr["metadata"]["annotations"] = {**(cr["metadata"].get("annotations") or {}), **meta["annotations"]}
            cr["metadata"]["managedFields"] = [wrote]
            cr["metadata"]["generation"] += cr["spec"] != before
        self.written_version = self.version
        api.put(CR, cr)  # the bootstrap's server-side apply as the API server records it

    def apply(self) -> None:
        """Helm applies the release after its hooks: each DaemonSet as it renders it, the shared
        fields as the live DaemonSet holds them, so only the revision annotation changes."""
        annotation = {"metadata": {"annotations": {RELEASE_REVISION_ANNOTATION: str(self.revision)}}}
        for obj in chart(self.pools):
            if obj["kind"] == "DaemonSet":
                self.cluster.kubectl.patch("apps/v1", "DaemonSet", obj["metadata"]["name"], annotation, namespace=NS)

    def holds(self) -> bool:
        """Whether the runner must wait for Helm now: a DaemonSet carries another release revision
        than the CR (Helm has not applied it yet), which the bootstrap wrote less than
        `HELM_APPLY_WAIT` seconds ago."""
        cr = self.cluster.cr()
        wrote = [
            parse_time(m["time"])
            for m in (cr or {}).get("metadata", {}).get("managedFields") or []
            if m["manager"] == BOOTSTRAP_FIELD_MANAGER
        ]
        return bool(wrote) and self.behind() and self.cluster.now < max(wrote) + HELM_APPLY_WAIT

    def behind(self) -> bool:
        """Whether a DaemonSet carries another release revision than the CR (Helm not applied yet)."""
        cr = self.cluster.api.objects.get(CR)
        wanted = ((cr or {}).get("metadata") or {}).get("annotations", {}).get(RELEASE_REVISION_ANNOTATION)
        return wanted is not None and any(
            (obj["metadata"].get("annotations") or {}).get(RELEASE_REVISION_ANNOTATION) != wanted
            for path, obj in self.cluster.api.objects.items()
            if path.startswith(DAEMONSETS + "/")
        )


@dataclass
class Pass:
    """What one runner pass sent (`requests`, the runner's only) and how it ended (`error`: an
    API answer, a lost lease or a cache not listed, which a pass may meet; anything else is
    raised)."""

    requests: list
    error: Exception | None

    @property
    def writes(self) -> list:
        return [r for r in self.requests if r.method != "GET"]


class Cluster:
    """`nodes` GPU nodes whose driver pods run the values' version, the chart's objects, the CR
    with `policy`, and a runner; see the module's docstring."""

    def __init__(self, nodes: int = 4, policy: dict | None = None, pools: list[dict] | None = None):
        self.now = T0
        self.api = FakeApi(clock=lambda: self.now).__enter__()
        self.api.exempt.add(KUBECTL)
        self.kubectl = self.api.client(attempts=1, user_agent=KUBECTL)
        self.controller = DaemonSetController(self.api, self.kubectl, lambda: self.now)
        self.kubelet = Kubelet(self.api, self.kubectl)
        self.workloads = Workloads(self.api, self.kubectl)
        self.helm = Helm(self, policy or {}, pools)
        self.lease = {"held": True, "checks_left": None}  # see `is_leader`
        self.names = itertools.count()
        for obj in chart(pools):  # as Helm installed them, with the API server's defaults
            live = copy.deepcopy(obj)
            live["metadata"].update(namespace=NS, uid=f"uid-{obj['metadata']['name']}", generation=1)
            if obj["kind"] == "DaemonSet":
                live["spec"].setdefault("updateStrategy", copy.deepcopy(DEFAULT_STRATEGY))
            self.api.put(path_of(obj), live)
        for _ in range(nodes):
            self.add_node()
        self.sync()
        self.helm.bootstrap()  # `helm install`'s: the CR at the DaemonSets' revision
        self.runner = self.new_runner()

    def close(self) -> None:
        self.runner.close()
        self.api.__exit__(None, None, None)

    # -- the runner ---------------------------------------------------------------------------

    def new_runner(self) -> run.Runner:
        return run.Runner(self.api.client(attempts=1), NS, is_leader=self.is_leader, identity="runner", clock=lambda: self.now)

    def restart_runner(self) -> None:
        """The runner killed and started again: fresh caches, nothing remembered."""
        self.runner.close()
        self.runner = self.new_runner()

    def is_leader(self) -> bool:
        """The runner's lease check (one before each write): held, unless lost, or lapsing after
        the number of checks `lapse_after` set."""
        left = self.lease["checks_left"]
        if left is not None:
            self.lease["checks_left"] = left - 1 if left else None
            self.lease["held"] = self.lease["held"] and left > 0
        return self.lease["held"]

    def lapse_after(self, checks: int) -> None:
        self.lease["checks_left"] = checks

    def caches_current(self) -> bool:
        return self.api.delivered(self.runner.caches())

    def run_pass(self, wait: bool = True) -> Pass:
        """One runner pass, once its caches hold every change (unless not to `wait`)."""
        if wait:
            eventually(self.caches_current, 60, "the runner's caches to hold every change", interval=0.005)
        first = len(self.api.requests)
        error = None
        try:
            self.runner.run_pass()
        except (ApiException, LostLeadership, NotReady) as err:
            error = err
        return Pass([r for r in self.api.requests[first:] if r.user_agent != KUBECTL], error)

    # -- the cluster --------------------------------------------------------------------------

    def sync(self) -> None:
        """The DaemonSet controller and every kubelet catch up: a deleted driver pod gone, its
        successor created and Ready (but on a node whose driver fails: it restarts once more)."""
        for _ in range(2):  # the controller creates the pods of those the kubelet removed first
            self.controller.sync()
            self.kubelet.sync()

    def tick(self, seconds: float = 30) -> None:
        self.now += seconds

    def add_node(self, more_labels: dict | None = None) -> str:
        """A GPU node the driver's DaemonSet selects, Ready with 8 GPUs, with `more_labels`; its name."""
        name = f"n{next(self.names)}"
        node_labels = {GPU_NODE_LABEL: "true", **(more_labels or {})}
        self.kubectl.call("POST", NODES, body={"metadata": {"name": name, "labels": node_labels}, "spec": {}})
        self.set_node_ready(name, True)  # the kubelet's first status report
        return name

    def set_node_ready(self, node: str, ready: bool) -> None:
        """The node's kubelet reports it Ready or not (NotReady: the node controller's view, which
        then marks the node's pods not Ready, as its node lifecycle controller does; the kubelet,
        cut off, reports nothing more until the node is Ready again)."""
        obj = copy.deepcopy(self.nodes()[node])
        obj["status"] = node_status(ready)
        self.api.put(f"{NODES}/{node}", obj)
        if ready:
            return
        for path, pod in sorted(self.api.objects.items()):
            if "/pods/" in path and pod["spec"].get("nodeName") == node and workloads.ready(pod):
                pod = copy.deepcopy(pod)
                pod["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
                for container in pod["status"].get("containerStatuses") or []:
                    container["ready"] = False
                self.kubectl.call("PUT", path + "/status", body=pod)

    def not_ready(self) -> set[str]:
        return {n for n, obj in self.nodes().items() if not workloads.ready(obj)}

    def nodes(self) -> dict[str, dict]:
        return {path.rsplit("/", 1)[1]: obj for path, obj in sorted(self.api.objects.items()) if path.startswith(NODES + "/")}

    def edit_node(self, node: str, patch: dict) -> None:
        """A merge patch of the node (`kubectl label`, `kubectl cordon`)."""
        self.kubectl.patch("v1", "Node", node, patch)

    def skipped(self) -> set[str]:
        return {n for n, obj in self.nodes().items() if labels(obj).get(SKIP_LABEL) == "true"}

    # -- the CR ---------------------------------------------------------------------------------

    def cr(self) -> dict | None:
        return self.api.get(CR)

    def cr_version(self) -> str | None:
        cr = self.cr()
        return cr["spec"]["driver"]["payload"]["version"] if cr else None

    def upgrade_status(self) -> dict:
        return ((self.cr() or {}).get("status") or {}).get("upgradeStatus") or {}

    def upgrading(self) -> bool:
        return bool(self.upgrade_status().get("upgrading"))

    def kubectl_patch(self, ops: list[dict]) -> None:
        """`kubectl patch clusteroperators.gpu.metax-tech.com cluster-operator --type=json -p OPS`."""
        self.kubectl.patch("gpu.metax-tech.com/v1", "ClusterOperator", "cluster-operator", ops, patch_type="json")

    def set_policy(self, field: str, value) -> None:
        self.kubectl_patch([{"op": "add", "path": f"/spec/driver/upgradePolicy/{field}", "value": value}])

    def set_version(self, version: str) -> None:
        self.kubectl_patch([{"op": "replace", "path": "/spec/driver/payload/version", "value": version}])

    def delete_cr(self) -> None:
        """`kubectl delete clusteroperator cluster-operator` (a GitOps prune, a failed uninstall)."""
        self.kubectl.delete("gpu.metax-tech.com/v1", "ClusterOperator", "cluster-operator")

    # -- what the driver runs -------------------------------------------------------------------

    def revision_versions(self) -> dict[str, str]:
        """The driver's revision hash -> the driver version its template installs."""
        return {h: payload_version(r["data"]["spec"]["template"]) for h, r in self.controller.revisions().items()}

    def driver_versions(self) -> dict[str, str]:
        """node -> the driver version of its live driver pod ('-': none; '?': an unknown revision)."""
        versions = self.revision_versions()
        out = {}
        for node, pods in self.controller.driver_pods().items():
            live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
            if live:
                out[node] = versions.get(labels(live[-1])[REVISION_LABEL], "?")
        return {node: out.get(node, "-") for node in sorted(self.controller.selected())}

    def template_version(self) -> str:
        return payload_version(self.api.objects[DRIVER]["spec"]["template"])
