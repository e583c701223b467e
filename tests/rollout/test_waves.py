"""The waves' rules (`rollout.waves`): when a wave node is back, stuck or failed; which nodes a wave
takes; what leaves a wave. Each test names the rule it holds; those marked with a finding were
written for a fault that ran before, and fail on the engine before its fix."""

from __future__ import annotations

import pytest

from metax_operator.rollout.observation import Pod
from metax_operator.rollout.status import COMPLETED, DISABLED, PROGRESSING, STEP_UPGRADE
from tests.rollout.test_engine import T0, Cluster, drive, nodes_of, policy

HOUR = 3600


@pytest.mark.parametrize("fallback", ["pause", "rollback"])
def test_a_node_deleted_after_a_long_wait_gets_its_whole_readiness_timeout_from_its_deletion(fallback):
    """A wave node whose pods matching waitForCompletion ran for 2 hours (past the 10-minute
    readiness timeout) has its driver pod deleted then; the pass that sees it Terminating, 5 s
    later, must not count it failed (before: failed at once, StepFailed and the fallback, with no
    node named), and it is failed only 10 minutes after its own deletion if nothing comes back."""
    cluster = Cluster(3)
    cluster.waiting = {"n00", "n01", "n02"}
    pol = policy(
        maxParallel=1,
        readinessTimeout="10m",
        fallback=fallback,
        waitForCompletion={"podSelector": "app=training", "timeout": "4h"},
        upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}],
    )
    first = cluster.decide(pol, T0)
    assert first.delete == [] and first.cordon == ["n00"]
    cluster.waiting.discard("n00")  # the job ends after two hours
    late = cluster.decide(pol, T0 + 2 * HOUR)
    assert nodes_of(cluster, late) == ["n00"]
    # The old pod is Terminating (the fixture had replaced it at once): no new one yet.
    cluster.pods["n00"] = Pod("p-n00-0", "u-n00-0", "n00", "old", True, "Running", 0, T0 - 1000, deleting=T0 + 2 * HOUR)
    soon = cluster.decide(pol, T0 + 2 * HOUR + 5)
    assert [e.reason for e in soon.events] == []
    assert soon.status.phase == PROGRESSING and soon.status.step.current_step_state == STEP_UPGRADE
    assert soon.status.resume.failed.names == [] and "waiting for 1 of 1 pods" in soon.status.message
    assert soon.wake_at == T0 + 2 * HOUR + 600  # woken when its own timeout runs out
    stuck = cluster.decide(pol, T0 + 2 * HOUR + 600)
    assert stuck.status.resume.failed.names == ["n00"]  # failed then, and named
    assert {e.reason for e in stuck.events} & {"StepFailed", "FallbackRollback"}


def test_a_node_labelled_skip_while_its_wave_waits_for_its_jobs_keeps_its_driver():
    """The skip label on a wave node whose driver pod is not deleted yet (cordoned, waiting for its
    jobs) takes it out of the wave and uncordons it (before: the driver was deleted once the jobs
    ended, while the status listed the node as skipped)."""
    cluster = Cluster(2)
    cluster.waiting = {"n00"}
    wait = {"podSelector": "app=training"}
    pol = policy(maxParallel=1, waitForCompletion=wait, upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    assert nodes_of(cluster, cluster.decide(pol, T0)) == ["n01"]  # the free node first
    cluster.ready_all()
    taken = cluster.decide(pol, T0 + 5)
    assert taken.status.resume.wave == ["n00"] and "n00" in cluster.cordoned and taken.delete == []
    cluster.skipped = {"n00"}  # the admin labels it skip while it waits
    skipped = cluster.decide(pol, T0 + 8)
    assert skipped.delete == [] and skipped.status.resume.wave == [] and skipped.uncordon == ["n00"]
    cluster.waiting = set()  # the jobs end
    for t in range(9, 15):
        assert "n00" not in [ref.node for ref in cluster.decide(pol, T0 + t).delete]
    assert cluster.pods["n00"].revision == "old" and cluster.status.step.current_step_state == COMPLETED


def test_wait_for_completion_takes_a_node_with_matching_gpu_work_into_a_wave_and_cordons_it():
    """Nodes running GPU training pods that match waitForCompletion.podSelector are taken and
    cordoned, their driver deleted once the pods end (before: held back, never cordoned, new GPU
    jobs kept landing on them)."""
    cluster = Cluster(2)
    cluster.busy = {"n00", "n01"}
    cluster.waiting = {"n00", "n01"}
    pol = policy(
        maxParallel=1, waitForCompletion={"podSelector": "app=training", "timeout": "4h"}, upgradeSteps=[{"replicas": "100%"}]
    )
    first = cluster.decide(pol, T0)
    assert first.cordon == ["n00"] and first.status.resume.wave == ["n00"] and first.status.resume.held.names == []
    cluster.busy.discard("n00")
    cluster.waiting.discard("n00")
    assert nodes_of(cluster, cluster.decide(pol, T0 + 600)) == ["n00"]


def test_gpu_work_that_is_not_waited_for_still_holds_its_node_back():
    cluster = Cluster(2)
    cluster.busy = {"n00"}
    cluster.waiting = {"n01"}  # only n01's pods match the selector
    pol = policy(maxParallel=2, waitForCompletion={"podSelector": "app=training"}, upgradeSteps=[{"replicas": "100%"}])
    first = cluster.decide(pol, T0)
    assert first.status.resume.held.names == ["n00"] and first.cordon == ["n01"]


def test_a_driver_pod_still_starting_is_not_replaced_by_a_newer_template_until_ready():
    """Without a staged rollout, a second template change while the first one's driver pods are
    still starting (their driver may be flashing firmware) replaces them only once they are Ready
    or failed (before: deleted at once, not-Ready ones first)."""
    cluster = Cluster(3)
    pol = policy(enableRollout=False, readinessTimeout="10m")
    first = cluster.decide(pol, T0)
    assert nodes_of(cluster, first) == ["n00", "n01", "n02"]  # every pod at once
    cluster.set("n00", ready=True)  # n01 and n02 still flashing
    cluster.revision = "newer"  # a second firmware change
    again = cluster.decide(pol, T0 + 60)
    assert nodes_of(cluster, again) == ["n00"]
    assert "2 still starting" in again.status.message and "flashing firmware" in again.status.message
    assert again.wake_at is None or again.wake_at <= T0 + 600
    cluster.ready_all()
    assert set(nodes_of(cluster, cluster.decide(pol, T0 + 120))) == {"n01", "n02"}
    drive(cluster, pol, T0 + 180)
    assert cluster.status.phase == DISABLED and {p.revision for p in cluster.pods.values()} == {"newer"}


def test_a_driver_pod_that_never_gets_ready_is_replaced_after_its_readiness_timeout():
    cluster = Cluster(1)
    pol = policy(enableRollout=False, readinessTimeout="10m")
    cluster.decide(pol, T0)
    cluster.revision = "newer"
    assert cluster.decide(pol, T0 + 60).delete == []
    assert nodes_of(cluster, cluster.decide(pol, T0 + 601)) == ["n00"]


def test_a_new_revision_mid_rollout_does_not_take_a_starting_pod_of_the_one_it_replaces():
    cluster = Cluster(4)
    pol = policy(maxParallel=2, upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    assert nodes_of(cluster, cluster.decide(pol, T0)) == ["n00", "n01"]
    cluster.set("n00", ready=True)  # n01's new driver is still starting
    cluster.revision = "next"
    replaced = cluster.decide(pol, T0 + 30)
    assert "n01" not in nodes_of(cluster, replaced)
    cluster.ready_all()
    drive(cluster, pol, T0 + 60)
    assert cluster.status.step.current_step_state == COMPLETED
    assert {p.revision for p in cluster.pods.values()} == {"next"}


def test_a_failed_pod_of_an_older_template_is_replaced_first():
    """Failed or crash-looping pods run no driver: replacing them first costs nothing."""
    cluster = Cluster(3)
    cluster.pods["n02"] = Pod("p-n02-0", "u-n02-0", "n02", "old", False, "Running", 5, T0 - 1000)
    pol = policy(maxParallel=1, upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    assert nodes_of(cluster, cluster.decide(pol, T0)) == ["n02"]


def test_nodes_out_of_service_take_places_of_the_waves_beyond_max_unavailable_and_are_listed():
    """`maxParallel: 2`, `maxUnavailable: 0`, two nodes an admin cordoned: the first wave takes
    those two (out of service already: they cost no availability), then the rollout waits and
    names them; with one back, the waves take one serving node at a time; a node gone NotReady
    is taken within the cap alone; with both back, two at a time."""
    cluster = Cluster(6)
    pol = policy(maxParallel=2, maxUnavailable=0, upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    cluster.admin_cordoned = {"n04", "n05"}
    assert nodes_of(cluster, cluster.decide(pol, T0)) == ["n04", "n05"]
    cluster.ready_all()
    waiting = cluster.decide(pol, T0 + 5)
    assert waiting.delete == [] and waiting.status.resume.out_of_service.names == ["n04", "n05"]
    assert waiting.status.step.message.startswith(
        "step 0: waiting for GPU nodes to return to service: 2 out of service (n04, n05: cordoned, not Ready or without a"
        " driver pod) and 0 being swapped leave no room within maxParallel (2) plus maxUnavailable (0)"
    )
    cluster.admin_cordoned = {"n04"}
    one = cluster.decide(pol, T0 + 10)
    assert nodes_of(cluster, one) == ["n00"] and one.status.resume.out_of_service.count == 0
    cluster.ready_all()
    cluster.set("n01", ready=False)  # its node NotReady
    assert nodes_of(cluster, cluster.decide(pol, T0 + 15)) == ["n01"]
    cluster.ready_all()
    cluster.admin_cordoned = set()
    assert nodes_of(cluster, cluster.decide(pol, T0 + 20)) == ["n02", "n03"]
    drive(cluster, pol, T0 + 25)
    assert cluster.status.step.current_step_state == COMPLETED and cluster.revisions() == {"new": 6}
