"""How many GPU nodes are without a working driver at once, as a watch of the driver pods and the
nodes sees it for the whole of an administrator's action: the invariant the staged rollout exists
for.

A GPU node is a node that exists and carries the GPU label (`metax-tech.com/gpu.installed=true`,
the driver DaemonSet's nodeSelector). Its driver is down while it has no driver pod that is Ready
and not being deleted: from the moment its old pod is marked for deletion until its new pod is
Ready. A node deleted, or unlabelled by the uninstall's cleanup hook, leaves the fleet, and its
driver pod going after that is not counted: the node no longer offers GPUs.

The pods and the nodes come in two watches, whose changes reach the test in either order; the
count replays them in the order of their resourceVersions, which on an etcd-backed API server are
one counter for every object. So a driver pod the DaemonSet controller deletes because its node
lost the label is always counted after the node left, whichever watch brought its change first.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kubernetes import client, watch

from tests.controlplane import GPU_LABEL
from tests.e2e.tools import DRIVER_PODS, ready
from tests.e2e.userpath import cordoned
from tests.waiting import eventually


def _working(pod: client.V1Pod) -> bool:
    if pod.metadata.deletion_timestamp is not None:
        return False
    return ready(pod)


def gpu_nodes(api) -> frozenset[str]:
    return frozenset(n.metadata.name for n in client.CoreV1Api(api).list_node(label_selector=f"{GPU_LABEL}=true").items)


def down(nodes, pods) -> frozenset[str]:
    """The `nodes` without a working driver among `pods`."""
    return frozenset(nodes) - {p.spec.node_name for p in pods if _working(p)}


def down_now(api, namespace: str) -> frozenset[str]:
    """The GPU nodes without a working driver, from one LIST."""
    return down(gpu_nodes(api), client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=DRIVER_PODS).items)


def _apply(nodes: set[str], pods: dict[str, client.V1Pod], kind: str, obj) -> None:
    """One watch change (`kind` ADDED, MODIFIED or DELETED) of a node or a driver pod."""
    if isinstance(obj, client.V1Node):
        if kind != "DELETED" and (obj.metadata.labels or {}).get(GPU_LABEL) == "true":
            nodes.add(obj.metadata.name)
        else:
            nodes.discard(obj.metadata.name)
    elif kind == "DELETED":
        pods.pop(obj.metadata.uid, None)
    else:
        pods[obj.metadata.uid] = obj


@dataclass
class DriverDownWatch:
    """Follows the nodes and the driver pods of `namespace` from the moment it is made. `stop()`
    sets `most_down`, the largest number of GPU nodes down at once, and `worst`, those nodes; it
    raises if a watch ended before it (a count from a broken watch would prove nothing)."""

    api: object
    namespace: str
    most_down: int = 0
    worst: frozenset[str] = frozenset()
    _nodes: set[str] = field(default_factory=set)
    _pods: dict[str, client.V1Pod] = field(default_factory=dict)
    _changes: list[tuple[int, str, object]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopped: bool = False
    _ended: Exception | str | None = None

    def __post_init__(self):
        core = client.CoreV1Api(self.api)
        nodes = core.list_node()
        pods = core.list_namespaced_pod(self.namespace, label_selector=DRIVER_PODS)
        for obj in nodes.items + pods.items:
            _apply(self._nodes, self._pods, "ADDED", obj)
        self._start = (set(self._nodes), dict(self._pods))
        self._watches = []
        driver_pods = {"namespace": self.namespace, "label_selector": DRIVER_PODS}
        for lister, args, version in (
            (core.list_node, {}, nodes.metadata.resource_version),
            (core.list_namespaced_pod, driver_pods, pods.metadata.resource_version),
        ):
            follower = watch.Watch()
            stream = follower.stream(lister, resource_version=version, timeout_seconds=1800, **args)
            self._watches.append(follower)
            threading.Thread(target=self._follow, args=(stream,), daemon=True).start()

    def down(self) -> frozenset[str]:
        """The GPU nodes without a working driver pod now, as the watches have seen them so far."""
        with self._lock:
            return down(self._nodes, list(self._pods.values()))

    def _follow(self, stream) -> None:
        try:
            for change in stream:
                obj = change["object"]
                with self._lock:
                    if self._stopped:
                        return
                    _apply(self._nodes, self._pods, change["type"], obj)
                    self._changes.append((int(obj.metadata.resource_version), change["type"], obj))
            self._ended = self._ended or "it timed out"
        except Exception as error:  # noqa: BLE001 - reported by stop()
            self._ended = self._ended or error

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            changes = sorted(self._changes, key=lambda change: change[0])
        for follower in self._watches:
            follower.stop()
        if self._ended is not None:
            raise AssertionError(f"a watch of the driver pods or nodes ended before the test did: {self._ended}")
        nodes, pods = set(self._start[0]), dict(self._start[1])
        self.worst = down(nodes, pods.values())
        self.most_down = len(self.worst)
        for _, kind, obj in changes:
            _apply(nodes, pods, kind, obj)
            now = down(nodes, pods.values())
            if len(now) > self.most_down:
                self.most_down, self.worst = len(now), now


def quiet(api, watch: DriverDownWatch, max_parallel: int) -> None:
    """Stop `watch` and check what it saw: never more than `max_parallel` GPU nodes down at once,
    and, once the fleet is quiet, no node left cordoned."""
    watch.stop()
    assert watch.most_down <= max_parallel, f"{watch.most_down} GPU nodes without a driver at once: {sorted(watch.worst)}"
    eventually(lambda: not cordoned(api), 60, "no node left cordoned")
