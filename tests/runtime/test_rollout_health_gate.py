"""The health gate by the runner (`upgradePolicy.healthGate`), against the fake API server
(tests/fakeapi.py) on the real client: the snapshot of the nodes' health as `node_health.read`
projects it from Nodes and Pods written as the kubelet writes them, read only when the engine
asked for it; a step ready and paused reads one, fails on a NotReady upgraded node (the condition
and the Event name the comparison), and promotes when every node is healthy once the snapshot is
fresh. On the real API server with kwok nodes: tests/e2e/test_health_gate.py."""

from __future__ import annotations

import pytest

from metax_operator.conditions import rfc3339
from metax_operator.contract import GPU_NODE_LABEL
from metax_operator.rollout.health_gate import NodeHealth
from metax_operator.rollout.status import STEP_PAUSED, ConditionType, Reason
from metax_operator.runtime import node_health
from metax_operator.runtime.rollout_pass import RolloutPass
from tests.fakeapi import FakeApi
from tests.runtime.test_rollout_pass import NS, PODS, POLICY, T0, driver_pod, fleet, run_pass, stored_status
from tests.runtime.test_rollout_validation import executor  # noqa: F401 - the fixture, on this api's clock
from tests.waiting import eventually

GATED = {
    **POLICY,
    "upgradeSteps": [{"replicas": 1, "pauseDuration": 60000}, {"replicas": "100%", "pauseDuration": 0}],
    "healthGate": {"enable": True},
}


def gpu_node(name: str, ready: bool = True, capacity: int = 8, allocatable: int = 8) -> dict:
    return {
        "metadata": {"name": name, "labels": {GPU_NODE_LABEL: "true"}},
        "spec": {},
        "status": {
            "conditions": [{"type": "MemoryPressure", "status": "False"}, {"type": "Ready", "status": str(ready)}],
            "capacity": {"cpu": "64", "metax-tech.com/gpu": str(capacity)},
            "allocatable": {"cpu": "63500m", "metax-tech.com/gpu": str(allocatable)},
        },
    }


def restarted(pod: dict, at: float) -> dict:
    """`pod` with a container that ended at `at` and runs again."""
    ended = {"terminated": {"exitCode": 1, "finishedAt": rfc3339(at)}}
    status = {**pod.get("status", {}), "containerStatuses": [{"name": "main", "restartCount": 1, "lastState": ended}]}
    return {**pod, "status": status}


def failed_gpu_pod(name: str, node: str, at: float) -> dict:
    return {
        "metadata": {"name": name, "namespace": "ml", "uid": f"u-{name}"},
        "spec": {"nodeName": node, "containers": [{"name": "train", "resources": {"limits": {"metax-tech.com/gpu": "1"}}}]},
        "status": {
            "phase": "Failed",
            "containerStatuses": [{"name": "train", "state": {"terminated": {"exitCode": 2, "finishedAt": rfc3339(at)}}}],
        },
    }


@pytest.fixture
def api():
    """Three GPU nodes, healthy, whose driver pods run revision `old`; the DaemonSet's template at
    `new`; the gate on."""
    clock = [T0]
    with FakeApi(clock=lambda: clock[0]) as fake:
        fake.now = clock
        fleet(fake, 3, policy=GATED)
        for i in range(3):
            fake.put(f"/api/v1/nodes/n{i}", gpu_node(f"n{i}"))
        yield fake


def test_the_snapshot_reads_each_signal_as_the_kubelet_reports_it(api):
    api.put("/api/v1/nodes/n0", gpu_node("n0", ready=False))
    api.put("/api/v1/nodes/n1", gpu_node("n1", allocatable=6))  # two devices unhealthy
    api.put("/api/v1/nodes/n2", gpu_node("n2", capacity=0, allocatable=0))  # the plugin found none
    api.put("/api/v1/nodes/cpu", {"metadata": {"name": "cpu"}, "spec": {}, "status": {}})  # no GPU node: not read
    device = restarted(driver_pod("n1", "old") | {"spec": {"nodeName": "n1"}}, T0 - 5)
    device["metadata"] = {**device["metadata"], "name": "gpu-device-n1", "labels": {"app.kubernetes.io/component": "gpu-device"}}
    api.put(f"{PODS}/gpu-device-n1", device)
    api.put("/api/v1/namespaces/ml/pods/train-1", failed_gpu_pod("train-1", "n2", T0 - 3))
    cpu_job = failed_gpu_pod("cpu-1", "n0", T0 - 1)
    cpu_job["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "1"}}
    api.put("/api/v1/namespaces/ml/pods/cpu-1", cpu_job)  # failed, but no GPU pod
    api.requests.clear()
    health = node_health.read(api.client(), NS, T0)
    assert health.taken == T0
    lists = [r for r in api.sent("GET") if r.path in ("/api/v1/nodes", PODS, "/api/v1/pods")]
    assert len(lists) == 3 and all(r.query.get("limit") == "100" for r in lists), lists  # the caches' page size
    assert health.nodes == {
        "n0": NodeHealth(ready=False),
        "n1": NodeHealth(gpus_unavailable=True, last_restart=T0 - 5),
        "n2": NodeHealth(gpus_unavailable=True, last_failed_gpu_pod=T0 - 3),
    }


def step_zero_paused(api: FakeApi, executor: RolloutPass) -> None:
    """The first wave swaps n0's driver; its new pod is Ready; the next pass finds step 0 ready,
    pauses it and asks for a snapshot (none read yet)."""
    run_pass(api, executor)
    api.delete(f"{PODS}/driver-n0")
    api.now[0] += 30
    api.put(f"{PODS}/driver-n0-b", driver_pod("n0-b", "new") | {"spec": {"nodeName": "n0"}})
    eventually(lambda: executor.watches.driver_pods.get(f"{NS}/driver-n0-b"), 10, "the driver cache to hold the new pod")
    api.requests.clear()
    run_pass(api, executor)
    assert stored_status(api).step.current_step_state == STEP_PAUSED
    assert executor.health_asked and executor.health is None
    assert not [r for r in api.sent("GET") if r.path == "/api/v1/nodes"], "a snapshot read before it was asked for"


def test_a_not_ready_upgraded_node_fails_the_step_at_its_pause(api, executor):
    step_zero_paused(api, executor)
    api.put("/api/v1/nodes/n0", gpu_node("n0", ready=False))
    api.now[0] += 1
    api.requests.clear()
    run_pass(api, executor)
    assert {r.path for r in api.sent("GET")} >= {"/api/v1/nodes", PODS, "/api/v1/pods"}  # the snapshot's three LISTs
    failed = next(c for c in stored_status(api).conditions if c.type == ConditionType.FAILED)
    assert failed.status == "True" and failed.reason == Reason.UNHEALTHY_STEP
    assert "notReady: 1 of 1 upgraded nodes (100%) against 0 of 2 others (0%)" in failed.message
    events = [e.body["message"] for e in api.sent("POST", "/events") if e.body["reason"] == Reason.UNHEALTHY_STEP]
    assert len(events) == 1 and "notReady: 1 of 1 upgraded nodes" in events[0]
    assert api.get(f"{PODS}/driver-n1") is not None  # nothing more deleted


def test_a_healthy_step_promotes_once_its_pause_is_over_on_a_fresh_snapshot(api, executor):
    step_zero_paused(api, executor)
    api.now[0] += 1
    run_pass(api, executor)  # the snapshot: every node healthy
    assert not executor.health_asked and executor.health is not None
    api.now[0] += 60  # the pause is over; the snapshot is a minute old
    run_pass(api, executor)
    assert executor.health_asked and api.get(f"{PODS}/driver-n1") is not None
    api.now[0] += 1
    api.requests.clear()
    run_pass(api, executor)
    assert stored_status(api).step.current_step_index == 1
    assert [r.path for r in api.sent("DELETE")] == [f"{PODS}/driver-n1"]
    events = [e.body["message"] for e in api.sent("POST", "/events") if e.body["reason"] == Reason.HEALTH_GATE_PASSED]
    assert len(events) == 1 and "notReady: 0 of 1 upgraded nodes (0%) against 0 of 2 others (0%)" in events[0]
