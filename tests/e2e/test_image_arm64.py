"""The arm64 tools image against the real API server, as the chart runs it on an Arm GPU node:
the driver's `wait-for` init container, the preflight hook and the runner's first pass, each
under runc in image/emulate (the arm64 programs under QEMU) with its rendered container's
command, environment, user, read-only root and emptyDirs, authenticated as its ServiceAccount
through the files the kubelet projects, on the host's network (the API server listens on
loopback, as a hostNetwork pod would reach it).

Why not arm64 pods on the real node: its containerd shares the host's kernel, and QEMU would have
to be registered in the host's own binfmt_misc, changing the machine for everything else on it.
So the real node runs the amd64 image, and this module runs the arm64 entry points directly.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from kubernetes import client

from tests.e2e.tools import bootstrap, install_chart, kubectl, ready, release_values, uninstall_chart
from tests.helm import RELEASE, find, render_chart
from tests.image import build, run_as_pod, unpack
from tests.waiting import eventually

NS = "arm64-e2e"
VALUES = {"registry": "cr.example.com/metax", "driver": {"payload": {"version": "2.32.0.6"}}}
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@pytest.fixture(scope="module")
def arm64(tmp_path_factory) -> Path:
    return unpack(build(), tmp_path_factory.mktemp("arm64"), "arm64")


@pytest.fixture(scope="module")
def installed(control_plane, tmp_path_factory):
    """The chart installed (no hooks: they run here), the CR bootstrapped, and the rendered pods
    of the same values by workload name."""
    cp, tmp = control_plane, tmp_path_factory.mktemp("arm64-install")
    api = cp.api()
    install_chart(cp, api, tmp, RELEASE, NS, VALUES)
    bootstrap(cp, tmp, RELEASE, release_values(cp, RELEASE, NS))
    rendered = render_chart(VALUES, helm="helm3", args=["--namespace", NS])
    yield {"api": api, "tmp": tmp, "objects": rendered}
    uninstall_chart(cp, api, RELEASE, NS)


def pod_spec(objects: list[dict], kind: str, name: str) -> dict:
    return find(objects, kind, name)["spec"]["template"]["spec"]


def container(spec: dict, name: str) -> dict:
    (found,) = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    return found


def projected_service_account(cp, folder: Path, account: str) -> tuple[Path, dict]:
    """What the kubelet projects for a pod of `account`: its token, the cluster CA and the
    namespace; and the variables it sets so the in-cluster client finds the API server."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "token").write_text(kubectl(cp, "create", "token", account, "-n", NS, "--duration", "1h").strip())
    cluster = yaml.safe_load(cp.kubeconfig.read_text())["clusters"][0]["cluster"]
    (folder / "ca.crt").write_bytes(base64.b64decode(cluster["certificate-authority-data"]))
    (folder / "namespace").write_text(NS)
    server = urlsplit(cluster["server"])
    return folder, {"KUBERNETES_SERVICE_HOST": server.hostname, "KUBERNETES_SERVICE_PORT": str(server.port)}


def run_pod_container(cp, bundle: Path, spec: dict, name: str, folder: Path, node: str, args=None, files=None):
    """Runs container `name` of the pod spec as the kubelet would on `node`; `files` are the
    host directories of its other volumes by name."""
    account, env = projected_service_account(cp, folder / "serviceaccount", spec["serviceAccountName"])
    volumes = {v["name"]: v for v in spec.get("volumes", [])} | {"kube-api-access": account} | (files or {})
    fields = {"spec.nodeName": node, "metadata.namespace": NS, "metadata.name": f"{name}-arm64"}
    return run_as_pod(
        bundle,
        container(spec, name),
        spec.get("securityContext", {}),
        args=args,
        volumes=volumes,
        host_network=True,
        fields=fields,
        env=env,
    )


@pytest.fixture(scope="module")
def arm_node(installed) -> str:
    core = client.CoreV1Api(installed["api"])
    nodes = core.list_node(label_selector="kubernetes.io/arch=arm64,metax-tech.com/gpu.installed=true").items
    assert nodes, "the control plane's fleet has arm64 GPU nodes"
    return nodes[0].metadata.name


def test_wait_for_returns_once_the_prerequisites_on_the_arm_node_are_ready(control_plane, arm64, installed, arm_node, tmp_path):
    core = client.CoreV1Api(installed["api"])

    def prerequisites_ready() -> bool:
        pods = core.list_namespaced_pod(NS, field_selector=f"spec.nodeName={arm_node}").items
        running = {owner.name for pod in pods if ready(pod) for owner in pod.metadata.owner_references or []}
        return {"metax-gpu-label", "metax-container-runtime"} <= running

    eventually(prerequisites_ready, 60, "gpu-label and container-runtime running on the arm64 node")
    spec = pod_spec(installed["objects"], "DaemonSet", "metax-driver")
    out = run_pod_container(control_plane, arm64, spec, "wait-for", tmp_path, arm_node, args=[])
    assert out.returncode == 0, out.stdout + out.stderr
    assert arm_node in out.stderr and "Traceback" not in out.stderr


def values_files(objects: list[dict], folder: Path, values: dict | None = None) -> Path:
    """The hook values ConfigMap's files (its JSON key), optionally with other values."""
    config_map = find(objects, "ConfigMap", "metax-operator-values")
    folder.mkdir(parents=True, exist_ok=True)
    for key, text in config_map["data"].items():
        (folder / key).write_text(text if values is None else json.dumps({**json.loads(text), **values}))
    return folder


@pytest.fixture
def preflight_account(control_plane, installed, tmp_path):
    """The preflight hook's ServiceAccount and RBAC as Helm creates them before the hook (the
    chart was installed without hooks)."""
    kinds = ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
    objects = [o for o in installed["objects"] if o["kind"] in kinds and o["metadata"]["name"].endswith("-preflight")]
    assert {o["kind"] for o in objects} >= {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
    manifest = tmp_path / "preflight-rbac.yaml"
    manifest.write_text(yaml.safe_dump_all(objects))
    kubectl(control_plane, "apply", "-n", NS, "-f", str(manifest))
    yield
    kubectl(control_plane, "delete", "-n", NS, "-f", str(manifest), "--ignore-not-found")


def test_the_preflight_hook_checks_the_mixed_fleet(control_plane, arm64, installed, arm_node, preflight_account, tmp_path):
    spec = pod_spec(installed["objects"], "Job", "metax-operator-preflight")
    files = {"values": values_files(installed["objects"], tmp_path / "values")}
    out = run_pod_container(control_plane, arm64, spec, "preflight", tmp_path, arm_node, files=files)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("preflight: values valid; Kubernetes v1.")

    tagged = {"driver": {**VALUES["driver"], "deploy": True, "payload": {"version": "2.32.0.6-amd64"}}}
    files = {"values": values_files(installed["objects"], tmp_path / "tagged", tagged)}
    out = run_pod_container(control_plane, arm64, spec, "preflight", tmp_path, arm_node, files=files)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert (
        "driver.payload.version: 2.32.0.6-amd64 is tagged for amd64, and the GPU nodes are amd64 (6) and arm64 (4)" in out.stderr
    )


def test_the_runner_makes_its_first_pass(control_plane, arm64, installed, arm_node, tmp_path):
    spec = pod_spec(installed["objects"], "Deployment", "metax-operator-runner")
    runner = container(spec, "runner")
    out = run_pod_container(control_plane, arm64, spec, "runner", tmp_path, arm_node, args=[*runner.get("args", []), "--once"])
    assert out.returncode == 0, out.stderr
    entries = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    assert [e["action"] for e in entries if e.get("action") in ("start", "pass")] == ["start", "pass"], out.stderr
    assert not [e for e in entries if e["level"] in ("error", "critical")], out.stderr
