"""The validation of swapped nodes (`driver.upgradePolicy.validation`) on the real control plane:
`metax-operator run` with the chart's runner ServiceAccount creates each wave node's validation
pod through the API server (the chart's RBAC, the CRD's defaults and pruning), kwok plays the
kubelet (validation pods pass after two seconds; the faults make them fail or hang), and the
runner records each outcome on the driver pod, uncordons the node only once it passed, and
counts a node whose validation failed or timed out as a failed node of its step."""

from __future__ import annotations

import signal

import pytest
from kubernetes import client

from metax_operator.contract import RETRY_LABEL, VALIDATES_LABEL, VALIDATION_ANNOTATION
from tests.e2e.test_node_safety import GPU_NODES, runner_cordoned
from tests.e2e.test_rollout_cluster import (  # noqa: F401 - fixtures used by name
    EVENTS_NS,
    FAILING,
    NS,
    QUICK_POLICY,
    Runner,
    all_at,
    api,
    condition,
    driver_pods,
    idle,
    installed,
    node_states,
    patch_driver,
    revisions,
    start_rollout,
    sub,
    upgrade_status,
)
from tests.e2e.tools import get_cr, kubectl, log_entries, more_passes, seed_patch
from tests.waiting import consistently, eventually

VALIDATION_PODS = "app.kubernetes.io/component=driver-validation"
GPUS_GONE = "no PCI device is bound to the metax driver (nor to vfio-pci)"


def validation_pods(api) -> list:
    return client.CoreV1Api(api).list_namespaced_pod(NS, label_selector=VALIDATION_PODS).items


def events(api, reason: str) -> list[str]:
    found = client.CoreV1Api(api).list_namespaced_event(EVENTS_NS, field_selector="involvedObject.name=cluster-operator")
    return [e.message for e in found.items if e.reason == reason]


def validating(policy: dict, timeout: int = 60) -> dict:
    return {**policy, "validation": {"enable": True, "timeoutSeconds": timeout}}


def settle(cp, api, faults, old: str, block: str = "validation") -> None:
    """A rollout that did not complete is rolled back to `old` by disabling it; then the policy's
    `block` (validation, healthGate) goes off, so the next test starts idle."""
    faults.clear_faults()
    if sub(api).get("currentStepState") != "Completed":
        seed_patch(cp, "enableRollout", False)
        eventually(lambda: upgrade_status(api).get("phase") == "Disabled" and all_at(api, old), 180, "rolled back")
    eventually(lambda: runner_cordoned(api) == [], 60, "no node left cordoned")
    patch_driver(api, {"upgradePolicy": {"enableRollout": True, "pause": False, block: {"enable": False}}})


def test_each_swapped_node_is_validated_on_the_node_before_its_uncordon(control_plane, api, idle, faults):
    cp = control_plane
    old, new = start_rollout(cp, api, validating({**QUICK_POLICY, "maxParallel": 2}))
    try:
        seen = eventually(lambda: "validating" in node_states(cp).values() and node_states(cp), 60, "a node validating")
        assert all(state != "done" for node, state in seen.items() if state == "validating")
        eventually(lambda: sub(api).get("currentStepState") == "Completed", 240, "Completed")
        eventually(lambda: runner_cordoned(api) == [], 30, "every node uncordoned")
        assert all_at(api, new)
        pods = {p.spec.node_name: p for p in driver_pods(api)}
        assert {n: (p.metadata.annotations or {}).get(VALIDATION_ANNOTATION) for n, p in pods.items()} == dict.fromkeys(
            GPU_NODES, "passed"
        )
        checks = {p.spec.node_name: p for p in validation_pods(api)}
        assert set(checks) == set(GPU_NODES)
        for node, check in checks.items():  # on its node, owned by (and labelled with) the pod it validated
            assert check.status.phase == "Succeeded"
            [owner] = check.metadata.owner_references
            assert (owner.kind, owner.uid) == ("Pod", pods[node].metadata.uid) == ("Pod", check.metadata.labels[VALIDATES_LABEL])
            assert check.spec.containers[0].command[:2] == ["metax-operator", "check-node"]
        # The runner's own order, per node: its validation recorded, then its uncordon.
        runner = idle["runners"][0]
        order = [(e["action"], e) for e in log_entries(runner.log_path, "rollout-validated", "rollout-uncordon")]
        for node in GPU_NODES:
            validated = next(i for i, (action, e) in enumerate(order) if action == "rollout-validated" and node in e["validated"])
            uncordoned = next(i for i, (action, e) in enumerate(order) if action == "rollout-uncordon" and node in e["nodes"])
            assert validated < uncordoned, node
    finally:
        settle(cp, api, faults, old)


@pytest.mark.parametrize("fallback", ["pause", "rollback"])
def test_a_bad_driver_whose_pods_are_ready_stops_at_the_first_wave_its_nodes_cordoned_and_named(
    control_plane, api, idle, faults, fallback
):
    """A driver that loads (its pods Ready) but leaves the GPUs unusable: every validation fails.
    The first wave's nodes are failed, named in the status and in Events with the check's line,
    and left cordoned; no node beyond that wave loses its driver."""
    cp = control_plane
    faults.validations_fail(GPU_NODES, GPUS_GONE)  # what check-node writes to its termination log
    policy = validating({**FAILING, "maxFailureThreshold": 0, "fallback": fallback})
    old, new = start_rollout(cp, api, policy)
    first_wave = GPU_NODES[:3]  # maxParallel 3, in node order
    try:
        failed = eventually(lambda: (c := condition(api, "Failed")).get("status") == "True" and c, 120, "Failed")
        assert failed["reason"] == "StepFailed"
        status = upgrade_status(api)
        assert sorted(status["resume"]["failedNodes"]) == first_wave
        assert set(first_wave) <= set(runner_cordoned(api))
        messages = eventually(lambda: len(m := events(api, "ValidationFailed")) >= 3 and m, 30, "the ValidationFailed events")
        for node in first_wave:
            assert f"node {node}: validation failed: check-node: {GPUS_GONE}" in messages
        for pod in driver_pods(api):
            if pod.spec.node_name in first_wave and pod.metadata.labels["controller-revision-hash"] == new:
                assert pod.metadata.annotations[VALIDATION_ANNOTATION] == f"failed: check-node: {GPUS_GONE}"
        if fallback == "pause":
            assert status["status"]["currentStepState"] == "StepPaused"
            eventually(lambda: get_cr(api)["spec"]["driver"]["upgradePolicy"]["pause"] is True, 10, "pause: true set")
            states = node_states(cp)
            assert [n for n in GPU_NODES if states.get(n) == "failed"] == first_wave
            consistently(
                lambda: revisions(api)[new] == 3 and set(first_wave) <= set(runner_cordoned(api)),
                more_passes(idle["runners"][0], 3),
                30,
                "the failed nodes stay cordoned and no other node is swapped",
            )
        else:  # the rollback swaps the failed nodes back to the old driver, validated like any swap
            eventually(lambda: upgrade_status(api).get("phase") == "Terminating", 30, "Terminating")
            assert revisions(api)[new] <= 3
            faults.clear_faults()  # the fault fails every validation on these nodes, the old driver's too
            eventually(lambda: upgrade_status(api).get("phase") == "Idling" and all_at(api, old), 120, "rolled back")
            eventually(lambda: runner_cordoned(api) == [], 60, "the nodes given back once the old driver passed")
    finally:
        settle(cp, api, faults, old)


def test_a_validation_that_hangs_times_out_and_fails_its_node(control_plane, api, idle, faults):
    cp = control_plane
    bad = GPU_NODES[0]
    faults.validations_hang([bad])
    old, new = start_rollout(cp, api, validating({**FAILING, "maxFailureThreshold": 0, "fallback": "pause"}, timeout=5))
    try:
        eventually(lambda: condition(api, "Failed").get("status") == "True", 90, "Failed")
        assert upgrade_status(api)["resume"]["failedNodes"] == [bad]
        message = f"node {bad}: validation failed: its validation did not end within 5 s (timeoutSeconds)"
        eventually(lambda: message in events(api, "ValidationFailed"), 30, "the timeout's event")
        assert bad in runner_cordoned(api)
        [hung] = [p for p in validation_pods(api) if p.spec.node_name == bad]
        assert hung.status.phase == "Running" and hung.spec.active_deadline_seconds == 5  # the kubelet would end it
    finally:
        settle(cp, api, faults, old)


def test_a_runner_killed_mid_validation_hands_the_node_over_still_cordoned(control_plane, api, idle, faults):
    """The leader is killed while a node is validating; the next one keeps that node cordoned,
    times its validation out, goes on within the step's toleration, and the node is given back
    only after an admin's retry passed."""
    cp = control_plane
    slow = GPU_NODES[0]
    faults.validations_hang([slow])
    steps = [{**step, "toleration": 1} for step in QUICK_POLICY["upgradeSteps"]]
    policy = {**QUICK_POLICY, "upgradeSteps": steps, "maxParallel": 2, "maxUnavailable": 1}  # tolerated to the end
    old, new = start_rollout(cp, api, validating(policy, timeout=15))
    try:
        eventually(lambda: node_states(cp).get(slow) == "validating", 60, f"{slow} validating")
        idle["runners"][-1].stop(signal.SIGKILL)
        idle["runners"].append(Runner(idle["kubeconfig"], idle["tmp"], "runner-after-kill"))
        failed = eventually(lambda: node_states(cp).get(slow) == "failed", 90, f"{slow} failed by the next leader")
        assert failed and slow in runner_cordoned(api)
        message = f"node {slow}: validation failed: its validation did not end within 15 s (timeoutSeconds)"
        assert message in events(api, "ValidationFailed")
        eventually(lambda: sub(api).get("currentStepState") == "Completed", 240, "Completed within the toleration")
        assert slow in runner_cordoned(api), "a node whose validation failed was given back"
        faults.clear_faults()
        kubectl(cp, "label", "node", slow, f"{RETRY_LABEL}=true")  # the admin retries it once fixed
        eventually(lambda: node_states(cp).get(slow) == "done" and slow not in runner_cordoned(api), 90, f"{slow} retried")
        assert all_at(api, new)
    finally:
        settle(cp, api, faults, old)
