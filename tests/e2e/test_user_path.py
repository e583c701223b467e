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

import pytest
from kubernetes import client

from tests.controlplane import GPU_LABEL
from tests.e2e.tools import CR, kubectl
from tests.e2e.userpath import (
    CHART_OBJECTS,
    CRD,
    GPU_NODES,
    NS,
    POLICY,
    TOOLS_UID,
    PodWatch,
    ToolsCluster,
    assert_ran_as_tools_pod,
    driver_pods,
    get_cr,
    ok,
    release_name,
    rollout_completed,
    runner_pod,
    runner_waves,
    seed_install,
    terminated,
)
from tests.realnode import NODE_NAME
from tests.waiting import eventually

pytestmark = pytest.mark.xdist_group("real-node")

EVENTS_NS = "default"  # where the API server keeps events of the cluster-scoped CR
LEASE = "metax-operator-runner"


def conditions(api) -> dict[str, str]:
    return {c["type"]: c["status"] for c in ((get_cr(api) or {}).get("status") or {}).get("conditions") or []}


@pytest.mark.parametrize("which", ["helm3", "helm4"])
def test_seed_install_helm_test_staged_upgrade_and_uninstall(tools_cluster, tools_api, clean_slate, tmp_path, which):
    seed_path(tools_cluster, tools_api, tmp_path, which)


def runner_event_reasons(core: client.CoreV1Api) -> set[str]:
    events = core.list_namespaced_event(EVENTS_NS, field_selector="involvedObject.name=cluster-operator").items
    return {e.reason for e in events if e.reporting_component == "metax-operator-runner"}


def seed_path(cluster: ToolsCluster, api, tmp_path, which: str) -> None:
    """The seed's install, helm test, a staged upgrade through the values and uninstall, each
    checked where it ends (tests/e2e/test_versions_user_path.py walks it on other versions)."""
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    values = cluster.user_values(tmp_path, runner={"interval": 1}, driver={"upgradePolicy": POLICY})
    pods = PodWatch(api, NS)

    # The seed's install command: every hook runs, as a pod of the tools image on the real node.
    release = release_name(ok(seed_install(cluster, which, values)))
    for hook in ("preflight", "upgrade-crds", "bootstrap"):
        eventually(lambda hook=hook: [p for p in pods.hook(hook) if terminated(p)], 30, f"the {hook} hook's pod seen ended")
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
    eventually(
        lambda: (lease.read_namespaced_lease(LEASE, NS).spec.holder_identity or "").startswith(f"{runner.metadata.name}_"),
        60,
        "the runner pod holding the Lease",
    )
    healthy = {
        "SpecValid": "True",
        "ConfigMapsValid": "True",
        "Reconciled": "True",
        "HelmUpgradeRequired": "False",
        "WorkloadsValid": "True",
        "RunnerHealthy": "True",
    }
    eventually(lambda: conditions(api) == healthy, 60, "the runner's conditions on the CR")
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
    ok(
        cluster.helm(
            which,
            "upgrade",
            release,
            cluster.chart,
            "-n",
            NS,
            "--reuse-values",
            "--set",
            "driver.payload.version=2.33.0.1",
            "--wait",
            "--timeout",
            "5m",
        )
    )
    assert len(pods.hook("bootstrap")) == 2, "bootstrap runs again before the upgrade"
    done = eventually(lambda: rollout_completed(api), 120, "the staged rollout Completed")
    step = done["status"]
    assert step["upgradingPodSpecRevision"] not in old and step["lastPodSpecRevision"] in old
    assert step["totalUpgradeReplicas"] == step["totalUpgradeReadyReplicas"] == GPU_NODES
    assert step["currentStepIndex"] == 1 and done["lastAppliedSpec"] and done["lastCoDriverSpec"]
    assert {c["type"]: c["status"] for c in done["condition"]}["Succeed"] == "True"
    revisions = [p.metadata.labels["controller-revision-hash"] for p in driver_pods(api)]
    assert revisions == [step["upgradingPodSpecRevision"]] * GPU_NODES
    # The runner writes a pass's status before its Events: wait for the last pass's.
    eventually(
        lambda: {"RolloutStarted", "StepReady", "Completed"} <= runner_event_reasons(core),
        30,
        "the runner's Events of the rollout",
    )
    assert (waves := runner_waves(cluster)) == {0: [1], 1: [2, 1]}, waves

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
        "configmaps": [
            c.metadata.name for c in core.list_namespaced_config_map(NS).items if c.metadata.name != "kube-root-ca.crt"
        ],
        "serviceaccounts": [
            s.metadata.name for s in core.list_namespaced_service_account(NS).items if s.metadata.name != "default"
        ],
        "services": [s.metadata.name for s in core.list_namespaced_service(NS).items],
        "leases": [lease.metadata.name for lease in coordination.list_namespaced_lease(NS).items],
        "roles": [
            f"{r.metadata.namespace}/{r.metadata.name}"
            for r in rbac.list_role_for_all_namespaces(label_selector=CHART_OBJECTS).items
        ],
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
