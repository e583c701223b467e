"""A staged rollout on every Kubernetes version of scripts/controlplane/versions/matrix whose
`runs` says `rollout` (one of each class of what an API server enforces, the oldest supported
and the newest): that release's API server, controller manager (its DaemonSet controller) and
scheduler, with kwok's GPU nodes. As in test_rollout_cluster.py,
Helm 3 installs the chart without hooks and the bootstrap hook's command runs as a local process;
the runner runs as the chart's ServiceAccount. The seed's kubectl command changes the driver
version; the rollout's first step ends in a manual pause; an edit of the version made then is
refused by the chart's policy where the API server serves it, and elsewhere stored and held by
the runner (condition SpecHeld) until the rollout ends; the admin resumes, the rollout completes
at the first target, and the held edit then starts the next rollout, which completes too;
uninstall leaves no DaemonSet and no cordon.
"""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from metax_operator.chart import admission
from metax_operator.contract import CORDONED_LABEL
from metax_operator.runtime import api_failures, kube
from tests import controlplane
from tests.e2e.test_rollout_cluster import NS, RELEASE, Runner
from tests.e2e.tools import (
    bootstrap,
    cr_condition,
    driver_pods,
    get_cr,
    install_chart,
    kubectl,
    ready,
    release_values,
    seed_patch,
    service_account_kubeconfig,
    uninstall_chart,
)
from tests.waiting import eventually

pytestmark = pytest.mark.matrix

VERSIONS = [v for v in controlplane.matrix() if v.runs == "rollout"]
NODES = 4
POLICY = {
    "enableRollout": True,
    "maxParallel": 1,
    "upgradeSteps": [{"replicas": 1, "pauseDuration": {}}, {"replicas": "100%", "pauseDuration": 0}],
}


@pytest.fixture(scope="module", params=VERSIONS, ids=[v.version for v in VERSIONS])
def cluster(request, tmp_path_factory):
    version = request.param
    try:
        cp = controlplane.ControlPlane.start(
            tmp_path_factory.mktemp(f"cluster-{version.version}"), gpu_nodes=NODES, plain_nodes=1, kubernetes=version.version
        )
    except controlplane.ControlPlaneError as error:
        pytest.fail(f"Kubernetes {version.version}: {error}", pytrace=False)
    yield cp
    cp.stop()


def upgrade_status(api) -> dict:
    return (get_cr(api).get("status") or {}).get("upgradeStatus") or {}


def at(api, version: str) -> bool:
    """Every driver pod Ready with the payload `version`, and no rollout in progress."""
    pods = driver_pods(api, NS)
    images = {c.image for p in pods for c in p.spec.init_containers if c.name == "payload"}
    return (
        len(pods) == NODES
        and all(ready(p) for p in pods)
        and images == {f"cr.example.com/metax/driver-image:{version}"}
        and (upgrade_status(api).get("upgrading") is False)
    )


def _serves(cp, api_kind: str) -> bool:
    try:
        kube.Client.connect(str(cp.kubeconfig)).resource(*api_kind.rsplit("/", 1))
    except api_failures.NotServed:
        return False
    return True


def set_version(cp, version: str) -> str:
    """The seed's command for a new driver version (runbook 001, step 8): the API server's
    refusal as kubectl prints it, or "" when it is accepted."""
    patch = [{"op": "replace", "path": "/spec/driver/payload/version", "value": version}]
    try:
        kubectl(cp, "patch", "clusteroperators.gpu.metax-tech.com", "cluster-operator", "--type=json", "-p", json.dumps(patch))
    except AssertionError as refused:
        return str(refused)
    return ""


def test_a_staged_rollout_completes_and_an_edit_made_during_it_is_refused_or_held(cluster, tmp_path):
    cp = cluster
    api = cp.api()
    values = {
        "registry": "cr.example.com/metax",
        "driver": {"payload": {"name": "driver-image", "version": "2.32.0.6"}, "upgradePolicy": POLICY},
    }
    install_chart(cp, api, tmp_path, RELEASE, NS, values)
    bootstrap(cp, tmp_path, RELEASE, release_values(cp, RELEASE, NS))
    runner = Runner(service_account_kubeconfig(cp, tmp_path, "metax-operator-runner", NS), tmp_path, "runner-0")
    try:
        eventually(lambda: at(api, "2.32.0.6"), 90, "every driver pod Ready")
        assert set_version(cp, "2.33.0.1") == ""
        eventually(
            lambda: (upgrade_status(api).get("status") or {}).get("currentStepState") == "StepPaused",
            90,
            "step 0 done, waiting for the admin",
        )
        # the chart's ValidatingAdmissionPolicy: v1, or v1beta1 where 1.28-1.29 turned it on
        served = any(_serves(cp, f"{api_version}/ValidatingAdmissionPolicy") for api_version in admission.POLICY_API_VERSIONS)
        refusal = set_version(cp, "2.34.0.1")
        line = str(admission.frozen_during_rollout("driver.payload", "Progressing"))
        if served:
            assert line in refusal, refusal
        else:
            assert refusal == "", "an API server without the policy stores the edit"
            held = eventually(lambda: (c := cr_condition(api, "SpecHeld")) and c["status"] == "True" and c, 30, "the edit held")
            assert held["message"].startswith(line.split(";")[0]), held
        seed_patch(cp, "pause", False)
        eventually(lambda: at(api, "2.33.0.1") or at(api, "2.34.0.1"), 120, "the rollout completed")
        if not served:  # the held edit takes effect once the rollout ended: the next rollout
            eventually(lambda: upgrade_status(api).get("upgrading") is True or at(api, "2.34.0.1"), 60, "the next rollout")
            eventually(
                lambda: (upgrade_status(api).get("status") or {}).get("currentStepState") == "StepPaused" or at(api, "2.34.0.1"),
                90,
                "its first step",
            )
            assert cr_condition(api, "SpecHeld")["status"] == "False"
            seed_patch(cp, "pause", False)
            eventually(lambda: at(api, "2.34.0.1"), 120, "the held version rolled out")
        nodes = client.CoreV1Api(api).list_node().items
        assert not [n.metadata.name for n in nodes if n.spec.unschedulable or CORDONED_LABEL in (n.metadata.labels or {})]
    finally:
        runner.stop()
    uninstall_chart(cp, api, RELEASE, NS)
    assert client.AppsV1Api(api).list_namespaced_daemon_set(NS).items == []
