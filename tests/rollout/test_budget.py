"""How many nodes at once (`rollout.budget`): each step's cap, the nodes in flight, and the one
`take` every wave goes through, which returns the wave and keeps the rest."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metax_operator.chart.upgrade_policy import IntOrPercent, Policy, Step, validate
from metax_operator.rollout.budget import Budget, in_flight, out_of_service, step_caps, step_waves
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
    """With every node serving and nothing out of service, the wave is the first candidates the
    room (and `want`) allows, the rest is every other one, in order: nothing is dropped (a retry
    queue shorter than the cap kept its tail before)."""
    budget = Budget(cap, frozenset(f"busy{i}" for i in range(flying)))
    wave, rest = budget.take(candidates, want, node=str)
    assert wave + rest == candidates
    assert len(wave) <= max(cap - flying, 0)
    assert want is None or len(wave) <= max(want, 0)
    assert len(wave) == min(len(candidates), max(cap - flying, 0), len(candidates) if want is None else max(want, 0))


@settings(max_examples=500, deadline=None)
@given(
    candidates=st.lists(st.sampled_from("abcdefghij"), unique=True, max_size=10),
    down=st.sets(st.sampled_from("abcdefghijklmn")),
    failed=st.sets(st.sampled_from("abcdefghij")),
    cap=st.integers(1, 6),
    flying=st.integers(0, 6),
    allowance=st.integers(0, 4),
    want=st.one_of(st.none(), st.integers(0, 10)),
)
def test_a_wave_keeps_the_nodes_out_of_service_within_the_cap_plus_max_unavailable(
    candidates, down, failed, cap, flying, allowance, want
):
    """The availability bound: after the wave, the nodes not serving (in flight, out of service,
    and the wave's nodes that were serving) are at most the cap plus `maxUnavailable`, or no
    more than before when they were over it already; the wave stays within the cap; a candidate
    out of service or failed costs a place in the cap only; a candidate left out was refused by
    one of the two bounds; the order holds."""
    in_flight = frozenset(f"busy{i}" for i in range(flying))
    budget = Budget(cap, in_flight, frozenset(down - failed), allowance, frozenset(failed))
    wave, rest = budget.take(candidates, want, node=str)
    assert sorted(wave + rest, key=candidates.index) == candidates
    assert wave == [c for c in candidates if c in wave] and rest == [c for c in candidates if c in rest]
    count = budget.room if want is None else min(budget.room, want)
    assert len(wave) <= count
    serving_taken = [n for n in wave if n not in down | failed]
    out_before = len(in_flight) + len(down - failed)
    assert out_before + len(serving_taken) <= max(cap + allowance, out_before)
    for refused in rest:
        free = refused in down | failed
        before = wave[: sum(1 for n in wave if candidates.index(n) < candidates.index(refused))]
        serving_before = sum(1 for n in before if n not in down | failed)
        assert len(before) >= count or (not free and serving_before >= budget.availability)


def test_an_admins_cordon_and_a_node_not_ready_take_places_of_the_wave_beyond_max_unavailable():
    policy = validate({"maxParallel": 3, "maxUnavailable": 1, "upgradeSteps": [{"replicas": "100%"}]})
    pods = tuple(Pod(f"p{i}", f"u{i}", f"n{i}", "old", ready=i != 5, phase="Running", created=T0 - 5000) for i in range(8))
    observed = Cluster(
        "new", True, frozenset(f"n{i}" for i in range(8)), pods, unschedulable=frozenset({"n6", "n7"}), cordoned=frozenset({"n7"})
    )
    out = out_of_service(observed, NodePods(observed), frozenset())
    assert out == {"n5", "n6"}  # n7 is the runner's own cordon: counted with its wave
    # With driver pools, the nodes out of service as every rollout sees them: its own by its rules.
    pooled = dataclasses.replace(observed, elsewhere=frozenset({"n7", "pool-node"}))
    assert out_of_service(pooled, NodePods(pooled), frozenset()) == {"n5", "n6", "pool-node"}
    budget = Budget.for_step(policy, 8, 0, frozenset(), out)
    assert (budget.room, budget.availability) == (3, 2)
    wave, rest = budget.take(sorted(pods, key=lambda p: (p.ready, p.node)))
    assert [p.node for p in wave] == ["n5", "n0", "n1"]  # n5 is down already: a place in the cap only
    assert Budget.for_step(policy, 8, 0, frozenset({"n0", "n1"}), out).take(pods[2:5]) == ([], list(pods[2:5]))


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
