"""The runner and wait-for against the real control plane (kube-apiserver, etcd, kwok nodes).

The chart is installed with the real Helm 3 binary WITHOUT the post-renderer and without hooks
(hook Jobs cannot run containers under kwok); the `cluster-operator` CR is then created by the
bootstrap hook's own command (`metax-operator bootstrap`) run locally with the release's values,
as the post-install hook would. Runners are `metax-operator run` processes with a short lease
(4 s) so that handovers are quick to observe; their JSON log lines are the evidence of who acted.

The seed's §3.2.5.2 example starts from "default templates" in which metax-maca tolerates
node-role=maca and metax-driver node-role=driver; our chart's templates carry only the base
toleration of the metax-tech.com/gpu taint. `seed_default_templates` adds the seed's node-role
tolerations to those two DaemonSets (their pod template and the recorded scheduling base), as a
chart with the seed's templates would have rendered them.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kubernetes import client

from tests.controlplane import GPU_LABEL
from tests.e2e.test_user_faults import cr_events
from tests.e2e.tools import (
    CR,
    METAX,
    bootstrap,
    cr_condition,
    driver_pods,
    driver_pods_ready,
    get_cr,
    install_chart,
    kubectl,
    log_entries,
    more_passes,
    ready,
    release_values,
    service_account_kubeconfig,
    uninstall_chart,
)
from tests.waiting import consistently, eventually, for_seconds

NS = "runner-e2e"
RELEASE = "metax"
RELEASE_FULLNAME = "metax-operator"  # the chart's fullname: the runner's ServiceAccount is <fullname>-runner
LEASE = dict(duration=4, renew=3, retry=1)  # seconds

BASE = {"key": "metax-tech.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
ROLE_MACA = {"key": "node-role", "operator": "Equal", "value": "maca", "effect": "NoSchedule"}
ROLE_DRIVER = {"key": "node-role", "operator": "Equal", "value": "driver", "effect": "NoExecute"}
GENERAL = {"key": "node-type", "operator": "Equal", "value": "general", "effect": "NoSchedule"}
GPU = {"key": "node-type", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}
# The seed's §3.2.5.2 values: a global and a maca podTemplateSpec.
SEED_VALUES = {
    "registry": "cr.example.com/metax",
    "driver": {"payload": {"version": "2.32.0.6"}},
    "podTemplateSpec": {"spec": {"tolerations": [GENERAL]}},
    "maca": {"podTemplateSpec": {"spec": {"tolerations": [GPU]}}},
}


# -- helpers -----------------------------------------------------------------------------------


class Runner:
    """A `metax-operator run` process with its JSON log in a file, as the chart's runner
    ServiceAccount (the kubeconfig `installed` yields), so the chart's RBAC is what it gets."""

    def __init__(self, kubeconfig: Path, tmp: Path, identity: str, *extra: str, namespace: str = NS):
        self.identity = identity
        self.log_path = tmp / f"{identity}.log"
        self.proc = subprocess.Popen(
            [
                METAX,
                "run",
                "--namespace",
                namespace,
                "--kubeconfig",
                str(kubeconfig),
                "--identity",
                identity,
                "--interval",
                "1",
                "--lease-duration",
                str(LEASE["duration"]),
                "--renew-deadline",
                str(LEASE["renew"]),
                "--retry-period",
                str(LEASE["retry"]),
                "--log-level",
                "debug",
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log_path.open("w"),
        )

    def lines(self, *actions: str) -> list[dict]:
        return log_entries(self.log_path, *actions)

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


@pytest.fixture(scope="module")
def api(control_plane):
    return control_plane.api()


def tolerations(api, name: str) -> list[dict]:
    ds = client.AppsV1Api(api).read_namespaced_daemon_set(name, NS)
    return api.sanitize_for_serialization(ds.spec.template.spec.tolerations) or []


def seed_tolerations_output(cp) -> dict[str, list]:
    """The seed's own check (§3.2.4.1): `kubectl get ds -o jsonpath='{range .items[*]}...'`."""
    out = kubectl(
        cp,
        "get",
        "ds",
        "-n",
        NS,
        "-o",
        "jsonpath={range .items[*]}{.metadata.name}{'\\t'}{.spec.template.spec.tolerations}{'\\n'}{end}",
    )
    return {name: json.loads(value) for name, value in (line.split("\t") for line in out.splitlines() if line)}


def patch_cr(api, spec: dict) -> None:
    client.CustomObjectsApi(api).patch_cluster_custom_object(*CR, {"spec": spec})


def versions(api) -> dict[str, str]:
    """What a runner write changes: each DaemonSet's generation (bumped by spec writes only; the
    DaemonSet controller keeps updating status and resourceVersion while pods roll), the CR's
    resourceVersion, and the number of events the runner wrote."""
    dss = client.AppsV1Api(api).list_namespaced_daemon_set(NS).items
    found = {ds.metadata.name: str(ds.metadata.generation) for ds in dss}
    found["cr"] = get_cr(api)["metadata"]["resourceVersion"]
    events = client.CoreV1Api(api).list_namespaced_event("default", field_selector="source=metax-operator-runner").items
    found["events"] = str(len(events))
    return found


def kubectl_edit(cp, tmp: Path, change: dict) -> None:
    """`kubectl edit clusteroperator cluster-operator`, the editor merging `change` into the spec
    (None deletes a key), as an admin following seed §3.2.4.2 would."""
    editor = tmp / "editor.py"
    editor.write_text(
        "import json, sys, yaml\n"
        "path = sys.argv[-1]\n"
        "doc = yaml.safe_load(open(path))\n"
        "for key, value in json.loads(open(sys.argv[-2]).read()).items():\n"
        "    doc['spec'].pop(key, None) if value is None else doc['spec'].__setitem__(key, value)\n"
        "open(path, 'w').write(yaml.safe_dump(doc))\n"
    )
    (tmp / "change.json").write_text(json.dumps(change))
    kubectl(
        cp,
        "edit",
        "clusteroperators.gpu.metax-tech.com",
        "cluster-operator",
        env={"KUBE_EDITOR": f"{sys.executable} {editor} {tmp / 'change.json'}"},
    )


def seed_default_templates(cp, api) -> None:
    """Give metax-maca and metax-driver the seed's default-template tolerations (module docstring)."""
    apps = client.AppsV1Api(api)
    for name, role in (("metax-maca", ROLE_MACA), ("metax-driver", ROLE_DRIVER)):
        ds = apps.read_namespaced_daemon_set(name, NS)
        base = json.loads(ds.metadata.annotations["gpu.metax-tech.com/scheduling-base"])
        base["tolerations"].append(role)
        kubectl(
            cp,
            "patch",
            "ds",
            name,
            "-n",
            NS,
            "--type",
            "merge",
            "-p",
            json.dumps(
                {
                    "metadata": {"annotations": {"gpu.metax-tech.com/scheduling-base": json.dumps(base)}},
                    "spec": {"template": {"spec": {"tolerations": base["tolerations"]}}},
                }
            ),
        )


@pytest.fixture(scope="module")
def installed(control_plane, api, tmp_path_factory):
    """The chart installed with Helm 3 (no post-renderer, no hooks) and the CR bootstrapped."""
    tmp = tmp_path_factory.mktemp("runner-install")
    cp = control_plane
    install_chart(cp, api, tmp, RELEASE, NS, SEED_VALUES)
    seed_default_templates(cp, api)
    # What Helm rendered (no post-renderer): the base only, so the CR's podTemplateSpec is not there yet.
    assert tolerations(api, "metax-maca") == [BASE, ROLE_MACA]
    assert tolerations(api, "metax-driver") == [BASE, ROLE_DRIVER]
    bootstrap(cp, tmp, RELEASE, release_values(cp, RELEASE, NS))
    # Where the tests start: every driver pod up (one still starting is replaced only once Ready).
    eventually(lambda: driver_pods_ready(api, NS, len(gpu_nodes(api))), 60, "every driver pod Ready")
    yield service_account_kubeconfig(cp, tmp, f"{RELEASE_FULLNAME}-runner", NS)
    uninstall_chart(cp, api, RELEASE, NS)


@pytest.fixture
def runner(installed, tmp_path):
    """One runner for the test; stopped (SIGTERM) at the end."""
    proc = Runner(installed, tmp_path, "runner-main")
    yield proc
    proc.stop()


def same_driver_events(api) -> list[str]:
    return [e.message for e in cr_events(api) if e.reason == "SameDriver"]


def wait_converged(api, runner: Runner, timeout: float = 30) -> None:
    """Until a pass writes nothing (the runner logs `pass` with writes 0)."""
    start = len(runner.lines("pass"))
    eventually(lambda: any(p["writes"] == 0 for p in runner.lines("pass")[start:]), timeout, "a pass without writes")


def seed_example_spec() -> dict:
    return {
        "podTemplateSpec": {"spec": {"tolerations": [GENERAL]}},
        "tolerations": None,
        "maca": {"podTemplateSpec": {"spec": {"tolerations": [GPU]}}},
    }


# -- the seed's example and kubectl edit --------------------------------------------------------


def test_seed_example_takes_effect_without_the_post_renderer(control_plane, api, runner):
    pods = {p.metadata.uid for p in driver_pods(api, NS)}
    patch_cr(api, seed_example_spec())
    eventually(lambda: tolerations(api, "metax-maca") == [BASE, ROLE_MACA, GPU], 20, "metax-maca tolerations")
    eventually(lambda: tolerations(api, "metax-driver") == [BASE, ROLE_DRIVER, GENERAL], 20, "metax-driver tolerations")
    shown = seed_tolerations_output(control_plane)
    assert shown["metax-maca"] == [BASE, ROLE_MACA, GPU]
    assert shown["metax-driver"] == [BASE, ROLE_DRIVER, GENERAL]
    assert shown["metax-gpu-device"] == [BASE, GENERAL]
    wait_converged(api, runner)
    passes = [p["writes"] for p in runner.lines("pass")]
    print(f"writes per pass until converged: {passes[: passes.index(0) + 1]}")
    # The CR reaches the DaemonSets within a few passes. The driver's new template differs only
    # in its tolerations: the same driver, so no driver pod is replaced for it.
    applied_in, seen = [], 0
    for entry in runner.lines("pass", "apply"):
        seen += entry["action"] == "pass"
        if entry["action"] == "apply":
            applied_in.append(seen)
    assert max(applied_in) <= 2, f"the CR took more than a few passes to reach the DaemonSets: {applied_in}"
    assert runner.lines("rollout-delete") == [] and {p.metadata.uid for p in driver_pods(api, NS)} == pods
    status = get_cr(api)["status"]["upgradeStatus"]
    at = {p.metadata.labels["controller-revision-hash"] for p in driver_pods(api, NS)}
    assert status["upgrading"] is False and status["resume"]["stableRevision"] not in at, (status, at)
    ds = client.AppsV1Api(api).read_namespaced_daemon_set("metax-maca", NS)
    managers = {m.manager: m.operation for m in ds.metadata.managed_fields}
    assert managers.get("metax-operator-runner") == "Apply"


def test_kubectl_edit_of_the_cr_tolerations_changes_the_daemonsets(control_plane, api, runner, tmp_path):
    patch_cr(api, seed_example_spec())
    eventually(lambda: tolerations(api, "metax-driver") == [BASE, ROLE_DRIVER, GENERAL], 20, "seed state")
    wait_converged(api, runner)
    pods, said = {p.metadata.uid for p in driver_pods(api, NS)}, len(same_driver_events(api))
    compute = {**GENERAL, "value": "compute"}
    kubectl_edit(control_plane, tmp_path, {"podTemplateSpec": {"spec": {"tolerations": [compute]}}})
    eventually(lambda: tolerations(api, "metax-driver") == [BASE, ROLE_DRIVER, compute], 20, "the edit applied")
    # The same driver with another toleration: the stable revision at once, no driver pod replaced.
    eventually(lambda: len(same_driver_events(api)) > said, 20, "the SameDriver event")
    assert "only in where driver pods may run" in same_driver_events(api)[-1]
    wait_converged(api, runner)
    assert {p.metadata.uid for p in driver_pods(api, NS)} == pods and runner.lines("rollout-delete") == []
    assert tolerations(api, "metax-maca") == [BASE, ROLE_MACA, GPU]  # its own podTemplateSpec wins

    # Seed §3.2.4.2: the deprecated global tolerations, added with kubectl edit.
    key1 = {"key": "key1", "operator": "Equal", "value": "value1", "effect": "NoSchedule"}
    key2 = {"key": "key2", "operator": "Equal", "value": "value1", "effect": "NoExecute"}
    kubectl_edit(control_plane, tmp_path, {"podTemplateSpec": None, "tolerations": [key1, key2]})
    eventually(
        lambda: seed_tolerations_output(control_plane)["metax-gpu-label"] == [BASE, key1, key2],
        20,
        "the deprecated tolerations applied",
    )
    shown = seed_tolerations_output(control_plane)
    assert shown["metax-driver"] == [BASE, ROLE_DRIVER, key1, key2]
    assert shown["metax-maca"] == [BASE, ROLE_MACA, GPU]  # custom tolerations win over deprecated ones


def test_a_second_identical_pass_writes_nothing(installed, api, runner):
    patch_cr(api, seed_example_spec())
    eventually(lambda: tolerations(api, "metax-maca") == [BASE, ROLE_MACA, GPU], 20, "seed state")
    wait_converged(api, runner)
    assert runner.stop() == 0
    assert runner.lines("stopped")[-1]["released_lease"] is True
    before = versions(api)
    once = subprocess.run(
        [METAX, "run", "--once", "--namespace", NS, "--kubeconfig", str(installed), "--log-level", "debug"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert once.returncode == 0, once.stderr
    assert versions(api) == before
    passes = [json.loads(line) for line in once.stderr.splitlines() if '"action": "pass"' in line]
    assert [p["writes"] for p in passes] == [0]


def test_enabling_the_rollout_by_kubectl_edit_leaves_the_driver_on_delete(control_plane, api, runner, tmp_path):
    """Seed §3.2.8 turns the staged rollout on with `kubectl edit` of the CR, and off again. The
    driver DaemonSet is OnDelete either way (its pods change only when the runner deletes them),
    so neither edit writes the strategy, and no pod is replaced by either."""
    apps = client.AppsV1Api(api)
    strategy = lambda: apps.read_namespaced_daemon_set("metax-driver", NS).spec.update_strategy  # noqa: E731
    assert strategy().type == "OnDelete"
    wait_converged(api, runner)
    pods = {p.metadata.uid for p in driver_pods(api, NS)}
    policy = {"enableRollout": True, "upgradeSteps": [{"replicas": 2}, {"replicas": "100%"}]}
    kubectl_edit(control_plane, tmp_path, {"driver": {**get_cr(api)["spec"]["driver"], "upgradePolicy": policy}})
    wait_converged(api, runner)
    patch_cr(api, {"driver": {"upgradePolicy": {"enableRollout": False}}})
    wait_converged(api, runner)
    assert strategy().type == "OnDelete"
    assert {p.metadata.uid for p in driver_pods(api, NS)} == pods


# -- validation at run time ----------------------------------------------------------------------


def test_an_invalid_cr_edit_is_not_applied_and_says_why(control_plane, api, runner):
    patch_cr(api, seed_example_spec())
    eventually(lambda: tolerations(api, "metax-maca") == [BASE, ROLE_MACA, GPU], 20, "seed state")
    wait_converged(api, runner)
    before = {k: v for k, v in versions(api).items() if k.startswith("metax-")}
    # The CRD's schema accepts it (a string); the shared validation refuses a regex Go cannot compile.
    bad = {
        "vfioManager": {"vfioConfig": [{"nodeName": "gpu-(?=0)", "gpus": "0"}]},
        "podTemplateSpec": {"spec": {"tolerations": [{**GENERAL, "value": "never-applied"}]}},
    }
    patch_cr(api, bad)
    try:
        spec_valid = eventually(
            lambda: (c := cr_condition(api, "SpecValid")) and c["status"] == "False" and c, 20, "SpecValid=False"
        )
        assert "spec.vfioManager.vfioConfig[0].nodeName" in spec_valid["message"]
        assert cr_condition(api, "Reconciled")["reason"] == "InvalidSpec"
        # Events of a cluster-scoped object live in namespace default (`kubectl describe` finds them).
        events = eventually(
            lambda: [
                e
                for e in client.CoreV1Api(api).list_namespaced_event("default", field_selector="reason=InvalidSpec").items
                if "spec.vfioManager.vfioConfig[0].nodeName" in e.message
                and e.type == "Warning"
                and e.involved_object.name == "cluster-operator"
            ],
            10,
            "a Warning event InvalidSpec naming the field",
        )
        assert events
        consistently(
            lambda: {k: v for k, v in versions(api).items() if k.startswith("metax-")} == before,
            more_passes(runner, 3),
            30,
            "the DaemonSets untouched by a runner refusing the spec",
        )
    finally:
        patch_cr(api, {"vfioManager": {"vfioConfig": []}})
    eventually(lambda: cr_condition(api, "SpecValid")["status"] == "True", 20, "SpecValid=True after the fix")
    eventually(lambda: {**GENERAL, "value": "never-applied"} in tolerations(api, "metax-driver"), 20, "the fixed spec applied")


def test_a_broken_configmap_edit_is_reported(control_plane, api, runner):
    core = client.CoreV1Api(api)
    core.patch_namespaced_config_map("driver-config", NS, {"data": {"node-vfnums": "nodes:\n  foo:\n    vfnum: 99\n"}})
    try:
        found = eventually(
            lambda: (c := cr_condition(api, "ConfigMapsValid")) and c["status"] == "False" and c, 20, "ConfigMapsValid=False"
        )
        assert "driver-config[node-vfnums].nodes.foo.vfnum" in found["message"]
    finally:
        core.patch_namespaced_config_map("driver-config", NS, {"data": {"node-vfnums": "nodes: {}\n"}})
    eventually(lambda: cr_condition(api, "ConfigMapsValid")["status"] == "True", 20, "ConfigMapsValid=True")


def test_a_flipped_deploy_switch_asks_for_helm_upgrade_and_creates_nothing(api, runner):
    patch_cr(api, {"exporter": {"deploy": True}})
    try:
        found = eventually(
            lambda: (c := cr_condition(api, "HelmUpgradeRequired")) and c["status"] == "True" and c,
            20,
            "HelmUpgradeRequired=True",
        )
        assert "--set exporter.deploy=true" in found["message"]
        consistently(
            lambda: (
                "metax-data-exporter"
                not in {ds.metadata.name for ds in client.AppsV1Api(api).list_namespaced_daemon_set(NS).items}
            ),
            more_passes(runner, 2),
            30,
            "no exporter DaemonSet created by the runner",
        )
    finally:
        patch_cr(api, {"exporter": {"deploy": False}})
    eventually(lambda: cr_condition(api, "HelmUpgradeRequired")["status"] == "False", 20, "back in sync")


def test_an_edit_racing_a_pass_is_not_stamped_as_observed_until_a_pass_plans_from_it(api, installed):
    """Regression: an edit landing between the reconcile's read of the CR and its status write
    (a 409) made the pass re-read the CR and stamp the NEW generation as observed, with conditions
    planned from the OLD spec, here SpecValid=True for a spec the runner refuses. The race is
    driven, not timed: the runner's own client makes the edit right before its status write."""
    from metax_operator.runtime import reconcile
    from metax_operator.runtime.kube import Client

    runner_api = Client.connect(str(installed))  # the runner's ServiceAccount, in process
    bad = {"vfioManager": {"vfioConfig": [{"nodeName": "gpu-(", "gpus": "0"}]}}  # the CRD accepts it
    raced: list[int] = []
    call = runner_api.call

    def edit_then_write(method, path, *args, **kwargs):
        if method == "PUT" and path.endswith("/status") and not raced:
            patch_cr(api, bad)
            raced.append(get_cr(api)["metadata"]["generation"])
        return call(method, path, *args, **kwargs)

    def one_pass() -> None:
        seen = reconcile.observe(runner_api, NS)
        reconcile.apply(runner_api, seen, reconcile.decide(seen), lambda: True, time.time)

    patch_cr(api, {"gpuLabel": {"log": {"level": "debug"}}})  # a new generation for the pass to stamp
    planned = get_cr(api)["metadata"]["generation"]
    runner_api.call = edit_then_write
    try:
        one_pass()
        [edited] = raced
        assert edited > planned
        status = get_cr(api).get("status") or {}
        assert status.get("observedGeneration") != edited, "the edit was stamped as observed by a pass that never read it"
        assert all(c.get("observedGeneration") != edited for c in status.get("conditions") or [])

        one_pass()  # plans from the edited CR
        status = get_cr(api)["status"]
        spec_valid = next(c for c in status["conditions"] if c["type"] == "SpecValid")
        assert status["observedGeneration"] == edited == spec_valid["observedGeneration"]
        assert spec_valid["status"] == "False" and "spec.vfioManager.vfioConfig[0].nodeName" in spec_valid["message"]
    finally:
        patch_cr(api, {"vfioManager": {"vfioConfig": []}, "gpuLabel": {"log": {"level": "info"}}})
        runner_api.call = call
        one_pass()


# -- what a pass costs the API server -------------------------------------------------------------


class Counted:
    """Every request a kubernetes ApiClient sends (what `metrics.Metrics.count_requests` counts)."""

    def __init__(self, api_client):
        self.requests: list[str] = []
        send = api_client.request

        def counted(method, url, *args, **kwargs):
            self.requests.append(f"{method} {url.split('?')[0]}")
            return send(method, url, *args, **kwargs)

        api_client.request = counted


def test_a_steady_pass_sends_no_request(api, installed):
    """Once the runner's caches have listed and a pass found nothing to do, the next pass, the
    reconcile and the rollout step both, reads the CR, the DaemonSets, the ConfigMaps and the
    Service from its caches: not one request. The runner's own ServiceAccount, so the chart's
    RBAC allows the watches."""
    from metax_operator.runtime.kube import Client
    from metax_operator.runtime.run import Runner

    runner_api = Client.connect(str(installed))
    runner = Runner(runner_api, NS, lambda: True)
    try:
        patch_cr(api, seed_example_spec())
        eventually(lambda: runner.run_pass() == 0, 60, "a pass that writes nothing")
        counted = Counted(runner_api.api_client)
        assert runner.run_pass() == 0
        assert counted.requests == [], f"a steady pass sent {counted.requests}"
    finally:
        runner.close()


def test_the_runner_reads_its_own_writes_before_its_watch_delivers_them(api, installed):
    """Read-your-writes: right after the runner's client writes an object the runner caches, a
    read through the cache returns that write (or a newer object), never the one before it."""
    from metax_operator.runtime.kube import Client
    from metax_operator.runtime.object_cache import ObjectCache
    from metax_operator.runtime.resource_version import compare_versions

    runner_api = Client.connect(str(installed))
    cache = ObjectCache(runner_api, NS).start()
    try:
        assert cache.wait_synced(30)
        for level in ("debug", "info") * 10:
            written = runner_api.patch(
                "apps/v1",
                "DaemonSet",
                "metax-gpu-label",
                {"metadata": {"annotations": {"bench.example/level": level}}},
                namespace=NS,
            )
            read = cache.get("apps/v1", "DaemonSet", "metax-gpu-label", NS)
            assert compare_versions(read["metadata"]["resourceVersion"], written["metadata"]["resourceVersion"]) >= 0
            assert read["metadata"]["annotations"]["bench.example/level"] == level
    finally:
        cache.stop()
        runner_api.patch(
            "apps/v1", "DaemonSet", "metax-gpu-label", {"metadata": {"annotations": {"bench.example/level": None}}}, namespace=NS
        )


def test_a_cache_that_cannot_list_is_never_read_as_absent(installed):
    """The runner's Role covers its release namespace only: caches of another namespace fail
    to list, and a read of them is an error, not "no such ConfigMap"."""
    from metax_operator.runtime.kube import Client
    from metax_operator.runtime.object_cache import NotReady, ObjectCache

    cache = ObjectCache(Client.connect(str(installed)), "default").start()
    try:
        eventually(
            lambda: {i.name: i.state for i in cache.informers}["configmap-driver-config"] == "failing",
            30,
            "the ConfigMap cache failing to list (403)",
        )
        with pytest.raises(NotReady, match="configmap-driver-config is failing"):
            cache.get("v1", "ConfigMap", "driver-config", "default")
    finally:
        cache.stop()


# -- leader election -----------------------------------------------------------------------------


def test_only_the_lease_holder_acts_and_a_killed_leader_hands_over(control_plane, api, installed, tmp_path):
    patch_cr(api, seed_example_spec())
    a, b = Runner(installed, tmp_path, "runner-a"), Runner(installed, tmp_path, "runner-b")
    try:
        eventually(lambda: a.lines("lease-acquired") or b.lines("lease-acquired"), 20, "a leader")
        leader, follower = (a, b) if a.lines("lease-acquired") else (b, a)
        eventually(
            lambda: any(w["holder"] == leader.identity for w in follower.lines("wait-lease")),
            10,
            "the follower to log that it waits for the leader's lease",
        )
        new = {**GENERAL, "value": "rack-1"}
        patch_cr(api, {"podTemplateSpec": {"spec": {"tolerations": [new]}}})
        eventually(lambda: new in tolerations(api, "metax-driver"), 20, "the leader to apply")
        # The runner logs an apply once the API server has answered it: the line may trail the object.
        eventually(lambda: leader.lines("apply"), 10, "the leader's apply in its log")
        assert not follower.lines("apply")

        killed = time.monotonic()
        leader.stop(signal.SIGKILL)
        eventually(
            lambda: follower.lines("lease-acquired"), LEASE["duration"] + 2 * LEASE["retry"] + 2, "the follower to take the lease"
        )
        handover = time.monotonic() - killed
        print(f"handover after SIGKILL of the leader: {handover:.1f}s (lease {LEASE['duration']}s)")
        assert handover <= LEASE["duration"] + 2 * LEASE["retry"] + 1
        newer = {**GENERAL, "value": "rack-2"}
        patch_cr(api, {"podTemplateSpec": {"spec": {"tolerations": [newer]}}})
        eventually(lambda: newer in tolerations(api, "metax-driver"), 20, "the new leader to apply")
        eventually(lambda: follower.lines("apply"), 10, "the new leader's apply in its log")

        # A graceful stop releases the lease at once.
        follower.stop()
        lease = client.CoordinationV1Api(api).read_namespaced_lease("metax-operator-runner", NS)
        assert not lease.spec.holder_identity
    finally:
        a.stop(signal.SIGKILL)
        b.stop(signal.SIGKILL)


# -- wait-for ------------------------------------------------------------------------------------


def component_pod(name: str, component: str, node: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/component": component}},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "c", "image": "registry.example/c:1"}],
            "tolerations": [{"operator": "Exists"}],
        },
    }


def pod_ready(core, name: str, ns: str) -> bool:
    pod = core.read_namespaced_pod(name, ns)
    return ready(pod)


@pytest.fixture
def waitfor_ns(api):
    core = client.CoreV1Api(api)
    name = f"waitfor-{int(time.time() * 1000) % 100000}"
    core.create_namespace({"metadata": {"name": name}})
    eventually(lambda: core.list_namespaced_service_account(name).items, 20, "the default service account")
    yield name
    core.delete_namespace(name)


def gpu_nodes(api) -> list[str]:
    return sorted(n.metadata.name for n in client.CoreV1Api(api).list_node(label_selector=f"{GPU_LABEL}=true").items)


def start_wait_for(cp, ns: str, node: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            METAX,
            "wait-for",
            "--namespace",
            ns,
            "--node",
            node,
            "--component",
            "gpuLabel",
            "--component",
            "runtime",
            "--kubeconfig",
            str(cp.kubeconfig),
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_wait_for_returns_only_once_the_prerequisites_on_its_node_are_ready(faults, api, waitfor_ns):
    core = client.CoreV1Api(api)
    node, other = gpu_nodes(api)[:2]
    core.create_namespaced_pod(waitfor_ns, component_pod("label", "gpuLabel", node))
    core.create_namespaced_pod(waitfor_ns, component_pod("runtime-elsewhere", "runtime", other))
    eventually(
        lambda: pod_ready(core, "label", waitfor_ns) and pod_ready(core, "runtime-elsewhere", waitfor_ns),
        20,
        "the gpuLabel pod and the other node's runtime pod Ready",
    )
    faults.pods_ready_after([node], 6)
    core.create_namespaced_pod(waitfor_ns, component_pod("runtime", "runtime", node))
    proc = start_wait_for(faults, waitfor_ns, node)
    try:
        consistently(
            lambda: proc.poll() is None, for_seconds(3), 10, "wait-for waiting while the runtime pod on its node is not Ready"
        )
        assert not pod_ready(core, "runtime", waitfor_ns)
        assert proc.wait(30) == 0
        assert pod_ready(core, "runtime", waitfor_ns), "wait-for returned before the pod was Ready"
    finally:
        proc.kill()
    log = [json.loads(line) for line in proc.stderr.read().splitlines()]
    waiting = next(e for e in log if e["action"] == "waiting")
    assert waiting["pending"] == {"runtime": "pod runtime is Pending, not Ready"}
    assert "waiting for runtime on node" in waiting["msg"]
    assert log[-1]["action"] == "prerequisites-ready"


def test_wait_for_blocks_while_a_prerequisite_never_becomes_ready(faults, api, waitfor_ns):
    core = client.CoreV1Api(api)
    node = gpu_nodes(api)[2]
    core.create_namespaced_pod(waitfor_ns, component_pod("label", "gpuLabel", node))
    eventually(lambda: pod_ready(core, "label", waitfor_ns), 20, "the gpuLabel pod Ready")
    faults.pods_never_ready([node])
    core.create_namespaced_pod(waitfor_ns, component_pod("runtime", "runtime", node))
    eventually(
        lambda: core.read_namespaced_pod("runtime", waitfor_ns).status.phase == "Running",
        20,
        "the runtime pod Running (not Ready)",
    )
    started = time.monotonic()
    proc = start_wait_for(faults, waitfor_ns, node, "--timeout", "4")
    assert proc.wait(30) == 1
    assert time.monotonic() - started >= 4
    log = [json.loads(line) for line in proc.stderr.read().splitlines()]
    assert any(e["action"] == "waiting" and e["pending"] == {"runtime": "pod runtime is Running, not Ready"} for e in log)
    assert log[-1]["action"] == "timeout"
