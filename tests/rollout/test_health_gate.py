"""The health gate (`upgradePolicy.healthGate`): the comparison of the upgraded nodes with the
others (`health_gate.compare`), and the engine holding a step at its pause until a snapshot of the
nodes' health is fresh enough, failing the step on a regression (then `fallback`), and promoting
it when none, on the hand-stepped cluster of test_engine."""

from __future__ import annotations

import pytest

from metax_operator.chart.upgrade_policy import HealthGate, HealthSignal
from metax_operator.rollout import health_gate
from metax_operator.rollout.health_gate import HealthSnapshot, NodeHealth
from metax_operator.rollout.status import PROGRESSING, STEP_PAUSED, TERMINATING, ConditionType, Reason
from tests.rollout.test_engine import T0, Cluster, policy

HEALTHY = NodeHealth()


def snapshot(cluster: Cluster, taken: float, **unhealthy: NodeHealth) -> HealthSnapshot:
    """Every node healthy at `taken` but those named."""
    return HealthSnapshot(taken, {node: unhealthy.get(node, HEALTHY) for node in cluster.nodes})


def gated_policy(**overrides):
    """Two upgraded nodes, a 10 s pause, then the rest: the health gate on."""
    raw = {
        "maxParallel": 2,
        "upgradeSteps": [{"replicas": 2, "pauseDuration": 10000}, {"replicas": "100%", "pauseDuration": 0}],
        "healthGate": {"enable": True},
    }
    return policy(**{**raw, **overrides})


def at_pause(cluster: Cluster, pol) -> float:
    """Step 0's two nodes swapped and Ready: the pass at the returned time finds the step ready,
    pauses it, and asks for a snapshot."""
    assert sorted(r.node for r in cluster.decide(pol, T0).delete) == ["n00", "n01"]
    cluster.ready_all()
    decision = cluster.decide(pol, T0 + 5)
    assert cluster.status.step.current_step_state == STEP_PAUSED
    assert decision.observe_health and decision.wake_at == T0 + 5  # asked at once, the pause going on
    return T0 + 5


def condition(cluster: Cluster, kind: ConditionType):
    return next(c for c in cluster.status.conditions if c.type == kind)


def test_the_share_of_each_group_is_compared_against_the_others_share():
    gate = HealthGate(((HealthSignal.NOT_READY, 20),) + tuple((s, 0) for s in HealthSignal if s is not HealthSignal.NOT_READY))
    nodes = {f"u{i}": NodeHealth(ready=i > 0) for i in range(2)} | {f"o{i}": NodeHealth(ready=i > 1) for i in range(8)}
    compared = health_gate.compare(HealthSnapshot(T0, nodes), ["u0", "u1"], [f"o{i}" for i in range(8)], T0, gate)
    not_ready = next(c for c in compared if c.signal is HealthSignal.NOT_READY)
    assert (not_ready.upgraded, not_ready.upgraded_total, not_ready.others, not_ready.others_total) == (1, 2, 2, 8)
    assert not_ready.regression == pytest.approx(25.0) and not_ready.regressed  # 50% against 25%, 20 allowed
    assert [c.signal for c in compared if c.regressed] == [HealthSignal.NOT_READY]
    assert health_gate.verdict(compared) == (
        "notReady: 1 of 2 upgraded nodes (50%) against 2 of 8 others (25%), 25.0 points more, 20 allowed"
    )
    # The others as unhealthy as the upgraded: no regression, whatever the absolute share.
    level = {f"u{i}": NodeHealth(ready=False) for i in range(2)} | {f"o{i}": NodeHealth(ready=False) for i in range(8)}
    assert not any(c.regressed for c in health_gate.compare(HealthSnapshot(T0, level), ["u0", "u1"], list(level)[2:], T0, gate))


def test_nothing_is_compared_when_a_group_is_empty_or_its_nodes_are_gone():
    gate = HealthGate()
    health = HealthSnapshot(T0, {"u0": NodeHealth(ready=False)})
    assert health_gate.compare(health, ["u0"], [], T0, gate) == []
    assert health_gate.compare(health, ["u0"], ["deleted"], T0, gate) == []  # not in the snapshot


def test_restarts_and_failed_gpu_pods_count_from_the_step_start():
    before, during = (
        NodeHealth(last_restart=T0 - 1, last_failed_gpu_pod=T0 - 1),
        NodeHealth(last_restart=T0, last_failed_gpu_pod=T0 + 1),
    )
    for signal in (HealthSignal.RESTARTS, HealthSignal.FAILED_GPU_PODS):
        assert not before.shows(signal, T0) and during.shows(signal, T0)
        assert not HEALTHY.shows(signal, 0.0)  # never restarted, never failed
    assert NodeHealth(gpus_unavailable=True).shows(HealthSignal.GPUS_UNAVAILABLE, T0)


def promoted_on_a_new_snapshot(cluster: Cluster, pol, due: float):
    """The step's pause over at `due`: the gate asks for a snapshot taken since, and promotes on it."""
    decision = cluster.decide(pol, due)
    assert decision.observe_health and decision.delete == [] and decision.wake_at == due
    assert cluster.status.step.current_step_index == 0 and cluster.status.step.current_step_state == STEP_PAUSED
    assert cluster.status.message == "step 0: comparing the upgraded nodes' health with the others' before promoting"
    cluster.health = snapshot(cluster, due + 1)
    decision = cluster.decide(pol, due + 1)
    assert cluster.status.step.current_step_index == 1 and len(decision.delete) == 2
    return decision


def test_a_healthy_step_promotes_after_its_pause_with_the_comparison_in_an_event():
    cluster, pol = Cluster(10), gated_policy()
    now = at_pause(cluster, pol)
    cluster.health = snapshot(cluster, now + 1)
    decision = cluster.decide(pol, now + 1)
    assert not decision.observe_health and decision.delete == []
    assert decision.wake_at == T0 + 15  # the pause's end; the next look is 300 s away
    decision = promoted_on_a_new_snapshot(cluster, pol, T0 + 15)
    passed = [e for e in decision.events if e.reason == Reason.HEALTH_GATE_PASSED]
    assert [e.message for e in passed] == [
        "step 0: "
        + "; ".join(
            f"{s.value}: 0 of 2 upgraded nodes (0%) against 0 of 8 others (0%), 0.0 points more, 0 allowed" for s in HealthSignal
        )
    ]


def test_a_node_gone_wrong_after_the_last_look_of_the_pause_is_seen_before_the_step_promotes():
    """A snapshot taken during the pause, however recent, does not promote: the one taken once
    the pause is over does, and here n01 went NotReady in between."""
    cluster, pol = Cluster(10), gated_policy()
    now = at_pause(cluster, pol)
    cluster.health = snapshot(cluster, T0 + 14)  # healthy, a second before the pause ends
    cluster.decide(pol, T0 + 14)
    decision = cluster.decide(pol, T0 + 15)
    assert decision.observe_health and decision.delete == [] and now < T0 + 15
    cluster.health = snapshot(cluster, T0 + 16, n01=NodeHealth(ready=False))
    decision = cluster.decide(pol, T0 + 16)
    assert condition(cluster, ConditionType.FAILED).reason == Reason.UNHEALTHY_STEP
    assert cluster.status.step.current_step_index == 0 and decision.delete == []


def test_a_snapshot_from_before_the_step_was_ready_is_not_compared():
    cluster, pol = Cluster(10), gated_policy()
    cluster.health = snapshot(cluster, T0 - 100, n00=NodeHealth(ready=False))  # an old one, n00 then NotReady
    now = at_pause(cluster, pol)
    decision = cluster.decide(pol, now + 1)
    assert decision.observe_health and not any(c.reason == Reason.UNHEALTHY_STEP for c in cluster.status.conditions)


@pytest.mark.parametrize("fallback", ["pause", "rollback"])
def test_a_regression_at_the_pause_fails_the_step_naming_the_comparison(fallback):
    cluster, pol = Cluster(10), gated_policy(fallback=fallback)
    now = at_pause(cluster, pol)
    cluster.health = snapshot(cluster, now + 1, n00=NodeHealth(ready=False))
    decision = cluster.decide(pol, now + 1)  # during the pause: it need not run out
    why = (
        "step 0: the upgraded nodes are less healthy than the others: "
        "notReady: 1 of 2 upgraded nodes (50%) against 0 of 8 others (0%), 50.0 points more, 0 allowed"
    )
    failed = condition(cluster, ConditionType.FAILED)
    assert (failed.status, failed.reason, failed.message) == ("True", Reason.UNHEALTHY_STEP, f"{why}: fallback {fallback}")
    not_ready = next(c for c in decision.health_compared if c.signal is HealthSignal.NOT_READY)
    assert (not_ready.upgraded, not_ready.upgraded_total, not_ready.others, not_ready.others_total) == (1, 2, 0, 8)
    assert [e.message for e in decision.events if e.reason == Reason.UNHEALTHY_STEP] == [f"{why}: fallback {fallback}"]
    if fallback == "pause":
        assert cluster.status.phase == PROGRESSING and decision.set_pause is True and decision.delete == []
        assert cluster.status.resume.pause_reason == "failure"
    else:
        assert cluster.status.phase == TERMINATING and decision.restore is not None


def test_a_regression_within_max_regression_promotes():
    cluster, pol = Cluster(10), gated_policy(healthGate={"enable": True, "maxRegression": {"notReady": 50}})
    now = at_pause(cluster, pol)
    cluster.health = snapshot(cluster, now + 1, n00=NodeHealth(ready=False))
    cluster.decide(pol, now + 1)
    cluster.decide(pol, T0 + 15)
    cluster.health = snapshot(cluster, T0 + 16, n00=NodeHealth(ready=False))
    decision = cluster.decide(pol, T0 + 16)
    assert cluster.status.step.current_step_index == 1 and len(decision.delete) == 2


def test_a_restart_before_the_step_began_is_no_regression():
    cluster, pol = Cluster(10), gated_policy()
    now = at_pause(cluster, pol)
    cluster.health = snapshot(cluster, now + 1, n00=NodeHealth(last_restart=T0 - 10), n01=NodeHealth(last_failed_gpu_pod=T0 - 1))
    cluster.decide(pol, now + 1)
    assert cluster.status.step.current_step_state == STEP_PAUSED
    assert not any(c.reason == Reason.UNHEALTHY_STEP for c in cluster.status.conditions)


def test_at_the_admins_pause_the_gate_looks_again_when_the_admin_resumes():
    cluster, pol = Cluster(10), gated_policy(upgradeSteps=[{"replicas": 2}, {"replicas": "100%", "pauseDuration": 0}])
    now = at_pause(cluster, pol)
    paused = gated_policy(upgradeSteps=[{"replicas": 2}, {"replicas": "100%", "pauseDuration": 0}], pause=True)
    cluster.health = snapshot(cluster, now + 1)
    cluster.decide(paused, now + 1)  # the runner's pause landed and was confirmed
    assert cluster.status.resume.pause_confirmed
    resumed_at = now + 60
    decision = cluster.decide(pol, resumed_at)  # the admin set pause: false: a snapshot from now on
    assert decision.observe_health and cluster.status.step.current_step_index == 0
    cluster.health = snapshot(cluster, resumed_at + 1, n01=NodeHealth(gpus_unavailable=True))
    decision = cluster.decide(pol, resumed_at + 1)
    failed = condition(cluster, ConditionType.FAILED)
    assert failed.reason == Reason.UNHEALTHY_STEP and "gpusUnavailable: 1 of 2 upgraded nodes (50%)" in failed.message
    assert decision.set_pause is True and decision.delete == []


def test_after_a_regression_the_admins_resume_upgrades_the_step_again_and_gates_it_anew():
    cluster, pol = Cluster(10), gated_policy()
    now = at_pause(cluster, pol)
    cluster.health = snapshot(cluster, now + 1, n00=NodeHealth(ready=False))
    cluster.decide(pol, now + 1)
    cluster.decide(gated_policy(pause=True), now + 2)  # the runner's pause landed
    cluster.health = snapshot(cluster, now + 3)  # the admin fixed n00
    decision = cluster.decide(pol, now + 3)  # and resumed: the step is ready again, and gated anew
    assert cluster.status.step.current_step_index == 0 and cluster.status.step.current_step_state == STEP_PAUSED
    assert condition(cluster, ConditionType.FAILED).status == "False" and decision.delete == []
    promoted_on_a_new_snapshot(cluster, pol, now + 3 + 10)


def test_an_upgraded_node_gone_not_ready_counts_upgraded_though_its_driver_pod_is_unready_too():
    """The node lifecycle controller marks a NotReady node's pods unready: its driver pod is at the
    revision but not Ready (not failed yet), and the node still belongs to the upgraded group."""
    cluster, pol = Cluster(10), gated_policy()
    now = at_pause(cluster, pol)
    cluster.set("n00", ready=False)
    cluster.health = snapshot(cluster, now + 1, n00=NodeHealth(ready=False))
    cluster.decide(pol, now + 1)
    assert "notReady: 1 of 2 upgraded nodes (50%)" in condition(cluster, ConditionType.FAILED).message
