"""The health gate (`driver.upgradePolicy.healthGate`) on the real control plane: `metax-operator
run` with the chart's runner ServiceAccount reads its snapshot of the nodes' health through the
API server (the chart's RBAC; kwok plays the kubelets, the controller manager the node lifecycle)
at each step's pause, lets a healthy rollout through step by step, and fails the step whose
upgraded node went NotReady during its pause, naming the comparison."""

from __future__ import annotations

from tests.e2e import test_node_validation as node_validation
from tests.e2e.test_node_validation import events
from tests.e2e.test_rollout_cluster import (  # noqa: F401 - fixtures used by name
    NODES,
    QUICK_POLICY,
    all_at,
    api,
    condition,
    driver_pods,
    idle,
    installed,
    revisions,
    start_rollout,
    sub,
)
from tests.e2e.tools import get_cr, more_passes
from tests.waiting import consistently, eventually

GATED = {
    **QUICK_POLICY,
    "maxParallel": 2,
    "upgradeSteps": [{"replicas": 2, "pauseDuration": 15000}, {"replicas": "100%", "pauseDuration": 0}],
    "healthGate": {"enable": True},
}


def settle(cp, api, faults, old: str) -> None:
    node_validation.settle(cp, api, faults, old, "healthGate")


def test_a_healthy_rollout_promotes_each_step_through_the_gate(control_plane, api, idle, faults):
    cp = control_plane
    old, new = start_rollout(cp, api, GATED)
    try:
        eventually(lambda: sub(api).get("currentStepState") == "Completed", 240, "Completed")
        assert all_at(api, new)
        passed = events(api, "HealthGatePassed")
        assert any(
            m.startswith(f"step 0: notReady: 0 of 2 upgraded nodes (0%) against 0 of {NODES - 2} others (0%)") for m in passed
        ), passed
        assert condition(api, "Failed").get("status") != "True"
    finally:
        settle(cp, api, faults, old)


def test_an_upgraded_node_gone_not_ready_fails_the_step_at_its_pause(control_plane, api, idle, faults):
    cp = control_plane
    old, new = start_rollout(cp, api, {**GATED, "fallback": "pause"})
    try:
        eventually(
            lambda: sub(api).get("currentStepState") == "StepPaused" and sub(api).get("currentStepIndex") == 0,
            120,
            "step 0 paused",
        )
        upgraded = sorted(p.spec.node_name for p in driver_pods(api) if p.metadata.labels["controller-revision-hash"] == new)
        assert len(upgraded) == 2
        faults.nodes_not_ready(upgraded[:1])
        failed = eventually(lambda: (c := condition(api, "Failed")).get("status") == "True" and c, 90, "the step failed")
        assert failed["reason"] == "UnhealthyStep"
        comparison = f"notReady: 1 of 2 upgraded nodes (50%) against 0 of {NODES - 2} others (0%)"
        assert comparison in failed["message"]
        # the pass writes the status before its Events
        eventually(lambda: any(comparison in m for m in events(api, "UnhealthyStep")), 30, "the UnhealthyStep event")
        eventually(lambda: get_cr(api)["spec"]["driver"]["upgradePolicy"]["pause"] is True, 30, "pause: true set")
        consistently(
            lambda: revisions(api)[new] == 2,
            more_passes(idle["runners"][0], 3),
            60,
            "no node beyond the step's is swapped",
        )
    finally:
        settle(cp, api, faults, old)
