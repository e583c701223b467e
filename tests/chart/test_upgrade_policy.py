"""driver.upgradePolicy parsing and validation (seed 000 table 3.11) and its integer arithmetic."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from metax_operator.chart.upgrade_policy import HealthSignal, IntOrPercent, Policy, Step, problems, validate
from metax_operator.errors import UserErrors
from tests.cases import WORKED_EXAMPLES

CASES = WORKED_EXAMPLES


def fields(policy, **kwargs) -> list[str]:
    return [e.field for e in problems(policy, **kwargs)]


def test_defaults_are_table_3_11():
    policy = validate({})
    assert policy == Policy(
        enable_rollout=False,
        steps=(),
        pause=False,
        max_parallel=IntOrPercent(100, True),
        max_unavailable=IntOrPercent(0),
        max_failure_threshold=0,
        fallback="pause",
        readiness_timeout_ms=600_000,
        allow_gpu_workloads=False,
        cordon=True,
    )
    assert validate({"cordon": False}).cordon is False


def test_missing_policy_is_the_defaults():
    assert validate(None) == Policy()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_worked_examples_targets(case):
    policy = validate(case["policy"])
    assert policy.targets(case["nodes"]) == [e["target"] for e in case["expect"]]


def test_seed_step_written_with_pause_is_a_manual_pause():
    policy = validate(
        {
            "enableRollout": True,
            "upgradeSteps": [{"replicas": 2, "pause": None}, {"replicas": 5, "pause": {}}, {"replicas": "100%"}],
        }
    )
    assert [s.pause_ms for s in policy.steps] == [None, None, None]


@pytest.mark.parametrize(
    "raw,ms",
    [
        (None, None),
        ({}, None),
        ("", None),
        (10000, 10000),
        (0, 0),
        ("10s", 10_000),
        ("5m", 300_000),
        ("1m30s", 90_000),
        ("250ms", 250),
        ("1.5h", 5_400_000),
        ("10000", 10_000),
    ],
)
def test_pause_duration_forms(raw, ms):
    policy = validate({"upgradeSteps": [{"replicas": "100%", "pauseDuration": raw}]})
    assert policy.steps[0].pause_ms == ms


def test_readiness_timeout_accepts_ms_and_durations():
    assert validate({"readinessTimeout": "2m"}).readiness_timeout_ms == 120_000
    assert validate({"readinessTimeout": 5000}).readiness_timeout_ms == 5000
    assert fields({"readinessTimeout": 0}) == ["driver.upgradePolicy.readinessTimeout"]
    assert fields({"readinessTimeout": "soon"}) == ["driver.upgradePolicy.readinessTimeout"]


@pytest.mark.parametrize("replicas", ["150%", "abc", -1, 0, "0%", "-5%", True, 2.5, "5"])
def test_bad_replicas_are_rejected_naming_the_step(replicas):
    policy = {"enableRollout": True, "upgradeSteps": [{"replicas": 1}, {"replicas": replicas}, {"replicas": "100%"}]}
    assert fields(policy) == ["driver.upgradePolicy.upgradeSteps[1].replicas"]


@pytest.mark.parametrize(
    "key,value",
    [
        ("maxParallel", "-5%"),
        ("maxParallel", "0%"),
        ("maxParallel", "101%"),
        ("maxParallel", -1),
        ("maxUnavailable", "x"),
        ("maxUnavailable", -2),
        ("maxFailureThreshold", -1),
        ("maxFailureThreshold", "3"),
        ("fallback", "retry"),
        ("pause", "false"),
        ("enableRollout", 1),
        ("allowGpuWorkloads", "yes"),
        ("cordon", "true"),
    ],
)
def test_bad_top_level_fields_are_rejected(key, value):
    assert fields({key: value}) == [f"driver.upgradePolicy.{key}"]


def test_falling_targets_are_rejected():
    policy = {"upgradeSteps": [{"replicas": 5}, {"replicas": 3}, {"replicas": "50%"}, {"replicas": "40%"}, {"replicas": "100%"}]}
    assert fields(policy) == ["driver.upgradePolicy.upgradeSteps[1].replicas", "driver.upgradePolicy.upgradeSteps[3].replicas"]


def test_last_step_must_reach_every_node():
    assert fields({"upgradeSteps": [{"replicas": "90%"}]}) == ["driver.upgradePolicy.upgradeSteps[0].replicas"]
    ints = {"upgradeSteps": [{"replicas": 2}, {"replicas": 10}]}
    assert fields(ints) == []  # an int can only be checked against the node count at run time
    assert fields(ints, nodes=10) == []
    assert fields(ints, nodes=11) == ["driver.upgradePolicy.upgradeSteps[1].replicas"]
    assert validate(ints).last_step_problem(11)
    assert validate(ints).last_step_problem(10) is None


def test_enabled_rollout_needs_steps():
    assert fields({"enableRollout": True}) == ["driver.upgradePolicy.upgradeSteps"]
    assert fields({"enableRollout": True, "upgradeSteps": []}) == ["driver.upgradePolicy.upgradeSteps"]


def test_unknown_and_conflicting_fields_are_named():
    policy = {"maxParalel": 2, "upgradeSteps": [{"replicas": "100%", "pause": {}, "pauseDuration": 5}, {"replica": 3}]}
    assert fields(policy) == [
        "driver.upgradePolicy.maxParalel",
        "driver.upgradePolicy.upgradeSteps[0].pause",
        "driver.upgradePolicy.upgradeSteps[1].replica",
        "driver.upgradePolicy.upgradeSteps[1].replicas",
    ]


def test_every_problem_is_reported_at_once_with_a_fix():
    with pytest.raises(UserErrors) as err:
        validate(
            {"enableRollout": "yes", "fallback": "x", "upgradeSteps": [{"replicas": "150%"}]},
            field_prefix="spec.driver.upgradePolicy",
        )
    lines = str(err.value).splitlines()
    assert len(lines) == 3
    assert all(line.startswith("spec.driver.upgradePolicy.") and "; " in line for line in lines)


def test_not_a_mapping():
    assert fields(["replicas"]) == ["driver.upgradePolicy"]
    assert fields({"upgradeSteps": {"replicas": 1}}) == ["driver.upgradePolicy.upgradeSteps"]
    assert fields({"upgradeSteps": ["x"]}) == ["driver.upgradePolicy.upgradeSteps[0]"]


def test_toleration_is_int_or_percent_of_the_target():
    policy = validate({"upgradeSteps": [{"replicas": 10, "toleration": "15%"}, {"replicas": "100%", "toleration": 2}]})
    assert policy.tolerations(100) == [2, 2]  # ceil(15% x 10) = 2
    assert fields({"upgradeSteps": [{"replicas": "100%", "toleration": "200%"}]}) == [
        "driver.upgradePolicy.upgradeSteps[0].toleration"
    ]


def test_validate_has_no_side_effects_on_its_input():
    raw = {"enableRollout": True, "upgradeSteps": [{"replicas": "5%", "pause": None}, {"replicas": "100%"}]}
    snapshot = yaml.safe_dump(raw)
    validate(raw)
    problems(raw, nodes=3)
    assert yaml.safe_dump(raw) == snapshot


@settings(max_examples=300, deadline=None)
@given(percent=st.integers(1, 100), total=st.integers(0, 20_000))
def test_percent_rounds_up_in_integers(percent, total):
    got = IntOrPercent(percent, True).of(total)
    assert got * 100 >= percent * total > (got - 1) * 100 or (total == 0 and got == 0)


@settings(max_examples=200, deadline=None)
@given(
    raw=st.lists(st.integers(1, 100), min_size=1, max_size=6),
    nodes=st.integers(0, 20_000),
    parallel=st.one_of(st.integers(0, 50), st.integers(1, 100).map(lambda p: f"{p}%")),
)
def test_targets_rise_and_reach_all_nodes(raw, nodes, parallel):
    steps = tuple(Step(IntOrPercent(p, True)) for p in sorted(raw)) + (Step(IntOrPercent(100, True)),)
    policy = Policy(steps=steps, max_parallel=validate({"maxParallel": parallel}).max_parallel)
    targets = policy.targets(nodes)
    assert targets == sorted(targets)
    assert targets[-1] == nodes
    assert all(t >= min(1, nodes) for t in targets)


def test_wait_drain_and_on_timeout_parse_with_their_defaults():
    policy = validate(
        {
            "waitForCompletion": {"podSelector": "team in (ml, hpc),!batch", "timeout": "2h"},
            "drain": {"enable": True},
            "onTimeout": "fail",
        }
    )
    assert (policy.wait_selector, policy.wait_timeout_ms) == ("team in (ml, hpc),!batch", 7_200_000)
    assert (policy.drain, policy.drain_timeout_ms, policy.on_timeout) == (True, 300_000, "fail")
    defaults = validate({})
    assert (defaults.wait_selector, defaults.wait_timeout_ms, defaults.drain, defaults.on_timeout) == ("", 0, False, "hold")


@pytest.mark.parametrize(
    "policy, field",
    [
        ({"waitForCompletion": {"podSelector": "app training"}}, "waitForCompletion.podSelector"),
        ({"waitForCompletion": {"podSelector": 3}}, "waitForCompletion.podSelector"),
        ({"waitForCompletion": {"timeout": "soon"}}, "waitForCompletion.timeout"),
        ({"waitForCompletion": {"selector": "a=b"}}, "waitForCompletion.selector"),
        ({"waitForCompletion": "a=b"}, "waitForCompletion"),
        ({"drain": {"enable": "yes"}}, "drain.enable"),
        ({"drain": {"timeout": 0}}, "drain.timeout"),
        ({"drain": True}, "drain"),
        ({"onTimeout": "evict"}, "onTimeout"),
    ],
)
def test_bad_wait_and_drain_fields_are_named(policy, field):
    assert fields(policy) == [f"driver.upgradePolicy.{field}"]


def test_validation_parses_with_its_defaults_and_is_none_when_off():
    assert validate({}).validation is None
    assert validate({"validation": {"enable": False, "timeoutSeconds": 30}}).validation is None
    on = validate({"validation": {"enable": True}}).validation
    assert (on.timeout_s, on.workload_image, on.workload_command) == (600, "", ())
    workload = {"image": "cr.example.com/metax/maca-sample:2.18.0.3", "command": ["/sample"], "resources": {"limits": {"cpu": 1}}}
    given_ = validate({"validation": {"enable": True, "timeoutSeconds": 90, "workload": workload}}).validation
    assert (given_.timeout_s, given_.workload_image, given_.workload_command) == (90, workload["image"], ("/sample",))
    assert given_.workload_resources == '{"limits": {"cpu": 1}}'


@pytest.mark.parametrize(
    "validation, field",
    [
        ({"enable": "yes"}, "validation.enable"),
        ({"timeoutSeconds": 0}, "validation.timeoutSeconds"),
        ({"timeoutSeconds": "10m"}, "validation.timeoutSeconds"),
        ({"workload": {"image": "maca-sample"}}, "validation.workload.image"),  # no registry path, no tag
        ({"workload": {"image": "cr.example.com/metax/maca-sample:2.18", "command": "/sample"}}, "validation.workload.command"),
        (
            {"workload": {"resources": {"limits": {"metax-tech.com/gpu": "one"}}}},
            "validation.workload.resources.limits.metax-tech.com/gpu",
        ),
        ({"image": "cr.example.com/metax/tools:1"}, "validation.image"),
    ],
)
def test_bad_validation_fields_are_named(validation, field):
    assert fields({"validation": validation}) == [f"driver.upgradePolicy.{field}"]


def test_the_health_gate_parses_off_or_with_its_limits():
    assert validate({"healthGate": {"enable": False, "maxRegression": {"notReady": 5}}}).health_gate is None
    gate = validate({"healthGate": {"enable": True, "maxRegression": {"restarts": 10}}}).health_gate
    limits = {s.value: gate.allowed(s) for s in HealthSignal}
    assert limits == {"notReady": 0, "gpusUnavailable": 0, "restarts": 10, "failedGpuPods": 0}


@pytest.mark.parametrize(
    "gate, field",
    [
        ({"enable": 1}, "healthGate.enable"),
        ({"maxRegression": {"notReady": 101}}, "healthGate.maxRegression.notReady"),
        ({"maxRegression": {"restarts": -1}}, "healthGate.maxRegression.restarts"),
        ({"maxRegression": {"failedGpuPods": "5%"}}, "healthGate.maxRegression.failedGpuPods"),
        ({"maxRegression": {"crashes": 1}}, "healthGate.maxRegression.crashes"),
        ({"threshold": 1}, "healthGate.threshold"),
    ],
)
def test_bad_health_gate_fields_are_named(gate, field):
    assert fields({"healthGate": gate}) == [f"driver.upgradePolicy.{field}"]
