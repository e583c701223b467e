"""The OnDelete simulator driving the engine: timelines, failures, hangs, crashes, admin scripts."""

from __future__ import annotations

import dataclasses

import pytest

from metax_operator.chart.upgrade_policy import validate
from metax_operator.rollout.health_gate import NodeHealth
from metax_operator.rollout.simulate import simulate
from metax_operator.rollout.status import COMPLETED, IDLING, STEP_PAUSED, UpgradeStatus
from tests.cases import WORKED_EXAMPLES
from tests.rollout.oracle import NEW, OLD, Config, Simulation
from tests.rollout.test_engine import assert_fits_the_crd

CASES = WORKED_EXAMPLES


def run(policy, **config):
    sim = Simulation(Config(**config), validate(policy))
    sim.set_revision(NEW)
    return sim, sim.run()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_worked_examples(case):
    assert simulate(validate(case["policy"]), case["nodes"]).as_json() == {"steps": case["expect"]}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_worked_examples_take_the_same_waves_when_every_validation_passes(case):
    policy = validate({**case["policy"], "validation": {"enable": True}})
    assert policy.validation is not None
    assert simulate(policy, case["nodes"]).as_json() == {"steps": case["expect"]}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_worked_examples_take_the_same_waves_when_every_node_is_healthy_at_the_health_gate(case):
    policy = validate({**case["policy"], "healthGate": {"enable": True}})
    assert policy.health_gate is not None
    sim = Simulation(
        Config(nodes=case["nodes"], interval=5.0, ready_latency=(30.0, 30.0)), dataclasses.replace(policy, enable_rollout=True)
    )
    sim.set_revision(NEW)
    result = sim.run()
    assert result.as_json() == {"steps": case["expect"]}
    assert result.status.step.current_step_state == COMPLETED and sim.health is not None  # the gate looked


def test_a_node_the_first_step_leaves_not_ready_stops_the_rollout_at_that_steps_pause():
    class Planted(Simulation):
        def _health(self, now):
            """The first node the rollout upgraded is NotReady."""
            health = super()._health(now)
            first = min(p.node for p in self.pods.values() if p.revision == NEW)
            return dataclasses.replace(health, nodes={**health.nodes, first: NodeHealth(ready=False)})

    policy = {
        "enableRollout": True,
        "maxParallel": 2,
        "upgradeSteps": [{"replicas": 2, "pauseDuration": 60000}, {"replicas": "100%", "pauseDuration": 0}],
        "healthGate": {"enable": True},
    }
    sim = Planted(Config(nodes=10, admin_delay=None), validate(policy))
    sim.set_revision(NEW)
    result = sim.run()
    assert result.status.step.current_step_index == 0 and result.status.step.current_step_state == STEP_PAUSED
    assert result.status.resume.pause_reason == "failure"
    assert sorted(result.pods.values()).count(NEW) == 2  # nothing beyond the first step


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_duration_is_the_ideal_schedule_within_one_interval_per_wave(case):
    latency, interval, terminate = 40.0, 5.0, 1.0
    result = simulate(validate(case["policy"]), case["nodes"], ready_latency=latency, interval=interval)
    waves = sum(len(step["deletions"]) for step in case["expect"])
    pauses = sum(step["after"] / 1000 for step in case["expect"][:-1] if step["after"] != "manual")
    ideal = waves * latency + pauses
    last_ready = result.steps[-1].ready
    assert ideal <= last_ready <= ideal + waves * (interval + terminate) + len(case["expect"]) * interval


def test_same_seed_same_timeline_and_the_table_fields():
    policy = {
        "enableRollout": True,
        "maxParallel": "30%",
        "upgradeSteps": [{"replicas": "20%", "pauseDuration": 1000}, {"replicas": "100%", "pauseDuration": 0}],
    }
    _, first = run(policy, nodes=40, seed=7, ready_latency=(10, 50))
    _, second = run(policy, nodes=40, seed=7, ready_latency=(10, 50))
    assert first.as_json() == second.as_json() and first.end_time == second.end_time
    assert [s.target for s in first.steps] == [8, 40]
    assert [s.deletions for s in first.steps] == [[3, 3, 2], [10, 10, 10, 2]]
    assert all(s.ready is not None and s.ready > s.started for s in first.steps)


def test_failing_pods_are_retried_then_the_fallback_pause_waits_for_the_admin():
    policy = {
        "enableRollout": True,
        "maxFailureThreshold": 2,
        "maxParallel": 2,
        "upgradeSteps": [{"replicas": 2}, {"replicas": "100%"}],
    }
    sim, result = run(policy, nodes=5, fail_probability=1.0, admin_resumes_failures=False)
    step = result.steps[0]
    assert step.retries == [2, 2] and step.fallback_retries == 2
    assert result.status.step.current_step_state == STEP_PAUSED
    assert sim.spec_pause is True
    assert sorted(result.pods.values()) == [NEW, NEW, OLD, OLD, OLD]


def test_hanging_pods_fail_at_the_readiness_timeout_and_roll_back():
    policy = {
        "enableRollout": True,
        "fallback": "rollback",
        "readinessTimeout": "2m",
        "maxParallel": 3,
        "upgradeSteps": [{"replicas": 3}, {"replicas": "100%"}],
    }
    _, result = run(policy, nodes=6, hang_probability=1.0)
    assert result.rollback_waves == [3]
    assert set(result.pods.values()) == {OLD}
    assert result.status.phase == IDLING
    assert result.end_time >= 120


def test_crashes_between_actions_still_complete_without_deleting_upgraded_pods():
    policy = {
        "enableRollout": True,
        "maxParallel": "50%",
        "upgradeSteps": [{"replicas": "10%", "pause": None}, {"replicas": "100%", "pauseDuration": "30s"}],
    }
    _, result = run(policy, nodes=30, crash_probability=0.3, seed=3)
    assert result.crashes > 0
    assert result.status.step.current_step_state == COMPLETED
    assert set(result.pods.values()) == {NEW}
    assert result.deleted_ready_upgraded == 0 and result.max_in_flight_over_cap <= 0


def test_scripted_admin_pause_holds_deletions_and_resume_continues():
    policy = {"enableRollout": True, "maxParallel": 1, "upgradeSteps": [{"replicas": "100%", "pauseDuration": 0}]}

    def pause(sim):
        sim.spec_pause = True

    def resume(sim):
        sim.spec_pause = False

    sim = Simulation(Config(nodes=4, ready_latency=(10, 10)), validate(policy), admin=[(15, pause), (600, resume)])
    sim.set_revision(NEW)
    result = sim.run()
    assert result.deletions_while_paused == 0
    assert result.status.step.current_step_state == COMPLETED
    assert result.end_time > 600


def test_nodes_joining_and_leaving_mid_rollout():
    policy = {"enableRollout": True, "maxParallel": 2, "upgradeSteps": [{"replicas": "100%", "pauseDuration": 0}]}
    sim = Simulation(
        Config(nodes=6, ready_latency=(10, 10)),
        validate(policy),
        admin=[(20, lambda s: s.add_node("node-new", 20)), (20, lambda s: s.remove_node("node-00005"))],
    )
    sim.set_revision(NEW)
    result = sim.run()
    assert result.status.step.current_step_state == COMPLETED
    assert result.pods == {**{f"node-{i:05d}": NEW for i in range(5)}, "node-new": NEW}


def test_gpu_busy_nodes_wait_until_their_work_ends():
    policy = {"enableRollout": True, "maxParallel": 0, "upgradeSteps": [{"replicas": "100%", "pauseDuration": 0}]}
    _, result = run(policy, nodes=3, busy_nodes={"node-00001": 500.0}, ready_latency=(10, 10))
    assert result.steps[0].deletions == [2, 1]
    assert result.end_time >= 500 and set(result.pods.values()) == {NEW}


class Recorded(Simulation):
    """Keeps every status the runner wrote."""

    def __init__(self, *args):
        super().__init__(*args)
        self.written: list[UpgradeStatus] = []

    def _persist(self, status: UpgradeStatus) -> None:
        self.written.append(status)
        super()._persist(status)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_worked_examples_with_pods_ready_at_once_every_status_fitting_the_crd(case):
    policy = dataclasses.replace(validate(case["policy"]), enable_rollout=True, pause=False)
    sim = Recorded(Config(nodes=case["nodes"], ready_latency=(0, 0), terminate_latency=0), policy)
    sim.set_revision(NEW)
    result = sim.run()
    assert result.as_json() == {"steps": case["expect"]}
    assert result.pods == {node: NEW for node in sim.nodes}
    for status in sim.written:
        assert_fits_the_crd(status.to_json())
