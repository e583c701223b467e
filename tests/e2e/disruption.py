"""How many GPU nodes are without a working driver at once, as a watch of the driver pods sees it
for the whole of an administrator's action: the invariant the staged rollout exists for.

A GPU node's driver is down while the node has no driver pod that is Ready and not being
deleted: from the moment its old pod is marked for deletion until its new pod is Ready.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kubernetes import client, watch

from tests.controlplane import GPU_LABEL
from tests.e2e.tools import DRIVER_PODS


def _working(pod: client.V1Pod) -> bool:
    if pod.metadata.deletion_timestamp is not None:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def gpu_nodes(api) -> frozenset[str]:
    return frozenset(n.metadata.name for n in client.CoreV1Api(api).list_node(label_selector=f"{GPU_LABEL}=true").items)


def down(nodes: frozenset[str], pods) -> frozenset[str]:
    """The `nodes` without a working driver among `pods`."""
    return nodes - {p.spec.node_name for p in pods if _working(p)}


def down_now(api, namespace: str) -> frozenset[str]:
    """The GPU nodes without a working driver, from one LIST."""
    return down(gpu_nodes(api), client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=DRIVER_PODS).items)


@dataclass
class DriverDownWatch:
    """Follows the driver pods of `namespace` from the moment it is made; `most_down` is the
    largest number of GPU nodes down at once so far, `worst` those nodes. `stop()` raises if the
    watch ended before it (a count from a broken watch would prove nothing)."""

    api: object
    namespace: str
    nodes: frozenset[str] = frozenset()
    most_down: int = 0
    worst: frozenset[str] = frozenset()
    _pods: dict[str, client.V1Pod] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopped: bool = False
    _ended: Exception | str | None = None

    def __post_init__(self):
        core = client.CoreV1Api(self.api)
        self.nodes = gpu_nodes(self.api)
        start = core.list_namespaced_pod(self.namespace, label_selector=DRIVER_PODS)
        for pod in start.items:
            self._pods[pod.metadata.uid] = pod
        self._count()
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._follow, args=(core, start.metadata.resource_version), daemon=True)
        self._thread.start()

    def down(self) -> frozenset[str]:
        """The GPU nodes without a working driver pod now."""
        with self._lock:
            return down(self.nodes, list(self._pods.values()))

    def _count(self) -> None:
        down = self.down()
        if len(down) > self.most_down:
            self.most_down, self.worst = len(down), down

    def _follow(self, core, version: str) -> None:
        try:
            for change in self._watch.stream(
                core.list_namespaced_pod,
                self.namespace,
                label_selector=DRIVER_PODS,
                resource_version=version,
                timeout_seconds=1800,
            ):
                pod = change["object"]
                with self._lock:
                    if change["type"] == "DELETED":
                        self._pods.pop(pod.metadata.uid, None)
                    else:
                        self._pods[pod.metadata.uid] = pod
                self._count()
            if not self._stopped:
                self._ended = "it timed out"
        except Exception as error:  # noqa: BLE001 - reported by stop()
            if not self._stopped:
                self._ended = error

    def stop(self) -> None:
        self._stopped = True
        self._watch.stop()
        self._thread.join(10)
        if self._ended is not None:
            raise AssertionError(f"the watch of the driver pods ended before the test did: {self._ended}")
