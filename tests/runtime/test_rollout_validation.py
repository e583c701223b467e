"""The validation of swapped nodes by the runner (`upgradePolicy.validation`), pass by pass against
the fake API server (tests/fakeapi.py) on the real client: a Ready wave pod gets a validation pod
on its node, made from the driver's template; its node stays cordoned, labelled `validating` and
holding its slot until the pod ends; then the runner records the outcome on the driver pod and
either uncordons the node and goes on, or counts it failed, says why in an Event and leaves it
cordoned. On the real API server with kwok nodes: tests/e2e/test_node_validation.py."""

from __future__ import annotations

import pytest

from metax_operator.contract import STATE_LABEL, VALIDATES_LABEL, VALIDATION_ANNOTATION
from metax_operator.runtime.rollout_pass import RolloutPass
from tests.fakeapi import FakeApi
from tests.runtime.test_rollout_pass import (
    CR,
    NS,
    PODS,
    POLICY,
    T0,
    cluster_operator,
    driver_pod,
    fleet,
    is_cordoned,
    node_labels,
    run_pass,
    stored_status,
)
from tests.waiting import eventually

TEMPLATE = {
    "spec": {
        "imagePullSecrets": [{"name": "site-registry"}],
        "initContainers": [
            {"name": "wait-for", "image": "cr.example.com/metax/metax-operator-tools:0.9.0", "imagePullPolicy": "Always"},
            {"name": "payload", "image": "cr.example.com/metax/driver-image:2.32.0.6-amd64"},
        ],
        "containers": [{"name": "driver-manager", "image": "driver:2"}],
    }
}
VALIDATING = {**POLICY, "validation": {"enable": True, "timeoutSeconds": 300}}
MODULE_MISSING = "the metax kernel module is not loaded (/host/sys/module/metax is missing)"


@pytest.fixture
def api():
    """Two nodes whose driver pods run revision `old`, the DaemonSet's template at `new`; the
    server stamps creations with the test's clock."""
    clock = [T0]
    with FakeApi(clock=lambda: clock[0]) as fake:
        fake.now = clock
        fleet(fake, 2, TEMPLATE, VALIDATING)
        yield fake


@pytest.fixture
def executor(api):
    runner = RolloutPass(api.client(), NS, guard=lambda: True, clock=lambda: api.now[0])
    yield runner
    runner.close()


def swapped_and_validating(api: FakeApi, executor: RolloutPass) -> dict:
    """The first wave swaps n0's driver; its new pod is Ready; the next pass makes its validation
    pod. Returns that pod."""
    run_pass(api, executor)
    assert [r.path for r in api.sent("DELETE")] == [f"{PODS}/driver-n0"]
    api.delete(f"{PODS}/driver-n0")  # the kubelet is done with it; the DaemonSet makes its successor
    api.now[0] += 30
    api.put(f"{PODS}/driver-n0-b", driver_pod("n0-b", "new") | {"spec": {"nodeName": "n0"}})
    eventually(lambda: executor.watches.driver_pods.get(f"{NS}/driver-n0-b"), 10, "the driver cache to hold the new pod")
    api.requests.clear()
    run_pass(api, executor)
    validation = api.get(f"{PODS}/driver-n0-b-validation")
    assert validation is not None, "no validation pod"
    return validation


def validation_ended(api: FakeApi, executor: RolloutPass, status: dict) -> None:
    """The kubelet reports the validation pod ended with `status`; the runner's cache sees it."""
    pod = api.get(f"{PODS}/driver-n0-b-validation")
    api.put(f"{PODS}/driver-n0-b-validation", {**pod, "status": status})
    api.now[0] += 20

    def seen():
        check = next((c for uid, c in executor.watches.validation_pods.snapshot().values() if uid == "uid-driver-n0-b"), None)
        return check is not None and check.done

    eventually(seen, 10, "the validation cache to see the pod end")
    api.requests.clear()


def test_a_ready_wave_pod_gets_a_validation_pod_on_its_node_from_the_driver_template(api, executor):
    pod = swapped_and_validating(api, executor)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["labels"][VALIDATES_LABEL] == "uid-driver-n0-b"
    assert meta["labels"]["app.kubernetes.io/component"] == "driver-validation"
    assert meta["ownerReferences"] == [{"apiVersion": "v1", "kind": "Pod", "name": "driver-n0-b", "uid": "uid-driver-n0-b"}]
    assert spec["nodeName"] == "n0" and spec["restartPolicy"] == "Never" and spec["activeDeadlineSeconds"] == 300
    assert spec["imagePullSecrets"] == [{"name": "site-registry"}]
    assert spec["tolerations"] == [{"operator": "Exists"}] and spec["automountServiceAccountToken"] is False
    [check] = spec["containers"]
    assert check["image"] == "cr.example.com/metax/metax-operator-tools:0.9.0" and check["imagePullPolicy"] == "Always"
    assert check["command"] == ["metax-operator", "check-node", "--sys", "/host/sys", "--driver-version", "2.32.0.6-amd64"]
    assert spec["volumes"] == [{"name": "host-sys", "hostPath": {"path": "/sys", "type": "Directory"}}]
    assert is_cordoned(api, "n0") and node_labels(api, "n0")[STATE_LABEL] == "validating"
    assert not api.sent("DELETE")  # n0 holds the one slot of maxParallel: 1


def test_the_administrators_workload_runs_after_the_built_in_check(api, executor):
    workload = {
        "image": "cr.example.com/metax/maca-sample:2.18.0.3",
        "command": ["/opt/sample", "--gpus", "1"],
        "resources": {"limits": {"metax-tech.com/gpu": 1}},
    }
    api.put(CR, cluster_operator({**VALIDATING, "validation": {**VALIDATING["validation"], "workload": workload}}))
    spec = swapped_and_validating(api, executor)["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["check-node"]
    [container] = spec["containers"]
    assert container["image"] == workload["image"] and container["command"] == workload["command"]
    assert container["resources"] == {"limits": {"metax-tech.com/gpu": 1}}


def test_a_passed_validation_is_recorded_then_the_node_is_uncordoned_and_the_rollout_goes_on(api, executor):
    swapped_and_validating(api, executor)
    validation_ended(api, executor, {"phase": "Succeeded"})
    run_pass(api, executor)
    assert api.get(f"{PODS}/driver-n0-b")["metadata"]["annotations"][VALIDATION_ANNOTATION] == "passed"
    assert not is_cordoned(api, "n0") and node_labels(api, "n0")[STATE_LABEL] == "done"
    assert [r.path for r in api.sent("DELETE")] == [f"{PODS}/driver-n1"]  # the next wave


def test_a_failed_validation_is_recorded_named_in_an_event_and_its_node_stays_cordoned(api, executor):
    swapped_and_validating(api, executor)
    ended = {"terminated": {"exitCode": 1, "message": MODULE_MISSING + "\n"}}
    validation_ended(api, executor, {"phase": "Failed", "containerStatuses": [{"name": "check-node", "state": ended}]})
    run_pass(api, executor)
    driver = api.get(f"{PODS}/driver-n0-b")
    assert driver["metadata"]["annotations"][VALIDATION_ANNOTATION] == f"failed: check-node: {MODULE_MISSING}"
    events = [(e.body["reason"], e.body["message"]) for e in api.sent("POST", "/events")]
    assert ("ValidationFailed", f"node n0: validation failed: check-node: {MODULE_MISSING}") in events
    assert is_cordoned(api, "n0") and node_labels(api, "n0")[STATE_LABEL] == "failed"
    assert stored_status(api).resume.failed.names == ["n0"]
    assert not api.sent("DELETE")  # the step failed (toleration 0): the runner's pause, no next wave
    assert api.get(CR)["spec"]["driver"]["upgradePolicy"]["pause"] is True


def test_an_invalid_policy_mid_validation_keeps_the_node_cordoned(api, executor):
    """A pass that cannot decide (the policy invalid) gives back the nodes whose driver is back,
    but not one whose validation still runs: the validation the policy asks for is still read."""
    swapped_and_validating(api, executor)
    api.put(CR, cluster_operator({**VALIDATING, "maxParallel": "0%"}))  # invalid: write 0 for no limit
    eventually(lambda: executor.watches.validation_pods.snapshot(), 10, "the validation cache to hold the pod")
    run_pass(api, executor)
    assert is_cordoned(api, "n0")
    api.put(CR, cluster_operator({**POLICY, "maxParallel": "0%"}))  # validation off too: given back
    run_pass(api, executor)
    assert not is_cordoned(api, "n0")
