"""`helm install --wait`, `helm upgrade --wait` and `helm uninstall --wait` of the chart, with its
post-renderer, under Helm 3.18 and Helm 4.1, into the real control plane.

Hooks are skipped (`--no-hooks`): the chart's hooks are Jobs, and under kwok no container runs
(the harness leaves out kwok's stage that would mark a Job's pod Succeeded, so nothing fakes a
hook's success). The hook commands are run as local processes against the API server by the
hooks' and the runner's own e2e tests. So this test checks what Helm itself applies: every
enabled DaemonSet reaches desired = ready on exactly the nodes it selects (the GPU nodes, or
every node for gpu-label), an upgrade rolls the changed DaemonSet and keeps an admin's in-place
edit of driver-config, and uninstall removes it all.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from tests.controlplane import CACHE, GPU_LABEL, REPO
from tests.waiting import eventually

BIN = CACHE / "bin"
RELEASE = "metax"
CRD = "clusteroperators.gpu.metax-tech.com"
VALUES = {
    "registry": "registry.invalid/metax",
    "driver": {"payload": {"version": "2.32.0.6"}},
    "exporter": {"deploy": True},
}  # every component on
HELMS = {
    "helm3": (BIN / "helm3", str(REPO / "postrender" / "metax-postrender")),
    "helm4": (BIN / "helm4", "metax-postrender"),  # the plugin, installed in the test's Helm home
}


@pytest.fixture(scope="module")
def helm_env(control_plane, tmp_path_factory) -> dict:
    """Helm's homes in a temp dir (the Helm 4 post-renderer plugin installed there), the cluster's kubeconfig."""
    home = tmp_path_factory.mktemp("helm-home")
    env = {
        **os.environ,
        "KUBECONFIG": str(control_plane.kubeconfig),
        "HELM_DATA_HOME": str(home / "data"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_CACHE_HOME": str(home / "cache"),
    }
    subprocess.run([BIN / "helm4", "plugin", "install", REPO / "postrender"], env=env, check=True, capture_output=True)
    return env


def helm(which: str, env: dict, *args: str) -> str:
    binary, post_renderer = HELMS[which]
    rendering = ("--post-renderer", post_renderer) if args[0] in ("install", "upgrade", "template") else ()
    done = subprocess.run([str(binary), *args, *rendering], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{which} {args[0]} failed:\n{done.stderr}"
    return done.stdout


def rendered_daemonsets(which: str, env: dict, values: Path, namespace: str) -> set[str]:
    manifests = helm(which, env, "template", RELEASE, str(REPO), "-n", namespace, "-f", str(values))
    return {d["metadata"]["name"] for d in yaml.safe_load_all(manifests) if d and d["kind"] == "DaemonSet"}


def daemonsets_settled(api, namespace: str) -> dict | None:
    """{name: DaemonSet} once every DaemonSet's controller has caught up and all its pods are
    current and Ready; None before."""
    found = client.AppsV1Api(api).list_namespaced_daemon_set(namespace).items
    for ds in found:
        s = ds.status
        if not (
            s.observed_generation == ds.metadata.generation
            and s.desired_number_scheduled > 0
            and s.desired_number_scheduled == s.number_ready == (s.updated_number_scheduled or 0) == s.current_number_scheduled
        ):
            return None
    return {ds.metadata.name: ds for ds in found}


def assert_on_selected_nodes_only(api, namespace: str, daemonsets: dict) -> None:
    core = client.CoreV1Api(api)
    nodes = core.list_node().items
    gpu_nodes = {n.metadata.name for n in nodes if n.metadata.labels.get(GPU_LABEL) == "true"}
    # x86 and Arm GPU servers side by side: every component runs on both.
    assert {n.metadata.labels["kubernetes.io/arch"] for n in nodes if n.metadata.name in gpu_nodes} == {"amd64", "arm64"}
    for name, ds in daemonsets.items():
        selector = ds.spec.template.spec.node_selector or {}
        expected = gpu_nodes if selector.get(GPU_LABEL) == "true" else {n.metadata.name for n in nodes}
        if name != "metax-gpu-label":
            assert selector.get(GPU_LABEL) == "true", f"{name} does not select GPU nodes: {selector}"
        match = ",".join(f"{k}={v}" for k, v in ds.spec.selector.match_labels.items())
        pods = core.list_namespaced_pod(namespace, label_selector=match).items
        assert sorted(p.spec.node_name for p in pods) == sorted(expected), name
        assert ds.status.number_ready == len(expected), name


@pytest.fixture
def namespace(request, control_plane, helm_env):
    """The release's namespace. The cluster is left as found: the release is removed even when
    the test failed half-way, and so is the CRD if this install created it (Helm keeps CRDs;
    Helm 4 refuses to install over one that Helm 3 created, see docs/control-plane.md)."""
    which = request.node.callspec.params["which"]
    extensions = client.ApiextensionsV1Api(control_plane.api())
    crd_before = {c.metadata.name for c in extensions.list_custom_resource_definition().items}
    namespace = f"metax-{which}"
    yield namespace
    subprocess.run(
        [str(HELMS[which][0]), "uninstall", RELEASE, "-n", namespace, "--no-hooks", "--ignore-not-found"],
        env=helm_env,
        capture_output=True,
        timeout=120,
    )
    client.CoreV1Api(control_plane.api()).delete_namespace(namespace)
    if CRD not in crd_before:
        extensions.delete_custom_resource_definition(CRD)
        eventually(
            lambda: CRD not in {c.metadata.name for c in extensions.list_custom_resource_definition().items},
            60,
            f"CRD {CRD} deleted",
        )


@pytest.mark.parametrize("which", HELMS)
def test_install_upgrade_uninstall(control_plane, helm_env, namespace, tmp_path, which):
    api = control_plane.api()
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(VALUES))
    expected = rendered_daemonsets(which, helm_env, values, namespace)
    assert {"metax-gpu-label", "metax-driver", "metax-data-exporter"} <= expected

    helm(
        which,
        helm_env,
        "install",
        RELEASE,
        str(REPO),
        "-n",
        namespace,
        "--create-namespace",
        "-f",
        str(values),
        "--wait",
        "--timeout",
        "3m",
        "--no-hooks",
    )
    installed = daemonsets_settled(api, namespace)
    assert installed is not None, "helm install --wait returned before the DaemonSets were ready"
    assert set(installed) == expected
    assert_on_selected_nodes_only(api, namespace, installed)
    # The seed's in-place edit of driver-config (§3.2.6), as `kubectl edit` writes it.
    edited = {"module-params": "xcore_page_size: 12\n"}
    client.CoreV1Api(api).patch_namespaced_config_map("driver-config", namespace, {"data": edited}, field_manager="kubectl-edit")

    helm(
        which,
        helm_env,
        "upgrade",
        RELEASE,
        str(REPO),
        "-n",
        namespace,
        "-f",
        str(values),
        "--set",
        "gpuDevice.log.level=debug",
        "--set-string",
        "gpuDevice.image.tag=0.10.1",
        "--set-string",
        "driver.payload.version=2.33.0.1",
        "--wait",
        "--timeout",
        "3m",
        "--no-hooks",
    )
    upgraded = eventually(lambda: daemonsets_settled(api, namespace), 60, "DaemonSets settled after upgrade")
    gpu_device = upgraded["metax-gpu-device"]
    assert gpu_device.metadata.generation == installed["metax-gpu-device"].metadata.generation + 1
    assert gpu_device.spec.template.spec.containers[0].image.endswith(":0.10.1")
    # Once installed, Helm renders the fields the runner writes from the CR as the live DaemonSet
    # holds them: a new log level or driver version reaches the pods through the CR (the
    # bootstrap hook, then the runner; both skipped here), never by Helm's own write, which would
    # fight the runner's.
    env = {e.name: e.value for e in gpu_device.spec.template.spec.containers[0].env}
    assert env["LOG_LEVEL"] == "info", env
    payload = {c.name: c.image for c in upgraded["metax-driver"].spec.template.spec.init_containers}["payload"]
    assert payload.endswith(":2.32.0.6"), payload
    assert upgraded["metax-driver"].metadata.generation == installed["metax-driver"].metadata.generation
    # The admin's edit of driver-config is kept: Helm renders the live ConfigMap's keys (under
    # Helm 4 the upgrade would otherwise stop on a conflict with kubectl-edit, under Helm 3 undo it).
    config = client.CoreV1Api(api).read_namespaced_config_map("driver-config", namespace).data
    assert config["module-params"] == edited["module-params"] and config["node-vfnums"] == "nodes: {}\n", config
    assert_on_selected_nodes_only(api, namespace, upgraded)
    history = json.loads(helm(which, helm_env, "history", RELEASE, "-n", namespace, "-o", "json"))
    assert [(h["revision"], h["status"]) for h in history] == [(1, "superseded"), (2, "deployed")]

    helm(which, helm_env, "uninstall", RELEASE, "-n", namespace, "--wait", "--timeout", "2m", "--no-hooks")
    assert client.AppsV1Api(api).list_namespaced_daemon_set(namespace).items == []
    eventually(lambda: not client.CoreV1Api(api).list_namespaced_pod(namespace).items, 60, f"no pods left in {namespace}")
