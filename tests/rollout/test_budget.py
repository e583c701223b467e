"""How many nodes at once (`rollout.budget`): each step's cap, the nodes in flight, and the one
`take` every wave goes through, which returns the wave and keeps the rest."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metax_operator.chart.upgrade_policy import IntOrPercent, Policy, Step, validate
from metax_operator.rollout.budget import Budget, in_flight, step_caps, step_waves
from metax_operator.rollout.observation import Cluster, NodePods, Pod
from tests.cases import WORKED_EXAMPLES

T0 = 1_800_000_000.0


@pytest.mark.parametrize("case", WORKED_EXAMPLES, ids=lambda c: c["name"])
def test_the_seed_worked_examples_delete_in_batches_of_each_steps_cap(case):
    policy = validate(case["policy"])
    targets = policy.targets(case["nodes"])
    previous = 0
    for cap, target, expect in zip(step_caps(policy, case["nodes"]), targets, case["expect"], strict=True):
        delta = target - previous
        assert expect["deletions"] == [cap] * (delta // cap) + ([delta % cap] if delta % cap else [])
        previous = target
    assert step_waves(policy, case["nodes"]) == [len(e["deletions"]) for e in case["expect"]]


def test_max_parallel_zero_is_no_cap():
    policy = validate({"maxParallel": 0, "upgradeSteps": [{"replicas": 3}, {"replicas": "100%"}]})
    assert step_caps(policy, 10) == [10, 10]


@settings(max_examples=200, deadline=None)
@given(
    raw=st.lists(st.integers(1, 100), min_size=1, max_size=6),
    nodes=st.integers(0, 20_000),
    parallel=st.one_of(st.integers(0, 50), st.integers(1, 100).map(lambda p: f"{p}%")),
)
def test_caps_are_positive(raw, nodes, parallel):
    steps = tuple(Step(IntOrPercent(p, True)) for p in sorted(raw)) + (Step(IntOrPercent(100, True)),)
    policy = Policy(steps=steps, max_parallel=validate({"maxParallel": parallel}).max_parallel)
    assert all(c >= 1 for c in step_caps(policy, nodes))


@settings(max_examples=300, deadline=None)
@given(
    candidates=st.lists(st.text("abcdef", min_size=1, max_size=3), unique=True, max_size=12),
    cap=st.integers(1, 8),
    flying=st.integers(0, 10),
    want=st.one_of(st.none(), st.integers(-2, 12)),
)
def test_take_gives_the_wave_within_the_room_and_keeps_every_other_candidate(candidates, cap, flying, want):
    """The wave is the first candidates the room (and `want`) allows, the rest is every other one,
    in order: nothing is dropped (a retry queue shorter than the cap kept its tail before)."""
    budget = Budget(cap, frozenset(f"busy{i}" for i in range(flying)))
    wave, rest = budget.take(candidates, want)
    assert wave + rest == candidates
    assert len(wave) <= max(cap - flying, 0)
    assert want is None or len(wave) <= max(want, 0)
    assert len(wave) == min(len(candidates), max(cap - flying, 0), len(candidates) if want is None else max(want, 0))


def test_in_flight_counts_deletions_young_pods_and_wave_nodes_without_a_pod_within_the_timeout():
    pods = (
        Pod("a", "ua", "n0", "new", ready=False, phase="Running", created=T0 - 10),  # starting
        Pod("b", "ub", "n1", "new", ready=False, phase="Running", created=T0 - 1000),  # past the timeout: failed
        Pod("c", "uc", "n2", "old", ready=True, phase="Running", created=T0 - 5000, deleting=T0 - 5),  # being deleted
        Pod("d", "ud", "n3", "old", ready=True, phase="Running", created=T0 - 5000),  # settled
        Pod("e", "ue", "n4", "old", ready=True, phase="Running", created=T0 - 5000, deleting=T0 - 900),  # stuck deleting
    )
    observed = Cluster("new", True, frozenset({"n0", "n1", "n2", "n3", "n4", "n5"}), pods)
    assert in_flight(NodePods(observed), {"n5"}, T0, 600) == {"n0", "n2", "n5"}


def test_a_budget_with_this_passes_deletions_has_less_room():
    budget = Budget(3, frozenset({"n0"}))
    assert budget.room == 2
    assert budget.with_deleted({"n1", "n0"}).room == 1
    assert Budget(1, frozenset({"n0", "n1"})).room == 0
