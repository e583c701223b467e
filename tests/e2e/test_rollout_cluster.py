"""The staged driver rollout on the real control plane (kube-apiserver, controller manager with the
real DaemonSet controller, scheduler, etcd, kwok nodes): `metax-operator run` processes, as the
chart's runner ServiceAccount, drive the metax-driver DaemonSet (OnDelete) through the seed's
policies while the test changes the driver version, injects faults and kills runners.

The chart is installed with Helm 3 without hooks (hook Jobs cannot run under kwok); the CR is
created by `metax-operator bootstrap`, as the post-install hook would. Admin actions use the
seed's kubectl commands, corrected (docs/rollout-admin.md), with the real kubectl.

Evidence comes from the API server (pods, the CR's status and events) and from the runners' JSON
log lines (`rollout-pass`: the step and the pods deleted in that pass).
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from kubernetes import client, watch

from metax_operator.contract import RETRY_LABEL, STATE_LABEL
from tests.cases import SEED_POLICY
from tests.e2e import tools
from tests.e2e.tools import (
    CR,
    METAX,
    bootstrap,
    delete_cr,
    get_cr,
    helm3,
    install_chart,
    kubectl,
    log_entries,
    more_passes,
    ready,
    release_values,
    run,
    seed_patch,
    service_account_kubeconfig,
    uninstall_chart,
)
from tests.helm import CHART
from tests.rollout.test_engine import TABLE_3_16_STATUS
from tests.waiting import consistently, eventually

NS = "rollout-e2e"
RELEASE = "metax"
DRIVER_PODS = tools.DRIVER_PODS
EVENTS_NS = "default"  # where the API server keeps events of cluster-scoped objects
NODES = 10  # the control plane fixture's GPU nodes

# Where the seed's exact durations are not the point: the same steps, no pauses.
QUICK_POLICY = {
    **SEED_POLICY,
    "upgradeSteps": [
        {"replicas": 2, "pauseDuration": 0},
        {"replicas": 5, "pauseDuration": 0},
        {"replicas": "100%", "pauseDuration": 0},
    ],
}

# The seed's admin commands, corrected (resource name, --type=json, /spec paths, pause: true pauses).


# -- helpers -----------------------------------------------------------------------------------


def node_states(cp) -> dict[str, str]:
    """Each labelled node's upgrade state, as `kubectl get nodes -L` shows it."""
    rows = kubectl(cp, "get", "nodes", "-L", STATE_LABEL, "--no-headers").splitlines()
    return {fields[0]: fields[5] for fields in map(str.split, rows) if len(fields) > 5}


def upgrade_status(api) -> dict:
    return (get_cr(api).get("status") or {}).get("upgradeStatus") or {}


def sub(api) -> dict:
    return upgrade_status(api).get("status") or {}


def condition(api, kind: str) -> dict:
    return next((c for c in upgrade_status(api).get("condition") or [] if c["type"] == kind), {})


def patch_driver(api, driver: dict) -> None:
    client.CustomObjectsApi(api).patch_cluster_custom_object(*CR, {"spec": {"driver": driver}})


def driver_pods(api) -> list:
    return tools.driver_pods(api, NS)


def revisions(api) -> Counter:
    return Counter(p.metadata.labels.get("controller-revision-hash") for p in driver_pods(api))


def all_at(api, revision: str) -> bool:
    pods = driver_pods(api)
    return len(pods) == NODES and all(p.metadata.labels.get("controller-revision-hash") == revision and ready(p) for p in pods)


def template(api) -> dict:
    ds = client.AppsV1Api(api).read_namespaced_daemon_set("metax-driver", NS)
    return api.sanitize_for_serialization(ds.spec.template)


def newest_revision_number(api) -> int:
    """The highest ControllerRevision number of the driver DaemonSet."""
    revisions_ = client.AppsV1Api(api).list_namespaced_controller_revision(NS).items
    return max(r.revision for r in revisions_ if r.metadata.name.startswith("metax-driver-"))


def payload_image(api) -> str:
    init = template(api)["spec"]["initContainers"]
    return next(c["image"] for c in init if c["name"] == "payload")


class Runner:
    """A `metax-operator run` process (the chart's runner ServiceAccount), JSON log in a file."""

    def __init__(self, kubeconfig: Path, tmp: Path, identity: str, *more: str):
        self.log_path = tmp / f"{identity}.log"
        self.proc = subprocess.Popen(
            [
                METAX,
                "run",
                "--namespace",
                NS,
                "--kubeconfig",
                str(kubeconfig),
                "--identity",
                identity,
                "--interval",
                "1",
                "--lease-duration",
                "3",
                "--renew-deadline",
                "2",
                "--retry-period",
                "1",
                "--log-level",
                "debug",
                *more,
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log_path.open("w"),
        )

    def lines(self, action: str) -> list[dict]:
        return log_entries(self.log_path, action)

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(30)


def deletions_per_step(runners: list[Runner]) -> dict[int, list[int]]:
    """Step -> sizes of the successive waves: the pods each pass deleted for the first time."""
    seen: set[str] = set()
    waves: dict[int, list[int]] = defaultdict(list)
    for r in runners:
        for line in r.lines("rollout-pass"):
            new = [name for name in line["deleted"] if name not in seen]
            seen.update(new)
            if new:
                waves[line["step"]].append(len(new))
    return dict(waves)


class PodHistory:
    """Every driver pod the API server created, per node, from a watch (the test's own witness)."""

    def __init__(self, api):
        self.created: dict[str, set[str]] = defaultdict(set)
        self.deleted: set[str] = set()
        self.deleted_at: dict[str, float] = {}  # uid -> when its deletion was first seen
        self.ready_at: dict[str, float] = {}  # uid -> when it was first seen Ready
        self._stop = threading.Event()
        self._watch = watch.Watch()
        core = client.CoreV1Api(api)
        start = core.list_namespaced_pod(NS, label_selector=DRIVER_PODS)
        self.before = {p.metadata.uid for p in start.items}
        self._thread = threading.Thread(target=self._run, args=(core, start.metadata.resource_version), daemon=True)
        self._thread.start()

    def _run(self, core, version: str) -> None:
        try:
            self._follow(core, version)
        except Exception:  # noqa: BLE001 - the control plane stopping ends the watch
            pass

    def _follow(self, core, version: str) -> None:
        for change in self._watch.stream(
            core.list_namespaced_pod, NS, label_selector=DRIVER_PODS, resource_version=version, timeout_seconds=600
        ):
            pod = change["object"]
            if pod.spec.node_name:
                self.created[pod.spec.node_name].add(pod.metadata.uid)
            uid = pod.metadata.uid
            if pod.metadata.deletion_timestamp is not None or change["type"] == "DELETED":
                self.deleted.add(uid)
                self.deleted_at.setdefault(uid, time.monotonic())
            elif ready(pod):
                self.ready_at.setdefault(uid, time.monotonic())

    def stop(self) -> None:
        self._watch.stop()

    def deletions_per_node(self) -> dict[str, int]:
        return {node: len(uids & self.deleted) for node, uids in self.created.items()}


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api(control_plane):
    return control_plane.api()


@pytest.fixture(scope="module")
def installed(control_plane, api, tmp_path_factory):
    """The chart (rollout enabled, the seed policy) installed with Helm 3, the CR bootstrapped."""
    tmp = tmp_path_factory.mktemp("rollout-install")
    cp = control_plane
    install_chart(
        cp,
        api,
        tmp,
        RELEASE,
        NS,
        {"registry": "cr.example.com/metax", "driver": {"payload": {"version": "2.32.0.6"}, "upgradePolicy": SEED_POLICY}},
    )
    bootstrap(cp, tmp, RELEASE, release_values(cp, RELEASE, NS))
    kubeconfig = service_account_kubeconfig(cp, tmp, "metax-operator-runner", NS)
    eventually(lambda: len(driver_pods(api)) == NODES and all(ready(p) for p in driver_pods(api)), 60, "every driver pod Ready")
    yield {"kubeconfig": kubeconfig, "helm": helm3(cp), "tmp": tmp}
    uninstall_chart(cp, api, RELEASE, NS)


_versions = iter(range(1, 1000))


@pytest.fixture
def idle(installed, api, tmp_path):
    """A runner, the rollout idle with every pod Ready at one revision; the runners the test
    starts are stopped at its end."""
    runners = [Runner(installed["kubeconfig"], tmp_path, "runner-0")]
    try:
        eventually(
            lambda: upgrade_status(api).get("phase") in ("Idling", "Disabled") and not upgrade_status(api).get("upgrading"),
            60,
            "an idle rollout",
        )
        eventually(lambda: len(revisions(api)) == 1 and all(ready(p) for p in driver_pods(api)), 60, "one revision")
        yield {**installed, "runners": runners, "tmp": tmp_path}
    finally:
        for r in runners:
            r.stop(signal.SIGKILL)


def new_version() -> str:
    return f"2.33.0.{next(_versions)}"


def start_rollout(cp, api, policy: dict) -> tuple[str, str]:
    """Set the policy, then change the driver version with the seed's kubectl patch (step 8);
    returns (old revision, new revision)."""
    patch_driver(api, {"upgradePolicy": policy})
    old = next(iter(revisions(api)))
    kubectl(
        cp,
        "patch",
        "ClusterOperator/cluster-operator",
        "--type",
        "json",
        "--patch",
        json.dumps([{"op": "replace", "path": "/spec/driver/payload/version", "value": new_version()}]),
    )

    def started() -> str | None:  # one read: the revision and the phase of the same status
        status = upgrade_status(api)
        revision = (status.get("status") or {}).get("upgradingPodSpecRevision")
        return revision if status.get("phase") == "Progressing" and revision not in (None, "", old) else None

    return old, eventually(started, 30, "the rollout to start")


# -- the seed policy ---------------------------------------------------------------------------


def test_seed_policy_runs_to_completion(control_plane, api, idle):
    cp = control_plane
    history = PodHistory(api)
    old, new = start_rollout(cp, api, SEED_POLICY)
    shown = kubectl(cp, "get", "clusteroperators")
    assert "PHASE" in shown and "STEP" in shown and "UPGRADED" in shown and "TOTAL" in shown

    # Step 0: two waves of one, then the runner pauses (spec pause: true) and waits for the admin.
    eventually(
        lambda: sub(api).get("currentStepState") == "StepPaused" and sub(api)["currentStepIndex"] == 0, 60, "step 0 paused"
    )
    eventually(lambda: get_cr(api)["spec"]["driver"]["upgradePolicy"]["pause"] is True, 10, "pause: true set")
    consistently(
        lambda: sub(api)["currentStepIndex"] == 0 and revisions(api)[new] == 2,
        more_passes(idle["runners"][0], 3),
        30,
        "a manual pause holding",
    )
    assert Counter(node_states(cp).values()) == {"done": 2, "pending": NODES - 2}  # kubectl get nodes -L
    status = json.loads(
        kubectl(cp, "get", "clusteroperators.gpu.metax-tech.com", "cluster-operator", "-o", "jsonpath={.status.upgradeStatus}")
    )
    assert set(status["status"]) >= TABLE_3_16_STATUS
    assert status["upgrading"] is True and status["phase"] == "Progressing"
    assert status["status"]["lastPodSpecRevision"] == old and status["lastAppliedSpec"]
    seed_patch(cp, "pause", False)  # resume (the seed had true/false swapped)

    # Steps 1 and 2 end in 10 s pauses that continue on their own.
    resumed = time.monotonic()
    eventually(lambda: sub(api).get("currentStepIndex") == 3, 90, "step 3 reached without the admin")
    assert time.monotonic() - resumed >= 20, "two 10 s pauses"
    assert get_cr(api)["spec"]["driver"]["upgradePolicy"]["pause"] is False

    # The last step pauses too: the admin's confirmation completes the rollout.
    eventually(lambda: sub(api).get("currentStepState") == "StepPaused", 60, "last step paused")
    eventually(lambda: get_cr(api)["spec"]["driver"]["upgradePolicy"]["pause"] is True, 10, "pause: true set")
    assert upgrade_status(api)["phase"] == "Progressing"
    seed_patch(cp, "pause", False)
    eventually(lambda: sub(api).get("currentStepState") == "Completed", 30, "Completed")
    assert all_at(api, new)
    eventually(lambda: set(node_states(cp).values()) == {"done"}, 30, "every node's state done")
    # One rollout over the fleet of x86 and Arm servers: its steps counted both (the waves above).
    nodes = {n.metadata.name: n.metadata.labels["kubernetes.io/arch"] for n in client.CoreV1Api(api).list_node().items}
    assert Counter(nodes[p.spec.node_name] for p in driver_pods(api)) == {"amd64": 6, "arm64": 4}
    final = upgrade_status(api)
    assert final["phase"] == "Idling" and final["upgrading"] is False
    assert final["status"]["totalUpgradeReadyReplicas"] == NODES == final["status"]["totalUpgradeReplicas"]
    assert condition(api, "Succeed")["status"] == "True"
    assert deletions_per_step(idle["runners"]) == {0: [1, 1], 1: [2, 1], 2: [2, 1], 3: [1, 1]}
    history.stop()
    assert set(history.deletions_per_node().values()) == {1}, history.deletions_per_node()
    events = client.CoreV1Api(api).list_namespaced_event(EVENTS_NS, field_selector="involvedObject.name=cluster-operator")
    reasons = [e.reason for e in events.items]
    assert reasons.count("StepReady") >= 4 and "Completed" in reasons and "RolloutStarted" in reasons
    row = kubectl(cp, "get", "clusteroperators", "--no-headers").split()
    assert row[1:5] == ["Idling", "3", str(NODES), str(NODES)], row


def test_admin_pause_stops_new_deletions(control_plane, api, idle):
    cp = control_plane
    policy = {**QUICK_POLICY, "maxParallel": 1}
    old, new = start_rollout(cp, api, policy)
    eventually(lambda: revisions(api)[new] >= 1, 30, "the first upgraded pod")
    seed_patch(cp, "pause", True)
    eventually(lambda: len(pods := driver_pods(api)) == NODES and all(map(ready, pods)), 30, "the wave in flight to finish")
    held = revisions(api)[new]
    assert held < NODES
    consistently(lambda: revisions(api)[new] == held, more_passes(idle["runners"][0], 4), 30, "no deletion while paused")
    seed_patch(cp, "pause", False)
    eventually(lambda: sub(api).get("currentStepState") == "Completed", 60, "Completed after resume")
    assert all_at(api, new)


def first_cr_where(api, since: str, check, timeout: int = 90) -> dict:
    """The first version of the CR after resourceVersion `since` that satisfies `check`, from a
    watch: a status that a later pass overwrites within a second is still seen."""
    stream = watch.Watch().stream(
        client.CustomObjectsApi(api).list_cluster_custom_object,
        *CR[:3],
        field_selector=f"metadata.name={CR[3]}",
        resource_version=since,
        timeout_seconds=timeout,
    )
    for change in stream:
        if check(change["object"]):
            return change["object"]
    raise AssertionError(f"no version of the CR within {timeout}s satisfied the check")


def test_a_forced_rollback_right_after_a_completed_rollout_returns_to_its_revision(control_plane, api, idle):
    """Regression: a runner replaced right after a rollout completed, then a new version and
    `enableRollout: false`, rolled the driver back to the version of the rollout BEFORE (the CR's
    spec.driver restored from a stale lastCoDriverSpec), a revision nobody asked for."""
    cp = control_plane
    runners = idle["runners"]
    since = get_cr(api)["metadata"]["resourceVersion"]
    _, done = start_rollout(cp, api, QUICK_POLICY)
    completed = first_cr_where(
        api,
        since,
        lambda cr: (
            (((cr.get("status") or {}).get("upgradeStatus") or {}).get("status") or {}).items()
            >= {"upgradingPodSpecRevision": done, "currentStepState": "Completed"}.items()
        ),
    )
    runners[-1].stop(signal.SIGKILL)  # no idle pass after the one that completed
    version = completed["spec"]["driver"]["payload"]["version"]
    recorded = completed["status"]["upgradeStatus"]
    # The very status that says Completed already records the completed revision's spec and template.
    assert json.loads(recorded["lastCoDriverSpec"])["payload"]["version"] == version
    init = json.loads(recorded["lastAppliedSpec"])["spec"]["initContainers"]
    assert next(c["image"] for c in init if c["name"] == "payload").endswith(f":{version}")
    eventually(lambda: all_at(api, done), 30, "every pod at the completed revision")
    before = template(api)

    kubectl(
        cp,
        "patch",
        "ClusterOperator/cluster-operator",
        "--type",
        "json",
        "--patch",
        json.dumps([{"op": "replace", "path": "/spec/driver/payload/version", "value": new_version()}]),
    )
    runners.append(Runner(idle["kubeconfig"], idle["tmp"], "runner-1"))
    eventually(
        lambda: (s := sub(api)).get("upgradingPodSpecRevision") not in (None, "", done) and s["lastPodSpecRevision"] == done,
        30,
        "the next rollout to start",
    )
    seed_patch(cp, "enableRollout", False)
    eventually(
        lambda: upgrade_status(api).get("phase") == "Disabled" and all_at(api, done), 90, "rolled back to the completed revision"
    )
    assert template(api) == before
    assert get_cr(api)["spec"]["driver"]["payload"]["version"] == version
    consistently(
        lambda: template(api) == before and all_at(api, done),
        more_passes(runners[-1], 3),
        30,
        "the runner's reconcile keeping the restored template",
    )
    patch_driver(api, {"upgradePolicy": {"enableRollout": True}})


def test_a_forced_rollback_of_a_rollout_first_met_in_flight_converges(control_plane, api, installed, tmp_path):
    """Regression: a runner whose first pass meets the pods at an older revision records no
    lastCoDriverSpec for it; a forced rollback then restored the template but not the CR, so
    every other pass the reconcile re-applied the abandoned version and the rollout restored the
    template again, for ever. The CR now goes back to the old revision's spec and stays there."""
    cp = control_plane
    setup = Runner(installed["kubeconfig"], tmp_path, "runner-setup")
    try:  # settle whatever an earlier test left, then no runner: nothing records anything
        eventually(
            lambda: (
                upgrade_status(api).get("phase") in ("Idling", "Disabled")
                and not upgrade_status(api).get("upgrading")
                and len(revisions(api)) == 1
                and all(ready(p) for p in driver_pods(api))
            ),
            90,
            "an idle rollout",
        )
    finally:
        setup.stop()
    old, before = next(iter(revisions(api))), template(api)
    version = get_cr(api)["spec"]["driver"]["payload"]["version"]
    # A fresh CR (no status) naming a new version: the pods sit at the older revision when the
    # runner's first pass sees them.
    values = release_values(cp, RELEASE, NS)
    values["driver"]["payload"]["version"] = new_version()
    values["driver"]["upgradePolicy"] = SEED_POLICY
    delete_cr(api)
    bootstrap(cp, tmp_path, RELEASE, values)
    runner = Runner(installed["kubeconfig"], tmp_path, "runner-first")
    try:
        new = eventually(
            lambda: (
                (s := upgrade_status(api)).get("phase") == "Progressing"
                and s["status"]["lastPodSpecRevision"] == old
                and s["status"]["upgradingPodSpecRevision"]
            ),
            60,
            "a rollout from the pods' revision",
        )
        assert upgrade_status(api)["lastCoDriverSpec"] == ""  # the case: nothing recorded the old revision's spec
        eventually(
            lambda: sub(api).get("currentStepState") == "StepPaused" and revisions(api)[new] == 2,
            60,
            "step 0 paused with two pods upgraded",
        )
        seed_patch(cp, "enableRollout", False)  # the forced rollback
        eventually(
            lambda: upgrade_status(api).get("phase") == "Disabled" and all_at(api, old),
            90,
            "rolled back to the pods' first revision",
        )
        assert get_cr(api)["spec"]["driver"]["payload"]["version"] == version
        assert template(api) == before
        # Every template change, even one undone a second later, bumps a ControllerRevision's number.
        latest = newest_revision_number(api)
        passes = len(runner.lines("pass"))
        consistently(
            lambda: template(api) == before and all_at(api, old) and newest_revision_number(api) == latest,
            lambda: len(runner.lines("pass")) >= passes + 6,
            30,
            "the template at the old revision while the runner passes",
        )
        assert get_cr(api)["spec"]["driver"]["payload"]["version"] == version
    finally:
        runner.stop()
        patch_driver(api, {"upgradePolicy": {"enableRollout": True, "pause": False}})


def test_a_pod_re_created_while_a_template_was_set_and_set_back_without_a_runner_is_rolled_back(
    control_plane, api, idle, tmp_path
):
    """A new payload version set on the DaemonSet and set back (a `helm upgrade` and a `helm
    rollback`) while no runner runs, and a driver pod deleted in between: the DaemonSet controller
    re-creates it from the template of that moment. The next runner finds it created at another
    revision after the fleet settled, rolls it back (Terminating, reason PodsBehind) and nothing
    else, and settles."""
    cp = control_plane
    eventually(lambda: upgrade_status(api).get("resume", {}).get("settledAt"), 30, "the fleet settled")
    old, before, image = next(iter(revisions(api))), template(api), payload_image(api)
    idle["runners"][0].stop()

    def set_payload(value: str) -> None:
        patch = {"spec": {"template": {"spec": {"initContainers": [{"name": "payload", "image": value}]}}}}
        kubectl(cp, "-n", NS, "patch", "daemonset", "metax-driver", "--patch", json.dumps(patch))

    set_payload(image.rsplit(":", 1)[0] + ":" + new_version())
    victim = driver_pods(api)[0]
    node = victim.spec.node_name
    client.CoreV1Api(api).delete_namespaced_pod(victim.metadata.name, NS)
    behind = eventually(
        lambda: next(
            (p for p in driver_pods(api) if p.spec.node_name == node and p.metadata.labels["controller-revision-hash"] != old),
            None,
        ),
        60,
        "the deleted pod re-created from the new template",
    )
    set_payload(image)
    eventually(lambda: template(api) == before, 30, "the template set back")
    runner = Runner(idle["kubeconfig"], tmp_path, "runner-behind")
    idle["runners"].append(runner)
    settled = lambda: all_at(api, old) and upgrade_status(api).get("phase") == "Idling"  # noqa: E731
    eventually(settled, 90, "every pod back at the settled revision")
    events = client.CoreV1Api(api).list_event_for_all_namespaces(field_selector="reason=PodsBehind").items
    assert [e.message for e in events if behind.metadata.labels["controller-revision-hash"] in e.message], events
    deleted = [name for line in runner.lines("rollout-delete") for name in line["pods"]]
    assert deleted == [behind.metadata.name], deleted
    assert upgrade_status(api)["resume"]["abandonedRevision"] == behind.metadata.labels["controller-revision-hash"]


# -- failures ----------------------------------------------------------------------------------

FAILING = {
    "enableRollout": True,
    "upgradeSteps": [{"replicas": 3, "pauseDuration": 0}, {"replicas": "100%", "pauseDuration": 0}],
    "pause": False,
    "maxParallel": 3,
    "maxUnavailable": 0,
    "maxFailureThreshold": 2,
    "readinessTimeout": "4s",
}


def test_a_pod_that_never_becomes_ready_is_retried_then_pauses_with_failed(control_plane, api, idle, faults):
    cp = control_plane
    history = PodHistory(api)
    bad = "gpu-node-0000"  # first in node order: in the first wave
    faults.pods_never_ready([bad])
    old, new = start_rollout(cp, api, {**FAILING, "fallback": "pause"})
    try:
        failed = eventually(lambda: (c := condition(api, "Failed")).get("status") == "True" and c, 90, "Failed")
        assert failed["reason"] == "StepFailed"
        status = upgrade_status(api)
        assert status["status"]["currentStepState"] == "StepPaused"
        assert status["status"]["currentFailureRetry"] == FAILING["maxFailureThreshold"]
        assert bad in status["resume"]["failedNodes"]
        # The runner writes the status first, then sets pause: true.
        eventually(lambda: get_cr(api)["spec"]["driver"]["upgradePolicy"]["pause"] is True, 10, "pause: true set")
        consistently(
            lambda: revisions(api)[new] == 3, more_passes(idle["runners"][0], 3), 30, "no deletion beyond step 0 while paused"
        )
        per_node = history.deletions_per_node()
        assert per_node[bad] == 1 + FAILING["maxFailureThreshold"], per_node  # the upgrade, then each retry
        assert sorted(n for n, c in per_node.items() if c) == ["gpu-node-0000", "gpu-node-0001", "gpu-node-0002"]
        reasons = [
            e.reason
            for e in client.CoreV1Api(api)
            .list_namespaced_event(EVENTS_NS, field_selector="involvedObject.name=cluster-operator")
            .items
        ]
        assert reasons.count("StepRetry") >= FAILING["maxFailureThreshold"] and "StepFailed" in reasons

        # Each node's state where an admin looks: the failed node, the two upgraded, the rest pending.
        states = eventually(lambda: (s := node_states(cp)).get(bad) == "failed" and s, 30, "the failed node's label")
        assert Counter(states.values()) == {"failed": 1, "done": 2, "pending": NODES - 3}, states
        # The admin fixes the node and retries it alone, the rollout still paused: its driver pod is
        # deleted once more, comes back Ready, and the retry label is consumed.
        faults.clear_faults()
        kubectl(cp, "label", "node", bad, f"{RETRY_LABEL}=true")
        eventually(lambda: node_states(cp)[bad] == "done", 60, "the retried node done")
        assert RETRY_LABEL not in client.CoreV1Api(api).read_node(bad).metadata.labels
        assert history.deletions_per_node()[bad] == 2 + FAILING["maxFailureThreshold"]
        assert get_cr(api)["spec"]["driver"]["upgradePolicy"]["pause"] is True and revisions(api)[new] == 3
        events = client.CoreV1Api(api).list_namespaced_event(EVENTS_NS, field_selector="involvedObject.name=cluster-operator")
        assert any(e.reason == "NodeRetried" and bad in e.message for e in events.items)
        history.stop()
    finally:  # roll back by disabling, so the next test starts idle
        faults.clear_faults()
        seed_patch(cp, "enableRollout", False)
        eventually(lambda: upgrade_status(api).get("phase") == "Disabled" and all_at(api, old), 90, "rolled back")
        patch_driver(api, {"upgradePolicy": {"enableRollout": True, "pause": False}})


def test_fallback_rollback_restores_the_old_revision_everywhere(control_plane, api, idle, faults):
    cp = control_plane
    before = template(api)
    image = payload_image(api)
    faults.pods_never_ready(["gpu-node-0001"])
    old, new = start_rollout(cp, api, {**FAILING, "fallback": "rollback"})
    eventually(lambda: upgrade_status(api).get("phase") == "Terminating", 90, "Terminating")
    faults.clear_faults()  # the fault hits every new pod on that node, the old revision's too
    eventually(
        lambda: upgrade_status(api).get("phase") == "Idling" and all_at(api, old), 90, "every pod back at the old revision"
    )
    assert template(api) == before
    assert payload_image(api) == image
    assert get_cr(api)["spec"]["driver"]["payload"]["version"] in image  # the CR follows (lastCoDriverSpec)
    assert condition(api, "Terminating")["reason"] == "RolledBack"
    consistently(
        lambda: template(api) == before and all_at(api, old),
        more_passes(idle["runners"][0], 3),
        30,
        "the runner's reconcile not bringing the abandoned version back",
    )


def test_enable_rollout_false_mid_rollout_rolls_back(control_plane, api, idle):
    cp = control_plane
    before = template(api)
    old, new = start_rollout(cp, api, SEED_POLICY)
    eventually(lambda: sub(api).get("currentStepState") == "StepPaused", 60, "step 0 paused")
    assert revisions(api)[new] == 2
    seed_patch(cp, "enableRollout", False)  # the seed's forced rollback, corrected
    phases = set()
    eventually(lambda: phases.add(upgrade_status(api).get("phase")) or "Disabled" in phases, 60, "Disabled")
    assert "Disabling" in phases or condition(api, "Terminating").get("reason") == "RolledBack"
    eventually(lambda: all_at(api, old), 60, "every pod at the old revision")
    assert template(api) == before
    patch_driver(api, {"upgradePolicy": {"enableRollout": True, "pause": False}})


# -- runner kills ------------------------------------------------------------------------------


def test_runners_killed_at_random_moments_complete_the_rollout(control_plane, api, idle, faults):
    cp = control_plane
    rng = random.Random(7)
    runners = idle["runners"]
    nodes = [f"gpu-node-{i:04d}" for i in range(NODES)]
    faults.pods_ready_after(nodes, 2.0)  # slow pods: the rollout lasts long enough to be killed often
    history = PodHistory(api)
    steps_seen: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            s = sub(api)
            if s.get("upgradingPodSpecRevision") == new and (not steps_seen or steps_seen[-1] != s["currentStepIndex"]):
                steps_seen.append(s["currentStepIndex"])
            time.sleep(0.1)

    policy = {
        **QUICK_POLICY,
        "upgradeSteps": [
            {"replicas": 2, "pauseDuration": 500},
            {"replicas": 5, "pauseDuration": 500},
            {"replicas": 8, "pauseDuration": 500},
            {"replicas": "100%", "pauseDuration": 500},
        ],
    }
    old, new = start_rollout(cp, api, policy)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    kills = 0
    while sub(api).get("currentStepState") != "Completed" or kills < 20:
        time.sleep(rng.uniform(0.3, 2.5))
        runners[-1].stop(rng.choice([signal.SIGKILL, signal.SIGKILL, signal.SIGTERM]))
        kills += 1
        runners.append(Runner(idle["kubeconfig"], idle["tmp"], f"runner-{kills}"))
        if kills > 80:
            break
    eventually(lambda: sub(api).get("currentStepState") == "Completed", 120, "Completed")
    stop.set()
    history.stop()
    print(f"{kills} runner kills during the rollout; steps seen {steps_seen}")
    assert kills >= 20
    assert all_at(api, new)
    assert steps_seen == [0, 1, 2, 3], f"a step was skipped or repeated: {steps_seen}"
    per_node = history.deletions_per_node()
    assert sorted(per_node) == nodes and set(per_node.values()) == {1}, per_node


# -- where a version change comes from -----------------------------------------------------------


def test_helm_upgrade_of_the_payload_version_starts_a_rollout(control_plane, api, idle):
    cp = control_plane
    patch_driver(api, {"upgradePolicy": QUICK_POLICY})
    old = next(iter(revisions(api)))
    history = PodHistory(api)
    version = new_version()
    # In the chart's order: the bootstrap hook (pre-upgrade) writes the new values into the CR,
    # with the revision Helm is about to apply, then Helm applies the release (hooks run here as
    # local commands: --no-hooks); the runner holds until then.
    values = release_values(cp, RELEASE, NS)
    values["driver"]["payload"]["version"] = version
    values["driver"]["upgradePolicy"] = QUICK_POLICY
    upcoming = json.loads(run(*idle["helm"], "status", RELEASE, "-n", NS, "-o", "json"))["version"] + 1
    bootstrap(cp, idle["tmp"], RELEASE, values, revision=upcoming)
    run(
        *idle["helm"],
        "upgrade",
        RELEASE,
        str(CHART),
        "-n",
        NS,
        "--no-hooks",
        "--reuse-values",
        "--set",
        f"driver.payload.version={version}",
        "--set-json",
        f"driver.upgradePolicy={json.dumps(QUICK_POLICY)}",
    )
    # The rollout of the new revision, started and done (woken by the changes, ten nodes can be
    # done between two polls: no waiting for the phase Progressing).
    eventually(
        lambda: (s := sub(api)).get("upgradingPodSpecRevision") not in (None, old) and s.get("currentStepState") == "Completed",
        120,
        "the new revision rolled out",
    )
    assert payload_image(api).endswith(f":{version}")
    new = sub(api)["upgradingPodSpecRevision"]
    assert new != old and all_at(api, new)
    history.stop()
    # Each node is replaced exactly once: the CR had the new version before Helm changed the
    # DaemonSet, so the runner never put the old one back.
    per_node = history.deletions_per_node()
    assert sorted(per_node) == [f"gpu-node-{i:04d}" for i in range(NODES)] and set(per_node.values()) == {1}, per_node


def test_with_rollout_off_every_pod_is_replaced_at_once(control_plane, api, idle):
    cp = control_plane
    patch_driver(api, {"upgradePolicy": {"enableRollout": False}})
    eventually(lambda: upgrade_status(api).get("phase") == "Disabled", 30, "Disabled")
    history = PodHistory(api)
    old = next(iter(revisions(api)))
    started = time.monotonic()
    kubectl(
        cp,
        "patch",
        "ClusterOperator/cluster-operator",
        "--type",
        "json",
        "--patch",
        json.dumps([{"op": "replace", "path": "/spec/driver/payload/version", "value": new_version()}]),
    )
    eventually(
        lambda: (
            (r := revisions(api)) and old not in r and all(ready(p) for p in driver_pods(api)) and len(driver_pods(api)) == NODES
        ),
        30,
        "every pod replaced",
    )
    took = time.monotonic() - started
    # The test's watch may trail the LIST above by a moment.
    eventually(
        lambda: sum(uid not in history.before for uid in history.ready_at) >= NODES, 10, "the watch to see every new pod Ready"
    )
    history.stop()
    print(f"10 driver pods replaced at once in {took:.1f} s")
    assert set(history.deletions_per_node().values()) == {1}
    # The runner replaces them, in one pass (the DaemonSet stays OnDelete, whatever the policy: no
    # other writer can make the DaemonSet controller replace pods): one deletion batch of every pod.
    strategy = client.AppsV1Api(api).read_namespaced_daemon_set("metax-driver", NS).spec.update_strategy
    assert strategy.type == "OnDelete"
    batches = [line["pods"] for r in idle["runners"] for line in r.lines("rollout-delete")]
    old_uids = history.before
    assert old_uids <= set(history.deleted_at), "every old pod deleted"
    assert [len(pods) for pods in batches] == [NODES], batches
    patch_driver(api, {"upgradePolicy": {"enableRollout": True}})
