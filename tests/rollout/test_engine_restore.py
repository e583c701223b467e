"""A rollback's restore that did not land (review finding 12): the engine on the harness of
tests/rollout/test_engine.py, with the ControllerRevision data and the DaemonSet a restore reads."""

from __future__ import annotations

import dataclasses
import json

import pytest

from metax_operator.rollout import engine, freeze
from metax_operator.rollout.observation import Pod
from metax_operator.rollout.restore import Restore
from metax_operator.rollout.status import DISABLED, DISABLING, IDLING, TERMINATING
from tests.rollout.test_engine import T0, Cluster, policy
from tests.runtime.test_rollout_observe import daemonset, revision


@pytest.mark.parametrize("disable", [True, False], ids=["enableRollout-false", "fallback-rollback"])
@pytest.mark.parametrize("kept", [True, False], ids=["revision-kept", "revision-pruned"])
def test_a_restore_that_did_not_land_is_planned_again_not_taken_for_a_new_revision(disable, kept):
    """The rollback wrote spec.driver back, then its template write failed: the next reconcile maps
    the old spec onto the abandoned template, a revision that is neither (`hybrid`). Before, a
    fallback rollback rolled that forward as a new revision, and `enableRollout: false` took it
    for Disabled and replaced every pod at once. Now the restore is planned again; without the
    old ControllerRevision the rollback goes on to `hybrid`, in waves of maxParallel."""
    cluster = Cluster(6)
    pol = policy(maxParallel=2, fallback="rollback", upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    cluster.decide(pol, T0)
    cluster.ready_all()
    if disable:
        pol = dataclasses.replace(pol, enable_rollout=False)
    else:
        cluster.set("n00", phase="Failed", ready=False)
    kept_revisions = {"old": revision("old", 1)["data"]} if kept else {}
    observed = dataclasses.replace(cluster.observed(), revisions=kept_revisions, daemonset=daemonset())
    first = engine.decide(observed, pol, cluster.status, T0 + 5)
    assert first.restore.revision == "old" and first.status.resume.restoring == "old"
    cluster.status, cluster.revision = first.status, "hybrid"  # the template write did not land
    observed = dataclasses.replace(cluster.observed(), revisions=kept_revisions, daemonset=daemonset())
    again = engine.decide(observed, pol, cluster.status, T0 + 10)
    assert again.status.phase == (DISABLING if disable else TERMINATING)
    assert [e.reason for e in again.events] == []
    if kept:
        assert again.restore.revision == "old" and again.delete == []
        return
    assert again.restore is None and again.status.step.last_pod_spec_revision == "hybrid"
    assert len(again.delete) == 2, "the rollback goes on to the template there is, in waves"
    cluster.status = again.status
    now = T0 + 15
    for _ in range(20):
        cluster.decide(pol, now)
        cluster.ready_all()
        now += 5
    assert cluster.revisions() == {"hybrid": 6} and cluster.status.phase in (DISABLED, IDLING)


def test_a_restore_not_landed_with_the_template_still_at_the_abandoned_revision_is_planned_again():
    """The runner stopped between the status write and the restore's writes: the template is still
    the abandoned one. That is the restore to do again, never a target to roll back to (the crash
    property of tests/rollout/test_engine_properties.py found this)."""
    cluster = Cluster(4)
    pol = policy(maxParallel=2, fallback="rollback", upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    cluster.decide(pol, T0)
    cluster.set("n00", phase="Failed")
    cluster.set("n01", ready=True)
    first = engine.decide(cluster.observed(), pol, cluster.status, T0 + 5)
    assert first.status.phase == TERMINATING and first.restore.revision == "old"
    cluster.status = first.status  # neither write landed: the template is still at "new"
    again = engine.decide(cluster.observed(), pol, cluster.status, T0 + 10)
    assert again.restore.revision == "old" and again.status.step.last_pod_spec_revision == "old"
    assert again.delete == []


def test_a_restore_whose_cr_write_did_not_land_is_planned_again_before_any_wave_and_never_undone():
    """The rollback's status was written (restoring, the restored spec recorded), then its write of
    the CR's spec.driver failed: the reconcile brought the template back from the record, but the
    CR still names the abandoned driver. Before, the next pass took the template for done, forgot
    the restore, and once the rollback ended the runner applied the abandoned driver from the CR:
    with `enableRollout: false`, to every node at once. Now the write is planned again, and no
    rollback wave starts until the CR shows it."""
    version_a, version_b = {"payload": {"version": "A"}}, {"payload": {"version": "B"}}

    def observed(cluster: Cluster, in_force: dict, stored: dict):
        return dataclasses.replace(
            cluster.observed(),
            driver_spec=json.dumps(in_force, sort_keys=True),
            cr_spec={"driver": in_force},
            stored_driver=stored,
        )

    cluster = Cluster(4, new="old")
    pol = policy(maxParallel=1, upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    cluster.status = engine.decide(observed(cluster, version_a, version_a), pol, None, T0).status  # records A's spec
    cluster.revision = "new"  # the admin's kubectl patch of the version: B
    started = engine.decide(observed(cluster, version_b, version_b), pol, cluster.status, T0 + 1)
    assert [ref.node for ref in started.delete] == ["n00"]
    cluster.status, cluster.pods["n00"] = started.status, Pod("p-n00-1", "u-n00-1", "n00", "new", True, "Running", 0, T0 + 1)
    disabled = dataclasses.replace(pol, enable_rollout=False)
    abort = engine.decide(observed(cluster, version_b, version_b), disabled, cluster.status, T0 + 2)
    assert abort.status.phase == DISABLING and abort.restore.driver_spec["payload"] == {"version": "A"}
    assert json.loads(abort.status.resume.spec)["driver"]["payload"] == {"version": "A"}
    cluster.status, cluster.revision = abort.status, "old"  # the reconcile applied the record: the template is back
    for t in (3, 4):  # the CR's write failed: planned again every pass, and nothing else
        again = engine.decide(observed(cluster, version_a, version_b), disabled, cluster.status, T0 + t)
        assert again.restore == Restore("old", {**version_a, "upgradePolicy": {}}, None)
        assert again.delete == [] and again.status.phase == DISABLING and "did not land" in again.status.message
        cluster.status = again.status
    landed = engine.decide(observed(cluster, version_a, version_a), disabled, cluster.status, T0 + 5)
    assert landed.restore is None and landed.status.resume.restoring is None
    assert [ref.node for ref in landed.delete] == ["n00"]  # the rollback's wave, back to A


def test_the_freeze_does_not_take_a_pending_restore_for_an_admins_edit():
    """While the restore's write of spec.driver has not landed, the CR differs from the record in
    spec.driver: the runner's own pending write (SpecHeld stays False), acted on as recorded."""
    recorded = {"driver": {"payload": {"version": "A"}, "upgradePolicy": {"enableRollout": False}}, "gpuDevice": {"x": 1}}
    status = {"upgrading": True, "phase": DISABLING, "resume": {"spec": freeze.record(recorded), "restoring": "old"}}
    cr = {
        "spec": {**recorded, "driver": {**recorded["driver"], "payload": {"version": "B"}}},
        "status": {"upgradeStatus": status},
    }
    in_force = freeze.in_force(cr)
    assert in_force.held == () and in_force.spec["driver"]["payload"] == {"version": "A"}
    cr["spec"]["gpuDevice"] = {"x": 2}  # an admin's edit of another field meanwhile is held as ever
    assert freeze.in_force(cr).held == ("gpuDevice",)
