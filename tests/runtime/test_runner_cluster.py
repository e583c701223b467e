"""Whole-runner scenarios on the fake cluster (tests/runtime/cluster.py): `run.Runner`, with its
Helm hold, freeze, reconcile and rollout, on the chart's real DaemonSets, with the DaemonSet
controller and the kubelet between its passes. Each is a fault a review found that only the
whole runner shows (the rollout's half alone does not run the freeze and the reconcile that
turn it into harm).
"""

from __future__ import annotations

import pytest

from metax_operator.contract import CORDONED_LABEL, GPU_NODE_LABEL, SKIP_LABEL, STATE_LABEL
from tests.runtime.cluster import CR, PODS, REVISION_LABEL, VERSIONS, Cluster, labels

A, B = VERSIONS[:2]
POLICY = {
    "enableRollout": True,
    "maxParallel": 1,
    "readinessTimeout": "10m",
    "maxFailureThreshold": 0,
    "fallback": "rollback",
    "upgradeSteps": [{"replicas": "100%", "pauseDuration": 0}],
}


@pytest.fixture
def cluster():
    world = Cluster(nodes=4, policy=POLICY)
    yield world
    world.close()


def settle(cluster: Cluster, passes: int = 3) -> None:
    for _ in range(passes):
        cluster.run_pass()
        cluster.tick()
        cluster.sync()


def start_rollout_of_b(cluster: Cluster) -> None:
    """The admin sets version B (`kubectl patch`); the runner's first wave takes n0."""
    settle(cluster)
    cluster.set_version(B)
    for _ in range(6):
        cluster.run_pass()
        cluster.tick()
        cluster.sync()
        if cluster.driver_versions()["n0"] == B:
            return
    raise AssertionError(f"n0 was not upgraded: {cluster.upgrade_status().get('message')}")


def restore_write(request) -> bool:
    """The restore's write of the CR's spec.driver (a JSON patch of its payload)."""
    return (
        request.method == "PATCH"
        and request.path == CR
        and isinstance(request.body, list)
        and any(op["path"] == "/spec/driver/payload" for op in request.body)
    )


def kill_at(cluster: Cluster, first) -> None:
    """The runner dies at the first request `first` matches: it and every later write of the
    pass are lost (answered 500)."""
    dead = []

    def intercept(request):
        if request.method != "GET" and (dead or first(request)):
            dead.append(request)
            return 500, {"kind": "Status", "code": 500, "message": "the runner was killed"}
        return None

    cluster.api.interceptors.append(intercept)


@pytest.mark.parametrize("fault", ["500", "kill", "fallback"])
def test_a_rollback_whose_write_of_the_cr_is_lost_still_ends_on_the_old_driver_in_waves(cluster, fault):
    """The restore's write of spec.driver back to A is lost after the pass wrote its status (the
    API server answers 500; the runner is killed right there; the same after the policy's own
    fallback rollback): the rollback must still end with the CR, the template and every pod at
    A, one node at a time, and never start the abandoned B again."""
    if fault == "fallback":
        cluster.kubelet.failing.add("n0")  # B's driver does not come up on n0
    start_rollout_of_b(cluster)
    if fault == "500":
        cluster.api.fail("PATCH", CR, 500, times=3)
    else:
        kill_at(cluster, restore_write)
    if fault == "fallback":
        cluster.tick(601)  # n0 not Ready within readinessTimeout: the step fails, fallback rollback
    else:
        cluster.set_policy("enableRollout", False)  # the admin's forced rollback
    lost = next((p for p in (cluster.run_pass() for _ in range(4)) if p.error is not None), None)
    assert lost is not None and any(restore_write(r) for r in lost.writes), "no pass tried the restore"
    cluster.api.clear_faults()
    cluster.api.interceptors.clear()
    if fault != "500":
        cluster.restart_runner()
    cluster.kubelet.failing.clear()
    most, phases = 0, []
    for _ in range(30):  # the rollback to its end, then three passes more
        cluster.tick()
        cluster.sync()
        done = cluster.run_pass()
        most = max(most, sum(1 for r in done.writes if r.method == "DELETE" and "/pods/" in r.path))
        phases.append(cluster.upgrade_status()["phase"])
        if len(phases) > 3 and all(phase in ("Idling", "Disabled") for phase in phases[-4:]):
            break
    ended = (cluster.cr_version(), cluster.template_version(), set(cluster.driver_versions().values()))
    assert ended == (A, A, {A}), f"CR, template and driver versions {ended} after the phases {phases}"
    assert most == 1, f"{most} driver pods deleted in one pass under maxParallel 1"
    assert "Progressing" not in phases, f"a rollout started again after the rollback: {phases}"


def test_with_the_cr_deleted_mid_rollout_the_runner_uncordons_a_node_whose_driver_is_back():
    """The CR is deleted (`kubectl delete`, a GitOps prune) while n0, cordoned by the runner for
    its swap, has its new driver Ready: the runner lifts its cordon and its state label."""
    cluster = Cluster(nodes=3, policy={**POLICY, "maxFailureThreshold": 0, "fallback": "pause"})
    try:
        settle(cluster)
        cluster.set_version(B)
        for _ in range(6):
            if any(r.method == "DELETE" for r in cluster.run_pass().writes):
                break
            cluster.tick()
            cluster.sync()
        assert cluster.nodes()["n0"]["spec"].get("unschedulable"), "the runner did not cordon n0"
        cluster.tick()
        cluster.sync()
        assert cluster.driver_versions()["n0"] == B
        cluster.delete_cr()
        settle(cluster, passes=2)
        node = cluster.nodes()["n0"]
        assert not node["spec"].get("unschedulable")
        assert CORDONED_LABEL not in labels(node) and STATE_LABEL not in labels(node)
    finally:
        cluster.close()


def test_a_node_relabelled_out_of_the_daemonset_is_not_counted_failed_while_its_pod_awaits_deletion(cluster):
    """Found by the fault campaign: n2, whose driver pod at the new revision never started, loses
    the label the DaemonSet selects on; the DaemonSet controller has not deleted that pod yet (it
    is slow) when the readiness timeout passes. n2 left the DaemonSet: the runner must not count
    it failed (a failed node makes the step retry, pause or roll back the whole fleet)."""
    start_rollout_of_b(cluster)
    n2 = next(p for p in cluster.controller.driver_pods()["n2"])
    cluster.api.delete(f"{PODS}/{n2['metadata']['name']}")  # gone at once (an eviction long done)
    cluster.controller.sync()  # its successor at B, Pending: the kubelet never starts it
    assert cluster.controller.driver_pods()["n2"][0]["metadata"]["labels"][REVISION_LABEL] == cluster.controller.current()
    cluster.edit_node("n2", {"metadata": {"labels": {GPU_NODE_LABEL: None}}})  # no GPU any more
    cluster.tick(601)  # past readinessTimeout (10m) since the pod's creation
    cluster.run_pass()
    failed = (cluster.upgrade_status().get("resume") or {}).get("failedNodes") or []
    assert "n2" not in failed, f"n2 left the DaemonSet and was counted failed: {cluster.upgrade_status().get('message')}"


def test_a_runner_at_rest_decides_again_only_when_a_cache_it_reads_changes(cluster):
    """Once the rollout is at rest (`rollout.rest`), a pass leaves it out while nothing it reads
    changes: not kubelet status reports, not GPU jobs, not the clock. A relabelled node, a pod or
    the CR brings it back at once, and a new version rolls out as before."""
    settle(cluster, passes=4)
    decided = []
    observe = cluster.runner.rollouts.watches.observe
    cluster.runner.rollouts.watches.observe = lambda *args, **kwargs: decided.append(1) or observe(*args, **kwargs)

    def decides() -> bool:
        decided.clear()
        cluster.run_pass()
        return bool(decided)

    assert not decides(), "a pass over a settled fleet decided again"
    cluster.set_node_ready("n1", True)  # a status report: the node's resourceVersion moves
    cluster.set_node_ready("n1", True)
    cluster.workloads.start("n2")  # GPU work starts
    cluster.tick(3600)
    assert not decides(), "status reports, a GPU job or an hour made the rollout decide again"
    cluster.edit_node("n3", {"metadata": {"labels": {SKIP_LABEL: "true"}}})
    assert decides(), "a node labelled skip did not make the rollout decide"
    assert labels(cluster.nodes()["n3"])[STATE_LABEL] == "skipped"
    assert decides() and not decides(), "the pass after the label write decides, and the one after it rests"
    cluster.set_version(B)
    for _ in range(12):
        cluster.run_pass()
        cluster.tick()
        cluster.sync()
    assert cluster.driver_versions() == {"n0": B, "n1": B, "n2": A, "n3": A}  # n2 runs GPU work, n3 is skipped
