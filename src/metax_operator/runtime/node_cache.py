"""The rollout's one cache of the cluster's nodes: what each cordon, state label and eligibility
check reads (`cordon.NodeState`: whether the node is unschedulable, its resourceVersion, the
product's `metax-tech.com/...` labels), and the nodes skipped, cordoned by the runner or to retry.

A Node is about 20 KB, most of it its kubelet's status (conditions, images), which the kubelet
rewrites every few minutes: at 10,000 nodes a watch of whole Nodes receives and parses 33 of
them a second for those three fields. Two watches carry them instead:
- every node's metadata (`Informer(metadata_only=True)`: labels and resourceVersion, a third of
  the bytes; a status report still moves the resourceVersion, so the events keep coming, lighter);
- the unschedulable nodes' metadata, by field selector (`spec.unschedulable=true`, which the API
  server has selected nodes by since long before 1.23): a handful, whose events are cordons and
  uncordons. `spec.unschedulable` is not metadata; this watch is how it is known.

The two are separate streams: a cordon can reach one before the other. A node is read as
unschedulable while the second watch has not seen the node's resourceVersion (`has_seen`)
without it, as well as when it holds it: when unsure, unschedulable is the safe answer, since a
cordon then confirms the node with a GET (`cordon.cordon`) and never takes it for its own, and
nothing else reads the flag. The second watch moves on with every cordon and uncordon and every
minute's bookmark, so it is unsure only of nodes changed within the last minute.

The label selections the rollout reads (`labelled`: `metax-tech.com/driver-upgrade.skip`,
`.cordoned`, `.retry` set to `true`, and `.pool` set to any pool) are an index of the metadata cache, kept as its events
arrive: a pass reads the few names, not every node. Before this cache they were three more
watches, each receiving every change of the nodes it selected (during a rollout, every status
report of every cordoned node, whole).
"""

from __future__ import annotations

from metax_operator.contract import CORDONED_LABEL, POOL_LABEL, RETRY_LABEL, SKIP_LABEL
from metax_operator.runtime import cordon
from metax_operator.runtime.informer import Informer
from metax_operator.runtime.kube import Client
from metax_operator.runtime.watch_stream import STEADY_GATHER

#: The labels whose nodes the rollout reads by name: set to "true" (the pool label: to any value).
SELECTED = (SKIP_LABEL, CORDONED_LABEL, RETRY_LABEL, POOL_LABEL)


def labels_differ(before: cordon.NodeState, after: cordon.NodeState) -> bool:
    """A node's change as the rollout reads it (`Informer.differs`): its labels. A kubelet's
    status report moves only its resourceVersion, which a cordon reads from the store anyway."""
    return before.labels != after.labels


def selected_labels(state: cordon.NodeState) -> list[str]:
    """The SELECTED labels on a node (its index terms)."""
    return [key for key, value in state.labels if key in SELECTED and (value == "true" or key == POOL_LABEL)]


class NodeCache:
    """`get`, `snapshot` and `has_seen` as an `Informer` of `cordon.NodeState`s; `informers`
    are its two watches, to start, stop and check as the runner's other caches."""

    def __init__(self, api: Client, resync: float):
        path = api.resource("v1", "Node").path()
        # Its values say unschedulable=False: metadata has no spec. `get` and `snapshot` say it.
        self.metadata = Informer(
            api,
            path,
            project=cordon.node_state,
            metadata_only=True,
            index=selected_labels,
            differs=labels_differ,
            gather=STEADY_GATHER,
            resync=resync,
            name="nodes",
        )
        self.unschedulable = Informer(
            api,
            path,
            field_selector="spec.unschedulable=true",
            project=lambda obj: obj["metadata"]["resourceVersion"],
            metadata_only=True,
            differs=lambda before, after: False,  # a change is a cordon or an uncordon
            resync=resync,
            name="unschedulable-nodes",
        )
        # The unschedulable nodes and the version their watch had seen, read together, again
        # only once the watch has moved on: what every `get` compares a node with.
        self._cordoned: tuple[frozenset[str], str, int] = (frozenset(), "", -1)

    @property
    def informers(self) -> tuple[Informer, Informer]:
        return self.metadata, self.unschedulable

    @property
    def changes(self) -> int:
        """How often a node was added, removed, relabelled, cordoned or uncordoned (`Informer.changes`)."""
        return self.metadata.changes + self.unschedulable.changes

    def cordoned(self) -> frozenset[str]:
        """The nodes the unschedulable watch holds: those known cordoned (by anyone). Unlike
        `get`, a node changed since that watch's last event is not taken for cordoned: what the
        rollout's availability counts (`rollout.budget`) must not count every busy node."""
        return self._unschedulable()[0]

    def get(self, name: str) -> cordon.NodeState | None:
        state = self.metadata.get(name)
        if state is None:
            return None
        cordoned, seen = self._unschedulable()
        if name in cordoned or int(state.resource_version) > seen:
            return cordon.NodeState(True, state.resource_version, state.labels)
        return state

    def snapshot(self) -> dict[str, cordon.NodeState]:
        states = self.metadata.snapshot()
        cordoned, seen = self._unschedulable()
        for name, state in states.items():
            if name in cordoned or int(state.resource_version) > seen:
                states[name] = cordon.NodeState(True, state.resource_version, state.labels)
        return states

    def _unschedulable(self) -> tuple[frozenset[str], int]:
        """The unschedulable nodes, and the resourceVersion their watch holds every change up to
        (-1: none yet: every node is newer), read together; read again once the watch moved on."""
        names, version, seen = self._cordoned
        if self.unschedulable.resource_version != version:
            store, version = self.unschedulable.versioned_snapshot()
            names, seen = frozenset(store), int(version) if version else -1
            self._cordoned = (names, version, seen)
        return names, seen

    def has_seen(self, resource_version: str) -> bool:
        """Both watches hold every change up to `resource_version`."""
        return self.metadata.has_seen(resource_version) and self.unschedulable.has_seen(resource_version)

    def labels_seen(self, resource_version: str) -> bool:
        """The nodes' labels hold every change up to `resource_version` (the metadata watch's)."""
        return self.metadata.has_seen(resource_version)

    def labelled(self, label: str) -> Labelled:
        """The nodes carrying `label` (one of SELECTED)."""
        return Labelled(self.metadata, label)


class Labelled:
    """The names of the nodes carrying one of the SELECTED labels, as a cache of names gives them
    (`snapshot()`: name -> name)."""

    def __init__(self, nodes: Informer, label: str):
        self.nodes, self.label = nodes, label

    def snapshot(self) -> dict[str, str]:
        return {name: name for name in self.nodes.indexed(self.label)}
