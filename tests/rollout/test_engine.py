"""The rollout decision function, rule by rule (docs/rollout.md), on hand-built observations.

`Cluster` is a hand-stepped fixture, not a simulator: no clock, no latencies; the engine's
deletions replace pods at once at the current revision, and the test says when they are Ready or
failed. The worked examples run through the OnDelete simulator (tests/rollout/test_simulate.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jsonschema
import pytest
import yaml

from metax_operator.chart.upgrade_policy import validate
from metax_operator.conditions import rfc3339
from metax_operator.rollout import engine, observation
from metax_operator.rollout.context import Next
from metax_operator.rollout.decision import Decision
from metax_operator.rollout.health_gate import HealthSnapshot
from metax_operator.rollout.observation import Pod
from metax_operator.rollout.rollback import Rollback
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
    UpgradeStatus,
)

T0 = 1_800_000_000.0
CRD_FILE = Path(__file__).resolve().parents[2] / "crds/clusteroperators.gpu.metax-tech.com.yaml"
CRD = yaml.load(CRD_FILE.read_text(), Loader=yaml.CSafeLoader)
UPGRADE_STATUS_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"][
    "upgradeStatus"
]
TABLE_3_16 = {"lastAppliedSpec", "lastCoDriverSpec", "upgrading", "condition", "phase", "message", "status"}
TABLE_3_16_STATUS = {
    "lastPodSpecRevision",
    "upgradingPodSpecRevision",
    "currentStepIndex",
    "currentUpgradeReplicas",
    "currentUpgradeReadyReplicas",
    "currentFailureRetry",
    "currentStepState",
    "totalUpgradeReplicas",
    "totalUpgradeReadyReplicas",
    "lastUpdateTime",
    "message",
}


def policy(**overrides):
    raw = {
        "enableRollout": True,
        "upgradeSteps": [{"replicas": 2, "pauseDuration": 0}, {"replicas": "100%", "pauseDuration": 0}],
        "maxParallel": 1,
    }
    raw.update(overrides)
    return validate(raw)


class Cluster:
    """N nodes, each running one Ready pod at `old`; the DaemonSet's template is at `new`."""

    def __init__(self, n: int, old: str = "old", new: str = "new"):
        self.revision = new
        self.nodes = {f"n{i:02d}" for i in range(n)}
        self.pods = {node: Pod(f"p-{node}-0", f"u-{node}-0", node, old, True, "Running", 0, T0 - 1000) for node in self.nodes}
        self.busy: set[str] = set()
        self.skipped: set[str] = set()  # as rollout_observe.build: out of `nodes`, listed
        self.cordoned: set[str] = set()  # the runner's cordons: each deletion or cordon adds, each uncordon removes
        self.waiting: set[str] = set()  # nodes running pods that match waitForCompletion.podSelector
        self.retry: set[str] = set()  # nodes an admin labelled for a retry
        self.admin_cordoned: set[str] = set()  # nodes someone else cordoned
        self.evicted: list[str] = []  # every node a pass asked to drain, in order
        self.status: UpgradeStatus | None = None
        self.health: HealthSnapshot | None = None  # the latest snapshot of the nodes' health (the health gate)
        # Revisions whose template differs from the current one's only in scheduling: as
        # rollout_observe.build, their pods read as at the current revision.
        self.same: set[str] = set()
        self.serial = 0

    def observed(self, caught_up: bool = True) -> observation.Cluster:
        # As the runner observes it: the skipped nodes are not eligible, but those of the wave in
        # flight (a node labelled skip mid-swap) are, for the engine to tell what became of them.
        wave = set(self.status.resume.wave) if self.status is not None else set()
        same = self.same | {self.revision}
        pods = tuple(dataclasses.replace(p, revision=self.revision) if p.revision in same else p for p in self.pods.values())
        return observation.Cluster(
            self.revision,
            caught_up,
            frozenset((self.nodes - self.skipped) | (wave & self.nodes)),
            pods,
            frozenset(self.busy),
            wait_busy_nodes=frozenset(self.waiting),
            skipped=frozenset(self.skipped),
            cordoned=frozenset(self.cordoned),
            unschedulable=frozenset(self.cordoned | self.admin_cordoned),
            retry=frozenset(self.retry),
            template=f"template-{self.revision}",
            driver_spec=f"spec-{self.revision}",
            health=self.health,
            same_driver=frozenset(same),
        )

    def decide(self, pol, now: float) -> Decision:
        decision = engine.decide(self.observed(), pol, self.status, now)
        assert_fits_the_crd(decision.status.to_json())
        self.status = decision.status
        self.cordoned -= set(decision.uncordon)
        self.cordoned |= set(decision.cordon) - self.admin_cordoned  # another's cordon is never taken for the runner's
        self.evicted += decision.evict
        for ref in decision.delete:
            node = next(n for n, p in self.pods.items() if p.uid == ref.uid)
            assert ref.node == node
            self.cordoned |= {node} - self.admin_cordoned
            self.serial += 1
            self.pods[node] = Pod(
                f"p-{node}-{self.serial}", f"u-{node}-{self.serial}", node, self.revision, False, "Running", 0, now
            )
        if decision.restore is not None:
            self.revision = decision.restore.revision
        return decision

    def set(self, node: str, **fields) -> None:
        self.pods[node] = dataclasses.replace(self.pods[node], **fields)

    def ready_all(self) -> None:
        for node, pod in self.pods.items():
            if pod.phase != "Failed":
                self.pods[node] = dataclasses.replace(pod, ready=True)

    def revisions(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for pod in self.pods.values():
            out[pod.revision] = out.get(pod.revision, 0) + 1
        return out


def assert_fits_the_crd(status: dict) -> None:
    """The status as the API server would store it: valid for the CRD and nothing pruned."""
    jsonschema.Draft7Validator(UPGRADE_STATUS_SCHEMA, format_checker=jsonschema.FormatChecker()).validate(status)
    assert set(status) <= set(UPGRADE_STATUS_SCHEMA["properties"]), "fields the API server would prune"
    assert set(status["status"]) <= set(UPGRADE_STATUS_SCHEMA["properties"]["status"]["properties"])


def nodes_of(cluster: Cluster, decision: Decision) -> list[str]:
    return sorted(ref.name.split("-")[1] for ref in decision.delete)


def drive(cluster: Cluster, pol, now: float, passes: int = 200, step: float = 5.0) -> float:
    """Passes with every replacement Ready at once, until the rollout is over."""
    for _ in range(passes):
        cluster.decide(pol, now)
        cluster.ready_all()
        now += step
        if cluster.status.phase in (IDLING, DISABLED) and cluster.status.step.current_step_state in (COMPLETED, ""):
            break
    return now


def test_status_has_every_field_of_table_3_16_and_the_seed_shape():
    cluster = Cluster(4)
    decision = cluster.decide(policy(), T0)
    status = decision.status.to_json()
    assert TABLE_3_16 <= set(status)
    assert TABLE_3_16_STATUS <= set(status["status"])
    assert status["phase"] == PROGRESSING and status["upgrading"] is True
    assert status["status"]["lastPodSpecRevision"] == "old"
    assert status["status"]["upgradingPodSpecRevision"] == "new"
    progressing = next(c for c in status["condition"] if c["type"] == "Progressing")
    assert set(progressing) == {"type", "status", "lastTransitionTime", "reason", "message"}
    assert progressing["status"] == "True" and progressing["lastTransitionTime"] == "2027-01-15T08:00:00Z"
    assert {c["type"] for c in status["condition"]} == {"Progressing", "Succeed", "Failed", "Terminating"}
    assert [e.reason for e in decision.events] == ["RolloutStarted", STEP_INIT]


def test_first_wave_takes_not_ready_old_pods_first_then_node_names():
    cluster = Cluster(6)
    cluster.set("n04", ready=False, phase="Pending")
    decision = cluster.decide(policy(maxParallel=2, upgradeSteps=[{"replicas": "100%"}]), T0)
    assert nodes_of(cluster, decision) == ["n00", "n04"]


def test_no_new_wave_until_the_previous_one_is_ready():
    cluster = Cluster(6)
    pol = policy(maxParallel=2, upgradeSteps=[{"replicas": "100%"}])
    assert len(cluster.decide(pol, T0).delete) == 2
    assert cluster.decide(pol, T0 + 5).delete == []
    cluster.set("n00", ready=True)
    assert cluster.decide(pol, T0 + 10).delete == []  # n01 still coming up
    cluster.set("n01", ready=True)
    assert nodes_of(cluster, cluster.decide(pol, T0 + 15)) == ["n02", "n03"]


def test_an_upgraded_ready_pod_is_never_deleted_and_the_rollout_completes():
    cluster = Cluster(7)
    pol = policy(maxParallel="50%", upgradeSteps=[{"replicas": 3, "pauseDuration": 0}, {"replicas": "100%", "pauseDuration": 0}])
    deleted: list[str] = []
    now = T0
    for _ in range(50):
        decision = cluster.decide(pol, now)
        for ref in decision.delete:
            assert ref.uid.endswith("-0"), "only the original (old) pods are deleted"
            deleted.append(ref.uid)
        cluster.ready_all()
        now += 5
    assert len(deleted) == len(set(deleted)) == 7
    assert cluster.status.step.current_step_state == COMPLETED
    assert cluster.status.phase == IDLING and cluster.status.upgrading is False
    succeed = next(c for c in cluster.status.conditions if c.type == "Succeed")
    assert succeed.status == "True"


def test_failed_pod_is_retried_then_fallback_pause():
    cluster = Cluster(4)
    pol = policy(maxFailureThreshold=1, upgradeSteps=[{"replicas": 1}, {"replicas": "100%"}])
    cluster.decide(pol, T0)  # deletes n00
    cluster.set("n00", phase="Failed")
    retry = cluster.decide(pol, T0 + 5)
    assert retry.status.step.current_failure_retry == 1
    assert [e.reason for e in retry.events] == ["StepRetry"]
    assert nodes_of(cluster, retry) == ["n00"]  # the failed pod, recreated
    assert retry.status.resume.wave_kind == "retry"
    cluster.set("n00", phase="Failed")
    fallback = cluster.decide(pol, T0 + 10)
    assert fallback.delete == []
    assert fallback.set_pause is True
    assert fallback.status.step.current_step_state == STEP_PAUSED
    failed = next(c for c in fallback.status.conditions if c.type == "Failed")
    assert (failed.status, failed.reason) == ("True", "StepFailed")
    assert any(e.type == "Warning" and e.reason == "StepFailed" for e in fallback.events)
    # the admin fixes the node and resumes: the failed pod is recreated, the retries start again from 0
    cluster.decide(dataclasses.replace(pol, pause=True), T0 + 15)
    resumed = cluster.decide(pol, T0 + 20)
    assert nodes_of(cluster, resumed) == ["n00"]
    assert resumed.status.step.current_failure_retry == 0
    cluster.set("n00", phase="Failed")
    assert nodes_of(cluster, again := cluster.decide(pol, T0 + 25)) == ["n00"]  # then the step's retry
    assert again.status.step.current_failure_retry == 1


def test_resuming_after_the_fallback_pause_recreates_the_failed_pods_with_no_retries_allowed():
    # maxFailureThreshold 0 (the default): the fallback comes at the first failure, and the
    # admin's `pause: false` must still recreate the failed pod rather than fail again at once.
    cluster = Cluster(4)
    pol = policy(upgradeSteps=[{"replicas": 1, "pauseDuration": 0}, {"replicas": "100%", "pauseDuration": 0}])
    cluster.decide(pol, T0)
    cluster.set("n00", phase="Failed")
    assert cluster.decide(pol, T0 + 5).set_pause is True
    cluster.decide(dataclasses.replace(pol, pause=True), T0 + 10)  # the runner's pause lands
    resumed = cluster.decide(pol, T0 + 20)
    assert nodes_of(cluster, resumed) == ["n00"], [e.reason for e in resumed.events]
    assert [e.reason for e in resumed.events] == ["Resumed"]
    cluster.ready_all()
    assert drive(cluster, pol, T0 + 25) and cluster.status.step.current_step_state == COMPLETED


def test_toleration_lets_a_step_finish_with_failures():
    cluster = Cluster(4)
    pol = policy(
        maxParallel=2, upgradeSteps=[{"replicas": 2, "toleration": 1, "pauseDuration": 0}, {"replicas": "100%", "toleration": 1}]
    )
    cluster.decide(pol, T0)
    cluster.set("n00", ready=True)
    cluster.set("n01", phase="Failed")
    decision = cluster.decide(pol, T0 + 5)
    assert decision.status.step.current_step_index == 1
    assert nodes_of(cluster, decision) == ["n02", "n03"]
    assert decision.status.resume.failed.names == ["n01"]


def test_readiness_timeout_and_restarts_make_a_pod_failed():
    cluster = Cluster(3)
    pol = policy(maxParallel=2, readinessTimeout="1m", upgradeSteps=[{"replicas": 2}, {"replicas": "100%"}])
    cluster.decide(pol, T0)
    cluster.set("n01", restart_count=3)
    assert cluster.decide(pol, T0 + 30).status.resume.failed.names == ["n01"]
    decision = cluster.decide(pol, T0 + 61)  # n00 not Ready after 60 s either
    assert decision.status.resume.failed.count == 2
    failed = next(c for c in decision.status.conditions if c.type == "Failed")
    assert failed.status == "True"  # maxFailureThreshold 0: straight to the fallback


def test_fallback_rollback_restores_the_template_then_replaces_new_pods_in_waves():
    cluster = Cluster(4)
    pol = policy(fallback="rollback", maxParallel=2, upgradeSteps=[{"replicas": 2}, {"replicas": "100%"}])
    cluster.decide(pol, T0)
    cluster.set("n00", phase="Failed")
    cluster.set("n01", ready=True)
    decision = cluster.decide(pol, T0 + 5)
    assert decision.status.phase == TERMINATING
    assert decision.restore.revision == "old"
    assert decision.delete == []  # not before the template is back
    rollback = cluster.decide(pol, T0 + 10)
    assert nodes_of(cluster, rollback) == ["n00", "n01"]  # the failed one first
    assert rollback.status.resume.wave_kind == "rollback"
    cluster.ready_all()
    done = cluster.decide(pol, T0 + 15)
    assert done.status.phase == IDLING and done.status.upgrading is False
    assert cluster.revisions() == {"old": 4}
    terminating = next(c for c in done.status.conditions if c.type == "Terminating")
    assert (terminating.status, terminating.reason) == ("False", "RolledBack")


def test_max_unavailable_bounds_failures_at_the_end():
    cluster = Cluster(4)
    pol = policy(maxParallel=0, maxUnavailable=0, upgradeSteps=[{"replicas": "100%", "toleration": 2}])
    cluster.decide(pol, T0)
    cluster.ready_all()
    cluster.set("n03", phase="Failed", ready=False)
    decision = cluster.decide(pol, T0 + 5)
    assert decision.status.step.current_step_state == STEP_PAUSED
    assert next(c for c in decision.status.conditions if c.type == "Failed").status == "True"


def test_manual_pause_is_set_confirmed_and_released_by_the_admin():
    cluster = Cluster(3)
    pol = policy(upgradeSteps=[{"replicas": 1, "pause": {}}, {"replicas": "100%", "pauseDuration": 0}])
    cluster.decide(pol, T0)
    cluster.ready_all()
    ready = cluster.decide(pol, T0 + 5)
    assert ready.set_pause is True and ready.status.resume.paused_by_runner
    # the runner crashed before patching pause: the next pass asks again, deletes nothing
    again = cluster.decide(pol, T0 + 10)
    assert again.set_pause is True and again.delete == []
    paused = dataclasses.replace(pol, pause=True)
    confirmed = cluster.decide(paused, T0 + 15)
    assert confirmed.status.resume.pause_confirmed and confirmed.delete == []
    assert cluster.decide(paused, T0 + 3600).delete == []
    resumed = cluster.decide(pol, T0 + 3605)
    assert resumed.status.step.current_step_index == 1 and nodes_of(cluster, resumed) == ["n01"]
    assert "Resumed" in [e.reason for e in resumed.events]


def test_timed_pause_waits_until_recheck_time():
    cluster = Cluster(3)
    pol = policy(upgradeSteps=[{"replicas": 1, "pauseDuration": "10s"}, {"replicas": "100%", "pauseDuration": 0}])
    cluster.decide(pol, T0)
    cluster.ready_all()
    ready = cluster.decide(pol, T0 + 5)
    assert ready.status.step.recheck_time == rfc3339(T0 + 15)
    assert ready.wake_at == T0 + 15 and ready.set_pause is None
    assert cluster.decide(pol, T0 + 14).delete == []
    assert nodes_of(cluster, cluster.decide(pol, T0 + 15)) == ["n01"]


def test_admin_pause_stops_new_deletions_at_any_time():
    cluster = Cluster(4)
    pol = policy(maxParallel=2, upgradeSteps=[{"replicas": "100%"}])
    cluster.decide(pol, T0)
    cluster.ready_all()
    paused = dataclasses.replace(pol, pause=True)
    decision = cluster.decide(paused, T0 + 5)
    assert decision.delete == [] and "paused" in decision.status.message
    assert decision.set_pause is None and not decision.status.resume.paused_by_runner
    assert nodes_of(cluster, cluster.decide(pol, T0 + 10)) == ["n02", "n03"]


def test_enable_rollout_false_mid_rollout_rolls_back_to_disabled():
    cluster = Cluster(4)
    pol = policy(maxParallel=2, upgradeSteps=[{"replicas": "100%"}])
    cluster.decide(pol, T0)
    cluster.ready_all()
    off = dataclasses.replace(pol, enable_rollout=False)
    decision = cluster.decide(off, T0 + 5)
    assert decision.status.phase == DISABLING and decision.restore.revision == "old"
    assert nodes_of(cluster, cluster.decide(off, T0 + 10)) == ["n00", "n01"]
    cluster.ready_all()
    done = cluster.decide(off, T0 + 15)
    assert done.status.phase == DISABLED and cluster.revisions() == {"old": 4}
    assert done.status.resume.abandoned_revision == "new"


def test_forced_rollback_during_the_fallback_pause_releases_the_runners_pause():
    cluster = Cluster(3)
    pol = policy(maxParallel=1, upgradeSteps=[{"replicas": "100%"}])
    cluster.decide(pol, T0)
    cluster.set("n00", phase="Failed")
    assert cluster.decide(pol, T0 + 5).set_pause is True  # fallback pause
    paused_off = dataclasses.replace(pol, pause=True, enable_rollout=False)  # the spec holds the runner's pause
    disabling = cluster.decide(paused_off, T0 + 10)
    assert disabling.status.phase == DISABLING and disabling.set_pause is False
    assert disabling.restore.revision == "old"
    # the runner crashed before patching pause back: the next pass asks again and goes on
    again = cluster.decide(paused_off, T0 + 15)
    assert again.set_pause is False and nodes_of(cluster, again) == ["n00"]
    cluster.ready_all()
    done = cluster.decide(dataclasses.replace(paused_off, pause=False), T0 + 20)
    assert done.set_pause is None and not done.status.resume.release_pause
    assert done.status.phase == DISABLED


def test_enable_rollout_false_replaces_every_pod_at_once():
    cluster = Cluster(5)
    off = policy(enableRollout=False)
    decision = cluster.decide(off, T0)
    assert len(decision.delete) == 5 and decision.status.phase == DISABLED
    assert decision.status.upgrading is False
    cluster.ready_all()
    cluster.decide(off, T0 + 5)
    assert cluster.status.resume.stable_revision == "new"


def in_step_one():
    """Six nodes: step 0 upgraded two, and step 1 started (`maxParallel: 2`); the cluster and policy."""
    cluster = Cluster(6)
    pol = policy(maxParallel=2, upgradeSteps=[{"replicas": 2, "pauseDuration": 0}, {"replicas": "100%"}])
    cluster.decide(pol, T0)
    cluster.ready_all()
    cluster.decide(pol, T0 + 5)  # step 1 starts
    cluster.ready_all()
    return cluster, pol


def test_a_new_revision_mid_rollout_restarts_at_step_zero():
    cluster, pol = in_step_one()
    cluster.revision = "newer"
    decision = cluster.decide(pol, T0 + 10)
    sub = decision.status.step
    assert (sub.current_step_index, sub.last_pod_spec_revision, sub.upgrading_pod_spec_revision) == (0, "old", "newer")
    assert "NewRevision" in [e.reason for e in decision.events]
    assert len(decision.delete) == 2


def test_template_set_back_to_the_last_revision_is_a_rollback():
    cluster = Cluster(4)
    pol = policy(maxParallel=2, upgradeSteps=[{"replicas": "100%"}])
    cluster.decide(pol, T0)
    cluster.ready_all()
    cluster.revision = "old"
    decision = cluster.decide(pol, T0 + 5)
    assert decision.status.phase == TERMINATING and decision.restore is None
    assert nodes_of(cluster, decision) == ["n00", "n01"]


def test_edited_steps_continue_at_the_first_step_reaching_the_upgraded_pods():
    cluster = Cluster(10)
    pol = policy(maxParallel=0, upgradeSteps=[{"replicas": 3}, {"replicas": "100%"}])
    cluster.decide(pol, T0)
    cluster.ready_all()
    cluster.decide(pol, T0 + 5)  # step 0 ready, manual pause
    edited = policy(maxParallel=0, upgradeSteps=[{"replicas": 1}, {"replicas": 2}, {"replicas": 5}, {"replicas": "100%"}])
    decision = cluster.decide(edited, T0 + 10)
    assert decision.status.step.current_step_index == 2
    assert "StepsEdited" in [e.reason for e in decision.events]
    assert len(decision.delete) == 2


def test_nodes_joining_come_up_new_and_nodes_leaving_drop_out_of_n():
    cluster = Cluster(4)
    pol = policy(maxParallel=0, upgradeSteps=[{"replicas": "50%"}, {"replicas": "100%"}])
    cluster.decide(pol, T0)
    assert cluster.status.step.current_upgrade_replicas == 2
    cluster.nodes |= {"n10", "n11"}
    for node in ("n10", "n11"):
        cluster.pods[node] = Pod(f"p-{node}", f"u-{node}", node, "new", True, "Running", 0, T0)
    cluster.nodes.discard("n03")
    del cluster.pods["n03"]
    cluster.ready_all()
    decision = cluster.decide(pol, T0 + 5)
    assert decision.status.step.total_upgrade_replicas == 5
    assert decision.status.step.current_step_state == STEP_PAUSED  # 4 upgraded >= ceil(50% x 5)


def test_pod_stuck_terminating_fails_after_the_timeout():
    cluster = Cluster(2)
    pol = policy(readinessTimeout="1m", upgradeSteps=[{"replicas": "100%", "toleration": 1}])
    decision = cluster.decide(pol, T0)
    stuck = cluster.pods["n00"]
    cluster.pods["n00"] = dataclasses.replace(
        Pod("p-n00-0", "u-n00-0", "n00", "old", False, "Running", 0, T0 - 1000), deleting=T0
    )
    assert stuck.revision == "new" and decision.delete
    assert cluster.decide(pol, T0 + 30).delete == []  # still terminating: the wave waits
    late = cluster.decide(pol, T0 + 61)
    assert late.status.resume.failed.names == ["n00"]
    assert nodes_of(cluster, late) == ["n01"]  # tolerated: the next wave goes


def test_a_retry_gives_a_stuck_node_the_timeout_again_before_the_fallback():
    cluster = Cluster(2)
    pol = policy(readinessTimeout="1m", maxFailureThreshold=1, upgradeSteps=[{"replicas": "100%"}], maxParallel=1)
    cluster.decide(pol, T0)
    cluster.pods["n00"] = Pod("p-n00-0", "u-n00-0", "n00", "old", False, "Running", 0, T0 - 1000, deleting=T0)
    retry = cluster.decide(pol, T0 + 61)
    assert retry.status.step.current_failure_retry == 1 and retry.delete == []
    assert cluster.decide(pol, T0 + 90).status.step.current_step_state == STEP_UPGRADE
    fallback = cluster.decide(pol, T0 + 122)
    assert fallback.status.step.current_step_state == STEP_PAUSED and fallback.set_pause is True


def test_gpu_busy_nodes_are_held_back_and_reported():
    cluster = Cluster(3)
    cluster.busy = {"n00", "n01"}
    pol = policy(maxParallel=0, upgradeSteps=[{"replicas": "100%"}])
    decision = cluster.decide(pol, T0)
    assert nodes_of(cluster, decision) == ["n02"]
    assert decision.status.resume.held.names == ["n00", "n01"]
    assert [e.reason for e in decision.events if e.type == "Warning"] == ["NodesHeldBack"]
    cluster.ready_all()
    assert cluster.decide(pol, T0 + 5).delete == []
    allowed = dataclasses.replace(pol, allow_gpu_workloads=True)
    assert nodes_of(cluster, cluster.decide(allowed, T0 + 10)) == ["n00", "n01"]


def test_nothing_happens_until_the_daemonset_controller_caught_up():
    cluster = Cluster(3)
    decision = engine.decide(cluster.observed(caught_up=False), policy(), None, T0)
    assert decision.delete == [] and decision.status.phase == IDLING
    assert "DaemonSet controller" in decision.status.message


def test_an_int_last_step_below_n_holds_with_a_condition():
    cluster = Cluster(5)
    pol = policy(upgradeSteps=[{"replicas": 1, "pauseDuration": 0}, {"replicas": 4}])
    decision = cluster.decide(pol, T0)
    assert decision.delete == []
    failed = next(c for c in decision.status.conditions if c.type == "Failed")
    assert (failed.status, failed.reason) == ("True", "InvalidPolicy")
    assert "100%" in decision.status.message


def test_a_pass_repeated_on_the_same_state_changes_nothing():
    cluster = Cluster(4)
    pol = policy(maxParallel=2, upgradeSteps=[{"replicas": "100%"}])
    cluster.decide(pol, T0)
    first = cluster.decide(pol, T0 + 5)
    again = engine.decide(cluster.observed(), pol, first.status, T0 + 10)
    assert again.delete == [] and again.events == []
    assert again.status.step.last_update_time == first.status.step.last_update_time


def test_idle_records_the_settled_template_and_driver_spec():
    cluster = Cluster(2, old="new")
    decision = cluster.decide(policy(), T0)
    assert decision.status.phase == IDLING and decision.delete == []
    assert (decision.status.last_applied_spec, decision.status.last_co_driver_spec) == ("template-new", "spec-new")


def test_a_rollout_started_right_after_a_completed_one_records_the_completed_revisions_spec():
    """Regression (e2e: a forced rollback landed on the install-time driver version): the pass that
    completes a rollout must record its template and spec.driver as lastAppliedSpec and
    lastCoDriverSpec. When the next version arrives before any idle pass (a runner restarted, or an
    admin quick to patch), the next rollout otherwise records the spec of the rollout BEFORE, and
    its rollback writes that older spec.driver back to the CR while restoring the newer revision."""
    cluster = Cluster(4)
    pol = policy(maxParallel=2)
    cluster.revision = "old"
    assert cluster.decide(pol, T0).status.last_co_driver_spec == "spec-old"  # idle at the install revision
    cluster.revision = "new"
    now = drive(cluster, pol, T0 + 5)  # stops at the pass that completes: no idle pass after it
    assert cluster.status.step.current_step_state == COMPLETED and cluster.revisions() == {"new": 4}
    cluster.revision = "newer"
    started = cluster.decide(pol, now)
    assert started.status.phase == PROGRESSING
    assert started.status.step.last_pod_spec_revision == "new"
    assert (started.status.last_applied_spec, started.status.last_co_driver_spec) == ("template-new", "spec-new")
    cluster.ready_all()
    rollback = cluster.decide(dataclasses.replace(pol, enable_rollout=False), now + 5)
    assert rollback.restore.revision == "new" and rollback.status.last_co_driver_spec == "spec-new"


# -- node safety: cordons, re-deletions, skipped nodes -------------------------------------------


def test_a_cordoned_node_is_uncordoned_once_its_new_pod_is_ready():
    cluster = Cluster(3)
    pol = policy(maxParallel=1, upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    first = cluster.decide(pol, T0)
    assert nodes_of(cluster, first) == ["n00"] and cluster.cordoned == {"n00"}
    assert cluster.decide(pol, T0 + 1).uncordon == []  # the new pod is not Ready yet
    assert cluster.status.resume.cordoned.names == ["n00"]
    cluster.ready_all()
    second = cluster.decide(pol, T0 + 2)
    assert second.uncordon == ["n00"] and nodes_of(cluster, second) == ["n01"]
    drive(cluster, pol, T0 + 3)
    assert cluster.status.step.current_step_state == COMPLETED
    assert cluster.decide(pol, T0 + 100).uncordon == [] and cluster.cordoned == set()


def test_a_node_whose_new_driver_fails_stays_cordoned():
    cluster = Cluster(2)
    pol = policy(maxParallel=0, readinessTimeout="1m", upgradeSteps=[{"replicas": "100%", "toleration": 1, "pauseDuration": 0}])
    cluster.decide(pol, T0)
    cluster.ready_all()
    cluster.set("n00", ready=False, phase="Failed")
    done = cluster.decide(pol, T0 + 5)
    assert done.status.step.current_step_state in (STEP_PAUSED, STEP_READY, COMPLETED)
    assert done.uncordon == ["n01"]
    assert cluster.decide(pol, T0 + 10).uncordon == [] and cluster.cordoned == {"n00"}


def test_a_cordon_found_on_a_node_outside_any_swap_is_released():
    """A runner killed after the uncordon decision, before the uncordon: the next one finishes it."""
    cluster = Cluster(2, old="new")
    cluster.cordoned = {"n01", "gone-node"}
    assert sorted(cluster.decide(policy(), T0).uncordon) == ["gone-node", "n01"]


def test_a_wave_node_whose_pod_is_still_to_be_replaced_stays_cordoned():
    """The runner cordoned, then died before deleting: its pod is Ready at the old revision, and
    stays cordoned while the pause holds the re-deletion."""
    cluster = Cluster(2)
    pol = policy(maxParallel=1, upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    cluster.decide(pol, T0)
    cluster.pods["n00"] = Pod("p-n00-0", "u-n00-0", "n00", "old", True, "Running", 0, T0 - 1000)  # not deleted
    paused = cluster.decide(dataclasses.replace(pol, pause=True), T0 + 1)
    assert paused.delete == [] and paused.uncordon == []
    again = cluster.decide(pol, T0 + 2)
    assert [ref.uid for ref in again.delete] == ["u-n00-0"] and again.uncordon == []


def test_a_re_deletion_passes_the_same_busy_node_check_as_a_first_deletion():
    cluster = Cluster(2)
    pol = policy(maxParallel=1, upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    cluster.decide(pol, T0)
    cluster.pods["n00"] = Pod("p-n00-0", "u-n00-0", "n00", "old", True, "Running", 0, T0 - 1000)  # not deleted
    cluster.busy = {"n00"}  # a GPU pod landed meanwhile
    held = cluster.decide(pol, T0 + 1)  # n00 leaves the wave, held back; the next wave takes n01
    assert "u-n00-0" not in [ref.uid for ref in held.delete] and held.status.resume.held.names == ["n00"]
    assert nodes_of(cluster, held) == ["n01"]
    cluster.ready_all()
    cluster.busy = set()
    assert [ref.uid for ref in cluster.decide(pol, T0 + 2).delete] == ["u-n00-0"]


def test_skipped_nodes_keep_their_driver_are_listed_and_the_rollout_completes():
    cluster = Cluster(4)
    cluster.skipped = {"n01", "n03"}
    pol = policy(maxParallel=0, upgradeSteps=[{"replicas": 1, "pauseDuration": 0}, {"replicas": "100%", "pauseDuration": 0}])
    first = cluster.decide(pol, T0)
    assert first.status.resume.skipped.names == ["n01", "n03"] and first.status.resume.skipped.count == 2
    drive(cluster, pol, T0 + 1)
    assert cluster.status.step.current_step_state == COMPLETED
    assert cluster.status.step.total_upgrade_replicas == 2 == cluster.status.step.total_upgrade_ready_replicas
    assert {n: p.revision for n, p in cluster.pods.items()} == {"n00": "new", "n01": "old", "n02": "new", "n03": "old"}


def test_drain_takes_a_busy_node_last_cordons_it_evicts_its_gpu_pods_then_swaps_its_driver():
    cluster = Cluster(2)
    cluster.busy = {"n00"}
    pol = policy(maxParallel=1, drain={"enable": True}, upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    assert nodes_of(cluster, cluster.decide(pol, T0)) == ["n01"]  # the free node first
    cluster.ready_all()
    taken = cluster.decide(pol, T0 + 5)
    assert taken.delete == [] and taken.cordon == ["n00"] and taken.status.resume.wave == ["n00"]
    assert taken.status.resume.held.names == []
    draining = cluster.decide(pol, T0 + 6)
    assert draining.delete == [] and draining.evict == ["n00"] and draining.cordon == []
    assert "waiting for their work to end" in draining.status.message
    assert cluster.decide(dataclasses.replace(pol, pause=True), T0 + 7).evict == []  # a pause stops the drain
    cluster.busy = set()  # the evicted GPU pods are gone
    assert [ref.node for ref in cluster.decide(pol, T0 + 8).delete] == ["n00"]
    drive(cluster, pol, T0 + 9)
    assert cluster.status.step.current_step_state == COMPLETED and cluster.cordoned == set()


def test_a_wait_that_times_out_holds_the_node_back_uncordoned_until_its_work_ends():
    cluster = Cluster(2)
    cluster.waiting = {"n00"}
    pol = policy(
        maxParallel=0,
        waitForCompletion={"podSelector": "app=training", "timeout": "1m"},
        upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}],
    )
    first = cluster.decide(pol, T0)
    assert nodes_of(cluster, first) == ["n01"] and first.cordon == ["n00"] and first.evict == []
    cluster.ready_all()
    assert cluster.decide(pol, T0 + 30).delete == []  # still waiting, drain off: nothing evicted
    assert cluster.evicted == []
    late = cluster.decide(pol, T0 + 61)
    assert [(e.type, e.reason) for e in late.events] == [("Warning", "WaitTimeout"), ("Warning", "NodesHeldBack")]
    assert late.status.resume.timed_out_nodes == ["n00"] and late.uncordon == ["n00"]
    again = cluster.decide(pol, T0 + 70)
    assert again.delete == [] and again.status.resume.held.names == ["n00"]
    assert again.status.step.current_step_state == STEP_UPGRADE  # not complete without n00
    cluster.waiting = set()
    assert nodes_of(cluster, cluster.decide(pol, T0 + 80)) == ["n00"]


def test_a_drain_that_times_out_with_on_timeout_fail_counts_against_the_toleration():
    cluster = Cluster(3)
    cluster.busy = {"n00"}
    pol = policy(
        maxParallel=0,
        drain={"enable": True, "timeout": "30s"},
        onTimeout="fail",
        maxUnavailable=1,
        upgradeSteps=[{"replicas": "100%", "pauseDuration": 0, "toleration": 1}],
    )
    cluster.decide(pol, T0)
    cluster.ready_all()
    assert cluster.decide(pol, T0 + 1).evict == ["n00"]
    late = cluster.decide(pol, T0 + 32)
    assert [e.reason for e in late.events if e.type == "Warning"] == ["DrainTimeout"]
    assert late.status.resume.failed.names == ["n00"]
    assert late.status.step.current_step_state in (STEP_PAUSED, STEP_READY, COMPLETED)
    drive(cluster, pol, T0 + 33)
    assert cluster.status.step.current_step_state == COMPLETED
    assert cluster.pods["n00"].revision == "old" and cluster.cordoned == set()


def test_a_drain_timeout_beyond_the_toleration_is_retried_with_a_new_drain():
    cluster = Cluster(2)
    cluster.busy = {"n00"}
    pol = policy(
        maxParallel=0,
        drain={"enable": True, "timeout": "30s"},
        onTimeout="fail",
        maxFailureThreshold=1,
        upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}],
    )
    cluster.decide(pol, T0)
    cluster.ready_all()
    cluster.decide(pol, T0 + 1)
    retry = cluster.decide(pol, T0 + 32)
    assert retry.status.step.current_failure_retry == 1 and retry.delete == []
    assert cluster.decide(pol, T0 + 33).status.resume.wave_kind == "retry"
    assert cluster.decide(pol, T0 + 34).evict == ["n00"]  # drained again, with a new timeout
    cluster.busy = set()
    assert [ref.node for ref in cluster.decide(pol, T0 + 40).delete] == ["n00"]


def test_handlers_name_the_next_one_and_a_chain_that_does_not_settle_is_an_error(monkeypatch):
    """Each handler returns what runs next: a pass that would cycle raises instead of looping."""
    monkeypatch.setattr(Rollback, "idle", lambda self: Next.IDLE)
    with pytest.raises(engine.Unsettled, match=r"did not settle within 18 steps \(phase Idling.*idle -> idle"):
        engine.decide(Cluster(2).observed(), policy(), None, T0)


class Terminating(Cluster):
    """As Cluster, but a deleted pod stays Terminating for `GRACE` seconds (`finish` ends those
    past it); then the DaemonSet creates its successor, not Ready."""

    GRACE = 3

    def decide(self, pol, now: float) -> Decision:
        decision = engine.decide(self.observed(), pol, self.status, now)
        self.status = decision.status
        for ref in decision.delete:
            pod = self.pods[ref.node]
            if pod.uid == ref.uid and pod.deleting is None:
                self.pods[ref.node] = dataclasses.replace(pod, deleting=now)
        if decision.restore is not None:
            self.revision = decision.restore.revision
        return decision

    def finish(self, now: float) -> None:
        for node, pod in list(self.pods.items()):
            if pod.deleting is not None and now - pod.deleting >= self.GRACE:
                self.serial += 1
                self.pods[node] = Pod(
                    f"p-{node}-{self.serial}", f"u-{node}-{self.serial}", node, self.revision, False, "Running", 0, now
                )

    def down(self) -> int:
        return sum(1 for p in self.pods.values() if p.deleting is not None or not p.ready)


@pytest.mark.parametrize("change", ["enableRollout false", "a new revision"])
def test_aborting_or_retargeting_mid_wave_never_takes_more_than_max_parallel_nodes(change):
    # 20 nodes in waves of 4; the second wave's pods are still Terminating when the admin aborts
    # (rollback in waves) or a newer version arrives (the rollout restarts at step 0).
    cluster, now = Terminating(20), T0
    pol = policy(maxParallel=4, upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    cluster.decide(pol, now)
    cluster.finish(now + Terminating.GRACE)
    cluster.ready_all()
    now += 5
    assert len(cluster.decide(pol, now).delete) == 4 and cluster.down() == 4  # wave 2, Terminating
    if change == "enableRollout false":
        pol = dataclasses.replace(pol, enable_rollout=False)
    else:
        cluster.revision = "newer"
    for _ in range(60):
        now += 1
        cluster.decide(pol, now)
        assert cluster.down() <= 4, f"{cluster.down()} nodes down at once: {cluster.status.message}"
        cluster.finish(now)
        cluster.ready_all()
        if cluster.status.phase in (IDLING, DISABLED) and not cluster.status.upgrading:
            break
    assert set(cluster.revisions()) == {"old" if change == "enableRollout false" else "newer"}, cluster.revisions()


def test_a_wave_node_whose_deletion_was_lost_and_that_gets_gpu_work_leaves_the_wave():
    # Wave [n00, n01]; n01's cordon was refused (409) so its pod stayed, and a GPU job then landed
    # on it: the wave must not wait for that job; n01 is held back and the rollout goes on.
    cluster = Cluster(4)
    pol = policy(maxParallel=2, upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    decision = engine.decide(cluster.observed(), pol, None, T0)
    cluster.status = decision.status
    assert decision.status.resume.wave == ["n00", "n01"]
    cluster.serial += 1
    cluster.pods["n00"] = Pod("p-n00-new", "u-n00-new", "n00", "new", True, "Running", 0, T0)
    cluster.cordoned.add("n00")
    cluster.busy = {"n01"}
    later = cluster.decide(pol, T0 + 60)
    assert nodes_of(cluster, later) == ["n02", "n03"], later.status.message
    assert later.status.resume.held.names == ["n01"]
    cluster.ready_all()
    cluster.busy = set()  # the job ends: n01 is taken
    assert nodes_of(cluster, cluster.decide(pol, T0 + 120)) == ["n01"]


def test_a_template_set_back_during_an_all_at_once_replacement_replaces_the_pods_it_had_replaced():
    """`enableRollout: false`: a new revision replaces the pods at once, but a GPU-busy node's is
    held back; the template set back to the stable revision before that node is free (a `helm
    rollback` right after the upgrade) leaves the replaced pods at the abandoned revision, which
    must go too, not be taken for settled."""
    cluster = Cluster(3, old="a", new="a")
    pol = policy(enableRollout=False, upgradeSteps=[])
    assert cluster.decide(pol, T0).status.resume.settled_at == rfc3339(T0)
    cluster.revision, cluster.busy = "b", {"n02"}
    assert nodes_of(cluster, cluster.decide(pol, T0 + 5)) == ["n00", "n01"]
    cluster.ready_all()
    cluster.decide(pol, T0 + 10)
    cluster.revision = "a"  # set back
    assert nodes_of(cluster, cluster.decide(pol, T0 + 15)) == ["n00", "n01"]
    cluster.ready_all()
    done = cluster.decide(pol, T0 + 20)
    assert cluster.revisions() == {"a": 3} and done.delete == [] and done.status.resume.stable_revision == "a"


def test_a_pod_re_created_from_a_template_set_back_before_the_runner_saw_it_is_rolled_back():
    """The template goes to b and back to a between two passes (the runner held, or down), and
    meanwhile someone deleted n01's driver pod: the DaemonSet controller re-created it at b. The
    fleet is not settled: a rollback to a replaces it in waves, and b is the abandoned revision.
    A pod at another revision from before the fleet settled (n03, skipped then) is no reason for
    one, but goes with it."""
    cluster = Cluster(4, old="a", new="a")
    cluster.pods["n03"] = dataclasses.replace(cluster.pods["n03"], revision="z")
    cluster.skipped = {"n03"}
    pol = policy(maxParallel=1, upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    assert cluster.decide(pol, T0).status.phase == IDLING
    cluster.skipped = set()
    unskipped = cluster.decide(pol, T0 + 5)
    assert unskipped.status.phase == IDLING and unskipped.delete == []
    cluster.pods["n01"] = Pod("p-n01-b", "u-n01-b", "n01", "b", True, "Running", 0, T0 + 6)
    started = cluster.decide(pol, T0 + 10)
    assert started.status.phase == TERMINATING and nodes_of(cluster, started) == ["n01"]
    assert started.status.resume.abandoned_revision == "b" and started.events[0].reason == "PodsBehind"
    drive(cluster, pol, T0 + 15)
    assert cluster.revisions() == {"a": 4} and cluster.status.phase == IDLING


@pytest.mark.parametrize("enable_rollout", [True, False])
def test_a_revision_that_changes_only_where_driver_pods_run_replaces_no_pod(enable_rollout):
    """A toleration added to the driver through the CR, or a node pool added beside it: the new
    revision runs the same driver, its pods stay, and it becomes the stable revision at once."""
    cluster = Cluster(4, old="a", new="a")
    pol = policy(enableRollout=enable_rollout, maxParallel=1, upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    cluster.decide(pol, T0)
    cluster.revision, cluster.same = "b", {"a"}
    decision = cluster.decide(pol, T0 + 5)
    assert decision.delete == [] and decision.status.upgrading is False
    assert decision.status.resume.stable_revision == "b"
    assert decision.status.phase == (IDLING if enable_rollout else DISABLED)
    assert [e.reason for e in decision.events] == ["SameDriver"]
    assert "only in where driver pods may run" in decision.events[0].message
    assert cluster.decide(pol, T0 + 10).events == []  # said once
    cluster.revision, cluster.same = "c", set()  # then a new driver: every node's pod is replaced
    drive(cluster, pol, T0 + 15)
    assert cluster.revisions() == {"c": 4} and cluster.status.resume.stable_revision == "c"


def test_a_revision_that_changes_only_where_pods_run_mid_rollout_lets_the_rollout_go_on():
    cluster, pol = in_step_one()
    cluster.revision, cluster.same = "new-tolerating", {"new"}
    decision = cluster.decide(pol, T0 + 10)
    sub = decision.status.step
    assert (sub.current_step_index, sub.last_pod_spec_revision, sub.upgrading_pod_spec_revision) == (1, "old", "new-tolerating")
    assert sub.total_upgrade_ready_replicas == 4 and nodes_of(cluster, decision) == ["n04", "n05"]
    assert not {"NewRevision", "SameDriver"} & {e.reason for e in decision.events}


def test_a_template_set_back_to_the_stable_driver_with_other_scheduling_is_a_rollback_of_the_new_pods():
    cluster = Cluster(4)
    pol = policy(maxParallel=2, upgradeSteps=[{"replicas": "100%"}])
    cluster.decide(pol, T0)
    cluster.ready_all()
    cluster.revision, cluster.same = "old-tolerating", {"old"}
    decision = cluster.decide(pol, T0 + 5)
    assert decision.status.phase == TERMINATING and decision.restore is None
    assert decision.status.step.last_pod_spec_revision == "old-tolerating"
    assert nodes_of(cluster, decision) == ["n00", "n01"]
    drive(cluster, pol, T0 + 10)
    assert cluster.status.resume.stable_revision == "old-tolerating" and cluster.status.phase == IDLING
    assert {p.revision for p in cluster.observed().pods} == {"old-tolerating"}
