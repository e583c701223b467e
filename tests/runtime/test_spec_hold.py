"""An edit of the CR mid-rollout that the API server stored (no ValidatingAdmissionPolicy before
Kubernetes 1.30) is held by the runner: the scenario of tests/runtime/test_runner_trace.py (a new
driver version rolled out in two steps over three nodes, whole runner passes against the fake API
server), with the admin changing the version again while the rollout is in progress."""

from __future__ import annotations

import json

from metax_operator.conditions import CrCondition
from tests.runtime.test_runner_trace import CR, DS, scenario

EDIT_AT = 2  # the pass before which the admin edits the CR (the rollout is in progress)
NEXT = "2.34.0.1"


def edit_the_version(api, i: int) -> None:
    if i == EDIT_AT:
        cr = api.get(CR)
        assert cr["status"]["upgradeStatus"]["upgrading"], "the scenario's rollout is in progress"
        cr["spec"]["driver"]["payload"]["version"] = NEXT
        cr["metadata"]["generation"] += 1
        api.put(CR, cr)


def condition(status: dict, kind: str) -> dict | None:
    return next((c for c in status.get("conditions") or () if c["type"] == kind), None)


def test_a_version_edited_mid_rollout_waits_for_the_rollout_to_end_and_is_reported():
    passes, statuses = scenario(edit_the_version)
    upgrading = [s["upgradeStatus"]["upgrading"] for s in statuses]
    end = upgrading.index(False, EDIT_AT)  # the first pass after which no rollout is in progress
    applies = [[r for r in sent if r["path"] == f"{DS}/metax-driver"] for sent in passes]

    # While the rollout runs, the driver's template keeps the rollout's version, and the rollout
    # keeps its revision and steps on (it does not start again at step 0 on the new version).
    assert not any(NEXT in json.dumps(r["body"]) for sent in applies[: end + 1] for r in sent)
    revisions = {s["upgradeStatus"]["status"]["upgradingPodSpecRevision"] for s in statuses[EDIT_AT : end + 1]}
    assert len(revisions) == 1, revisions
    steps = [s["upgradeStatus"]["status"]["currentStepIndex"] for s in statuses[EDIT_AT : end + 1]]
    assert steps == sorted(steps), steps

    # Reported as the condition, with the policy's line, and one Warning Event.
    held = [condition(s, CrCondition.SPEC_HELD) for s in statuses[EDIT_AT : end + 1]]
    assert held[-1] is not None and held[-1]["status"] == "True"
    assert held[-1]["message"].startswith(
        "driver.payload: cannot change while a driver rollout is in progress (phase Progressing): the edit is held"
    ), held[-1]["message"]
    events = [
        r["body"] for sent in passes for r in sent if r["path"].endswith("/events") and r["body"]["reason"] == "EditDuringRollout"
    ]
    assert len(events) == 1 and events[0]["type"] == "Warning" and "SpecHeld=True" in events[0]["message"]

    # The pass after the rollout ended applies the edit: a new version, a new rollout.
    assert any(NEXT in json.dumps(r["body"]) for r in applies[end + 1]), "the held edit takes effect"
    after = condition(statuses[end + 1], CrCondition.SPEC_HELD)
    assert after["status"] == "False"
    assert any(r["body"]["reason"] == "NothingHeld" for r in passes[end + 1] if r["path"].endswith("/events"))
