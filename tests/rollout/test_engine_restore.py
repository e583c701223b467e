"""A rollback's restore that did not land (review finding 12): the engine on the harness of
tests/rollout/test_engine.py, with the ControllerRevision data and the DaemonSet a restore reads."""

from __future__ import annotations

import dataclasses

import pytest

from metax_operator.rollout import engine
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
