"""The Progressing phase (`rollout.progress`): steps, retries and the fallback. Each test names the
rule it holds; those for a fault that ran before fail on the engine before its fix."""

from __future__ import annotations

from metax_operator.rollout.observation import Pod
from metax_operator.rollout.status import STEP_PAUSED, STEP_UPGRADE, TERMINATING
from tests.rollout.test_engine import T0, Cluster, nodes_of, policy


def test_a_retry_wave_smaller_than_the_cap_keeps_the_failed_nodes_it_did_not_take_queued():
    """Two failed nodes, a retry at maxParallel 2, but another node's new driver still coming up
    leaves room for one: the retry wave takes n00, and n01 stays queued and is retried next (before:
    it fell out of the queue, the retry was counted all the same, and the step fell back with n01
    never retried)."""
    cluster = Cluster(6)
    pol = policy(maxParallel=2, maxFailureThreshold=1, upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    assert nodes_of(cluster, cluster.decide(pol, T0)) == ["n00", "n01"]
    cluster.set("n00", phase="Failed")
    cluster.set("n01", phase="Failed")
    cluster.nodes.add("n06")  # a node joining: its driver pod is coming up, a slot in flight
    cluster.pods["n06"] = Pod("p-n06-0", "u-n06-0", "n06", "new", False, "Running", 0, T0 + 20)
    failed_uid = cluster.pods["n01"].uid
    retry = cluster.decide(pol, T0 + 30)
    assert nodes_of(cluster, retry) == ["n00"] and retry.status.resume.retry_queue == ["n01"]
    assert retry.status.step.current_failure_retry == 1
    cluster.ready_all()
    cluster.set("n01", phase="Failed", ready=False)
    again = cluster.decide(pol, T0 + 60)
    assert nodes_of(cluster, again) == ["n01"] and cluster.pods["n01"].uid != failed_uid
    assert again.status.resume.retry_queue == [] and again.status.step.current_failure_retry == 1
    cluster.ready_all()
    assert cluster.decide(pol, T0 + 90).status.step.current_step_state == STEP_UPGRADE


def test_a_retry_wave_whose_room_shrank_retries_every_failed_node_before_the_fallback():
    """The probe of the same fault: three failed nodes, room for two; with `fallback: rollback` the
    fleet must not roll back over a node that was never retried."""
    cluster = Cluster(6)
    pol = policy(
        maxParallel=3, maxFailureThreshold=1, fallback="rollback", upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}]
    )
    assert nodes_of(cluster, cluster.decide(pol, T0)) == ["n00", "n01", "n02"]
    for node in ("n00", "n01", "n02"):
        cluster.set(node, restart_count=3)  # crash-looping: failed
    # Outside any wave, n05's old pod was replaced by someone else: a young pod, one slot in flight.
    cluster.pods["n05"] = Pod("p-n05-x", "u-n05-x", "n05", cluster.revision, False, "Running", 0, T0 + 9)
    first = cluster.decide(pol, T0 + 10)
    assert nodes_of(cluster, first) == ["n00", "n01"] and first.status.resume.retry_queue == ["n02"]
    cluster.set("n05", ready=True)
    cluster.set("n00", ready=True)
    cluster.set("n01", ready=True)
    second = cluster.decide(pol, T0 + 20)
    assert nodes_of(cluster, second) == ["n02"] and second.status.phase != TERMINATING


def test_a_step_failed_after_its_retries_pauses_with_the_failed_nodes_named():
    cluster = Cluster(2)
    pol = policy(maxParallel=2, upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    cluster.decide(pol, T0)
    cluster.set("n00", phase="Failed")
    cluster.set("n01", ready=True)
    failed = cluster.decide(pol, T0 + 5)
    assert failed.status.step.current_step_state == STEP_PAUSED and failed.set_pause is True
    assert failed.status.resume.failed.names == ["n00"]


def test_a_driver_pod_that_says_it_cannot_start_fails_at_once_and_the_event_says_why():
    """A payload image without /payload: its init container ends with the payload contract's exit
    and one line. The node is failed at the next pass, not at the readiness timeout, and a
    Warning Event carries the line (once)."""
    cluster = Cluster(2)
    pol = policy(maxParallel=1, readinessTimeout="10m", upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    assert nodes_of(cluster, cluster.decide(pol, T0)) == ["n00"]
    line = "payload image cr.example.com/metax/driver-image:2.33.0.1 has no /payload directory"
    cluster.set("n00", failure=line)
    failed = cluster.decide(pol, T0 + 5)
    assert failed.status.resume.failed.names == ["n00"] and failed.status.step.current_step_state == STEP_PAUSED
    assert [(e.reason, e.message) for e in failed.events if e.reason == "DriverFailed"] == [("DriverFailed", f"node n00: {line}")]
    assert [e for e in cluster.decide(pol, T0 + 10).events if e.reason == "DriverFailed"] == []
