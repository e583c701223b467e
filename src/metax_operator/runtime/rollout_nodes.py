"""What the driver rollout does to nodes and their pods, in batches of parallel requests: cordon,
look at the node once more and delete its driver pod, cordon and drain, validate (create the
validation pods, record their outcome on the driver pods), uncordon, and write the nodes' state
labels (`NodeActions`, used by `rollout_pass.RolloutPass`).

Before a driver pod is deleted its node is cordoned (`cordon.py`; unless `upgradePolicy.cordon`
is false), then looked at once more, as the API server has it (`WorkCheck`): the engine decided
from caches of the pass's start, and a node labelled skip since, a GPU job bound since (unless
GPU work is allowed), or a pod matching `waitForCompletion.podSelector` started since must not
lose its driver; such a node keeps its driver pod, and the next pass sees why. Then the pod is
deleted with a uid precondition (404 or a failed precondition: already done), and counted as
being deleted until the pod cache shows it (`rollout_observe.OwnDeletions`); a node that could
not be cordoned keeps its pod until a later pass. A drain evicts the GPU workload pods of
cordoned nodes only; a DaemonSet's pods and static pods are left, as `kubectl drain
--ignore-daemonsets` does.

The lease is checked before every write, also before each node's of a batch (its cordon, then
again before its deletion): a runner whose lease lapses mid-batch sends only the requests already
in flight, at most `kube.PARALLEL_REQUESTS`. One node's refusal does not stop the others: a
request the API server refuses (a policy webhook guarding that node, a PodDisruptionBudget's 500)
is logged naming the node and kept in `refused`, and the batch goes on.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable

from kubernetes.client.exceptions import ApiException

from metax_operator import workloads
from metax_operator.contract import (
    CORDONED_LABEL,
    LIVE_PODS,
    POOL_LABEL,
    RETRY_LABEL,
    RUNNER_FIELD_MANAGER,
    STATE_LABEL,
    VALIDATION_ANNOTATION,
)
from metax_operator.jsonlog import event
from metax_operator.rollout.decision import PodRef, Verdict, WorkCheck
from metax_operator.rollout.node_state import NodeUpgradeState
from metax_operator.runtime import api_failures, cordon, kube
from metax_operator.runtime.kube import Client
from metax_operator.runtime.rollout_observe import Watches

log = logging.getLogger(__name__)

#: The most nodes whose labels one pass writes (a 10,000-node fleet's first labelling takes 20 passes).
STATE_WRITES_PER_PASS = 500
#: States a node stays in between waves: when a pass has more labels to write than it may, these wait.
_SETTLED = (NodeUpgradeState.PENDING, NodeUpgradeState.DONE)
#: What became of one pod of `Decision.delete` (`NodeActions.delete`).
DELETED, GONE = "deleted", "gone"  # by this pass; already, by someone else
REFUSED = "refused"  # the API server refused a write for it
BUSY = "busy"  # its node runs work the pass's snapshot did not show: its pod waits
SKIPPED = "skipped"  # its node is labelled skip since the snapshot: its pod stays


def write_order(changes: dict[str, dict[str, str | None]]) -> list[str]:
    """The nodes whose label `changes` a pass writes, first to last: the wave's nodes and the retry
    labels to drop before the settled states (`_SETTLED`), each group by name."""
    return sorted(changes, key=lambda n: (changes[n].get(STATE_LABEL) in _SETTLED and RETRY_LABEL not in changes[n], n))


class NodeActions:
    """The rollout's batches of node and pod writes (the driver pods' in `namespace`), for one
    runner, `check_lease` called before each write; `refused` holds the refusals of the current
    pass (cleared by `begin`)."""

    def __init__(self, api: Client, namespace: str, watches: Watches, check_lease: Callable[[], None]):
        self.api, self.namespace, self.watches, self._check = api, namespace, watches, check_lease
        self.refused: list[ApiException] = []
        self._own: cordon.OwnWrites | None = None

    def begin(self) -> None:
        """A pass's actions begin: no refusal yet."""
        self.refused = []

    def _per_node(self, action: str, node: Callable[[object], str], fn: Callable, refused):
        """`fn` for one item of a batch; a refusal is logged and recorded, and `refused` returned."""

        def one(item):
            self._check()  # each item, not once per batch: a deposed leader sends no more of it
            try:
                return fn(item)
            except ApiException as err:
                event(
                    log, "rollout-refused", logging.ERROR, refused=action, node=node(item), error=api_failures.failure_line(err)
                )
                self.refused.append(err)
                return refused

        return one

    def delete(self, pods: list[PodRef], cordon_first: bool, check: WorkCheck, now: float) -> tuple[set[str], int]:
        """Cordon each pod's node (when `cordon_first`; the cordon labels the node `deleting` in
        the same write), look at the node and its pods once more (`check`), then delete the pod,
        at the pass's time `now`; the nodes whose pod is gone, and the number of writes. A node
        whose pod stays after all is labelled what it is by the pass's state labels."""
        if not pods:
            return set(), 0
        self._check()
        cordoned: dict[str, cordon.NodeState] = {}

        def delete(pod: PodRef) -> tuple[str, str]:
            if cordon_first:
                found, node = cordon.cordon(self.api, pod.node, self._nodes, {STATE_LABEL: NodeUpgradeState.DELETING})
                if found == cordon.CORDONED:
                    cordoned[pod.node] = node
            else:
                found, node = "", self._node(pod.node)
            if node is None:
                return found, ""
            if cordon.skipped(node):
                return found, SKIPPED
            if self._runs_work(pod.node, check):
                return found, BUSY
            self._check()  # the lease may have lapsed during the cordon and the checks
            try:
                return found, DELETED if self.api.delete("v1", "Pod", pod.name, self.namespace, uid=pod.uid) else GONE
            except ApiException as err:
                if err.status == 409:  # the uid precondition failed: that pod is already gone
                    return found, GONE
                raise

        outcomes = self._parallel(self._per_node("delete", lambda p: p.node, delete, (REFUSED, "")), pods)
        for node, state in cordoned.items():  # what the state labels and the next cordons read
            self._nodes.record(node, state)
        cordons = [c for c, _ in outcomes]
        by = lambda outcome: [p.node for p, (_, d) in zip(pods, outcomes, strict=True) if d == outcome]  # noqa: E731
        not_now = [p.node for p, c in zip(pods, cordons, strict=True) if c == cordon.NOT_NOW]
        event(
            log,
            "rollout-delete",
            pods=[p.name for p in pods],
            deleted=len(by(DELETED)),
            cordoned=cordons.count(cordon.CORDONED),
            **({"not_cordoned": not_now} if not_now else {}),
            **({"busy": by(BUSY)} if by(BUSY) else {}),
            **({"skipped": by(SKIPPED)} if by(SKIPPED) else {}),
        )
        self.watches.deleted.add([p.uid for p, (_, d) in zip(pods, outcomes, strict=True) if d == DELETED], now)
        gone = set(by(DELETED)) | set(by(GONE))
        return gone, len(by(DELETED)) + len(by(GONE)) + cordons.count(cordon.CORDONED)

    def validate(self, manifests: list[dict]) -> int:
        """Create the validation pods `manifests` (server-side apply: one that exists is left as it
        is); the number created or confirmed."""
        if not manifests:
            return 0
        self._check()

        def create(pod: dict) -> bool:
            self.api.apply(pod, field_manager=RUNNER_FIELD_MANAGER)
            return True

        done = self._parallel(self._per_node("validate", lambda p: p["spec"]["nodeName"], create, False), manifests)
        event(log, "rollout-validate", pods=[p["metadata"]["name"] for p in manifests], created=sum(done))
        return sum(done)

    def record(self, verdicts: list[Verdict]) -> int:
        """Record each ended validation on its driver pod (uid-checked: a pod replaced since is
        left alone); the number of writes."""
        if not verdicts:
            return 0
        self._check()

        def write(verdict: Verdict) -> bool:
            patch = {"metadata": {"uid": verdict.pod.uid, "annotations": {VALIDATION_ANNOTATION: verdict.text}}}
            try:
                self.api.patch(
                    "v1",
                    "Pod",
                    verdict.pod.name,
                    patch,
                    namespace=self.namespace,
                    field_manager=RUNNER_FIELD_MANAGER,
                    project=lambda _: None,
                )
            except ApiException as err:
                if err.status in (404, 409, 422):  # gone, or another pod of that name now
                    return False
                raise
            return True

        done = self._parallel(self._per_node("record-validation", lambda v: v.pod.node, write, False), verdicts)
        event(log, "rollout-validated", validated={v.pod.node: v.text for v in verdicts})
        return sum(done)

    def _node(self, name: str) -> cordon.NodeState | None:
        """The node as the API server has it now (None: gone)."""
        found = self.api.get("v1", "Node", name)
        return cordon.node_state(found) if found is not None else None

    def _runs_work(self, node: str, check: WorkCheck) -> bool:
        """Whether `node` runs, now, what must not lose its driver (`check`): a GPU workload pod,
        or a pod matching the wait selector (one LIST of the node's live pods each)."""
        on_node = f"spec.nodeName={node},{LIVE_PODS}"
        if check.gpu:
            pods = self.api.list("v1", "Pod", field_selector=on_node, all_namespaces=True, project=workloads.gpu_pod)
            if any(gpu.workload for gpu in pods):
                return True
        if check.wait_selector:
            return bool(
                self.api.list("v1", "Pod", field_selector=on_node, label_selector=check.wait_selector, all_namespaces=True)
            )
        return False

    def label(self, states: dict[str, NodeUpgradeState], retry_done: set[str]) -> int:
        """Write each node's state label where it differs, drop it from nodes the rollouts no
        longer know, and drop the retry label of the nodes whose retry is done (`retry_done`: its
        pod deleted again, or nothing failed to retry); the number of writes."""
        changes = {}
        for node, state in self._nodes.read_through(self.watches.nodes.snapshot()).items():
            labels = dict(state.labels)
            change = {}
            if labels.get(STATE_LABEL) != states.get(node):
                change[STATE_LABEL] = states.get(node)
            if RETRY_LABEL in labels and node in retry_done:
                change[RETRY_LABEL] = None
            if change:
                changes[node] = change
        if not changes:
            return 0
        self._check()
        order = write_order(changes)
        batch = order[:STATE_WRITES_PER_PASS]
        write = self._per_node("label", str, lambda node: cordon.set_labels(self.api, node, changes[node]), None)
        done = self._parallel(write, batch)
        for node, state in zip(batch, done, strict=True):
            self._nodes.record(node, state)
        retried = sorted(n for n in batch if RETRY_LABEL in changes[n])
        event(
            log,
            "rollout-node-states",
            logging.INFO if retried or len(order) > len(batch) else logging.DEBUG,
            written=sum(1 for state in done if state),
            **({"left_for_next_pass": len(order) - len(batch)} if len(order) > len(batch) else {}),
            **({"retry_done": retried} if retried else {}),
        )
        return sum(1 for state in done if state)

    def drain(self, cordons: list[str], drains: list[str]) -> int:
        """Cordon `cordons`, then evict the GPU workload pods on `drains` that are cordoned; the
        number of writes."""
        if not cordons and not drains:
            return 0
        self._check()
        cordon_one = self._per_node("cordon", str, lambda node: cordon.cordon(self.api, node, self._nodes).outcome, REFUSED)
        found = dict(zip(cordons, self._parallel(cordon_one, cordons), strict=True))
        ready = {n for n in drains if found.get(n) not in (cordon.NOT_NOW, REFUSED)}
        pods = self.watches.gpu_pods_on(ready)
        evict = self._per_node("evict", lambda p: p.node, lambda p: cordon.evict(self.api, p.namespace, p.name), REFUSED)
        outcomes = self._parallel(evict, pods)
        event(
            log,
            "rollout-drain",
            cordoned=sorted(n for n, c in found.items() if c == cordon.CORDONED),
            evicted=[f"{p.namespace}/{p.name}" for p, o in zip(pods, outcomes, strict=True) if o == cordon.EVICTED],
            blocked=[f"{p.namespace}/{p.name}" for p, o in zip(pods, outcomes, strict=True) if o == cordon.BLOCKED],
            **({"not_cordoned": sorted(set(drains) - ready)} if set(drains) - ready else {}),
        )
        return list(found.values()).count(cordon.CORDONED) + outcomes.count(cordon.EVICTED)

    def move(self, pools: dict[str, str | None], cordons: list[str]) -> int:
        """Write each node's driver pool label (`rollout.membership`: None removes it), those in
        `cordons` cordoned by the same write (a node the cordon cannot take now keeps its pool
        this pass; one cordoned already just gets the label); the number of writes."""
        if not pools:
            return 0
        self._check()
        first = set(cordons)

        def move_one(node: str) -> cordon.NodeState | None:
            label = {POOL_LABEL: pools[node]}
            if node in first:
                found = cordon.cordon(self.api, node, self._nodes, label)
                if found.outcome != cordon.ALREADY:
                    return found.node  # cordoned and labelled in one write, or not now
            return cordon.set_labels(self.api, node, label)

        nodes = sorted(pools)
        done = self._parallel(self._per_node("move", str, move_one, None), nodes)
        for node, state in zip(nodes, done, strict=True):
            if state is not None:
                self._nodes.record(node, state)
        moved = {node: pools[node] for node, state in zip(nodes, done, strict=True) if state is not None}
        event(
            log,
            "rollout-move",
            logging.INFO,
            moved=moved,
            **({"not_now": sorted(set(nodes) - moved.keys())} if len(moved) < len(nodes) else {}),
        )
        return len(moved)

    def uncordon(self, nodes: list[str], states: dict[str, NodeUpgradeState] | None = None) -> int:
        """Uncordon `nodes` (those the runner cordoned), each labelled with its state in `states`
        (if there) in the same write; the number of writes. A node whose cordon label is gone as
        the node cache and this runner's own writes show it is skipped: the watch of that label
        may not have delivered an uncordon yet, and asking again would be a write refused."""
        nodes = [node for node in nodes if not self._given_back(node)]
        if not nodes:
            return 0
        self._check()
        states = states or {}
        labels = lambda node: {STATE_LABEL: states[node]} if node in states else None  # noqa: E731
        uncordon_one = self._per_node("uncordon", str, lambda node: cordon.uncordon(self.api, node, labels(node)), None)
        done = self._parallel(uncordon_one, nodes)
        for node, state in zip(nodes, done, strict=True):  # what the next cordons read
            self._nodes.record(node, state)
        uncordoned = sum(1 for state in done if state)
        event(log, "rollout-uncordon", nodes=nodes, uncordoned=uncordoned)
        return uncordoned

    def _given_back(self, node: str) -> bool:
        """Whether `node` is without the runner's cordon label, as this runner last knows it."""
        state = self._nodes.get(node)
        return state is not None and (CORDONED_LABEL, "true") not in state.labels

    @property
    def unseen_writes(self) -> bool:
        """Whether the node cache may not show the labels of a node write of this runner yet (what
        a rollout at rest reads of a node)."""
        written = self._own.written.values() if self._own is not None else ()
        return any(not self.watches.nodes.labels_seen(state.resource_version) for state in written)

    @property
    def _nodes(self) -> cordon.OwnWrites:
        """The node cache the cordons read, with this runner's own uncordons."""
        if self._own is None or self._own.nodes is not self.watches.nodes:
            self._own = cordon.OwnWrites(self.watches.nodes)
        return self._own

    @staticmethod
    def _parallel(fn, items: list) -> list:
        if not items:
            return []
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(kube.PARALLEL_REQUESTS, len(items))) as pool:
            return list(pool.map(fn, items))
