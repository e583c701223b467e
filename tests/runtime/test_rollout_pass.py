"""The rollout's executor (`runtime.rollout_pass.RolloutPass`) against a fake API server on loopback
(tests/fakeapi.py), on the real client: it writes the status first, with the resourceVersion it
read (a 409 ends the pass before any action), then does the decision's actions in order: the
pause (a JSON patch whose test op holds the value the engine saw: a 422 skips it), the
pause-confirmed status, the restore (spec.driver, then the template), cordons, uid-preconditioned
deletions (a 409 there means already gone), uncordons, events; transient 5xx answers are retried,
a 5xx that persists fails the pass with nothing after it applied, and a lost lease stops it
before the next write. Whole passes run on the real control plane in
tests/e2e/test_rollout_cluster.py; the real API server cannot be told to answer these failures.
"""

from __future__ import annotations

import dataclasses

import pytest
from kubernetes.client.exceptions import ApiException

from metax_operator.conditions import rfc3339
from metax_operator.contract import RETRY_LABEL, SKIP_LABEL, STATE_LABEL
from metax_operator.rollout.decision import Decision, PodRef
from metax_operator.rollout.node_state import NodeUpgradeState
from metax_operator.rollout.restore import Restore
from metax_operator.rollout.status import UpgradeStatus
from metax_operator.runtime import cr_status, kube, reconcile
from metax_operator.runtime.cordon import CORDONED_LABEL
from metax_operator.runtime.cr_status import LostLeadership
from metax_operator.runtime.metrics import Metrics
from metax_operator.runtime.rollout_pass import RolloutPass
from metax_operator.runtime.rollout_plan import Plan
from tests.fakeapi import FakeApi
from tests.runtime.test_rollout_observe import daemonset, pod, revision
from tests.waiting import eventually

NS = "metax"
CR = "/apis/gpu.metax-tech.com/v1/clusteroperators/cluster-operator"
DS = f"/apis/apps/v1/namespaces/{NS}/daemonsets/metax-driver"
PODS = f"/api/v1/namespaces/{NS}/pods"
NEW_TEMPLATE = {"spec": {"containers": [{"name": "driver-manager", "image": "driver:2"}]}}
POLICY = {"enableRollout": True, "pause": False, "maxParallel": 1, "upgradeSteps": [{"replicas": "100%", "pauseDuration": 0}]}
T0 = 1_800_000_000.0
NOW = rfc3339(T0)


def cluster_operator(policy: dict = POLICY, status: dict | None = None) -> dict:
    cr = {
        "apiVersion": "gpu.metax-tech.com/v1",
        "kind": "ClusterOperator",
        "metadata": {"name": "cluster-operator", "generation": 3, "uid": "cr-uid"},
        "spec": {"driver": {"payload": {"version": "2"}, "upgradePolicy": policy}},
        "status": {"observedGeneration": 3},
    }
    if status is not None:
        cr["status"]["upgradeStatus"] = status
    return cr


def driver_pod(node: str, revision_hash: str, ready: bool = True) -> dict:
    """The driver pod `driver-NODE` of the release's namespace."""
    driver = pod(f"driver-{node}", node, revision_hash, ready=ready)
    driver["metadata"].update(namespace=NS, labels={**driver["metadata"]["labels"], "app.kubernetes.io/component": "driver"})
    return driver


def recreated(node: str, revision_hash: str, ready: bool = True) -> dict:
    """The pod the DaemonSet controller creates on `node` once its driver pod was deleted: same
    name here, a new uid."""
    new = driver_pod(node, revision_hash, ready)
    new["metadata"]["uid"] += "-2"
    return new


def fleet(fake: FakeApi, nodes: int, template: dict = NEW_TEMPLATE, policy: dict = POLICY) -> None:
    """`nodes` nodes whose driver pods run revision `old` while the DaemonSet's `template` is
    revision `new`, and the CR with `policy`."""
    fake.put(DS, {**daemonset(template=template), "metadata": {**daemonset()["metadata"], "namespace": NS}})
    fake.put(f"/apis/apps/v1/namespaces/{NS}/controllerrevisions/metax-driver-old", revision("old", 1))
    fake.put(f"/apis/apps/v1/namespaces/{NS}/controllerrevisions/metax-driver-new", revision("new", 2, template=template))
    for i in range(nodes):
        fake.put(f"/api/v1/nodes/n{i}", {"metadata": {"name": f"n{i}"}, "spec": {}})
        fake.put(f"{PODS}/driver-n{i}", driver_pod(f"n{i}", "old"))
    fake.put(CR, cluster_operator(policy))


@pytest.fixture
def api():
    """Three nodes whose driver pods run revision `old` while the DaemonSet's template is `new`."""
    with FakeApi() as fake:
        fleet(fake, 3)
        yield fake


@pytest.fixture
def executor(api):
    lease = {"held": True}
    runner = RolloutPass(api.client(), NS, guard=lambda: lease["held"], clock=lambda: T0)
    runner.lease = lease
    yield runner
    runner.close()


def run_pass(api: FakeApi, executor: RolloutPass) -> int:
    """A runner pass of the rollout alone, as `run.Runner` runs it: decide on the CR and its policy
    as the pass validated it, write the status, act."""
    cr = read_cr(api)
    plan = decide(executor, cr)
    if plan is None:
        return 0
    now = rfc3339(executor.clock())
    written = cr_status.write(
        executor.api, cr, [], [], executor.guard, now, applied=False, rollout={"upgradeStatus": plan.upgrade_status}
    )
    return written.writes + (executor.act(written.cr, plan) if written.cr is not None else 0)


def decide(executor: RolloutPass, cr: dict):
    """The executor's decision on `cr`, acting on its spec and policy as the pass validated them."""
    return executor.decide(cr, cr["spec"], reconcile.Observed(NS, cr).check.policy)


def execute(executor: RolloutPass, cr: dict, decision: Decision, pause_seen: bool) -> int:
    """Carry out `decision` taken on `cr` as a pass does: its status written first, then the
    actions (none after a conflict); the number of writes."""
    stored = (cr.get("status") or {}).get("upgradeStatus")
    status = decision.status.to_json()
    written = cr_status.write_status(executor.api, cr, [], executor.guard, NOW, applied=False, rollout={"upgradeStatus": status})
    if written.cr is None:
        return 0
    return written.writes + executor.act(written.cr, Plan(decision, pause_seen, stored, executor.clock()))


def writes(api: FakeApi) -> list[tuple[str, str]]:
    """(method, path) of every request but reads, in order."""
    return [(r.method, r.path) for r in api.requests if r.method != "GET"]


def node_labels(api: FakeApi, node: str) -> dict:
    return api.get(f"/api/v1/nodes/{node}")["metadata"].get("labels") or {}


def stored_status(api: FakeApi) -> UpgradeStatus:
    return UpgradeStatus.from_json(api.get(CR)["status"]["upgradeStatus"])


def read_cr(api: FakeApi) -> dict:
    return api.get(CR)


def test_a_pass_writes_the_status_first_then_cordons_deletes_and_reports(api, executor):
    read = api.get(CR)["metadata"]["resourceVersion"]
    assert run_pass(api, executor) == 7  # status, cordon (labelling n0 deleting), deletion, two events, two state labels
    assert writes(api)[:5] == [
        ("PUT", CR + "/status"),
        ("PATCH", "/api/v1/nodes/n0"),
        ("DELETE", f"{PODS}/driver-n0"),
        ("POST", "/api/v1/namespaces/default/events"),
        ("POST", "/api/v1/namespaces/default/events"),
    ]
    assert sorted(writes(api)[5:]) == [("PATCH", f"/api/v1/nodes/n{i}") for i in (1, 2)]  # in parallel
    assert api.sent("PATCH")[0].body["metadata"]["labels"] == {CORDONED_LABEL: "true", STATE_LABEL: "deleting"}
    states = {n: node_labels(api, n)[STATE_LABEL] for n in ("n0", "n1", "n2")}
    assert states == {"n0": "deleting", "n1": "pending", "n2": "pending"}
    for label in api.sent("PATCH")[1:]:  # a merge patch naming the state label alone
        assert label.body == {"metadata": {"labels": {STATE_LABEL: node_labels(api, label.path.rsplit("/", 1)[1])[STATE_LABEL]}}}
    assert api.sent("PUT", CR)[0].body["metadata"]["resourceVersion"] == read
    assert api.sent("DELETE")[0].body["preconditions"] == {"uid": "uid-driver-n0"}
    node = api.get("/api/v1/nodes/n0")
    assert node["spec"]["unschedulable"] is True and node["metadata"]["labels"][CORDONED_LABEL] == "true"
    status = stored_status(api)
    assert (status.phase, status.resume.wave, status.step.upgrading_pod_spec_revision) == ("Progressing", ["n0"], "new")
    assert [e.body["reason"] for e in api.sent("POST", "/events")] == ["RolloutStarted", "StepUpgradeInit"]


def test_a_status_conflict_ends_the_pass_before_any_action(api, executor):
    api.fail("PUT", CR + "/status", 409)
    assert run_pass(api, executor) == 0
    assert writes(api) == [("PUT", CR + "/status")]
    assert f"{PODS}/driver-n0" in api.objects and "upgradeStatus" not in api.get(CR)["status"]
    assert run_pass(api, executor) == 7  # the next pass decides again, on the CR as it is now


def test_a_transient_5xx_is_retried(api, executor):
    api.fail("DELETE", f"{PODS}/driver-n0", 503, times=2)
    assert run_pass(api, executor) == 7
    assert len(api.sent("DELETE")) == 3 and f"{PODS}/driver-n0" not in api.objects


def test_a_5xx_that_persists_fails_the_pass_with_nothing_after_it_applied(api, executor):
    api.fail("PUT", CR + "/status", 500, times=10)
    with pytest.raises(ApiException) as failed:
        run_pass(api, executor)
    assert failed.value.status == 500
    assert {m for m, _ in writes(api)} == {"PUT"} and len(writes(api)) == 3  # the client's attempts
    assert f"{PODS}/driver-n0" in api.objects and "unschedulable" not in api.get("/api/v1/nodes/n0")["spec"]


def test_a_deletion_whose_uid_precondition_fails_is_already_done(api, executor):
    api.fail("DELETE", f"{PODS}/driver-n0", 409)  # that pod is gone: another one has its name
    assert run_pass(api, executor) == 7
    assert len(api.sent("DELETE")) == 1 and len(api.sent("POST", "/events")) == 2


def test_the_lease_lost_stops_the_pass_before_its_next_write(api, executor):
    executor.lease["held"] = False
    with pytest.raises(LostLeadership):
        run_pass(api, executor)
    assert writes(api) == []


def decision(**fields) -> Decision:
    """A decision on the CR as the fixture holds it: its status written, then `fields`' actions."""
    return Decision(status=UpgradeStatus(message="hand-made"), **fields)


def test_the_runners_pause_is_patched_with_a_test_op_then_confirmed_in_status(api, executor):
    status = UpgradeStatus(phase="Progressing")
    status.resume.paused_by_runner = True
    then = dataclasses.replace(status, resume=dataclasses.replace(status.resume, pause_confirmed=True))
    assert (
        execute(executor, read_cr(api), Decision(status=status, set_pause=True, status_once_paused=then), pause_seen=False) == 3
    )
    assert writes(api) == [("PUT", CR + "/status"), ("PATCH", CR), ("PUT", CR + "/status")]
    pointer = "/spec/driver/upgradePolicy/pause"
    assert api.sent("PATCH", CR)[0].body == [
        {"op": "test", "path": pointer, "value": False},
        {"op": "replace", "path": pointer, "value": True},
    ]
    assert read_cr(api)["spec"]["driver"]["upgradePolicy"]["pause"] is True
    assert stored_status(api).resume.pause_confirmed is True


def test_a_pause_the_admin_changed_meanwhile_is_left_alone(api, executor):
    """The spec no longer holds what the engine saw: the test op fails (422), nothing more is
    written about that pause, and the rest of the decision still runs."""
    seen = read_cr(api)
    edited = read_cr(api)
    edited["spec"]["driver"]["upgradePolicy"]["pause"] = True  # an admin's edit lands after the read
    api.put(CR, edited)
    seen["metadata"]["resourceVersion"] = edited_version = api.get(CR)["metadata"]["resourceVersion"]
    status = UpgradeStatus(phase="Progressing")
    status.resume.paused_by_runner = True
    then = dataclasses.replace(status, resume=dataclasses.replace(status.resume, pause_confirmed=True))
    assert (
        execute(
            executor,
            seen,
            Decision(status=status, set_pause=True, status_once_paused=then, uncordon=["n1"]),
            pause_seen=False,
        )
        == 1
    )
    assert edited_version != api.get(CR)["metadata"]["resourceVersion"]  # the status write
    assert writes(api) == [("PUT", CR + "/status"), ("PATCH", CR), ("PATCH", "/api/v1/nodes/n1")]
    assert stored_status(api).resume.pause_confirmed is False


def test_a_restore_writes_spec_driver_before_the_template(api, executor):
    driver = {"payload": {"version": "1"}, "upgradePolicy": POLICY}
    patch = revision("old", 1)["data"]
    assert execute(executor, read_cr(api), decision(restore=Restore("old", driver, patch)), pause_seen=False) == 3
    assert writes(api) == [("PUT", CR + "/status"), ("PATCH", CR), ("PATCH", DS)]
    assert api.sent("PATCH", CR)[0].body == [{"op": "add", "path": "/spec/driver/payload", "value": {"version": "1"}}]
    assert read_cr(api)["spec"]["driver"] == driver
    assert api.sent("PATCH", DS)[0].body == patch


def test_a_restore_leaves_an_admins_policy_edit_made_since_the_read(api, executor):
    # The pass read the CR, then the admin paused (and turned the rollout off) before the
    # restore's write: spec.driver goes back to the old payload, and the admin's edit stays.
    read = read_cr(api)
    admin = {**POLICY, "pause": True, "enableRollout": False}
    api.put(CR, {**read, "spec": {"driver": {**read["spec"]["driver"], "upgradePolicy": admin}}})
    restored = {"payload": {"version": "1"}, "probe": {"x": 1}, "upgradePolicy": POLICY}
    executor.act(read, Plan(decision(restore=Restore("old", restored, None)), False, None, T0))
    assert read_cr(api)["spec"]["driver"] == {"payload": {"version": "1"}, "probe": {"x": 1}, "upgradePolicy": admin}
    # A key the restored revision does not have goes.
    executor.act(read_cr(api), Plan(decision(restore=Restore("old", {"payload": {"version": "1"}}, None)), False, None, T0))
    assert read_cr(api)["spec"]["driver"] == {"payload": {"version": "1"}, "upgradePolicy": admin}


def test_a_restore_without_a_spec_or_a_revision_writes_what_it_can(api, executor):
    """No spec.driver reproduces the template: the template alone (the admin sets the spec); the
    ControllerRevision gone: the spec alone; a spec already in place is not written again."""
    assert execute(executor, read_cr(api), decision(restore=Restore("old", None, {"spec": {}})), pause_seen=False) == 2
    assert writes(api)[1:] == [("PATCH", DS)]
    current = read_cr(api)["spec"]["driver"]
    assert execute(executor, read_cr(api), decision(restore=Restore("old", current, None)), pause_seen=False) == 0
    assert writes(api)[2:] == []


def test_drain_cordons_then_evicts_only_on_cordoned_nodes(api, executor):
    gpu = {
        "metadata": {"name": "train", "namespace": "jobs"},
        "spec": {"nodeName": "n2", "containers": [{"resources": {"limits": {"metax-tech.com/gpu": "1"}}}]},
    }
    api.put("/api/v1/namespaces/jobs/pods/train", gpu)
    run_pass(api, executor)  # starts the caches (and the rollout: n0's pod)
    api.requests.clear()
    assert execute(executor, read_cr(api), decision(cordon=["n2"], evict=["n2"]), pause_seen=False) == 3
    assert writes(api) == [
        ("PUT", CR + "/status"),
        ("PATCH", "/api/v1/nodes/n2"),
        ("POST", "/api/v1/namespaces/jobs/pods/train/eviction"),
    ]
    assert api.sent("POST")[0].body["metadata"] == {"name": "train", "namespace": "jobs"}


def test_a_failing_watch_cache_stops_the_rollout_until_it_lists_again(api, executor):
    # The cluster-wide GPU-pod watch breaks (an overloaded API server) and a GPU job then lands on
    # n0: the cache cannot see it, so the rollout must take no node until the cache lists again.
    assert decide(executor, read_cr(api)) is not None  # starts the caches, all listed
    api.fail("GET", "/api/v1/pods", 500, times=10_000)
    api.fail("GET", "/api/v1/pods", 500, times=10_000, watch=True)
    api.close_watches()
    eventually(lambda: executor.watches.gpu_pods.state == "failing", 10, "the GPU-pod cache failing")
    job = {
        "metadata": {"name": "train", "namespace": "ml"},
        "spec": {"nodeName": "n0", "containers": [{"name": "c", "resources": {"requests": {"metax-tech.com/gpu": "1"}}}]},
        "status": {"phase": "Running"},
    }
    api.put("/api/v1/namespaces/ml/pods/train", job)
    assert run_pass(api, executor) == 0
    assert writes(api) == [] and f"{PODS}/driver-n0" in api.objects
    api.clear_faults()
    eventually(lambda: executor.watches.gpu_pods.state == "synced", 60, "the GPU-pod cache listed again")
    run_pass(api, executor)
    assert [r.path for r in api.sent("DELETE")] == [f"{PODS}/driver-n1"]  # n0 runs the job: held back


def test_one_nodes_refusal_does_not_stop_the_batch_nor_the_uncordons(api, executor):
    # n1's node is guarded by a policy webhook that refuses the runner (403); n2 was cordoned by
    # the runner earlier and its new driver is Ready: due for its uncordon in the same pass.
    api.put("/api/v1/nodes/n2", {"metadata": {"name": "n2", "labels": {CORDONED_LABEL: "true"}}, "spec": {"unschedulable": True}})
    driver = api.get(f"{PODS}/driver-n2")
    driver["metadata"]["labels"]["controller-revision-hash"] = "new"
    api.put(f"{PODS}/driver-n2", driver)
    api.put(CR, cluster_operator({**POLICY, "maxParallel": 2}))
    api.fail("PATCH", "/api/v1/nodes/n1", 403, times=10_000)
    with pytest.raises(ApiException) as refused:
        run_pass(api, executor)
    assert refused.value.status == 403
    assert [r.path for r in api.sent("DELETE")] == [f"{PODS}/driver-n0"]  # the other node of the wave
    n2 = api.get("/api/v1/nodes/n2")
    assert not n2["spec"]["unschedulable"] and CORDONED_LABEL not in (n2["metadata"].get("labels") or {})
    assert f"{PODS}/driver-n1" in api.objects


def test_a_gpu_job_bound_after_the_decision_keeps_its_driver(api, executor):
    # The engine took n0 from the GPU-pod cache of the pass's start; a job is bound to n0 before
    # the cordon lands. The last look after the cordon finds it: n0 stays cordoned, its driver stays.
    cr = read_cr(api)
    plan = decide(executor, cr)
    assert [ref.node for ref in plan.decision.delete] == ["n0"] and plan.decision.work_check.gpu
    job = {
        "metadata": {"name": "train", "namespace": "ml"},
        "spec": {"nodeName": "n0", "containers": [{"name": "c", "resources": {"limits": {"metax-tech.com/gpu": "1"}}}]},
        "status": {"phase": "Running"},
    }
    api.put("/api/v1/namespaces/ml/pods/train", job)
    execute(executor, cr, plan.decision, plan.pause_seen)
    assert api.sent("DELETE") == [] and f"{PODS}/driver-n0" in api.objects
    assert api.get("/api/v1/nodes/n0")["spec"]["unschedulable"] is True


class LaggingNodeCache:
    """A node cache whose watch has not delivered anything since `frozen` (names to states)."""

    changes = 0

    def __init__(self, frozen: dict):
        self.frozen = frozen

    def get(self, node: str):
        return self.frozen.get(node)

    def has_seen(self, resource_version: str) -> bool:
        return False

    labels_seen = has_seen

    def snapshot(self) -> dict:
        return dict(self.frozen)

    def cordoned(self) -> frozenset[str]:
        return frozenset(name for name, state in self.frozen.items() if state.unschedulable)


def uncordon_behind_a_lagging_node_watch(api, executor) -> None:
    """n0, cordoned by the runner, is uncordoned by it while the node watch stays behind (the
    cache still says cordoned)."""
    api.put("/api/v1/nodes/n0", {"metadata": {"name": "n0", "labels": {CORDONED_LABEL: "true"}}, "spec": {"unschedulable": True}})
    decide(executor, read_cr(api))  # starts the caches
    eventually(lambda: (s := executor.watches.nodes.get("n0")) and s.unschedulable, 10, "the cache to hold n0 cordoned")
    executor.watches.nodes = LaggingNodeCache({"n0": executor.watches.nodes.get("n0")})
    execute(executor, read_cr(api), decision(uncordon=["n0"]), pause_seen=False)
    assert api.get("/api/v1/nodes/n0")["spec"]["unschedulable"] is False


def test_a_cordon_right_after_the_runners_own_uncordon_is_not_taken_for_done(api, executor):
    # n0 was cordoned by the runner; its uncordon lands, but the node watch lags: the cache still
    # says unschedulable. A pass that then deletes n0's driver pod (a rollback, a new revision)
    # must cordon it again rather than take the stale cache's word.
    uncordon_behind_a_lagging_node_watch(api, executor)
    api.requests.clear()
    execute(executor, read_cr(api), decision(delete=[PodRef("driver-n0", "uid-driver-n0", "n0")]), pause_seen=False)
    assert writes(api)[-2:] == [("PATCH", "/api/v1/nodes/n0"), ("DELETE", f"{PODS}/driver-n0")]
    assert api.get("/api/v1/nodes/n0")["spec"]["unschedulable"] is True


def test_a_second_uncordon_while_the_cordon_labels_watch_lags_is_not_sent(api, executor):
    # n0's uncordon landed, but the watch of the cordon label has not delivered it: the next pass
    # asks to give n0 back again. Its own write says it is given back already: no second write.
    uncordon_behind_a_lagging_node_watch(api, executor)
    api.requests.clear()
    execute(executor, read_cr(api), decision(uncordon=["n0"]), pause_seen=False)
    assert ("PATCH", "/api/v1/nodes/n0") not in writes(api)


def test_an_uncordon_by_someone_else_that_the_cache_has_not_seen_is_not_taken_for_a_cordon(api, executor):
    # n0 was cordoned by an admin; they uncordon it, but the node watch lags: the cache still says
    # unschedulable. The deletion of n0's driver pod must not go on a schedulable node.
    api.put("/api/v1/nodes/n0", {"metadata": {"name": "n0"}, "spec": {"unschedulable": True}})
    decide(executor, read_cr(api))  # starts the caches
    eventually(lambda: (s := executor.watches.nodes.get("n0")) and s.unschedulable, 10, "the cache to hold n0 cordoned")
    executor.watches.nodes = LaggingNodeCache({"n0": executor.watches.nodes.get("n0")})
    api.put("/api/v1/nodes/n0", {"metadata": {"name": "n0"}, "spec": {"unschedulable": False}})
    api.requests.clear()
    execute(executor, read_cr(api), decision(delete=[PodRef("driver-n0", "uid-driver-n0", "n0")]), pause_seen=False)
    assert writes(api)[-2:] == [("PATCH", "/api/v1/nodes/n0"), ("DELETE", f"{PODS}/driver-n0")]
    assert is_cordoned(api, "n0")  # cordoned by the runner now, so it will uncordon it


def test_an_admins_cordon_is_confirmed_by_one_read_and_stays_theirs(api, executor):
    api.put("/api/v1/nodes/n0", {"metadata": {"name": "n0"}, "spec": {"unschedulable": True}})
    decide(executor, read_cr(api))
    eventually(lambda: (s := executor.watches.nodes.get("n0")) and s.unschedulable, 10, "the cache to hold n0 cordoned")
    api.requests.clear()
    execute(executor, read_cr(api), decision(delete=[PodRef("driver-n0", "uid-driver-n0", "n0")]), pause_seen=False)
    assert [r.path for r in api.sent("GET") if r.path.startswith("/api/v1/nodes/")] == ["/api/v1/nodes/n0"]
    assert writes(api)[-1] == ("DELETE", f"{PODS}/driver-n0") and ("PATCH", "/api/v1/nodes/n0") not in writes(api)
    assert not is_cordoned(api, "n0") and api.get("/api/v1/nodes/n0")["spec"]["unschedulable"] is True


def cordoned_by_runner(api: FakeApi, node: str) -> None:
    api.put(
        f"/api/v1/nodes/{node}", {"metadata": {"name": node, "labels": {CORDONED_LABEL: "true"}}, "spec": {"unschedulable": True}}
    )


def is_cordoned(api: FakeApi, node: str) -> bool:
    found = api.get(f"/api/v1/nodes/{node}")
    return bool(found["spec"].get("unschedulable")) and CORDONED_LABEL in (found["metadata"].get("labels") or {})


def test_a_swapped_node_is_written_once_going_in_and_once_coming_out(api, executor):
    """The cordon labels the node `deleting`, the uncordon `done`: no state label write of their
    own (before: two more PATCHes per swapped node, about a third of a wave's requests)."""
    run_pass(api, executor)
    assert [r.path for r in api.sent("PATCH") if r.path.endswith("/n0")] == ["/api/v1/nodes/n0"]  # the cordon
    api.put(f"{PODS}/driver-n0", recreated("n0", "new"))  # n0's new driver is Ready
    api.requests.clear()
    run_pass(api, executor)
    [uncordon] = [r for r in api.sent("PATCH") if r.path.endswith("/n0")]
    assert {"op": "add", "path": "/metadata/labels/metax-tech.com~1driver-upgrade.state", "value": "done"} in uncordon.body
    assert not is_cordoned(api, "n0") and node_labels(api, "n0")[STATE_LABEL] == "done"


def test_an_invalid_policy_freezes_the_rollout_but_gives_back_the_nodes_whose_driver_is_back(api, executor):
    # A wave of n1 and n2 was in flight: n2's new driver is Ready, n1's is still coming up. Then
    # an admin's edit makes the policy invalid: the runner decides nothing, deletes nothing and
    # leaves the status as it is, but n2 is not held cordoned for a rollout that cannot go on.
    for node, ready in (("n1", False), ("n2", True)):
        cordoned_by_runner(api, node)
        api.put(f"{PODS}/driver-{node}", driver_pod(node, "new", ready=ready))
    status = {"phase": "Progressing", "resume": {"wave": ["n1", "n2"], "waveKind": "upgrade"}}
    api.put(CR, cluster_operator({**POLICY, "maxParallel": "a few"}, status=status))
    stored = api.get(CR)["status"]["upgradeStatus"]
    run_pass(api, executor)
    assert not is_cordoned(api, "n2") and is_cordoned(api, "n1")
    assert api.sent("DELETE") == [] and api.get(CR)["status"]["upgradeStatus"] == stored
    run_pass(api, executor)  # nothing more to give back: no further write
    assert [path for method, path in writes(api) if path.startswith("/api/v1/nodes/")] == ["/api/v1/nodes/n2"]


def test_without_the_driver_daemonset_every_runner_cordon_is_lifted(api, executor):
    # `helm upgrade --set driver.deploy=false` mid-rollout: the DaemonSet and its pods go, no
    # driver swap is in progress any more, and an admin's own cordon (no runner label) stays.
    cordoned_by_runner(api, "n0")
    api.put("/api/v1/nodes/n1", {"metadata": {"name": "n1"}, "spec": {"unschedulable": True}})
    api.delete(DS)
    for i in range(3):
        api.delete(f"{PODS}/driver-n{i}")
    run_pass(api, executor)
    assert not is_cordoned(api, "n0") and api.get("/api/v1/nodes/n1")["spec"]["unschedulable"] is True
    assert api.sent("DELETE") == []


def test_a_lease_lost_mid_batch_sends_no_more_of_the_batch(api, executor):
    """The lease is checked before each node's writes, not once per batch: a runner deposed while
    a 33-node wave is being deleted sends only the requests already in flight."""
    for i in range(3, 33):
        api.put(f"/api/v1/nodes/n{i}", {"metadata": {"name": f"n{i}"}, "spec": {}})
        api.put(f"{PODS}/driver-n{i}", driver_pod(f"n{i}", "old"))
    api.put(CR, cluster_operator({**POLICY, "maxParallel": 33}))
    executor.guard = lambda: not api.sent("DELETE")  # the lease lapses once the first deletion went out
    with pytest.raises(LostLeadership):
        run_pass(api, executor)
    sent = [m for m, path in writes(api) if path.startswith(("/api/v1/nodes/", PODS))]
    assert 1 <= sent.count("DELETE") <= kube.PARALLEL_REQUESTS and sent.count("PATCH") <= kube.PARALLEL_REQUESTS, sent


# -- the nodes' state labels and the admin's retry label ----------------------------------------


def test_state_labels_are_written_only_when_they_change_and_leave_other_nodes(api, executor):
    api.put("/api/v1/nodes/cpu", {"metadata": {"name": "cpu"}, "spec": {}})  # no driver: not the rollout's
    api.put("/api/v1/nodes/gone", {"metadata": {"name": "gone", "labels": {STATE_LABEL: "done"}}, "spec": {}})
    run_pass(api, executor)
    assert STATE_LABEL not in node_labels(api, "cpu") and STATE_LABEL not in node_labels(api, "gone")  # stale: dropped
    api.requests.clear()
    run_pass(api, executor)  # n0's pod is gone, its new one not there yet: only n0's state moves
    assert [r.path for r in api.sent("PATCH") if "/nodes/" in r.path] == ["/api/v1/nodes/n0"]
    assert node_labels(api, "n0")[STATE_LABEL] == "waiting-for-ready"
    api.requests.clear()
    run_pass(api, executor)  # nothing moved
    assert [r.path for r in api.sent("PATCH") if "/nodes/" in r.path] == []


def test_a_pass_writes_at_most_its_share_of_labels_wave_nodes_first(api, executor, monkeypatch):
    monkeypatch.setattr("metax_operator.runtime.rollout_nodes.STATE_WRITES_PER_PASS", 1)
    run_pass(api, executor)
    assert node_labels(api, "n0")[STATE_LABEL] == "deleting"  # with its cordon
    assert node_labels(api, "n1")[STATE_LABEL] == "pending" and STATE_LABEL not in node_labels(api, "n2")
    api.requests.clear()
    run_pass(api, executor)  # n0 moves on to waiting-for-ready: the wave's node first, n2 waits
    assert [r.path for r in api.sent("PATCH")] == ["/api/v1/nodes/n0"]
    assert STATE_LABEL not in node_labels(api, "n2")
    api.requests.clear()
    run_pass(api, executor)
    assert [r.path for r in api.sent("PATCH")] == ["/api/v1/nodes/n2"]
    assert [node_labels(api, n).get(STATE_LABEL) for n in ("n0", "n1", "n2")] == ["waiting-for-ready", "pending", "pending"]


def test_the_state_metric_counts_every_node_also_those_whose_label_waits_for_the_next_pass(api, executor, monkeypatch):
    monkeypatch.setattr("metax_operator.runtime.rollout_nodes.STATE_WRITES_PER_PASS", 1)
    executor.metrics = Metrics()
    run_pass(api, executor)
    assert STATE_LABEL not in node_labels(api, "n2")  # its label waits, its count does not
    counts = {
        s.labels["state"]: s.value
        for f in executor.metrics.registry.collect()
        if f.name == "metax_operator_node_upgrade_state"
        for s in f.samples
    }
    assert counts == {state.value: 0 for state in NodeUpgradeState} | {"deleting": 1, "pending": 2}


def test_a_state_label_written_just_before_a_cordon_does_not_make_the_cordon_conflict(api, executor):
    # The label write bumps the node's resourceVersion; a cordon in the next pass, before the
    # watch delivered that write, must carry the version the write returned, not the cache's
    # (a conditional cordon on the cache's version would conflict, and the swap wait a pass).
    decide(executor, read_cr(api))  # starts the caches
    eventually(lambda: executor.watches.nodes.get("n1"), 10, "the node cache holding n1")
    executor.watches.nodes = LaggingNodeCache({n: executor.watches.nodes.get(n) for n in ("n0", "n1", "n2")})
    run_pass(api, executor)  # n0's driver pod deleted; every node labelled
    assert node_labels(api, "n1")[STATE_LABEL] == "pending"
    api.put(f"{PODS}/driver-n0", recreated("n0", "new"))  # n0's new driver is Ready: n1 is next
    api.requests.clear()
    run_pass(api, executor)
    assert ("DELETE", f"{PODS}/driver-n1") in writes(api)
    assert api.get("/api/v1/nodes/n1")["spec"]["unschedulable"] is True
    assert node_labels(api, "n1")[STATE_LABEL] == "deleting" and node_labels(api, "n0")[STATE_LABEL] == "done"


def test_a_retry_label_deletes_the_failed_driver_once_then_is_removed(api, executor):
    api.put(CR, cluster_operator({**POLICY, "maxParallel": 3, "upgradeSteps": [{"replicas": "100%"}]}))
    for i in range(3):  # n1's new driver failed (not Ready, restarted again and again)
        api.put(f"{PODS}/driver-n{i}", driver_pod(f"n{i}", "new", ready=i != 1))
    api.put("/api/v1/nodes/n1", {"metadata": {"name": "n1", "labels": {RETRY_LABEL: "true"}}, "spec": {}})
    api.put("/api/v1/nodes/n2", {"metadata": {"name": "n2", "labels": {RETRY_LABEL: "true"}}, "spec": {}})
    run_pass(api, executor)
    assert [r.path for r in api.sent("DELETE")] == [f"{PODS}/driver-n1"]
    assert RETRY_LABEL not in node_labels(api, "n1") and node_labels(api, "n1")[STATE_LABEL] == "deleting"
    assert RETRY_LABEL not in node_labels(api, "n2")  # nothing failed there: consumed, with an event
    reasons = [e.body["reason"] for e in api.sent("POST", "/events")]
    assert "NodeRetried" in reasons and "NothingToRetry" in reasons


def test_a_retry_whose_deletion_waits_keeps_the_label(api, executor):
    api.put(CR, cluster_operator({**POLICY, "maxParallel": 3, "upgradeSteps": [{"replicas": "100%"}]}))
    for i in range(3):  # n1's new driver failed (not Ready, restarted again and again)
        api.put(f"{PODS}/driver-n{i}", driver_pod(f"n{i}", "new", ready=i != 1))
    api.put("/api/v1/nodes/n1", {"metadata": {"name": "n1", "labels": {RETRY_LABEL: "true"}}, "spec": {}})
    api.fail("DELETE", f"{PODS}/driver-n1", 403, times=10_000)  # refused: the retry did not happen
    with pytest.raises(ApiException):
        run_pass(api, executor)
    labels = node_labels(api, "n1")
    assert labels[RETRY_LABEL] == "true" and labels[STATE_LABEL] == "failed"


def training_pod(node: str, gpu: bool) -> dict:
    """A pod matching `waitForCompletion.podSelector` (app=training), with a GPU or without."""
    resources = {"limits": {"metax-tech.com/gpu": "1"}} if gpu else {}
    return {
        "metadata": {"name": f"train-{node}", "namespace": "ml", "labels": {"app": "training"}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "resources": resources}]},
        "status": {"phase": "Running"},
    }


@pytest.mark.parametrize(("gpu", "allow_gpu"), [(False, False), (True, True)], ids=["no-gpu-request", "gpu-workloads-allowed"])
def test_a_pod_to_wait_for_bound_after_the_decision_keeps_its_driver(api, executor, gpu, allow_gpu):
    """The engine took n0 as free from the caches of the pass's start; a pod matching
    waitForCompletion.podSelector is bound to n0 before the cordon lands. The last look before the
    deletion finds it, whether it requests a GPU or not and also where GPU work is allowed (before:
    only GPU pods were looked for, and not at all with allowGpuWorkloads)."""
    wait = {"podSelector": "app=training"}
    api.put(CR, cluster_operator({**POLICY, "waitForCompletion": wait, "allowGpuWorkloads": allow_gpu}))
    cr = read_cr(api)
    plan = decide(executor, cr)
    eventually(lambda: executor.watches.waited is not None and executor.watches.waited.synced, 10, "the wait cache")
    assert [ref.node for ref in plan.decision.delete] == ["n0"]
    api.put("/api/v1/namespaces/ml/pods/train-n0", training_pod("n0", gpu))
    execute(executor, cr, plan.decision, plan.pause_seen)
    assert api.sent("DELETE") == [] and f"{PODS}/driver-n0" in api.objects
    assert api.get("/api/v1/nodes/n0")["spec"]["unschedulable"] is True


def test_a_node_labelled_skip_whose_label_the_cache_has_not_seen_keeps_its_driver(api, executor, monkeypatch):
    """The skip label is read from the node as the API server has it, right before the deletion:
    n0, cordoned by the runner for its wave, is labelled skip while the node watch lags; the cordon
    confirms n0 with a GET (the cache says unschedulable), which shows the label, and the driver
    pod stays (before: deleted, the label read only from the cache)."""
    cordoned_by_runner(api, "n0")
    decide(executor, read_cr(api))  # starts the caches
    eventually(lambda: (s := executor.watches.nodes.get("n0")) and s.unschedulable, 10, "the cache to hold n0 cordoned")
    send = FakeApi._send

    def lagging(self, watched, query, events, path, change, obj, before):
        if path.startswith("/api/v1/nodes/"):
            return None  # the node watches hear nothing
        return send(self, watched, query, events, path, change, obj, before)

    monkeypatch.setattr(FakeApi, "_send", lagging)
    node = api.get("/api/v1/nodes/n0")
    node["metadata"]["labels"][SKIP_LABEL] = "true"
    api.put("/api/v1/nodes/n0", node)
    assert executor.watches.skipped.snapshot() == {}
    run_pass(api, executor)
    assert f"{PODS}/driver-n0" in api.objects and api.sent("DELETE") == []
    assert [r.path for r in api.sent("GET") if r.path == "/api/v1/nodes/n0"]  # the confirmation read


def test_a_pod_the_runner_deleted_is_not_deleted_again_while_the_pod_watch_lags(api, executor, monkeypatch):
    """Without the staged rollout every old pod goes at once; the pass after it comes before the
    pod watch has delivered the deletions (a loaded API server). The pods the runner deleted are
    being deleted, not old pods to delete again (before: a second batch deleted them again)."""
    api.put(CR, cluster_operator({**POLICY, "enableRollout": False}))
    send = FakeApi._send

    def lagging(self, watched, query, events, path, change, obj, before):
        if path.startswith(PODS + "/"):
            return None  # the pod watches hear nothing
        return send(self, watched, query, events, path, change, obj, before)

    monkeypatch.setattr(FakeApi, "_send", lagging)
    run_pass(api, executor)
    deleted = [f"{PODS}/driver-n{i}" for i in range(3)]
    assert sorted(r.path for r in api.sent("DELETE")) == deleted
    assert sorted(executor.watches.driver_pods.snapshot()) == [f"{NS}/driver-n{i}" for i in range(3)]  # still live there
    api.requests.clear()
    run_pass(api, executor)
    assert api.sent("DELETE") == []
    assert {node_labels(api, f"n{i}")[STATE_LABEL] for i in range(3)} == {"deleting"}
    monkeypatch.setattr(FakeApi, "_send", send)
    for i in range(3):  # the pod watch delivers again: the new pods
        api.put(f"{PODS}/driver-n{i}", recreated(f"n{i}", "new"))
    pods = executor.watches.driver_pods.snapshot
    eventually(lambda: {p.pod.revision for p in pods().values()} == {"new"}, 10, "the new pods in the cache")
    run_pass(api, executor)
    assert executor.watches.deleted.pending(pods()) == {}  # the runner's deletions forgotten once seen
    assert {node_labels(api, f"n{i}")[STATE_LABEL] for i in range(3)} == {"done"}


def test_a_drain_leaves_a_daemonsets_gpu_pod_and_swaps_the_driver(api, executor):
    """A GPU pod a DaemonSet owns is on every node and back at once on a cordoned one: the drain
    leaves it, as `kubectl drain --ignore-daemonsets` does, and it holds no node back (before: it
    was evicted again and again until the drain timed out, and the rollout never completed)."""
    agent = {
        "metadata": {
            "name": "gpu-agent-n0",
            "namespace": "monitoring",
            "ownerReferences": [{"kind": "DaemonSet", "name": "gpu-agent", "uid": "agent-uid"}],
        },
        "spec": {"nodeName": "n0", "containers": [{"name": "a", "resources": {"limits": {"metax-tech.com/gpu": "1"}}}]},
        "status": {"phase": "Running"},
    }
    api.put("/api/v1/namespaces/monitoring/pods/gpu-agent-n0", agent)
    api.put(CR, cluster_operator({**POLICY, "drain": {"enable": True, "timeout": "5m"}}))
    run_pass(api, executor)
    assert [r.path for r in api.sent("DELETE")] == [f"{PODS}/driver-n0"]
    assert not [r for r in api.requests if r.path.endswith("/eviction")]
    assert stored_status(api).resume.held.names == []


def test_without_the_cr_the_runners_cordons_whose_driver_is_back_go_and_so_do_the_state_labels(api, executor):
    """The CR deleted mid-rollout (by an admin, or a helm uninstall whose cleanup has yet to run):
    no rollout is left, so the nodes the runner cordoned are given back once their driver is Ready,
    and the nodes' state labels go (before: a node stayed cordoned and labelled `deleting`)."""
    cordoned_by_runner(api, "n0")
    labelled = api.get("/api/v1/nodes/n1")
    labelled["metadata"]["labels"] = {STATE_LABEL: "deleting"}
    api.put("/api/v1/nodes/n1", labelled)
    cordoned_by_runner(api, "n2")
    api.put(f"{PODS}/driver-n2", driver_pod("n2", "new", ready=False))  # n2's new driver is not Ready yet
    api.delete(CR)
    executor.without_cr()
    assert not is_cordoned(api, "n0") and is_cordoned(api, "n2")
    assert STATE_LABEL not in node_labels(api, "n1")
