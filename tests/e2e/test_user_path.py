"""The user's path, as an administrator types it, under Helm 3.18 and Helm 4.1: the seed's
`helm install oci://DOMAIN/PROJECT/metax-operator --create-namespace -n metax-operator
--generate-name --wait --set registry=... --set driver.payload.version=...` from the local OCI
registry, with every hook; `helm test`; `helm upgrade --set driver.payload.version=...` that
the in-cluster runner rolls out in stages over the kwok driver pods; `helm uninstall --wait`.

The hook Jobs, the runner and the helm-test pod run as containers of the tools image built from
this working tree, on the real node (tests/realnode.py); the values file the administrator adds
with -f puts them there (`hooks.*`/`runner.*` nodeSelector and tolerations); the MetaX
components stay on the kwok nodes.
"""
from __future__ import annotations

import json
import re
import subprocess

import pytest
from kubernetes import client

from tests.controlplane import GPU_LABEL, wait_for as eventually
from tests.e2e.tools import CR, kubectl
from tests.e2e.userpath import (GPU_NODES, NS, RUNNER_PODS, TOOLS_UID, PodWatch, assert_ran_as_tools_pod, ok,
                                terminated)
from tests.realnode import NODE_NAME

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("real-node")]

CRD = "clusteroperators.gpu.metax-tech.com"
EVENTS_NS = "default"  # where the API server keeps events of the cluster-scoped CR
LEASE = "metax-operator-runner"
DRIVER_PODS = "app.kubernetes.io/component=driver"
CHART_OBJECTS = "app.kubernetes.io/name=metax-operator"
# Two steps over the 4 GPU nodes, no pauses: 1 pod, then the other 3 in waves of 2 (maxParallel 50%).
POLICY = {"enableRollout": True, "pause": False, "maxParallel": "50%", "maxUnavailable": 0,
          "maxFailureThreshold": 3, "fallback": "pause",
          "upgradeSteps": [{"replicas": 1, "pauseDuration": 0}, {"replicas": "100%", "pauseDuration": 0}]}


def seed_install(cluster, which: str, values, *more: str) -> subprocess.CompletedProcess:
    """The seed's command (§3.2.1) with the administrator's values file."""
    return cluster.helm(which, "install", cluster.chart, "--create-namespace", "-n", NS, "--generate-name",
                        "--wait", "--timeout", "5m", "--set", f"registry={cluster.registry}",
                        "--set", "driver.payload.version=2.32.0.6", "-f", str(values), *more)


def release_name(output: str) -> str:
    return re.search(r"^NAME: (\S+)$", output, re.M).group(1)


def get_cr(api) -> dict | None:
    try:
        return client.CustomObjectsApi(api).get_cluster_custom_object(*CR)
    except client.ApiException as err:
        if err.status == 404:
            return None
        raise


def upgrade_status(api) -> dict:
    return ((get_cr(api) or {}).get("status") or {}).get("upgradeStatus") or {}


def conditions(api) -> dict[str, str]:
    return {c["type"]: c["status"] for c in ((get_cr(api) or {}).get("status") or {}).get("conditions") or []}


def runner_pod(api) -> client.V1Pod | None:
    pods = [p for p in client.CoreV1Api(api).list_namespaced_pod(NS, label_selector=RUNNER_PODS).items
            if p.status.phase == "Running" and p.metadata.deletion_timestamp is None]
    return pods[0] if len(pods) == 1 else None


def runner_log(cluster) -> list[dict]:
    """The runner's JSON log lines, read as a user does (`kubectl logs`, through the kubelet)."""
    out = kubectl(cluster.cp, "logs", "-n", NS, "deployment/metax-operator-runner")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def driver_pods(api) -> list[client.V1Pod]:
    return [p for p in client.CoreV1Api(api).list_namespaced_pod(NS, label_selector=DRIVER_PODS).items
            if p.metadata.deletion_timestamp is None]


@pytest.fixture
def clean_slate(tools_cluster, tools_api):
    """Whatever the test leaves (a failed install's release and hook objects, the CRD Helm keeps,
    the namespace) is removed after it, and the GPU nodes get their gpu-label label back (the
    cleanup hook removes it; on a real cluster gpu-label's pods set it again)."""
    yield
    cluster, api = tools_cluster, tools_api
    for release in cluster.helm("helm3", "list", "-n", NS, "-q").stdout.split():
        cluster.helm("helm3", "uninstall", release, "-n", NS, "--no-hooks", "--wait")
    custom, rbac = client.CustomObjectsApi(api), client.RbacAuthorizationV1Api(api)
    if get_cr(api):
        custom.delete_cluster_custom_object(*CR)
    for role in rbac.list_cluster_role(label_selector=CHART_OBJECTS).items:
        rbac.delete_cluster_role(role.metadata.name)
    for binding in rbac.list_cluster_role_binding(label_selector=CHART_OBJECTS).items:
        rbac.delete_cluster_role_binding(binding.metadata.name)
    core, extensions = client.CoreV1Api(api), client.ApiextensionsV1Api(api)
    if any(n.metadata.name == NS for n in core.list_namespace().items):
        core.delete_namespace(NS)
    if any(c.metadata.name == CRD for c in extensions.list_custom_resource_definition().items):
        extensions.delete_custom_resource_definition(CRD)
    for node in core.list_node(label_selector="type=kwok").items:
        if node.metadata.name.startswith("gpu-node-"):
            core.patch_node(node.metadata.name, {"metadata": {"labels": {GPU_LABEL: "true"}}})
    eventually(lambda: NS not in {n.metadata.name for n in core.list_namespace().items}, 120, f"namespace {NS} gone")
    eventually(lambda: CRD not in {c.metadata.name for c in extensions.list_custom_resource_definition().items}, 60,
               "the CRD gone")


@pytest.mark.parametrize("which", ["helm3", "helm4"])
def test_seed_install_helm_test_staged_upgrade_and_uninstall(tools_cluster, tools_api, clean_slate, tmp_path, which):
    cluster, api = tools_cluster, tools_api
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    values = cluster.user_values(tmp_path, runner={"interval": 1}, driver={"upgradePolicy": POLICY})
    pods = PodWatch(api, NS)

    # The seed's install command: every hook runs, as a pod of the tools image on the real node.
    release = release_name(ok(seed_install(cluster, which, values)))
    for hook in ("preflight", "upgrade-crds", "bootstrap"):
        eventually(lambda: [p for p in pods.hook(hook) if terminated(p)], 30, f"the {hook} hook's pod seen ended")
        for pod in pods.hook(hook):
            assert_ran_as_tools_pod(pod, cluster)

    # The MetaX components stay on the kwok nodes (gpu-label too, though it runs on every node:
    # it does not tolerate the real node's taint); the tools pods are all on the real node.
    for pod in core.list_namespaced_pod(NS).items:
        tools = (pod.metadata.labels or {}).get("app.kubernetes.io/component") == "runner"
        assert (pod.spec.node_name == NODE_NAME) == tools, f"{pod.metadata.name} is on {pod.spec.node_name}"
    gpu_label = apps.read_namespaced_daemon_set("metax-gpu-label", NS)
    assert gpu_label.status.desired_number_scheduled == GPU_NODES + 1  # every kwok node, not the real one

    # The runner pod becomes leader and reconciles the CR.
    runner = eventually(lambda: runner_pod(api), 60, "one running runner pod")
    assert runner.spec.node_name == NODE_NAME
    lease = client.CoordinationV1Api(api)
    eventually(lambda: (lease.read_namespaced_lease(LEASE, NS).spec.holder_identity or "")
               .startswith(f"{runner.metadata.name}_"), 60, "the runner pod holding the Lease")
    eventually(lambda: conditions(api) == {"SpecValid": "True", "ConfigMapsValid": "True", "Reconciled": "True",
                                           "HelmUpgradeRequired": "False"}, 60, "the runner's conditions on the CR")
    assert kubectl(cluster.cp, "exec", "-n", NS, runner.metadata.name, "--", "id", "-u").strip() == str(TOOLS_UID)
    touched = kubectl(cluster.cp, "exec", "-n", NS, runner.metadata.name, "--", "touch", "/probe", check=False)
    assert touched == "", touched

    # helm test: the test pod runs on the real node and reports the install healthy.
    report = ok(cluster.helm(which, "test", release, "-n", NS, "--logs", "--timeout", "3m"))
    assert "test: the install is healthy" in report
    assert_ran_as_tools_pod(core.read_namespaced_pod("metax-operator-test", NS), cluster)

    # helm upgrade of the payload version: the hooks run again, the in-cluster runner rolls the
    # driver out step by step over the kwok driver pods.
    old = {p.metadata.labels["controller-revision-hash"] for p in driver_pods(api)}
    assert len(old) == 1 and len(driver_pods(api)) == GPU_NODES
    ok(cluster.helm(which, "upgrade", release, cluster.chart, "-n", NS, "--reuse-values",
                    "--set", "driver.payload.version=2.33.0.1", "--wait", "--timeout", "5m"))
    assert len(pods.hook("bootstrap")) == 2, "bootstrap runs again before the upgrade"
    done = eventually(lambda: (s := upgrade_status(api)).get("phase") == "Idling" and not s.get("upgrading")
                      and (s.get("status") or {}).get("currentStepState") == "Completed" and s, 120,
                      "the staged rollout Completed")
    step = done["status"]
    assert step["upgradingPodSpecRevision"] not in old and step["lastPodSpecRevision"] in old
    assert step["totalUpgradeReplicas"] == step["totalUpgradeReadyReplicas"] == GPU_NODES
    assert step["currentStepIndex"] == 1 and done["lastAppliedSpec"] and done["lastCoDriverSpec"]
    assert {c["type"]: c["status"] for c in done["condition"]}["Succeed"] == "True"
    new = [p for p in driver_pods(api) if p.metadata.labels["controller-revision-hash"] == step["upgradingPodSpecRevision"]]
    assert len(new) == GPU_NODES
    events = core.list_namespaced_event(EVENTS_NS, field_selector="involvedObject.name=cluster-operator").items
    reasons = {e.reason for e in events if e.reporting_component == "metax-operator-runner"}
    assert {"RolloutStarted", "StepReady", "Completed"} <= reasons, reasons
    waves = {}
    for line in runner_log(cluster):
        if line.get("action") == "rollout-pass" and line.get("deleted"):
            waves.setdefault(line["step"], []).append(len(line["deleted"]))
    assert waves == {0: [1], 1: [2, 1]}, waves

    # helm uninstall --wait: the cleanup hook runs on the real node and nothing of ours is left
    # but the CRD (kept by default, crds.keep).
    ok(cluster.helm(which, "uninstall", release, "-n", NS, "--wait", "--timeout", "3m"))
    eventually(lambda: [p for p in pods.hook("cleanup") if terminated(p)], 30, "the cleanup hook's pod seen ended")
    for pod in pods.hook("cleanup"):
        assert_ran_as_tools_pod(pod, cluster)
    pods.stop()
    assert_nothing_of_ours_left(api)


def ours_left(api) -> dict[str, list[str]]:
    """What of the release is still in the cluster, by kind (the CRD aside: Helm keeps it)."""
    core, apps, batch = client.CoreV1Api(api), client.AppsV1Api(api), client.BatchV1Api(api)
    rbac, coordination = client.RbacAuthorizationV1Api(api), client.CoordinationV1Api(api)
    found = {
        "pods": [p.metadata.name for p in core.list_namespaced_pod(NS).items],
        "daemonsets": [d.metadata.name for d in apps.list_namespaced_daemon_set(NS).items],
        "deployments": [d.metadata.name for d in apps.list_namespaced_deployment(NS).items],
        "jobs": [j.metadata.name for j in batch.list_namespaced_job(NS).items],
        "configmaps": [c.metadata.name for c in core.list_namespaced_config_map(NS).items
                       if c.metadata.name != "kube-root-ca.crt"],
        "serviceaccounts": [s.metadata.name for s in core.list_namespaced_service_account(NS).items
                            if s.metadata.name != "default"],
        "services": [s.metadata.name for s in core.list_namespaced_service(NS).items],
        "leases": [lease.metadata.name for lease in coordination.list_namespaced_lease(NS).items],
        "roles": [f"{r.metadata.namespace}/{r.metadata.name}"
                  for r in rbac.list_role_for_all_namespaces(label_selector=CHART_OBJECTS).items],
        "clusterroles": [r.metadata.name for r in rbac.list_cluster_role(label_selector=CHART_OBJECTS).items],
        "cr": [CR[-1]] if get_cr(api) else [],
        "node labels": [n.metadata.name for n in core.list_node(label_selector=GPU_LABEL).items],
    }
    return {kind: names for kind, names in found.items() if names}


def assert_nothing_of_ours_left(api) -> None:
    try:
        eventually(lambda: not ours_left(api), 120, "nothing of the release left")
    except AssertionError:
        raise AssertionError(f"left after helm uninstall --wait: {ours_left(api)}") from None
    assert CRD in {c.metadata.name for c in client.ApiextensionsV1Api(api).list_custom_resource_definition().items}
