"""Cordoning and draining a node around its driver swap, and the node labels the rollout reads.

Before the runner deletes a driver pod it cordons the pod's node (`spec.unschedulable: true`),
so that no GPU pod is scheduled onto a node whose driver is being replaced; once the new driver
pod is Ready the engine lists the node in `Decision.uncordon` and the runner uncordons it.

The runner uncordons only nodes it cordoned itself, and it records that on the node, in the same
write as the cordon: the label `CORDONED_LABEL`. (That write also sets the node's upgrade state,
`deleting`, and the uncordon's sets `done`: two label writes fewer per swapped node.) A label
rather than an annotation, because the runner finds those nodes by it (an index of its node
cache, `node_cache`, which holds the nodes' labels and not their annotations), also after a
restart: a runner killed between the cordon and the uncordon leaves the label, and the next
leader uncordons the node. A node that is already unschedulable without that label was
cordoned by someone else: the runner neither labels nor uncordons it.

Both writes are conditional, so nothing an admin does meanwhile is overwritten: the cordon is a
merge patch carrying the resourceVersion of the node as the runner's node cache holds it
(`node_cache.NodeCache`: whether each node is unschedulable, and its resourceVersion; 409 when
the node changed since, or the cache is behind: the deletion waits for the next pass, by when the
watch has brought the node's latest version); the uncordon is a JSON patch whose first op tests
the label (422 when an admin removed it, which is how an admin keeps a node the runner cordoned
cordoned). A cordon is one request: the PATCH, or a GET that confirms the node is unschedulable
already when the cache says so or cannot tell (the cache may not hold an uncordon yet).

A drain evicts pods through the Eviction API (`evict`), as `kubectl drain` does: the API server
refuses an eviction that a PodDisruptionBudget forbids (429), and the runner asks again at its
next pass, until the drain times out (`upgradePolicy.drain.timeout`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol

from kubernetes.client.exceptions import ApiException

from metax_operator.contract import CORDONED_LABEL, NODE_LABEL_PREFIX, SKIP_LABEL
from metax_operator.runtime.kube import Client
from metax_operator.runtime.resource_version import compare_versions


class NodeState(NamedTuple):
    """What the node cache keeps of a node: all a cordon needs, and the product's own labels
    (`metax-tech.com/...`: whether the driver DaemonSet's nodeSelector still selects it)."""

    unschedulable: bool
    resource_version: str
    labels: frozenset[tuple[str, str]] = frozenset()


class NodeReader(Protocol):
    """The node cache as a cordon reads it (`node_cache.NodeCache`, or `OwnWrites` over it)."""

    def get(self, name: str) -> NodeState | None: ...

    def has_seen(self, resource_version: str) -> bool: ...


def node_state(obj: dict) -> NodeState:
    """A Node's NodeState (of a node's metadata alone, `PartialObjectMetadata`: unschedulable False)."""
    labels = (obj["metadata"].get("labels") or {}).items()
    return NodeState(
        bool((obj.get("spec") or {}).get("unschedulable")),
        obj["metadata"]["resourceVersion"],
        frozenset((k, v) for k, v in labels if k.startswith(NODE_LABEL_PREFIX)),
    )


#: What `cordon` found or did.
CORDONED, ALREADY, NOT_NOW = "cordoned", "already-unschedulable", "not-now"


class Cordon(NamedTuple):
    """What `cordon` found or did, and the node as the API server returned it then (None with
    NOT_NOW): what the runner reads the node's labels from right before a deletion."""

    outcome: str
    node: NodeState | None


def cordon(api: Client, node: str, nodes: NodeReader, labels: Mapping[str, str] | None = None) -> Cordon:
    """Make `node` unschedulable for a driver swap: CORDONED (this call did, one PATCH, which sets
    the runner's own `labels` too), ALREADY (by an earlier pass or by someone else: one GET
    confirms what the node cache `nodes` says) or NOT_NOW (the node changed meanwhile, or is gone:
    the driver pod waits)."""
    known = nodes.get(node)
    if known is not None and known.unschedulable:
        # The cache lags the node by the watch's delay: an uncordon by someone else in that window
        # would let the driver go on a schedulable node. The node itself says.
        found = api.get("v1", "Node", node)
        known = node_state(found) if found is not None else None
        if known is not None and known.unschedulable:
            return Cordon(ALREADY, known)  # the runner's own cordon of an earlier pass, or someone else's: it stays theirs
    if known is None:
        return Cordon(NOT_NOW, None)
    patch = {
        "metadata": {"resourceVersion": known.resource_version, "labels": {CORDONED_LABEL: "true", **(labels or {})}},
        "spec": {"unschedulable": True},
    }
    try:
        return Cordon(CORDONED, api.patch("v1", "Node", node, patch, project=node_state))
    except ApiException as err:
        if err.status in (404, 409):
            return Cordon(NOT_NOW, None)
        raise


def skipped(node: NodeState) -> bool:
    """Whether the node carries the label that keeps its driver (`metax-tech.com/driver-upgrade.skip=true`)."""
    return (SKIP_LABEL, "true") in node.labels


#: What `evict` found or did.
EVICTED, BLOCKED, GONE = "evicted", "blocked-by-disruption-budget", "gone"


def evict(api: Client, namespace: str, name: str) -> str:
    """Ask the API server to evict a pod: EVICTED, BLOCKED (a PodDisruptionBudget allows no
    disruption now) or GONE."""
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace}}
    try:
        api.call("POST", api.resource("v1", "Pod").path(name, namespace, "eviction"), body=body)
    except ApiException as err:
        if err.status == 429:
            return BLOCKED
        if err.status == 404:
            return GONE
        raise
    return EVICTED


def uncordon(api: Client, node: str, labels: Mapping[str, str] | None = None) -> NodeState | None:
    """Make `node` schedulable again and drop the label, if the label is still there, setting the
    runner's own `labels` in the same write; the node as this call left it (None: it did
    nothing)."""
    pointer = _label_pointer(CORDONED_LABEL)
    patch = [
        {"op": "test", "path": pointer, "value": "true"},
        {"op": "remove", "path": pointer},
        {"op": "add", "path": "/spec/unschedulable", "value": False},
        *({"op": "add", "path": _label_pointer(key), "value": value} for key, value in (labels or {}).items()),
    ]
    try:
        return api.patch("v1", "Node", node, patch, patch_type="json", project=node_state)
    except ApiException as err:
        if err.status in (404, 409, 422):  # gone, or the label was removed meanwhile
            return None
        raise


class OwnWrites:
    """The node cache, read through this runner's own node writes (uncordons, state labels) until
    the cache holds them: an uncordon the watch has not delivered yet must not make the next
    cordon of that node look done already (the cache would still say unschedulable) and let its
    driver pod be deleted on a schedulable node; and a cordon after a label write must carry the
    resourceVersion that write returned, not the cache's older one (a 409 would delay the swap)."""

    def __init__(self, nodes: NodeReader):
        self.nodes = nodes
        self.written: dict[str, NodeState] = {}

    def get(self, node: str) -> NodeState | None:
        cached, mine = self.nodes.get(node), self.written.get(node)
        if mine is not None:
            # The cache holds a later version of the node (changed by someone else since): the
            # write is history, and the cache's word is safe (unschedulable while it cannot
            # tell); else a cordon would carry the write's resourceVersion and meet 409 at every
            # pass until both watches move past it, which a quiet cluster may leave them not to.
            newer = cached is not None and compare_versions(cached.resource_version, mine.resource_version) > 0
            if not newer and not self.nodes.has_seen(mine.resource_version):
                return mine
            del self.written[node]
        return cached

    def read_through(self, cached: dict[str, NodeState]) -> dict[str, NodeState]:
        """`cached` (a snapshot of the node cache) with each node this runner wrote read as `get`
        reads it: a pass reads every node this way without a `get` per node."""
        for node in list(self.written):
            state = self.get(node)
            if state is not None and node in cached:
                cached[node] = state
        return cached

    def record(self, node: str, state: NodeState | None) -> None:
        """`node` as a write of this runner left it (None: the write did nothing)."""
        if state is not None:
            self.written[node] = state


def _label_pointer(key: str) -> str:
    """The JSON pointer (RFC 6901) of a node's label `key`."""
    return "/metadata/labels/" + key.replace("~", "~0").replace("/", "~1")


def set_labels(api: Client, node: str, labels: dict[str, str | None]) -> NodeState | None:
    """Set (or, with None, remove) the runner's own `labels` on `node`: a merge patch naming only
    them, so no concurrent change to the node is lost; the node as it left it (None: gone)."""
    try:
        return api.patch("v1", "Node", node, {"metadata": {"labels": labels}}, project=node_state)
    except ApiException as err:
        if err.status == 404:
            return None
        raise
