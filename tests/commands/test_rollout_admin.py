"""The admin's view of a rollout: `metax-operator rollout status` (`commands.rollout_admin.render`),
and why nothing moves (`blockers`; the Lease read on a fake API server, `no_leader`)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from datetime import datetime, timezone

from metax_operator.commands import rollout_admin as admin
from metax_operator.contract import RETRY_LABEL, STATE_LABEL
from metax_operator.rollout.status import NodeList, Resume, StepStatus, UpgradeStatus
from metax_operator.rollout.target import Target
from tests.cases import SEED_POLICY
from tests.fakeapi import FakeApi


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


# -- why nothing moves ---------------------------------------------------------------------------


def with_conditions(doc: dict, *conditions: dict) -> dict:
    doc["status"]["conditions"] = list(conditions)
    return doc


IDLE = UpgradeStatus(phase="Idling").to_json()


def test_a_refused_spec_is_named_with_its_message_and_the_edit_that_fixes_it():
    refused = {
        "type": "SpecValid",
        "status": "False",
        "reason": "InvalidSpec",
        "message": "spec.vfioManager.vfioConfig[0].nodeName: is not a regular expression",
    }
    text = admin.render(with_conditions(cr(IDLE), refused))
    assert (
        "Stopped: the runner refuses the spec (SpecValid=False, InvalidSpec): spec.vfioManager.vfioConfig[0].nodeName:"
        " is not a regular expression; fix it: kubectl edit clusteroperators cluster-operator"
    ) in text.splitlines()
    assert text.splitlines()[-1] == "Next: nothing moves until the causes under Stopped are fixed"
    assert "nothing in flight" not in text


def test_an_unhealthy_runner_is_named_with_its_reason_and_its_log():
    failing = {"type": "RunnerHealthy", "status": "False", "reason": "Forbidden", "message": "pods ... is forbidden; give ..."}
    healthy = {"type": "SpecValid", "status": "True", "reason": "Valid", "message": ""}
    text = admin.render(with_conditions(cr(IDLE), failing, healthy), namespace="gpu")
    lines = text.splitlines()
    assert (
        "Stopped: the runner's passes fail (RunnerHealthy=False, Forbidden): pods ... is forbidden; give ...;"
        " its log: kubectl -n gpu logs deploy/metax-operator-runner"
    ) in lines
    assert not any("SpecValid" in line for line in lines)
    assert lines[-1] == "Next: nothing moves until the causes under Stopped are fixed"


def test_no_leader_is_said_even_when_the_policy_is_invalid():
    text = admin.render(cr(IDLE, {"enableRollout": True, "upgradeSteps": []}), leader="the Lease x/y is released")
    lines = text.splitlines()
    assert lines[0] == "The upgrade policy is invalid, so the runner does not act on it:"
    assert "Fix it: kubectl edit clusteroperators cluster-operator" in lines
    assert lines[-1] == "Stopped: no runner leads: the Lease x/y is released"


def test_the_admins_pause_the_runners_pauses_held_nodes_and_reboots_each_say_what_moves_them():
    in_flight = dict(phase="Progressing", upgrading=True, step=StepStatus(current_step_index=1, current_step_state="StepUpgrade"))
    admin_paused = UpgradeStatus(**in_flight, resume=Resume(held=NodeList(["n1", "n2"], 2))).to_json()
    text = admin.render(cr(admin_paused, {**SEED_POLICY, "pause": True}))
    assert "Waiting: paused by the admin (spec.driver.upgradePolicy.pause: true): metax-operator rollout resume" in text
    assert (
        "Waiting: for the GPU jobs on 2 nodes (n1, n2) to end (held back): let them finish, take such nodes in with"
        " driver.upgradePolicy.waitForCompletion or drain (docs/rollout-admin.md), or skip one:"
        " kubectl label node NODE metax-tech.com/driver-upgrade.skip=true"
    ) in text.splitlines()
    assert "Stopped" not in text
    paused = dict(phase="Progressing", upgrading=True, step=StepStatus(current_step_index=1, current_step_state="StepPaused"))
    step_pause = UpgradeStatus(**paused, resume=Resume(paused_by_runner=True, pause_reason="step")).to_json()
    text = admin.render(cr(step_pause, {**SEED_POLICY, "pause": True}))
    assert "Waiting: step 1 is done and waits for the admin: metax-operator rollout resume" in text
    assert "paused by the admin" not in text
    failure = UpgradeStatus(**paused, resume=Resume(paused_by_runner=True, pause_reason="failure")).to_json()
    assert "fix the failed nodes, then metax-operator rollout resume" in admin.render(cr(failure, {**SEED_POLICY, "pause": True}))
    reboot = UpgradeStatus(phase="Idling", resume=Resume(need_reboot=NodeList(["n7"], 1))).to_json()
    assert (
        "Waiting: 1 node (n7) need a reboot (firmware upgraded): reboot each once its GPU work stopped:"
        " kubectl drain NODE --ignore-daemonsets, reboot it, kubectl uncordon NODE"
    ) in admin.render(cr(reboot)).splitlines()
    draining = UpgradeStatus(**in_flight, resume=Resume(drain_start={"n4": "2026-01-01T00:00:00Z"})).to_json()
    assert "Waiting: for the drain of 1 node (n4)" in admin.render(cr(draining))
    outage = UpgradeStatus(**in_flight, resume=Resume(out_of_service=NodeList(["n8", "n9"], 2))).to_json()
    assert (
        "Waiting: for 2 nodes (n8, n9) out of service (cordoned by someone else, NotReady or without a driver pod) to"
        " return: the waves keep at most maxParallel plus maxUnavailable GPU nodes out of service; uncordon a node once"
        " its maintenance is over, or raise driver.upgradePolicy.maxUnavailable"
    ) in admin.render(cr(outage)).splitlines()


def test_a_quiet_cluster_has_no_cause_listed():
    text = admin.render(cr(IDLE))
    assert not any(line.startswith(("Stopped:", "Waiting:")) for line in text.splitlines())
    assert text.splitlines()[-1].startswith("Next: nothing in flight")


LEASE = "/apis/coordination.k8s.io/v1/namespaces/metax-operator/leases/metax-operator-runner"
NOW = 1_800_000_000.0


def lease(holder: str | None, renewed: float) -> dict:
    spec = {
        "leaseDurationSeconds": 15,
        "renewTime": datetime.fromtimestamp(renewed, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
    }
    if holder:
        spec["holderIdentity"] = holder
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "metax-operator-runner"}, "spec": spec}


def test_the_lease_says_whether_a_runner_leads():
    with FakeApi() as fake:
        api = fake.client()
        no_leader = functools.partial(admin.no_leader, api, "metax-operator", "metax-operator-runner", NOW)
        assert "no runner has ever taken the Lease metax-operator/metax-operator-runner" in no_leader()
        fake.put(LEASE, lease("runner-a_1234", NOW - 3))
        assert no_leader() is None
        fake.put(LEASE, lease("runner-a_1234", NOW - 40))
        assert no_leader().startswith(
            "the Lease metax-operator/metax-operator-runner's holder runner-a_1234 renewed it 40 s ago (it lasts 15 s)"
        )
        fake.put(LEASE, lease(None, NOW - 3))
        assert "is released and no runner took it over" in no_leader()
        fake.put(
            "/apis/batch/v1/namespaces/metax-operator/cronjobs/metax-operator-runner",
            {"apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": "metax-operator-runner"}},
        )
        assert no_leader() is None  # runner.mode cronjob: released between runs
        fake.fail("GET", LEASE, 403)
        assert no_leader().startswith("unknown: you may not read the Lease metax-operator/metax-operator-runner (403)")


def test_an_edit_the_runner_holds_is_named_with_its_line_and_the_rollout_moves_on():
    held = {
        "type": "SpecHeld",
        "status": "True",
        "reason": "EditDuringRollout",
        "message": "driver.payload: cannot change while a driver rollout is in progress (phase Progressing): the edit is held",
    }
    running = UpgradeStatus(phase="Progressing", upgrading=True).to_json()
    lines = admin.render(with_conditions(cr(running), held)).splitlines()
    assert (
        "Held: an edit made during the rollout (SpecHeld=True): driver.payload: cannot change while a driver rollout is in"
        " progress (phase Progressing): the edit is held"
    ) in lines
    assert "nothing moves" not in lines[-1], "a held edit does not stop the rollout"
    released = {**held, "status": "False", "reason": "NothingHeld"}
    assert not any(line.startswith("Held:") for line in admin.render(with_conditions(cr(running), released)).splitlines())


def test_all_lists_every_labelled_node_with_its_state_and_the_counts():
    with FakeApi() as fake:
        for name, labels in (
            ("gpu-b", {STATE_LABEL: "failed", RETRY_LABEL: "true"}),
            ("gpu-a", {STATE_LABEL: "done"}),
            ("gpu-c", {STATE_LABEL: "done"}),
            ("cpu-0", {}),  # not the rollout's: not listed
        ):
            fake.put(f"/api/v1/nodes/{name}", {"metadata": {"name": name, "labels": labels}})
        rows = admin.node_states(fake.client())
    assert rows == [("gpu-a", "done", False), ("gpu-b", "failed", True), ("gpu-c", "done", False)]
    status = UpgradeStatus(phase="Progressing", upgrading=True, step=StepStatus(current_step_state="StepUpgrade"))
    lines = admin.render(cr(status.to_json()), nodes=rows).splitlines()
    at = lines.index("Nodes: 2 done, 1 failed")
    assert [line.split() for line in lines[at + 1 :]] == [
        ["NODE", "STATE", "RETRY"],
        ["gpu-a", "done"],
        ["gpu-b", "failed", "asked"],
        ["gpu-c", "done"],
    ]
    as_json = json.loads(admin.render(cr(status.to_json()), "json", nodes=rows))
    assert as_json["nodes"][1] == {"name": "gpu-b", "state": "failed", "retry": True}
    assert as_json["upgradeStatus"]["phase"] == "Progressing"
    assert "none carries the label" in admin.render(cr(status.to_json()), nodes=[])


POOLS = [
    {"name": "rack-a", "nodeSelector": {"rack": "a"}},
    {"name": "rack-b", "nodeSelector": {"rack": "b"}, "upgradePolicy": {"pause": False}},
]


def pooled(driver: dict, pool_status: dict) -> dict:
    """A CR with two driver pools, rack-a's rollout at `pool_status`."""
    return {
        "spec": {"driver": {"upgradePolicy": SEED_POLICY, "pools": POOLS}},
        "status": {"upgradeStatus": driver, "pools": [{"name": "rack-a", "upgradeStatus": pool_status}]},
    }


def test_status_of_a_pool_is_its_own_rollout_and_the_drivers_lists_every_pool():
    rack_a = UpgradeStatus(
        phase="Progressing",
        upgrading=True,
        step=StepStatus(current_step_state="StepUpgrade", total_upgrade_replicas=3, total_upgrade_ready_replicas=1),
    )
    driver = UpgradeStatus(phase="Idling", step=StepStatus(total_upgrade_replicas=4, total_upgrade_ready_replicas=4))
    shown = pooled(driver.to_json(), rack_a.to_json())
    own = admin.render(shown, target=Target("rack-a"))
    assert own.startswith("Phase: Progressing") and "upgraded 1/3" in own and "Pools" not in own
    assert json.loads(admin.render(shown, "json", target=Target("rack-a"))) == rack_a.to_json()
    table = admin.render(shown).splitlines()
    assert table[0].startswith("Phase: Idling")
    assert table[-1] == "Pools (each: metax-operator rollout status --pool NAME): rack-a Progressing 1/3; rack-b -"


CR_PATH = "/apis/gpu.metax-tech.com/v1/clusteroperators/cluster-operator"


def switch(fake: FakeApi, tmp_path, *args: str) -> tuple[int, str, str]:
    config = tmp_path / "kubeconfig"
    server = fake.url
    config.write_text(
        f"apiVersion: v1\nkind: Config\ncurrent-context: x\nclusters: [{{name: c, cluster: {{server: '{server}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "metax_operator.cli", "rollout", *args, "--kubeconfig", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout, done.stderr


def test_pause_and_undo_of_a_pool_set_the_pools_own_policy(tmp_path):
    policy = {**SEED_POLICY, "enableRollout": True}
    with FakeApi() as fake:
        fake.put(
            CR_PATH, {"metadata": {"name": "cluster-operator"}, "spec": {"driver": {"upgradePolicy": policy, "pools": POOLS}}}
        )
        assert switch(fake, tmp_path, "pause", "--pool", "rack-a")[0] == 0
        assert switch(fake, tmp_path, "undo", "--pool", "rack-b")[0] == 0
        spec = fake.get(CR_PATH)["spec"]["driver"]
        assert spec["pools"][0]["upgradePolicy"] == {"pause": True}
        assert spec["pools"][1]["upgradePolicy"] == {"pause": False, "enableRollout": False}
        assert spec["upgradePolicy"] == policy  # the driver's own rollout untouched
        code, _, said = switch(fake, tmp_path, "resume", "--pool", "rack-c")
        assert (
            code == 1
            and said == "error: --pool: rack-c is no pool of spec.driver.pools (its pools: rack-a, rack-b); name one of them\n"
        )


def test_a_pools_pause_is_named_where_it_is_and_resumed_with_its_pool():
    running = UpgradeStatus(phase="Progressing", upgrading=True, step=StepStatus(current_step_state="StepUpgrade"))
    shown = pooled({}, {})
    shown["spec"]["driver"]["pools"] = [POOLS[0], {**POOLS[1], "upgradePolicy": {"pause": True}}]
    shown["status"]["pools"] = [{"name": "rack-b", "upgradeStatus": running.to_json()}]
    text = admin.render(shown, target=Target("rack-b"))
    said = (
        "Waiting: paused by the admin (spec.driver.pools[1].upgradePolicy.pause: true): "
        "metax-operator rollout resume --pool rack-b"
    )
    assert said in text.splitlines()
