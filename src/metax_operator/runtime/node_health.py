"""The nodes' health for the rollout's health gate (`rollout.health_gate.HealthSnapshot`), read only when
the engine asks for a snapshot (`Decision.observe_health`: at a step's pause, every few minutes
of it and before the step promotes), never kept in a watch cache. Three paged LISTs, each object
projected to the few fields the gate reads as its page is parsed:

- the GPU nodes (label `metax-tech.com/gpu.installed=true`): the Ready condition, and the
  `metax-tech.com/*` capacity and allocatable (the kubelet takes the devices its device plugin
  reports unhealthy out of allocatable; a plugin that finds no device reports none);
- the driver and gpu-device pods of the namespace: when a container of each last ended before a
  restart (`lastState.terminated.finishedAt`);
- the failed pods of the cluster (`status.phase=Failed`, by field selector): those requesting a
  `metax-tech.com/*` resource, by node, with when they ended.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kubernetes.utils.quantity import parse_quantity

from metax_operator import workloads
from metax_operator.conditions import parse_time
from metax_operator.contract import COMPONENT_LABEL, GPU_NODE_LABEL, RESOURCE_PREFIX
from metax_operator.rollout.health_gate import HealthSnapshot, NodeHealth
from metax_operator.runtime.informer import PAGE_SIZE
from metax_operator.runtime.kube import Client
from metax_operator.runtime.memory import give_back_memory
from metax_operator.runtime.rollout_projections import pod_node

#: The components whose restarts the gate counts: the driver and the device plugin.
RESTART_COMPONENTS = ("driver", "gpu-device")


@dataclass(frozen=True)
class _Node:
    """A GPU node as the snapshot reads it."""

    name: str
    ready: bool
    gpus_unavailable: bool


def read(api: Client, namespace: str, now: float) -> HealthSnapshot:
    """A snapshot of the GPU nodes' health, taken at `now`: pages of the caches' size, and the
    parse memory given back after, as the caches' LISTs do."""
    nodes = [
        n
        for page in api.pages("v1", "Node", label_selector=f"{GPU_NODE_LABEL}=true", project=project_node, page_size=PAGE_SIZE)
        for n in page
    ]
    components = f"{COMPONENT_LABEL} in ({','.join(RESTART_COMPONENTS)})"
    restarts = _latest(api.pages("v1", "Pod", namespace, label_selector=components, project=project_restart, page_size=PAGE_SIZE))
    failed = _latest(
        api.pages(
            "v1",
            "Pod",
            field_selector="status.phase=Failed",
            all_namespaces=True,
            project=project_failed_gpu_pod,
            page_size=PAGE_SIZE,
        )
    )
    give_back_memory()
    return HealthSnapshot(
        now,
        {n.name: NodeHealth(n.ready, n.gpus_unavailable, restarts.get(n.name, 0.0), failed.get(n.name, 0.0)) for n in nodes},
    )


def _latest(pages) -> dict[str, float]:
    """Node -> the latest time of the (node, time) pairs the pages hold."""
    latest: dict[str, float] = {}
    for page in pages:
        for item in page:
            if item is not None and item[0]:
                latest[item[0]] = max(latest.get(item[0], 0.0), item[1])
    return latest


def project_node(obj: Mapping) -> _Node:
    status = obj.get("status") or {}
    capacity, allocatable = _devices(status.get("capacity")), _devices(status.get("allocatable"))
    return _Node(obj["metadata"]["name"], workloads.ready(obj), allocatable == 0 or allocatable < capacity)


def _devices(resources: Mapping | None) -> int:
    """The node's `metax-tech.com/*` devices in `resources` (capacity or allocatable)."""
    return sum(int(parse_quantity(str(v))) for k, v in (resources or {}).items() if k.startswith(RESOURCE_PREFIX))


def project_restart(obj: Mapping) -> tuple[str, float] | None:
    """A driver or gpu-device pod's node and when a container of it last ended before a restart."""
    ended = [
        parse_time(((c.get("lastState") or {}).get("terminated") or {}).get("finishedAt")) or 0.0
        for c in (obj.get("status") or {}).get("containerStatuses") or ()
    ]
    return (pod_node(obj), max(ended)) if ended and max(ended) else None


def project_failed_gpu_pod(obj: Mapping) -> tuple[str, float] | None:
    """A failed pod's node and when it ended, if it requests a `metax-tech.com/*` resource."""
    if workloads.gpu_pod(obj) is None:
        return None
    status = obj.get("status") or {}
    ended = [
        parse_time(((c.get("state") or {}).get("terminated") or {}).get("finishedAt")) or 0.0
        for c in status.get("containerStatuses") or ()
    ]
    # A pod failed before any container ran (evicted, rejected at admission) has only its start.
    when = max(ended, default=0.0) or parse_time(status.get("startTime")) or 0.0
    return pod_node(obj), when
