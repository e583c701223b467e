"""Each node's upgrade state (`rollout.node_state`) through a rollout, and the admin's per-node
retry of a failed driver (`Cluster.retry`), on the hand-stepped cluster of test_engine.py."""

from __future__ import annotations

import dataclasses

from metax_operator.rollout.node_state import NodeUpgradeState as S
from metax_operator.rollout.node_state import states
from metax_operator.rollout.status import STEP_PAUSED
from tests.rollout.test_engine import T0, Cluster, nodes_of, policy


def decide(cluster: Cluster, pol, now: float) -> dict[str, S]:
    """One pass, and the states it gives (read from the observation the pass decided on)."""
    observed = cluster.observed()
    decision = cluster.decide(pol, now)
    return states(observed, decision, pol, now)


def test_states_follow_a_node_from_pending_to_done():
    cluster = Cluster(4)
    pol = policy(upgradeSteps=[{"replicas": 1, "pauseDuration": 0}, {"replicas": "100%", "pauseDuration": 0}])
    first = decide(cluster, pol, T0)
    assert first == {"n00": S.DELETING, "n01": S.PENDING, "n02": S.PENDING, "n03": S.PENDING}
    second = decide(cluster, pol, T0 + 5)  # n00's new pod is there, not Ready yet
    assert second["n00"] == S.WAITING_FOR_READY
    cluster.ready_all()
    third = decide(cluster, pol, T0 + 10)
    assert third["n00"] == S.DONE and third["n01"] == S.DELETING  # the next step's wave
    cluster.set("n01", phase="Failed")
    assert decide(cluster, pol, T0 + 15)["n01"] == S.FAILED


def test_skipped_held_and_preparing_nodes():
    cluster = Cluster(4)
    cluster.skipped = {"n03"}
    cluster.busy = {"n02"}  # GPU work, neither allowed nor drained: held out of every wave
    cluster.waiting = {"n01"}
    pol = policy(maxParallel=3, upgradeSteps=[{"replicas": "100%"}], waitForCompletion={"podSelector": "app=train"})
    got = decide(cluster, pol, T0)
    assert got == {"n00": S.DELETING, "n01": S.WAITING_FOR_JOBS, "n02": S.HELD, "n03": S.SKIPPED}
    drained = Cluster(2)
    drained.busy = {"n01"}
    drain = policy(maxParallel=2, upgradeSteps=[{"replicas": "100%"}], drain={"enable": True})
    assert decide(drained, drain, T0) == {"n00": S.DELETING, "n01": S.DRAINING}


def test_a_timed_out_wait_is_held_or_failed_as_on_timeout_says():
    for on_timeout, expected in (("hold", S.HELD), ("fail", S.FAILED)):
        cluster = Cluster(2)
        cluster.waiting = {"n01"}
        pol = policy(
            maxParallel=2,
            upgradeSteps=[{"replicas": "100%"}],
            waitForCompletion={"podSelector": "app=train", "timeout": "1m"},
            onTimeout=on_timeout,
        )
        decide(cluster, pol, T0)
        assert decide(cluster, pol, T0 + 61)["n01"] == expected, on_timeout


def test_a_retry_label_deletes_a_failed_nodes_pod_once_even_while_paused():
    cluster = Cluster(4)
    pol = policy(upgradeSteps=[{"replicas": 1}, {"replicas": "100%"}])  # fallback pause at the first failure
    cluster.decide(pol, T0)
    cluster.set("n00", phase="Failed")
    assert cluster.decide(pol, T0 + 5).set_pause is True
    paused = dataclasses.replace(pol, pause=True)
    cluster.decide(paused, T0 + 10)  # the runner's pause landed
    cluster.retry = {"n00", "n02"}  # n02 still runs its old driver: nothing to retry there
    retried = cluster.decide(paused, T0 + 15)
    assert nodes_of(cluster, retried) == ["n00"]
    assert [(e.type, e.reason) for e in retried.events] == [("Normal", "NodeRetried"), ("Warning", "NothingToRetry")]
    assert "n00" in retried.events[0].message and "n02" in retried.events[1].message
    assert retried.status.step.current_step_state == STEP_PAUSED  # the rollout stays paused


def test_a_retry_waits_for_room_under_max_parallel():
    cluster = Cluster(4)
    pol = policy(maxParallel=1, maxUnavailable=1, upgradeSteps=[{"replicas": "100%", "toleration": 1}])
    cluster.decide(pol, T0)  # n00 deleted
    cluster.set("n00", phase="Failed")  # tolerated: the wave moves on to n01
    moved = cluster.decide(pol, T0 + 5)
    assert nodes_of(cluster, moved) == ["n01"]
    cluster.retry = {"n00"}
    assert nodes_of(cluster, cluster.decide(pol, T0 + 10)) == []  # n01's swap holds the one slot
    now, deleted = T0 + 15, []
    while "n00" not in deleted and now < T0 + 100:
        cluster.ready_all()
        cluster.set("n00", ready=False)
        decision = cluster.decide(pol, now)
        assert len(decision.delete) <= 1  # the retry and the wave share maxParallel
        deleted, now = nodes_of(cluster, decision), now + 5
    assert deleted == ["n00"]  # once the wave left room: n02 and n03 went first
    assert cluster.pods["n00"].revision == "new" and cluster.pods["n00"].phase == "Running"


def test_a_retry_label_seen_again_while_the_retried_pod_comes_up_says_nothing():
    # The runner removes the label once the pod is deleted; a cache that still shows it for a
    # pass must not make the engine report "nothing to retry" about the retry it just did.
    cluster = Cluster(2)
    pol = policy(maxParallel=2, upgradeSteps=[{"replicas": "100%", "toleration": 1}], maxUnavailable=1)
    cluster.decide(pol, T0)
    cluster.set("n00", phase="Failed")
    cluster.retry = {"n00"}
    assert nodes_of(cluster, cluster.decide(pol, T0 + 5)) == ["n00"]
    again = cluster.decide(pol, T0 + 10)  # n00's new pod not Ready yet, the label still seen
    assert nodes_of(cluster, again) == [] and [e.reason for e in again.events if "n00" in e.message] == []


def test_a_retry_under_max_parallel_zero_has_no_cap():
    # maxParallel 0 is no cap (Policy.caps): a failed node's retry must not wait for a slot that never comes.
    cluster = Cluster(3)
    pol = policy(maxParallel=0, maxUnavailable=1, upgradeSteps=[{"replicas": "100%", "toleration": 1}])
    cluster.decide(pol, T0)
    cluster.ready_all()
    cluster.set("n00", phase="Failed", ready=False)
    cluster.retry = {"n00"}
    assert nodes_of(cluster, cluster.decide(pol, T0 + 5)) == ["n00"]


def test_a_pod_of_an_older_template_still_starting_waits_for_ready_and_is_not_deleted():
    """Without a staged rollout, a second template change while the first change's pods come up:
    the starting ones say waiting-for-ready (they are replaced once Ready), the others deleting."""
    cluster = Cluster(2)
    pol = policy(enableRollout=False)
    decide(cluster, pol, T0)  # both replaced at once
    cluster.set("n00", ready=True)
    cluster.revision = "newer"
    assert decide(cluster, pol, T0 + 5) == {"n00": S.DELETING, "n01": S.WAITING_FOR_READY}
