"""`status.upgradeStatus` (`rollout.status`): a golden trace of a rollout that touches most of the
bookkeeping (retry, timed and manual pauses, a drain that times out, skipped and reboot-needing
nodes, a rollback), compared key for key and in key order with the JSON the engine wrote before the
status was typed (tests/rollout/data/upgrade_status_trace.json; since then `resume.spec`, the spec
the rollout acts on, is added last in every pass with a rollout in progress, and
`resume.restoring` in the pass that plans the rollback's restore, and `resume.deletedAt`, empty
here, after `drainStart` in every pass); the codec's round trip on any
status (hypothesis); reading partial and null fields."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from metax_operator.chart.upgrade_policy import validate
from metax_operator.rollout import engine
from metax_operator.rollout.observation import Cluster, Pod
from metax_operator.rollout.status import (
    COMPLETED,
    DISABLED,
    DISABLING,
    IDLING,
    PROGRESSING,
    STEP_INIT,
    STEP_PAUSED,
    STEP_READY,
    STEP_UPGRADE,
    TERMINATING,
    Condition,
    NodeList,
    Resume,
    StepStatus,
    UpgradeStatus,
)

T0 = 1_800_000_000.0
GOLDEN = Path(__file__).parent / "data" / "upgrade_status_trace.json"


def scenario(decisions: list | None = None) -> list[dict]:
    """Six nodes (n5 skipped, n4 needing a reboot, n3 running GPU work that a drain cannot end), the
    status after each pass; each pass's whole decision is appended to `decisions` if given."""
    nodes = {f"n{i}" for i in range(6)}
    pods = {n: Pod(f"p-{n}-0", f"u-{n}-0", n, "old", True, "Running", 0, T0 - 1000) for n in nodes}
    revision, cordoned, serial = "new", set(), 0
    busy, skipped, reboot = {"n3"}, {"n5"}, frozenset({"n4"})
    base = {
        "enableRollout": True,
        "maxParallel": 2,
        "maxFailureThreshold": 1,
        "readinessTimeout": "1m",
        "drain": {"enable": True, "timeout": "30s"},
        "upgradeSteps": [
            {"replicas": 2, "pauseDuration": "10s"},
            {"replicas": 4, "pause": {}},
            {"replicas": "100%", "pauseDuration": 0},
        ],
    }
    status, out, pause = None, [], False
    # (seconds after T0, the admin's policy edits, what happens to the pods before the pass)
    script = [
        (-5, {}, ("revision", "old")),
        (0, {}, ("revision", "new")),
        (5, {}, ("fail", "n0")),
        (10, {}, None),
        (15, {}, ("ready",)),
        (20, {}, None),
        (31, {}, None),
        (36, {}, ("ready",)),
        (40, {}, None),
        (45, {"pause": True}, None),
        (50, {"pause": False}, None),
        (55, {}, None),
        (60, {}, ("ready",)),
        (65, {}, None),
        (70, {"pause": False}, None),
        (75, {}, ("ready",)),
        (80, {}, None),
        (85, {}, None),
        (116, {}, None),
        (121, {}, None),
        (125, {"enableRollout": False}, None),
        (130, {"enableRollout": False}, None),
        (135, {"enableRollout": False}, ("ready",)),
        (140, {"enableRollout": False}, None),
    ]
    for dt, overrides, change in script:
        if change and change[0] == "revision":
            revision = change[1]
        elif change and change[0] == "fail":
            pods[change[1]] = dataclasses.replace(pods[change[1]], phase="Failed")
        elif change:
            for n, p in pods.items():
                if p.phase != "Failed":
                    pods[n] = dataclasses.replace(p, ready=True)
        observed = Cluster(
            revision,
            True,
            frozenset(nodes - skipped),
            tuple(pods.values()),
            frozenset(busy),
            skipped=frozenset(skipped),
            cordoned=frozenset(cordoned),
            need_reboot=reboot,
            template=f"template-{revision}",
            driver_spec=f"spec-{revision}",
        )
        overrides = dict(overrides)
        pause = overrides.pop("pause", pause)
        decision = engine.decide(observed, validate({**base, **overrides, "pause": pause}), status, T0 + dt)
        if decisions is not None:
            decisions.append(decision)
        if decision.set_pause is not None:
            pause = decision.set_pause
        out.append(decision.status.to_json())
        status = UpgradeStatus.from_json(json.loads(json.dumps(out[-1])))  # as stored in the CR and read back
        cordoned = (cordoned - set(decision.uncordon)) | set(decision.cordon)
        for ref in decision.delete:
            serial += 1
            cordoned.add(ref.node)
            pods[ref.node] = Pod(
                f"p-{ref.node}-{serial}", f"u-{ref.node}-{serial}", ref.node, revision, False, "Running", 0, T0 + dt
            )
        if decision.restore is not None:
            revision = decision.restore.revision
    return out


def test_the_engine_writes_the_golden_status_trace_key_for_key_and_in_order():
    golden = json.loads(GOLDEN.read_text())
    got = scenario()
    assert len(got) == len(golden)
    for i, (status, expected) in enumerate(zip(got, golden, strict=True)):
        assert json.dumps(status) == json.dumps(expected), f"pass {i}"


def test_the_golden_statuses_read_back_to_the_same_json():
    for expected in json.loads(GOLDEN.read_text()):
        assert json.dumps(UpgradeStatus.from_json(expected).to_json()) == json.dumps(expected)


def test_a_status_before_the_first_rollout_has_no_step_state_and_no_times():
    written = UpgradeStatus().to_json()
    assert "currentStepState" not in written["status"] and "lastUpdateTime" not in written["status"]
    assert {"stepStartTime", "waveStartTime", "stepReadyTime"}.isdisjoint(written["resume"])
    assert (written["resume"]["heldNodes"], written["resume"]["heldNodeCount"]) == ([], 0)


def test_missing_and_null_fields_read_as_their_defaults():
    assert UpgradeStatus.from_json({}) == UpgradeStatus() == UpgradeStatus.from_json(None)
    status = UpgradeStatus.from_json(
        {
            "phase": "Progressing",
            "condition": None,
            "status": {"currentStepIndex": 2},
            "resume": {"wave": None, "failedNodes": ["n1"], "stepStartTime": None},
        }
    )
    assert status.phase == "Progressing" and status.conditions == [] and status.step.current_step_index == 2
    assert status.resume.wave == [] and status.resume.failed == NodeList(["n1"], 0)
    assert status.resume.step_start_time is None and status.step.current_step_state is None


names = st.lists(st.text(max_size=8), max_size=3)
times = st.none() | st.just("2027-01-15T08:00:00Z")
node_lists = st.builds(NodeList, names, st.integers(0, 50_000))
STATUSES = st.builds(
    UpgradeStatus,
    last_applied_spec=st.text(max_size=20),
    last_co_driver_spec=st.text(max_size=20),
    upgrading=st.booleans(),
    phase=st.sampled_from([IDLING, PROGRESSING, TERMINATING, DISABLED, DISABLING]),
    message=st.text(max_size=20),
    conditions=st.lists(
        st.builds(
            Condition,
            st.sampled_from(["Progressing", "Succeed", "Failed", "Terminating"]),
            st.sampled_from(["True", "False"]),
            st.text(max_size=8),
            st.text(max_size=8),
            st.just("2027-01-15T08:00:00Z"),
        ),
        max_size=4,
    ),
    step=st.builds(
        StepStatus,
        st.text(max_size=8),
        st.text(max_size=8),
        st.integers(0, 9),
        st.integers(0, 10**5),
        st.integers(0, 10**5),
        st.integers(0, 9),
        st.integers(0, 10**5),
        st.integers(0, 10**5),
        st.text(max_size=8),
        times,
        st.none() | st.sampled_from([STEP_INIT, STEP_UPGRADE, STEP_PAUSED, STEP_READY, COMPLETED]),
        times,
    ),
    resume=st.builds(
        Resume,
        st.text(max_size=8),
        st.text(max_size=8),
        names,
        st.sampled_from(["", "upgrade", "retry", "rollback"]),
        names,
        names,
        st.booleans(),
        st.sampled_from(["", "step", "failure"]),
        st.booleans(),
        st.booleans(),
        node_lists,
        node_lists,
        st.text(max_size=8),
        node_lists,
        node_lists,
        st.dictionaries(st.text(max_size=8), st.just("2027-01-15T08:00:00Z"), max_size=3),
        st.dictionaries(st.text(max_size=8), st.just("2027-01-15T08:00:05Z"), max_size=3),
        names,
        node_lists,
        node_lists,
        times,
        times,
        times,
        settled_at=times,
    ),
)


@given(STATUSES)
def test_any_status_survives_the_json_round_trip(status):
    written = status.to_json()
    assert UpgradeStatus.from_json(json.loads(json.dumps(written))) == status
    assert UpgradeStatus.from_json(written).to_json() == written
