"""Invariants of the rollout engine over random policies, cluster sizes, latencies, failures and
runner crashes (hypothesis), each run through the OnDelete simulator (`metax_operator.rollout.simulate`,
with the faults and counters of tests/rollout/oracle.py).

Bounded so the file runs in well under a minute: small clusters get many examples, clusters up to
20,000 nodes a few, with caps that keep the number of waves (and passes) small.
"""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metax_operator.chart.upgrade_policy import HealthGate, IntOrPercent, Policy, Step, Validation
from metax_operator.rollout.status import COMPLETED, IDLING, STEP_PAUSED
from tests.rollout.oracle import NEW, OLD, Config, Simulation

SMALL = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LARGE = settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def policies(draw, nodes: int, min_parallel_percent: int = 1) -> Policy:
    """A valid upgradePolicy for `nodes` nodes."""
    percents = sorted(draw(st.lists(st.integers(1, 99), max_size=3)))
    steps = [
        Step(
            IntOrPercent(p, True),
            draw(st.one_of(st.none(), st.integers(0, 120_000))),
            draw(
                st.one_of(st.integers(0, 2), st.integers(0, 30).map(lambda p: IntOrPercent(p, True))).map(
                    lambda t: t if isinstance(t, IntOrPercent) else IntOrPercent(t)
                )
            ),
        )
        for p in percents
    ]
    last = draw(st.one_of(st.just(IntOrPercent(100, True)), st.integers(nodes, nodes + 5).map(IntOrPercent)))
    steps.append(Step(last, draw(st.one_of(st.none(), st.integers(0, 60_000))), IntOrPercent(0)))
    parallel = draw(
        st.one_of(
            st.just(IntOrPercent(0)),
            st.integers(max(1, nodes * min_parallel_percent // 100), max(1, nodes)).map(IntOrPercent),
            st.integers(min_parallel_percent, 100).map(lambda p: IntOrPercent(p, True)),
        )
    )
    return Policy(
        enable_rollout=True,
        steps=tuple(steps),
        max_parallel=parallel,
        max_unavailable=draw(
            st.one_of(st.integers(0, 3).map(IntOrPercent), st.integers(0, 20).map(lambda p: IntOrPercent(p, True)))
        ),
        max_failure_threshold=draw(st.integers(0, 3)),
        fallback=draw(st.sampled_from(["pause", "rollback"])),
        readiness_timeout_ms=draw(st.integers(200_000, 600_000)),  # above the latencies drawn
        steps_key="random",
    )


def admin_pauses(draw) -> list:
    """Random windows in which the admin sets pause: true, then false."""
    script = []
    for start, length in draw(st.lists(st.tuples(st.floats(0, 3000), st.floats(1, 900)), max_size=2)):
        script += [
            (start, lambda sim: setattr(sim, "spec_pause", True)),
            (start + length, lambda sim: setattr(sim, "spec_pause", False)),
        ]
    return script


def joining_and_leaving(joins: list[float], leaves: list[float]) -> list:
    """A script of nodes `joined-I` joining at the times `joins`, and `node-I` leaving at `leaves`."""
    script = [(t, lambda sim, i=i, t=t: sim.add_node(f"joined-{i}", t)) for i, t in enumerate(joins)]
    script += [(t, lambda sim, i=i: sim.remove_node(f"node-{i:05d}")) for i, t in enumerate(leaves)]
    return script


def run(policy: Policy, config: Config, admin: list | None = None):
    sim = Simulation(config, policy, admin)
    sim.set_revision(NEW)
    return sim.run()


def check_safety(result, policy: Policy) -> None:
    assert result.max_in_flight_over_cap <= 0, "more pods in flight than the cap"
    assert result.max_taken_over_availability <= 0, "serving nodes taken beyond the cap plus maxUnavailable"
    assert result.deletions_while_paused == 0, "a deletion while paused"
    assert result.deleted_ready_upgraded == 0, "an upgraded Ready pod was deleted"
    for rec in result.steps:
        if rec.ready is not None and rec.fallback_retries is None:
            assert rec.upgraded_at_ready >= rec.target
            allowed = policy.steps[rec.step].toleration.of(rec.target)
            assert rec.failed_at_ready <= allowed
        if rec.fallback_retries is not None:
            assert rec.fallback_retries == policy.max_failure_threshold


def check_end_state(result, policy: Policy, nodes: int) -> None:
    status = result.status
    conditions = {c.type: c for c in status.conditions}
    if status.step.current_step_state == COMPLETED:
        assert status.phase == IDLING and not status.upgrading
        assert set(result.pods.values()) == {NEW} and len(result.pods) == nodes
    elif "Terminating" in conditions and conditions["Terminating"].reason == "RolledBack":
        assert set(result.pods.values()) == {OLD}, "after a rollback every pod is at the old revision"
        assert policy.fallback == "rollback"
    else:  # the fallback pause, waiting for the admin
        assert policy.fallback == "pause"
        assert status.step.current_step_state == STEP_PAUSED
        assert conditions["Failed"].status == "True"
        assert status.step.current_failure_retry == policy.max_failure_threshold


@SMALL
@given(
    data=st.data(), nodes=st.integers(1, 120), seed=st.integers(0, 2**16), latency=st.tuples(st.floats(1, 60), st.floats(0, 120))
)
def test_without_failures_every_pod_is_upgraded_safely(data, nodes, seed, latency):
    policy = data.draw(policies(nodes))
    result = run(
        policy,
        Config(
            nodes=nodes, seed=seed, ready_latency=(latency[0], latency[0] + latency[1]), admin_delay=data.draw(st.floats(0, 600))
        ),
        admin_pauses(data.draw),
    )
    check_safety(result, policy)
    assert result.status.step.current_step_state == COMPLETED
    assert set(result.pods.values()) == {NEW} and len(result.pods) == nodes
    targets = policy.targets(nodes)
    assert [r.target for r in result.steps] == [targets[r.step] for r in result.steps]
    # a step with nothing to do (target equal to the previous one) may pass within one pass, unrecorded
    assert {r.step for r in result.steps} >= {i for i, t in enumerate(targets) if t > ([0] + targets)[i]}
    assert sum(sum(r.deletions) for r in result.steps) == nodes


@SMALL
@given(
    data=st.data(),
    nodes=st.integers(4, 40),
    seed=st.integers(0, 2**16),
    cordoned=st.dictionaries(st.integers(0, 39), st.tuples(st.floats(0, 2000), st.floats(1, 3000)), max_size=4),
    down=st.dictionaries(st.integers(0, 39), st.tuples(st.floats(0, 2000), st.floats(1, 3000)), max_size=3),
    fail=st.floats(0, 0.2),
)
def test_nodes_out_of_service_take_places_of_the_waves_and_the_rollout_still_completes(data, nodes, seed, cordoned, down, fail):
    """An admin's cordons and nodes gone NotReady, for a while, anywhere in the rollout: no pass
    takes nodes still serving beyond the cap plus `maxUnavailable` less the nodes not serving
    (`check_safety`), and once they are back the rollout ends as it would have."""
    policy = data.draw(policies(nodes))
    spans = lambda drawn: {f"node-{i % nodes:05d}": (start, start + length) for i, (start, length) in drawn.items()}  # noqa: E731
    config = Config(nodes=nodes, seed=seed, ready_latency=(5, 60), fail_probability=fail)
    config.cordoned_nodes, config.down_nodes = spans(cordoned), spans(down)
    result = run(policy, config)
    check_safety(result, policy)
    check_end_state(result, policy, nodes)


@SMALL
@given(
    data=st.data(),
    nodes=st.integers(4, 60),
    seed=st.integers(0, 2**16),  # one node at least stays
    joins=st.lists(st.floats(0, 2000), max_size=3),
    leaves=st.lists(st.floats(0, 2000), max_size=3),
    busy=st.dictionaries(st.integers(0, 59), st.floats(0, 3000), max_size=3),
)
def test_nodes_joining_leaving_and_busy_still_complete(data, nodes, seed, joins, leaves, busy):
    policy = data.draw(policies(nodes + len(joins)))
    script = joining_and_leaving(joins, leaves)
    config = Config(
        nodes=nodes, seed=seed, ready_latency=(5, 60), busy_nodes={f"node-{i % nodes:05d}": until for i, until in busy.items()}
    )
    sim = Simulation(config, policy, script)
    sim.set_revision(NEW)
    result = sim.run()
    check_safety(result, policy)
    assert result.status.step.current_step_state == COMPLETED
    assert result.pods == dict.fromkeys(sim.nodes, NEW)  # every node there at the end, upgraded


@SMALL
@given(data=st.data(), nodes=st.integers(1, 80), seed=st.integers(0, 2**16), fail=st.floats(0, 0.4), hang=st.floats(0, 0.2))
def test_with_failures_steps_hold_toleration_or_take_the_fallback(data, nodes, seed, fail, hang):
    policy = data.draw(policies(nodes))
    result = run(
        policy,
        Config(
            nodes=nodes,
            seed=seed,
            fail_probability=fail,
            hang_probability=hang,
            ready_latency=(5, 90),
            admin_resumes_failures=False,
        ),
    )
    check_safety(result, policy)
    check_end_state(result, policy, nodes)


@SMALL
@given(
    data=st.data(),
    nodes=st.integers(1, 60),
    seed=st.integers(0, 2**16),
    crash=st.floats(0.05, 0.5),
    fail=st.sampled_from([0.0, 0.0, 0.2]),
)
def test_a_crash_anywhere_resumes_from_the_persisted_status(data, nodes, seed, crash, fail):
    policy = data.draw(policies(nodes))
    config = Config(nodes=nodes, seed=seed, fail_probability=fail, ready_latency=(5, 60), admin_resumes_failures=False)
    calm = run(policy, config)
    crashed = run(policy, dataclasses.replace(config, crash_probability=crash))
    for result in (calm, crashed):
        check_safety(result, policy)
        check_end_state(result, policy, nodes)
    if fail == 0.0:
        assert crashed.status.step.current_step_state == COMPLETED
        assert crashed.pods == calm.pods
        assert [r.target for r in crashed.steps] == [r.target for r in calm.steps]


@SMALL
@given(data=st.data(), nodes=st.integers(1, 80), seed=st.integers(0, 2**16), latency=st.floats(1, 300))
def test_with_every_validation_passing_the_rollout_takes_the_same_waves(data, nodes, seed, latency):
    """Validation adds time, never a different wave: a validating node holds its slot, and the
    step moves on once it passed (the oracle counts a node in flight until then)."""
    policy = data.draw(policies(nodes))
    config = Config(nodes=nodes, seed=seed, ready_latency=(5, 60), validation_latency=latency)
    plain = run(policy, config)
    validated = run(dataclasses.replace(policy, validation=Validation(timeout_s=600)), config)
    check_safety(validated, policy)
    assert validated.status.step.current_step_state == COMPLETED
    assert [(r.step, r.target, r.deletions) for r in validated.steps] == [(r.step, r.target, r.deletions) for r in plain.steps]
    assert validated.end_time >= plain.end_time


@SMALL
@given(data=st.data(), nodes=st.integers(1, 80), seed=st.integers(0, 2**16), crash=st.sampled_from([0.0, 0.2]))
def test_with_every_node_healthy_the_health_gate_takes_the_same_waves(data, nodes, seed, crash):
    """The health gate holds a step only on a regression: with every node healthy each step
    promotes as it would without the gate, also across runner crashes."""
    policy = data.draw(policies(nodes))
    config = Config(nodes=nodes, seed=seed, ready_latency=(5, 60), crash_probability=crash)
    plain = run(policy, config)
    gated = run(dataclasses.replace(policy, health_gate=HealthGate()), config)
    check_safety(gated, policy)
    assert gated.status.step.current_step_state == COMPLETED
    # The waves, step by step. A step whose target is met already takes no wave and is passed in
    # the pass that reached it; the timeline sees it only when a status at that step was stored
    # (a crash, or the gate's pass reading the health before it promotes), so it is not compared.
    assert waves(gated) == waves(plain)


def waves(result) -> list[tuple[int, int, list[int]]]:
    """Each step that took a wave: its index, target and wave sizes."""
    return [(r.step, r.target, r.deletions) for r in result.steps if r.deletions]


@SMALL
@given(
    data=st.data(),
    nodes=st.integers(1, 80),
    seed=st.integers(0, 2**16),
    fail=st.floats(0.01, 0.5),
    crash=st.sampled_from([0.0, 0.2]),
)
def test_with_validations_failing_steps_hold_toleration_or_take_the_fallback(data, nodes, seed, fail, crash):
    """A node whose validation fails is a failed node of its step, also across runner crashes:
    never counted upgraded beyond the toleration, retried, then the fallback."""
    policy = dataclasses.replace(data.draw(policies(nodes)), validation=Validation(timeout_s=600))
    config = Config(
        nodes=nodes,
        seed=seed,
        ready_latency=(5, 60),
        validation_fail_probability=fail,
        crash_probability=crash,
        admin_resumes_failures=False,
    )
    result = run(policy, config)
    check_safety(result, policy)
    check_end_state(result, policy, nodes)


@LARGE
@given(data=st.data(), nodes=st.integers(1_000, 20_000), seed=st.integers(0, 2**16))
def test_large_clusters_complete_within_the_cap(data, nodes, seed):
    policy = data.draw(policies(nodes, min_parallel_percent=25))
    policy = dataclasses.replace(policy, steps=policy.steps[-2:])  # at most 2 steps: few passes
    result = run(
        policy,
        Config(
            nodes=nodes,
            seed=seed,
            ready_latency=(20, 60),
            fail_probability=0.001,
            crash_probability=0.001,
            admin_resumes_failures=False,
        ),
    )
    check_safety(result, policy)
    check_end_state(result, policy, nodes)
