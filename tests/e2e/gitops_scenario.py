"""What the Argo CD and Flux scenarios (test_gitops_*.py) share: their fixtures (the chart in a
Helm repository on loopback, the tools image's pods) and what they observe and do alike: the CR,
the driver's revisions, the runner's log, the admin's seed commands, what a deletion must leave."""
from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest
import yaml
from kubernetes import client, watch

from tests.controlplane import GPU_LABEL, REPO
from tests.e2e.test_rollout_cluster import deletions_per_step
from tests.e2e.tools import CR, delete_cr, eventually, kubectl
from tests.gitops import ChartRepository, ToolsPods

NS = "metax-operator"
# The seed's 10-node staged policy: steps of 2, 5, 8 and 100% of the nodes, the first and the
# last waiting for the admin, maxParallel 50%.
POLICY = yaml.safe_load((REPO / "examples" / "rollout-10-nodes.yaml").read_text())["driver"]["upgradePolicy"]
# Pods the runner deletes per pass in each step of POLICY on 10 nodes (tests/e2e/test_rollout_cluster).
POLICY_WAVES = {0: [1, 1], 1: [2, 1], 2: [2, 1], 3: [1, 1]}
DRIVER = "app.kubernetes.io/component=driver"
OURS = "app.kubernetes.io/part-of=metax-operator"
SEED_PATCH = '[{"op": "replace", "path": "/spec/driver/upgradePolicy/%s", "value": %s}]'


@pytest.fixture(scope="module")
def api(control_plane):
    return control_plane.api()


@pytest.fixture(scope="module")
def chart(tmp_path_factory):
    """This checkout's chart in a Helm repository on loopback: its URL and the chart's version."""
    repository = ChartRepository(tmp_path_factory.mktemp("charts"))
    version = repository.publish()
    yield {"url": repository.url, "version": version}
    repository.stop()


@pytest.fixture(scope="module")
def tools_pods(control_plane, tmp_path_factory):
    pods = ToolsPods(control_plane, NS, tmp_path_factory.mktemp("tools-pods"))
    yield pods
    pods.stop()


@contextlib.contextmanager
def release_scope(api):
    """Around a module's release: no CR before and after it, and the GPU nodes' label (which the
    cleanup removes) put back for the session's other tests."""
    core = client.CoreV1Api(api)
    gpu_nodes = [n.metadata.name for n in core.list_node(label_selector=f"{GPU_LABEL}=true").items]
    delete_cr(api)
    try:
        yield
    finally:
        delete_cr(api)
        for name in gpu_nodes:
            core.patch_node(name, {"metadata": {"labels": {GPU_LABEL: "true"}}})


def window(seconds: float) -> None:
    """The observation window of a test that checks that nothing happens: a duration to watch,
    not a condition to wait for."""
    time.sleep(seconds)


def get_cr(api) -> dict:
    return client.CustomObjectsApi(api).get_cluster_custom_object(*CR)


def step_status(api) -> dict:
    return ((get_cr(api).get("status") or {}).get("upgradeStatus") or {}).get("status") or {}


def reconciled(api) -> bool:
    return any(c["type"] == "Reconciled" and c["status"] == "True"
               for c in (get_cr(api).get("status") or {}).get("conditions") or [])


def driver_revisions(api) -> set[str]:
    return {r.metadata.name for r in client.AppsV1Api(api).list_namespaced_controller_revision(
        NS, label_selector=DRIVER).items}


def generations(api) -> dict[str, int]:
    """metadata.generation of every DaemonSet and Deployment: it moves with each spec change."""
    apps = client.AppsV1Api(api)
    return ({f"DaemonSet/{d.metadata.name}": d.metadata.generation for d in apps.list_namespaced_daemon_set(NS).items}
            | {f"Deployment/{d.metadata.name}": d.metadata.generation
               for d in apps.list_namespaced_deployment(NS).items})


def seed_patch(cp, field: str, value) -> None:
    """The seed's admin command on spec.driver.upgradePolicy.<field> (docs/rollout-admin.md)."""
    kubectl(cp, "patch", "clusteroperators.gpu.metax-tech.com", "cluster-operator", "--type=json",
            "-p", SEED_PATCH % (field, json.dumps(value)))


def confirm_rollout(cp, api) -> None:
    """Act as the admin through POLICY's rollout: confirm, with the seed's command, the first and
    the last step, which wait for it; return once the rollout is Completed."""
    for step in (0, 3):
        eventually(lambda: step_status(api).get("currentStepState") == "StepPaused"
                   and step_status(api).get("currentStepIndex") == step, 120, f"step {step} paused")
        seed_patch(cp, "pause", False)
    eventually(lambda: step_status(api).get("currentStepState") == "Completed", 60, "the rollout Completed")


def assert_one_staged_rollout(api, tools_pods, revisions_before: set[str]) -> None:
    """Exactly one new driver revision, rolled out by the runner with POLICY's waves."""
    assert len(driver_revisions(api) - revisions_before) == 1, sorted(driver_revisions(api))
    assert deletions_per_step([RunnerLog(tools_pods.logs("metax-operator-runner-"))]) == POLICY_WAVES


def runtime_edit(cp, interval: int) -> None:
    """An admin's `kubectl patch` of the CR, which the runner applies to metax-gpu-device."""
    kubectl(cp, "patch", "clusteroperators.gpu.metax-tech.com", "cluster-operator", "--type=merge",
            "-p", json.dumps({"spec": {"gpuDevice": {"healthyInterval": interval}}}))


def runner_applied(api, interval: int) -> bool:
    """metax-gpu-device has the CR's healthyInterval, applied by the runner."""
    ds = client.AppsV1Api(api).read_namespaced_daemon_set("metax-gpu-device", NS)
    env = {e.name: e.value for c in ds.spec.template.spec.containers for e in c.env or []}
    return env.get("HEALTHY_INTERVAL") == str(interval) and any(
        m.manager == "metax-operator-runner" for m in ds.metadata.managed_fields)


class RunnerLog:
    """The runner's JSON log lines, read as tests/e2e/test_rollout_cluster's `deletions_per_step`
    reads a runner's."""

    def __init__(self, text: str):
        self.entries = []
        for line in text.splitlines():
            try:
                self.entries.append(json.loads(line))
            except ValueError:
                continue

    def lines(self, action: str) -> list[dict]:
        return [e for e in self.entries if e.get("action") == action]


def left_behind(cp, api) -> list[str]:
    """What of the release is still there after an uninstall, besides the CRD and namespace
    that are kept on purpose: our objects, the CR, the GPU label on nodes."""
    left = kubectl(cp, "get", "all,configmaps,serviceaccounts,roles,rolebindings", "-n", NS, "-l", OURS,
                   "-o", "name").split()
    left += kubectl(cp, "get", "clusterroles,clusterrolebindings", "-l", OURS, "-o", "name").split()
    try:
        get_cr(api)
        left.append("clusteroperator/cluster-operator")
    except client.ApiException as error:
        if error.status != 404:
            raise
    left += [f"node/{n.metadata.name} label {GPU_LABEL}"
             for n in client.CoreV1Api(api).list_node(label_selector=GPU_LABEL).items]
    return left


class StatusWatch:
    """What `extract(object)` gives for every change of one custom object (an Application, a
    HelmRelease), from a watch, until `stop()`."""

    def __init__(self, api, resource: tuple[str, str, str, str], name: str, extract):
        self.seen: list = []
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, args=(api, resource, name, extract), daemon=True)
        self._thread.start()

    def _run(self, api, resource, name, extract) -> None:
        objects = client.CustomObjectsApi(api)
        try:
            for event in self._watch.stream(objects.list_namespaced_custom_object, *resource,
                                            field_selector=f"metadata.name={name}", timeout_seconds=1800):
                self.seen.append(extract(event["object"]))
        except Exception:  # noqa: BLE001 - the control plane stopping ends the watch
            pass

    def stop(self) -> list:
        """What was seen, consecutive repeats collapsed."""
        self._watch.stop()
        self._thread.join(5)
        return [v for i, v in enumerate(self.seen) if i == 0 or self.seen[i - 1] != v]
