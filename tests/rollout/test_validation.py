"""The validation of swapped nodes (`upgradePolicy.validation`), rule by rule, on the hand-stepped
cluster of test_engine: a wave node whose new driver pod is Ready is validated before it counts,
holds its slot and stays cordoned meanwhile; a failed or timed-out validation makes it a failed
node of the step (an Event names why, retries and `fallback` apply), and the failure outlives the
wave."""

from __future__ import annotations

from metax_operator.rollout import node_state
from metax_operator.rollout.decision import PodRef, Verdict
from metax_operator.rollout.node_state import NodeUpgradeState
from metax_operator.rollout.observation import Check
from metax_operator.rollout.status import STEP_PAUSED, TERMINATING
from tests.rollout.test_engine import T0, Cluster, policy

MODULE_MISSING = "check-node: the metax kernel module is not loaded (/host/sys/module/metax is missing)"


def validating_policy(**overrides):
    raw = {"maxParallel": 1, "upgradeSteps": [{"replicas": "100%"}], "validation": {"enable": True, "timeoutSeconds": 60}}
    return policy(**{**raw, **overrides})


def ref(cluster: Cluster, node: str) -> PodRef:
    pod = cluster.pods[node]
    return PodRef(pod.name, pod.uid, node)


def state(cluster: Cluster, decision, pol, now: float, node: str) -> NodeUpgradeState:
    return node_state.states(cluster.observed(), decision, pol, now)[node]


def swapped(cluster: Cluster, pol, node: str = "n00") -> float:
    """The first wave deletes `node`'s pod; its new pod is Ready at T0 + 5."""
    assert [r.node for r in cluster.decide(pol, T0).delete] == [node]
    cluster.set(node, ready=True)
    return T0 + 5


def failing(cluster: Cluster, pol) -> float:
    """n00 swapped, its validation pod made, then failed (the module not loaded); the time then."""
    now = swapped(cluster, pol)
    cluster.decide(pol, now)
    cluster.set("n00", check=Check("p-n00-1-validation", now, done=True, passed=False, reason=MODULE_MISSING))
    return now + 5


def test_a_ready_wave_pod_is_validated_before_it_counts_its_node_cordoned_and_holding_its_slot():
    cluster, pol = Cluster(3), validating_policy()
    now = swapped(cluster, pol)
    decision = cluster.decide(pol, now)
    assert decision.validate == [ref(cluster, "n00")]
    assert decision.delete == [] and decision.uncordon == []  # its slot held, still cordoned
    assert state(cluster, decision, pol, now, "n00") == NodeUpgradeState.VALIDATING
    assert cluster.status.step.total_upgrade_ready_replicas == 0

    cluster.set("n00", check=Check("p-n00-1-validation", now))
    decision = cluster.decide(pol, now + 5)
    assert decision.validate == [] and decision.delete == [] and decision.uncordon == []
    assert decision.wake_at == now + 60  # when the validation would time out

    cluster.set("n00", check=Check("p-n00-1-validation", now, done=True, passed=True))
    decision = cluster.decide(pol, now + 10)
    assert decision.verdicts == [Verdict(ref(cluster, "n00"), "passed")]
    assert decision.uncordon == ["n00"]
    assert [r.node for r in decision.delete] == ["n01"]  # the next wave, in the same pass
    assert cluster.status.step.total_upgrade_ready_replicas == 1


def test_without_validation_a_ready_wave_pod_counts_at_once():
    cluster, pol = Cluster(3), policy(maxParallel=1, upgradeSteps=[{"replicas": "100%"}])
    now = swapped(cluster, pol)
    decision = cluster.decide(pol, now)
    assert decision.validate == [] and decision.verdicts == []
    assert decision.uncordon == ["n00"] and [r.node for r in decision.delete] == ["n01"]


def test_a_failed_validation_is_a_failed_node_named_in_status_and_an_event_and_stays_cordoned():
    cluster, pol = Cluster(3), validating_policy(fallback="pause")
    now = failing(cluster, pol)
    decision = cluster.decide(pol, now)
    assert decision.verdicts == [Verdict(ref(cluster, "n00"), f"failed: {MODULE_MISSING}")]
    assert [(e.reason, e.message) for e in decision.events if e.reason == "ValidationFailed"] == [
        ("ValidationFailed", f"node n00: validation failed: {MODULE_MISSING}")
    ]
    assert cluster.status.resume.failed.names == ["n00"]
    assert decision.uncordon == [] and decision.delete == []
    assert cluster.status.step.current_step_state == STEP_PAUSED  # fallback: pause
    assert cluster.status.resume.paused_by_runner and decision.set_pause is True
    assert state(cluster, decision, pol, now, "n00") == NodeUpgradeState.FAILED

    # Recorded: the next passes see the pod's record, say nothing again and keep the node cordoned.
    cluster.set("n00", verdict=f"failed: {MODULE_MISSING}")
    decision = cluster.decide(pol, now + 5)
    assert decision.verdicts == [] and decision.uncordon == []
    assert not [e for e in decision.events if e.reason == "ValidationFailed"]
    assert cluster.status.resume.failed.names == ["n00"]


def test_a_failed_validation_with_fallback_rollback_rolls_back():
    cluster, pol = Cluster(3), validating_policy(fallback="rollback")
    decision = cluster.decide(pol, failing(cluster, pol))
    assert cluster.status.phase == TERMINATING
    assert decision.restore is not None and decision.restore.revision == "old"
    assert decision.uncordon == []


def test_a_validation_that_does_not_end_times_out_as_failed():
    cluster, pol = Cluster(3), validating_policy()
    now = swapped(cluster, pol)
    cluster.decide(pol, now)
    cluster.set("n00", check=Check("p-n00-1-validation", now))
    assert cluster.decide(pol, now + 59).verdicts == []
    decision = cluster.decide(pol, now + 60)
    reason = "its validation did not end within 60 s (timeoutSeconds)"
    assert decision.verdicts == [Verdict(ref(cluster, "n00"), f"failed: {reason}")]
    assert cluster.status.resume.failed.names == ["n00"] and decision.uncordon == []


def test_a_retry_replaces_the_failed_pod_and_validates_its_successor():
    cluster, pol = Cluster(3), validating_policy(maxFailureThreshold=1)
    now = failing(cluster, pol)
    failed_pod = ref(cluster, "n00")
    cluster.set("n00", verdict=f"failed: {MODULE_MISSING}")
    decision = cluster.decide(pol, now)
    assert decision.delete == [failed_pod]  # the retry wave: its Ready but failed pod goes
    assert cluster.status.step.current_failure_retry == 1
    cluster.set("n00", ready=True)
    decision = cluster.decide(pol, now + 5)
    assert decision.validate == [ref(cluster, "n00")] and ref(cluster, "n00") != failed_pod
    assert decision.uncordon == []


def test_a_failed_validation_outlives_its_wave_within_the_toleration():
    cluster = Cluster(3)
    pol = validating_policy(upgradeSteps=[{"replicas": "100%", "toleration": 1}])
    now = failing(cluster, pol)
    decision = cluster.decide(pol, now)
    assert [r.node for r in decision.delete] == ["n01"]  # tolerated: the next wave goes on
    cluster.set("n00", verdict=f"failed: {MODULE_MISSING}")
    cluster.set("n01", ready=True, check=Check("p-n01-2-validation", now + 5, done=True, passed=True))
    decision = cluster.decide(pol, now + 10)
    assert decision.uncordon == ["n01"]  # n00, out of the wave now, stays cordoned
    assert cluster.status.resume.failed.names == ["n00"]
    assert state(cluster, decision, pol, now + 10, "n00") == NodeUpgradeState.FAILED
