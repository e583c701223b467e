"""Unit tests of the rollout's observation: projections of API objects and building the engine's
`Observed` from cache contents (`runtime.rollout_observe`). The caches themselves run on the real control
plane (tests/e2e/test_rollout_cluster.py)."""

from __future__ import annotations

import json
import time

import pytest

from metax_operator.commands import rollout_admin as admin
from metax_operator.conditions import parse_time
from metax_operator.rollout import engine, observation
from metax_operator.rollout.decision import Decision
from metax_operator.rollout.status import COMPLETED, IDLING, NodeList, UpgradeStatus
from metax_operator.runtime import cordon
from metax_operator.runtime.rollout_observe import build
from metax_operator.runtime.rollout_projections import (
    deletion_began,
    need_reboot,
    node_event,
    project_driver_pod,
    project_revision,
)
from metax_operator.workloads import gpu_pod
from tests.commands.test_rollout_admin import cr
from tests.rollout.test_engine import T0, policy

DS_UID = "ds-uid"


def pod(name: str, node: str, revision: str, ready: bool = True, owner: str = DS_UID, **extra) -> dict:
    meta = {
        "name": name,
        "uid": f"uid-{name}",
        "creationTimestamp": "2025-01-01T00:00:00Z",
        "labels": {"controller-revision-hash": revision},
        "ownerReferences": [{"kind": "DaemonSet", "uid": owner, "name": "metax-driver"}],
        **extra,
    }
    return {
        "metadata": meta,
        "spec": {"nodeName": node},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": str(ready)}],
            "containerStatuses": [{"restartCount": 1}, {"restartCount": 4}],
        },
    }


TEMPLATE = {"spec": {"containers": [{"name": "driver-manager", "image": "driver:1"}]}}


def revision(hash_: str, number: int, owner: str = DS_UID, template: dict = TEMPLATE) -> dict:
    """As the DaemonSet controller writes it: the template as a strategic merge patch."""
    return {
        "metadata": {
            "name": f"metax-driver-{hash_}",
            "labels": {"controller-revision-hash": hash_},
            "ownerReferences": [{"kind": "DaemonSet", "uid": owner}],
        },
        "revision": number,
        "data": {"spec": {"template": {**template, "$patch": "replace"}}},
    }


def daemonset(generation: int = 2, observed: int = 2, template: dict = TEMPLATE) -> dict:
    return {
        "metadata": {"name": "metax-driver", "uid": DS_UID, "generation": generation},
        "spec": {"template": template},
        "status": {"observedGeneration": observed},
    }


def applied_cr(generation: int = 4, observed: int = 4) -> dict:
    """A CR whose spec.driver the runner's reconcile applied up to generation `observed`."""
    return {
        "metadata": {"generation": generation},
        "spec": {"driver": {"payload": {"version": "1"}}},
        "status": {"observedGeneration": observed},
    }


def test_driver_pod_projection_keeps_what_the_engine_reads():
    projected = project_driver_pod(pod("p1", "n1", "abc", ready=False, deletionTimestamp="2025-01-01T00:00:10Z"))
    assert projected.owner_uid == DS_UID
    assert projected.pod == observation.Pod(
        name="p1",
        uid="uid-p1",
        node="n1",
        revision="abc",
        ready=False,
        phase="Running",
        restart_count=4,
        created=1735689600.0,
        deleting=1735689610.0,
    )


def test_a_pod_being_deleted_counts_from_when_its_deletion_was_asked_not_from_the_end_of_its_grace_period():
    """The API server stamps deletionTimestamp = the request's time + the grace period: the
    readiness timeout of a pod stuck Terminating runs from the request, as for the runner's own
    deletions (the engine's `deleting`)."""
    deleted = pod("p1", "n1", "abc", deletionTimestamp="2025-01-01T00:00:40Z", deletionGracePeriodSeconds=30)
    assert project_driver_pod(deleted).pod.deleting == parse_time("2025-01-01T00:00:10Z")
    assert deletion_began({"deletionTimestamp": "2025-01-01T00:00:10Z", "deletionGracePeriodSeconds": 0}) == 1735689610.0
    assert deletion_began({"name": "p1"}) is None


def test_pods_and_revisions_without_a_daemonset_owner_are_not_kept():
    orphan = pod("p", "n", "abc")
    orphan["metadata"]["ownerReferences"] = []
    assert project_driver_pod(orphan) is None
    rev = revision("abc", 1)
    rev["metadata"]["ownerReferences"] = [{"kind": "StatefulSet", "uid": "x"}]
    assert project_revision(rev) is None


@pytest.mark.parametrize(
    "resources, kept",
    [
        ({"limits": {"metax-tech.com/gpu": "1"}}, True),
        ({"requests": {"metax-tech.com/sgpu": "2"}}, True),
        ({"requests": {"nvidia.com/gpu": "1", "cpu": "1"}}, False),
        ({}, False),
    ],
)
def test_gpu_workload_projection_keeps_only_pods_requesting_metax_resources(resources, kept):
    obj = {"metadata": {"name": "w"}, "spec": {"nodeName": "n7", "containers": [{"resources": resources}]}}
    projected = gpu_pod(obj)
    assert (projected.node if projected else None) == ("n7" if kept else None)


def test_an_unscheduled_gpu_pod_holds_no_node():
    obj = {"metadata": {"name": "w"}, "spec": {"containers": [{"resources": {"limits": {"metax-tech.com/gpu": 1}}}]}}
    assert gpu_pod(obj).node == ""


def test_current_revision_is_the_newest_owned_controllerrevision():
    revs = [
        project_revision(r)
        for r in (revision("old", 1), revision("new", 3), revision("back", 2), revision("other", 9, owner="another-ds"))
    ]
    snap = build(daemonset(), revs, [], [], applied_cr(), None)
    assert snap.observed.current_revision == "new"
    assert set(snap.revisions) == {"old", "new", "back"}
    assert snap.observed.caught_up
    assert json.loads(snap.observed.driver_spec) == {"payload": {"version": "1"}}


def test_pods_at_a_revision_differing_only_in_where_pods_run_read_as_at_the_current_one():
    tolerating = {"spec": {**TEMPLATE["spec"], "tolerations": [{"operator": "Exists"}], "nodeSelector": {"a": "b"}}}
    newer_driver = {"spec": {"containers": [{"name": "driver-manager", "image": "driver:2"}]}}
    revs = [
        project_revision(r)
        for r in (revision("old", 1), revision("driver2", 2, template=newer_driver), revision("now", 3, template=tolerating))
    ]
    pods = [project_driver_pod(pod(f"p{i}", f"n{i}", rev)) for i, rev in enumerate(("old", "driver2", "now"))]
    observed = build(daemonset(template=tolerating), revs, pods, [], applied_cr(), None).observed
    assert observed.current_revision == "now" and observed.same_driver == {"old", "now"}
    assert [p.revision for p in observed.pods] == ["now", "driver2", "now"]


def test_not_caught_up_until_the_controller_observed_the_generation():
    snap = build(daemonset(generation=3, observed=2), [project_revision(revision("a", 1))], [], [], applied_cr(), None)
    assert not snap.observed.caught_up


def test_not_caught_up_while_the_revision_cache_lags_the_daemonset_template():
    newer = {"spec": {"containers": [{"name": "driver-manager", "image": "driver:2"}]}}
    revs = [project_revision(revision("a", 1))]
    assert not build(daemonset(template=newer), revs, [], [], applied_cr(), None).observed.caught_up
    revs.append(project_revision(revision("b", 2, template=newer)))
    snap = build(daemonset(template=newer), revs, [], [], applied_cr(), None)
    assert snap.observed.caught_up and snap.observed.current_revision == "b"


def test_not_caught_up_until_the_reconcile_applied_the_crs_generation():
    """Else a version patched into the CR but not yet in the template would be recorded as the
    stable revision's lastCoDriverSpec, and a rollback would restore it."""
    revs = [project_revision(revision("a", 1))]
    assert not build(daemonset(), revs, [], [], applied_cr(generation=5, observed=4), None).observed.caught_up


def test_nodes_are_the_pods_nodes_plus_the_wave_in_flight():
    pods = [
        project_driver_pod(pod("p1", "n1", "a")),
        project_driver_pod(pod("p2", "n2", "a")),
        project_driver_pod(pod("x", "n9", "a", owner="someone-else")),
    ]
    status = {"resume": {"wave": ["n3"]}}
    snap = build(daemonset(), [project_revision(revision("a", 1))], pods, ["n2"], applied_cr(), status)
    assert snap.observed.nodes == {"n1", "n2", "n3"}
    assert {p.name for p in snap.observed.pods} == {"p1", "p2"}
    assert snap.observed.gpu_busy_nodes == {"n2"}


def test_skipped_nodes_are_not_eligible_unless_their_pod_is_in_the_wave_in_flight():
    pods = [project_driver_pod(pod(f"p{i}", f"n{i}", "a")) for i in (1, 2, 3)]
    snap = build(
        daemonset(),
        [project_revision(revision("a", 1))],
        pods,
        [],
        applied_cr(),
        {"resume": {"wave": ["n3"]}},
        skipped=["n2", "n3"],
        cordoned=["n3"],
    )
    assert snap.observed.nodes == {"n1", "n3"}
    assert snap.observed.skipped == {"n2", "n3"} and snap.observed.cordoned == {"n3"}


def event(node: str, reason: str, last: str) -> dict:
    return {
        "metadata": {"name": f"{node}.{reason}", "creationTimestamp": last},
        "reason": reason,
        "involvedObject": {"kind": "Node", "name": node},
        "lastTimestamp": last,
    }


def test_a_node_needs_a_reboot_until_a_newer_rebooted_event():
    asked = [
        node_event(event("n1", "NodeNeedReboot", "2026-01-01T10:00:00Z")),
        node_event(event("n2", "NodeNeedReboot", "2026-01-01T10:00:00Z")),
        node_event(event("n3", "NodeNeedReboot", "2026-01-01T12:00:00Z")),
    ]
    rebooted = [
        node_event(event("n2", "Rebooted", "2026-01-01T11:00:00Z")),
        node_event(event("n3", "Rebooted", "2026-01-01T11:00:00Z")),
    ]  # before its firmware upgrade
    assert need_reboot(asked, rebooted) == {"n1", "n3"}
    snap = build(
        daemonset(), [project_revision(revision("a", 1))], [], [], applied_cr(), None, need_reboot=need_reboot(asked, rebooted)
    )
    status = engine.decide(snap.observed, admin.policy_mod.validate({}), None, 0.0).status
    assert status.resume.need_reboot == NodeList(["n1", "n3"], 2)
    assert "Need a reboot (NodeNeedReboot: firmware upgraded): 2: n1, n3" in admin.render(cr(status.to_json()))


# -- a wave node that leaves mid-wave (deleted, or relabelled out of the DaemonSet) ---------------

GPU_SELECTOR = {"metax-tech.com/gpu.installed": "true"}
NEW = {"spec": {"nodeSelector": GPU_SELECTOR, "containers": [{"name": "driver-manager", "image": "driver:2"}]}}


def node_cache(names, labels=GPU_SELECTOR) -> dict:
    return {n: cordon.node_state({"metadata": {"name": n, "resourceVersion": "1", "labels": labels}}) for n in names}


class Fleet:
    """Driver pods as the API holds them (every replacement comes up at once, Ready) and the
    runner's passes as it runs them: the snapshot by `build` from the pods, the node cache and the
    stored status, then `engine.decide`."""

    def __init__(self, n: int):
        self.ds = daemonset(template=NEW)
        self.revs = [project_revision(revision("old", 1)), project_revision(revision("new", 2, template=NEW))]
        self.pods = {f"n{i:02d}": pod(f"p-n{i:02d}", f"n{i:02d}", "old") for i in range(n)}
        self.nodes = node_cache(self.pods)
        self.status: dict | None = None
        self.serial = 0
        self.cordoned: set[str] = set()  # as the executor cordons and uncordons

    def decide(self, pol, now: float) -> Decision:
        snap = build(
            self.ds,
            self.revs,
            [project_driver_pod(p) for p in self.pods.values()],
            [],
            applied_cr(),
            self.status,
            cordoned=self.cordoned & set(self.nodes),
            nodes=self.nodes,
        )
        decision = engine.decide(snap.observed, pol, UpgradeStatus.from_json(self.status) if self.status else None, now)
        self.status = decision.status.to_json()
        self.cordoned = (self.cordoned | {ref.node for ref in decision.delete}) - set(decision.uncordon)
        for ref in decision.delete:
            self.serial += 1
            self.pods[ref.node] = pod(f"p-{ref.node}-{self.serial}", ref.node, "new", ready=False)
        return decision

    def ready_all(self) -> None:
        for p in self.pods.values():
            p["status"]["conditions"] = [{"type": "Ready", "status": "True"}]


@pytest.mark.parametrize("leaves", ["deleted", "relabelled"])
@pytest.mark.parametrize("fallback", ["pause", "rollback"])
def test_a_wave_node_that_leaves_drops_out_of_the_wave_and_of_n(leaves, fallback):
    # 4 nodes, waves of 2; n03 leaves while its driver pod is being replaced (pod GC removes the
    # pod of a deleted Node; the DaemonSet never recreates it on a node it no longer selects).
    pol = policy(
        maxParallel=2,
        fallback=fallback,
        upgradeSteps=[{"replicas": 2, "pauseDuration": 0}, {"replicas": "100%", "pauseDuration": 0}],
    )
    fleet, now = Fleet(4), T0
    while "n03" not in [ref.node for ref in fleet.decide(pol, now).delete]:
        fleet.ready_all()
        now += 5
    del fleet.pods["n03"]
    if leaves == "deleted":
        del fleet.nodes["n03"]
    else:
        fleet.nodes.update(node_cache(["n03"], labels={}))
    for _ in range(20):
        now += 301  # past the readiness timeout
        fleet.ready_all()
        decision = fleet.decide(pol, now)
        assert not decision.set_pause and decision.restore is None, decision.status.message
        if decision.status.phase == IDLING:
            break
    st = UpgradeStatus.from_json(fleet.status)
    assert st.phase == IDLING and st.step.current_step_state == COMPLETED, st.message
    assert st.step.total_upgrade_replicas == 3 and not st.resume.failed.names
    # The runner's cordon of n03 is lifted once no driver is coming (a relabelled node stays on).
    assert not fleet.cordoned & set(fleet.nodes), fleet.cordoned


@pytest.mark.parametrize("leaves", ["deleted", "relabelled"])
@pytest.mark.parametrize("ready", [False, True])
def test_the_pod_left_on_a_wave_node_that_left_holds_no_slot_and_is_not_counted(ready, leaves):
    # maxParallel 1: n02 is deleted, or loses the label the DaemonSet selects on, while its new
    # driver pod is still there (pod GC, or the DaemonSet controller, deletes it only later), Ready
    # or not yet. It holds no slot: n03 goes next at once; and the rollout completes over the 3
    # nodes there are, not 4, with no node counted failed.
    pol = policy(maxParallel=1, upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    fleet, now = Fleet(4), T0
    while "n02" not in [ref.node for ref in fleet.decide(pol, now).delete]:
        fleet.ready_all()
        now += 1
    left = fleet.pods["n02"]
    left["metadata"]["creationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    left["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]} if ready else {"phase": "Pending"}
    if leaves == "deleted":
        del fleet.nodes["n02"]
    else:
        fleet.nodes.update(node_cache(["n02"], labels={}))
    assert [ref.node for ref in fleet.decide(pol, now + 1).delete] == ["n03"], fleet.status
    fleet.ready_all()
    if leaves == "relabelled":
        left["status"] = {"phase": "Pending"}  # the pod the DaemonSet has not deleted yet never comes up
    st = fleet.decide(pol, now + 601).status  # past the readiness timeout
    assert st.phase == IDLING and st.step.current_step_state == COMPLETED, st.message
    assert st.step.total_upgrade_replicas == st.step.total_upgrade_ready_replicas == 3
    assert not st.resume.failed.names


def test_a_new_revision_takes_over_the_nodes_whose_pod_is_not_back_yet():
    # maxParallel 1: n00's old pod is deleted, and before the DaemonSet controller re-creates it
    # a next driver revision lands. n00 has no driver: the new rollout must not take n01 as well.
    pol = policy(maxParallel=1, upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    fleet, now = Fleet(2), T0
    assert [ref.node for ref in fleet.decide(pol, now).delete] == ["n00"]
    del fleet.pods["n00"]  # the DaemonSet controller lags
    following = {"spec": {**NEW["spec"], "containers": [{"name": "driver-manager", "image": "driver:3"}]}}
    fleet.ds = daemonset(template=following)
    fleet.revs.append(project_revision(revision("next", 3, template=following)))
    decision = fleet.decide(pol, now + 1)
    assert decision.delete == [] and decision.status.resume.wave == ["n00"], decision.status.message
    fleet.pods["n00"] = pod("p-n00-next", "n00", "next")  # back, at the new revision, Ready
    assert [ref.node for ref in fleet.decide(pol, now + 2).delete] == ["n01"]


def test_a_wave_node_still_selected_but_without_its_pod_yet_stays_in_the_wave():
    status = {"resume": {"wave": ["n01"]}}
    pods = [project_driver_pod(pod("p0", "n00", "new"))]
    nodes = node_cache(["n00", "n01"])
    ds = daemonset(template=NEW)
    assert build(ds, [], pods, [], applied_cr(), status, nodes=nodes).observed.nodes == {"n00", "n01"}
    assert build(ds, [], pods, [], applied_cr(), status, nodes=node_cache(["n00"])).observed.nodes == {"n00"}


def test_an_init_container_ending_with_the_payload_contracts_exit_makes_the_pod_failed_with_its_line():
    line = "payload image r/driver:2 has no /payload directory: a payload image holds its files under /payload"
    obj = pod("p1", "n1", "abc", ready=False)
    obj["status"]["initContainerStatuses"] = [
        {"name": "copier", "state": {"terminated": {"exitCode": 0}}},
        {
            "name": "payload",
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 3, "message": line + "\n"}},
        },
    ]
    assert project_driver_pod(obj).pod.failure == line
    obj["status"]["initContainerStatuses"][1]["lastState"]["terminated"]["exitCode"] = 1  # another failure: the timeout decides
    assert project_driver_pod(obj).pod.failure == ""
