"""`rest.at_rest` over the states the engine's simulations reach (tests/rollout/oracle.py: pods
failing and hanging, validations failing, runner crashes, GPU work, nodes joining and leaving,
admin pauses, the health gate): whenever a decision is at rest, the same observation decides the
same, and gives every node the same state label, at any later time and whatever GPU work or
waited-for pods run. That is what lets the runner leave the rollout out of a pass whose caches
hold nothing new (`runtime.rollout_pass`)."""

from __future__ import annotations

import copy
import dataclasses
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metax_operator.chart.upgrade_policy import HealthGate, IntOrPercent, Policy, Step, Validation
from metax_operator.rollout import engine, node_state
from metax_operator.rollout.observation import Check, Cluster, Pod
from metax_operator.rollout.rest import at_rest
from metax_operator.rollout.status import COMPLETED
from tests.rollout.oracle import NEW, Config, Simulation
from tests.rollout.test_engine_properties import SMALL, joining_and_leaving, policies

#: Seconds after a pass at which the same observation is decided again.
LATER = (0.001, 5.0, 3600.0, 30 * 24 * 3600.0)


class RestChecker:
    """`engine.decide` as the simulations call it, checking every decision at rest."""

    def __init__(self):
        self.decide = engine.decide
        self.last_at_rest = False  # the last decision was at rest

    def __call__(self, observed: Cluster, policy, status, now: float):
        decision = self.decide(observed, policy, copy.deepcopy(status), now)
        self.last_at_rest = at_rest(observed, policy, status, decision, now)
        if self.last_at_rest:
            self.check(observed, policy, status, decision, now)
        return decision

    def check(self, observed: Cluster, policy, status, decision, now: float) -> None:
        states = node_state.states(observed, decision, policy, now)
        nodes = sorted(observed.nodes | observed.skipped)
        for busy in (frozenset(), frozenset(nodes), frozenset(nodes[::2])):
            for later in LATER:
                again = dataclasses.replace(observed, gpu_busy_nodes=busy, wait_busy_nodes=frozenset(nodes[1::2]) | busy)
                decided = self.decide(again, policy, copy.deepcopy(status), now + later)
                assert decided == decision, f"at rest at {now}, decided otherwise {later} s later with GPU work on {sorted(busy)}"
                assert node_state.states(again, decided, policy, now + later) == states


def simulate_and_idle(policy, config: Config, admin=None, joining: int = 0) -> tuple[RestChecker, object]:
    """A simulated rollout, then runner passes for 20 minutes after it ended, `joining` nodes
    joining at its end (their pods as likely to fail or hang as the rollout's were)."""
    checker = RestChecker()
    with mock.patch.object(engine, "decide", checker):
        sim = Simulation(config, policy, admin)
        sim.set_revision(NEW)
        result = sim.run()
        now = result.end_time
        for i in range(joining):
            sim.add_node(f"late-{i}", now)
        for _ in range(20):
            now += 60.0
            sim._advance(now)
            sim._pass(now)
    return checker, result


@SMALL
@given(data=st.data(), nodes=st.integers(1, 60), seed=st.integers(0, 2**16), validation=st.booleans(), gate=st.booleans())
def test_a_completed_rollout_is_at_rest_and_decides_the_same_later(data, nodes, seed, validation, gate):
    policy = data.draw(policies(nodes))
    policy = dataclasses.replace(
        policy, validation=Validation(timeout_s=600) if validation else None, health_gate=HealthGate() if gate else None
    )
    config = Config(nodes=nodes, seed=seed, ready_latency=(5, 60))
    checker, result = simulate_and_idle(policy, config)
    assert result.status.step.current_step_state == COMPLETED
    assert checker.last_at_rest, "the passes after a completed rollout are at rest"


@SMALL
@given(
    data=st.data(),
    nodes=st.integers(2, 50),
    seed=st.integers(0, 2**16),
    fail=st.floats(0, 0.4),
    hang=st.floats(0, 0.2),
    invalid=st.sampled_from([0.0, 0.3]),
    crash=st.sampled_from([0.0, 0.2]),
    joins=st.lists(st.floats(0, 2000), max_size=2),
    leaves=st.lists(st.floats(0, 2000), max_size=2),
    busy=st.dictionaries(st.integers(0, 49), st.floats(0, 3000), max_size=3),
    admin=st.booleans(),
)
def test_every_decision_at_rest_is_the_same_later_and_with_other_gpu_work(
    data, nodes, seed, fail, hang, invalid, crash, joins, leaves, busy, admin
):
    policy = data.draw(policies(nodes + len(joins)))
    policy = dataclasses.replace(
        policy,
        validation=Validation(timeout_s=300) if invalid else None,
        allow_gpu_workloads=data.draw(st.booleans()),
        drain=data.draw(st.booleans()),
        wait_selector=data.draw(st.sampled_from(["", "app=training"])),
    )
    script = joining_and_leaving(joins, leaves)
    config = Config(
        nodes=nodes,
        seed=seed,
        ready_latency=(5, 90),
        fail_probability=fail,
        hang_probability=hang,
        validation_fail_probability=invalid,
        crash_probability=crash,
        admin_resumes_failures=admin,
        busy_nodes={f"node-{i % nodes:05d}": until for i, until in busy.items()},
    )
    simulate_and_idle(policy, config, script, joining=2)


def pods_at(revision: str, nodes: list[str], **fields) -> tuple[Pod, ...]:
    return tuple(Pod(f"driver-{n}", f"uid-{n}", n, revision, **fields) for n in nodes)


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda c: dataclasses.replace(c, pods=pods_at("old", ["a", "b"], ready=True)), "pods to swap"),
        (lambda c: dataclasses.replace(c, pods=pods_at("new", ["a", "b"], created=1_000.0)), "pods coming up"),
        (lambda c: dataclasses.replace(c, pods=c.pods[:1]), "a node without its pod"),
        (lambda c: dataclasses.replace(c, pods=pods_at("new", ["a", "b"], ready=True, deleting=1_000.0)), "a pod being deleted"),
        (lambda c: dataclasses.replace(c, retry=frozenset({"a"})), "a node to retry"),
        (lambda c: dataclasses.replace(c, caught_up=False), "the DaemonSet controller behind"),
        (
            lambda c: dataclasses.replace(c, pods=pods_at("new", ["a", "b"], ready=True, check=Check("check-a", 1_000.0))),
            "a validation pod running (a rollback took its wave over)",
        ),
    ],
)
def test_what_is_not_at_rest(change, why):
    """Each rule of `at_rest` refuses its case (the property above could not tell a rule that
    is too strict from one that is right; these tell a rule dropped)."""
    policy = Policy(
        enable_rollout=True, steps=(Step(IntOrPercent(100, True), None, IntOrPercent(0)),), validation=Validation(timeout_s=600)
    )
    pods = pods_at("new", ["a", "b"], ready=True)
    rested = Cluster(current_revision="new", caught_up=True, nodes=frozenset({"a", "b"}), pods=pods)
    first = engine.decide(rested, policy, None, 1_000.0)
    decision = engine.decide(rested, policy, first.status, 1_005.0)
    assert at_rest(rested, policy, first.status, decision, 1_005.0)
    changed = change(rested)
    decision = engine.decide(changed, policy, first.status, 1_005.0)
    assert not at_rest(changed, policy, first.status, decision, 1_005.0), why
