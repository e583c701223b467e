"""Each GPU node's place in the driver rollout, as the runner writes it on the node (the label
`metax-tech.com/driver-upgrade.state`): `kubectl get nodes -L metax-tech.com/driver-upgrade.state`
shows the fleet, where the CR's status lists only counts and the first names.

`states` is pure: it reads what a pass observed and what the engine decided in it (the pass's
deletions and cordons, its new status), so the label says what the node is doing once the pass
acted. It derives nothing the engine does not: a node is failed by the engine's own rule
(`observation.failed`), held by its rule for GPU work, and in a wave when the status says so.
"""

from __future__ import annotations

from enum import StrEnum

from metax_operator.chart.upgrade_policy import OnTimeout, Policy
from metax_operator.rollout.decision import Decision
from metax_operator.rollout.observation import (
    Cluster,
    Stage,
    ValidationOutcome,
    failed,
    held,
    starting,
    to_prepare,
    validation_outcome,
)


class NodeUpgradeState(StrEnum):
    """The label's values, in the order a node goes through them."""

    PENDING = "pending"  # its driver is at another revision; no wave has taken it yet
    CORDONED = "cordoned"  # in a wave, cordoned, its driver pod not deleted yet
    WAITING_FOR_JOBS = "waiting-for-jobs"  # in a wave, cordoned: pods matching waitForCompletion.podSelector run
    DRAINING = "draining"  # in a wave, cordoned: its GPU pods are being evicted
    DELETING = "deleting"  # its driver pod is being deleted
    WAITING_FOR_READY = "waiting-for-ready"  # its driver pod is not Ready yet (new, or of an older template still starting)
    VALIDATING = "validating"  # its new driver pod is Ready: its validation pod checks the node (upgradePolicy.validation)
    DONE = "done"  # its driver pod is at the DaemonSet's current revision and Ready
    FAILED = "failed"  # its new driver pod failed, or its validation (or its wait or drain timed out with onTimeout: fail)
    HELD = "held"  # kept out of the waves: it runs GPU work, or its wait or drain timed out (onTimeout: hold)
    SKIPPED = "skipped"  # labelled metax-tech.com/driver-upgrade.skip=true: its driver is never replaced


def states(
    observed: Cluster, decision: Decision, policy: Policy, now: float, deleted: set[str] | None = None
) -> dict[str, NodeUpgradeState]:
    """The state of every node the rollout knows (the eligible nodes and the skipped ones) after
    the pass that made `decision`; `deleted`, where the runner knows it, the nodes whose driver pod
    it did delete (a deletion it had to put off, the node not cordoned yet or running GPU work,
    leaves the node where it was), else every node of `decision.delete`."""
    pods = observed.node_pods
    resume = decision.status.resume
    revision, timeout = observed.current_revision, policy.readiness_timeout_ms / 1000
    deleting = {ref.node for ref in decision.delete} if deleted is None else deleted
    cordoned = observed.cordoned | set(decision.cordon)
    wave, timed_out = set(resume.wave), set(resume.timed_out_nodes)
    out = dict.fromkeys(observed.skipped, NodeUpgradeState.SKIPPED)
    for node in observed.nodes:
        pod = pods.live.get(node)
        if node in deleting or (pod is None and node in pods.deleting):
            state = NodeUpgradeState.DELETING
        elif pod is None:
            state = NodeUpgradeState.WAITING_FOR_READY if node in wave else NodeUpgradeState.PENDING
        elif pod.revision == revision:
            if pod.ready:
                state = _VALIDATED[validation_outcome(pod, node in wave, policy.validation, now)[0]]
            elif failed(pod, now, timeout):
                state = NodeUpgradeState.FAILED
            else:
                state = NodeUpgradeState.WAITING_FOR_READY
        elif starting(pod, now, timeout):  # a pod of an older template still coming up: replaced once Ready
            state = NodeUpgradeState.WAITING_FOR_READY
        elif node in timed_out:
            state = NodeUpgradeState.HELD if policy.on_timeout == OnTimeout.HOLD else NodeUpgradeState.FAILED
        elif node in wave:
            state = _preparing(node, observed, policy, cordoned)
        elif held(observed, policy, node):
            state = NodeUpgradeState.HELD
        else:
            state = NodeUpgradeState.PENDING
        out[node] = state
    return out


#: The state of a node whose new driver pod is Ready, by its validation's outcome.
_VALIDATED = {
    ValidationOutcome.PASSED: NodeUpgradeState.DONE,
    ValidationOutcome.VALIDATING: NodeUpgradeState.VALIDATING,
    ValidationOutcome.FAILED: NodeUpgradeState.FAILED,
}


def _preparing(node: str, observed: Cluster, policy: Policy, cordoned: set[str]) -> NodeUpgradeState:
    """A wave node whose old driver pod is still there: what it waits for (the engine's stages)."""
    stage = to_prepare(observed, policy, node)
    if stage is not None:
        return NodeUpgradeState.WAITING_FOR_JOBS if stage == Stage.WAIT else NodeUpgradeState.DRAINING
    return NodeUpgradeState.CORDONED if node in cordoned else NodeUpgradeState.PENDING
