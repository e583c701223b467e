"""The admin's view of a rollout: `metax-operator rollout status` (`commands.rollout_admin.render`)."""

from __future__ import annotations

import json

from metax_operator.commands import rollout_admin as admin
from metax_operator.rollout.status import NodeList, Resume, StepStatus, UpgradeStatus

SEED_POLICY = {
    "enableRollout": True,
    "upgradeSteps": [
        {"replicas": 2},
        {"replicas": 5, "pauseDuration": 10000},
        {"replicas": 8, "pauseDuration": 10000},
        {"replicas": "100%"},
    ],
    "maxParallel": "50%",
    "maxFailureThreshold": 3,
}


def cr(status: dict, policy: dict = SEED_POLICY) -> dict:
    return {"spec": {"driver": {"upgradePolicy": policy}}, "status": {"upgradeStatus": status}}


def test_status_table_shows_steps_wave_failed_nodes_and_the_next_action():
    status = UpgradeStatus(
        phase="Progressing",
        upgrading=True,
        step=StepStatus(
            current_step_index=1,
            current_step_state="StepUpgrade",
            total_upgrade_replicas=10,
            total_upgrade_ready_replicas=3,
            last_pod_spec_revision="a",
            upgrading_pod_spec_revision="b",
        ),
        resume=Resume(wave=["n3", "n4"], wave_kind="upgrade", failed=NodeList(["n9"], 1)),
    )
    text = admin.render(cr(status.to_json()))
    lines = text.splitlines()
    assert "Phase: Progressing" in lines[0] and "a -> b" in lines[0] and "upgraded 3/10" in lines[0]
    assert lines[1].split() == ["STEP", "TARGET", "UPGRADED", "AFTER", "STATE"]
    assert lines[2].split()[:3] == ["0", "2", "(2)"] and lines[2].endswith("done")
    assert lines[3].endswith("StepUpgrade") and lines[4].endswith("pending")
    assert "Wave (upgrade" in text and "n3, n4" in text
    assert "Failed nodes: 1: n9" in text
    assert "Next: waiting for 2 new pods to become Ready" in text


def test_next_action_after_a_runner_pause_is_resume():
    status = UpgradeStatus(
        phase="Progressing",
        upgrading=True,
        step=StepStatus(current_step_state="StepPaused"),
        resume=Resume(paused_by_runner=True, pause_reason="failure"),
    )
    policy = {**SEED_POLICY, "pause": True}
    assert "fix the failed nodes, then resume: metax-operator rollout resume" in admin.render(cr(status.to_json(), policy))


def test_status_json_is_the_upgrade_status():
    status = {"phase": "Idling"}
    assert json.loads(admin.render(cr(status), "json")) == status


def test_status_table_lists_skipped_and_cordoned_nodes():
    status = UpgradeStatus(resume=Resume(skipped=NodeList(["n2", "n7"], 2), cordoned=NodeList(["n3"] * 20, 25)))
    text = admin.render(cr(status.to_json()))
    assert "Skipped (label metax-tech.com/driver-upgrade.skip=true): 2: n2, n7" in text.splitlines()
    assert "Cordoned by the runner: 25: " in text and text.count("(+5 more)") == 1
