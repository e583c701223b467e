"""The control plane harness itself: real API server, DaemonSet controller and scheduler placing
pods on kwok nodes, and each injected fault visible through the API as a real node would show it."""

from __future__ import annotations

import socket
import uuid

import pytest
from kubernetes import client

from tests import controlplane
from tests.controlplane import GPU_LABEL, GPU_RESOURCE
from tests.e2e.tools import ready
from tests.waiting import consistently, eventually, for_seconds

pytestmark = pytest.mark.e2e  # starts control planes of its own


@pytest.fixture
def namespace(control_plane):
    core = client.CoreV1Api(control_plane.api())
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


def daemonset(name: str, node_selector: dict | None = None) -> dict:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": node_selector or {},
                    "containers": [{"name": "main", "image": "registry.invalid/metax/probe:1"}],
                },
            },
        },
    }


def create_daemonset(cp, namespace: str, manifest: dict) -> None:
    client.AppsV1Api(cp.api()).create_namespaced_daemon_set(namespace, manifest)


def pods(cp, namespace: str, app: str) -> list:
    return client.CoreV1Api(cp.api()).list_namespaced_pod(namespace, label_selector=f"app={app}").items


def node_names(cp, **selector) -> set[str]:
    label_selector = ",".join(f"{k}={v}" for k, v in selector.items())
    return {n.metadata.name for n in client.CoreV1Api(cp.api()).list_node(label_selector=label_selector).items}


def ready_daemonset(cp, namespace: str, name: str, expected: int):
    """The DaemonSet's status once the controller reports `expected` desired, scheduled and ready."""
    status = client.AppsV1Api(cp.api()).read_namespaced_daemon_set_status(name, namespace).status
    done = status.desired_number_scheduled == status.number_ready == status.current_number_scheduled == expected
    return status if done else None


def number_ready(cp, namespace: str, name: str) -> int:
    return client.AppsV1Api(cp.api()).read_namespaced_daemon_set_status(name, namespace).status.number_ready


def on_node(cp, namespace, app, node):
    return next((p for p in pods(cp, namespace, app) if p.spec.node_name == node), None)


def test_nodes_look_like_gpu_servers(control_plane):
    nodes = client.CoreV1Api(control_plane.api()).list_node().items
    gpu = [n for n in nodes if n.metadata.labels.get(GPU_LABEL) == "true"]
    plain = [n for n in nodes if GPU_LABEL not in n.metadata.labels]
    assert len(gpu) >= 10 and len(plain) >= 2
    for node in gpu:
        assert node.status.allocatable[GPU_RESOURCE] == "8"
        assert node.status.node_info.os_image == "Ubuntu 22.04.4 LTS"
        assert node.status.node_info.container_runtime_version == "containerd://1.7.13"
        assert node.status.node_info.kubelet_version == controlplane.K8S_VERSION
    for node in gpu + plain:
        assert ready(node)
    assert all(GPU_RESOURCE not in n.status.allocatable for n in plain)


def test_server_version_is_the_pinned_release(control_plane):
    assert client.VersionApi(control_plane.api()).get_code().git_version == controlplane.K8S_VERSION


def test_daemonset_selecting_gpu_nodes_is_ready_on_gpu_nodes_only(control_plane, namespace):
    gpu_nodes = node_names(control_plane, **{GPU_LABEL: "true"})
    create_daemonset(control_plane, namespace, daemonset("gpu-only", {GPU_LABEL: "true"}))
    eventually(
        lambda: ready_daemonset(control_plane, namespace, "gpu-only", len(gpu_nodes)),
        60,
        f"gpu-only DaemonSet ready on {len(gpu_nodes)} GPU nodes",
    )
    placed = pods(control_plane, namespace, "gpu-only")
    assert {p.spec.node_name for p in placed} == gpu_nodes
    assert all(ready(p) and p.status.pod_ip for p in placed)


def test_daemonset_without_selector_runs_on_every_node(control_plane, namespace):
    every = node_names(control_plane, type="kwok")
    assert node_names(control_plane, **{GPU_LABEL: "true"}) < every  # plain nodes exist
    create_daemonset(control_plane, namespace, daemonset("everywhere"))
    eventually(
        lambda: ready_daemonset(control_plane, namespace, "everywhere", len(every)),
        60,
        f"everywhere DaemonSet ready on all {len(every)} nodes",
    )
    assert {p.spec.node_name for p in pods(control_plane, namespace, "everywhere")} == every


def test_deleted_pods_go_away_and_are_replaced(control_plane, namespace):
    gpu_nodes = node_names(control_plane, **{GPU_LABEL: "true"})
    create_daemonset(control_plane, namespace, daemonset("replace", {GPU_LABEL: "true"}))
    eventually(lambda: ready_daemonset(control_plane, namespace, "replace", len(gpu_nodes)), 60, "replace ready")
    node = sorted(gpu_nodes)[0]
    old = on_node(control_plane, namespace, "replace", node)
    client.CoreV1Api(control_plane.api()).delete_namespaced_pod(old.metadata.name, namespace)
    replacement = eventually(
        lambda: (
            (p := on_node(control_plane, namespace, "replace", node)) and p.metadata.uid != old.metadata.uid and ready(p) and p
        ),
        60,
        f"a new Ready pod on {node}",
    )
    assert replacement.metadata.name != old.metadata.name
    names = {p.metadata.name for p in pods(control_plane, namespace, "replace")}
    assert old.metadata.name not in names


def test_pods_never_ready_on_a_faulted_node(faults, namespace):
    gpu_nodes = sorted(node_names(faults, **{GPU_LABEL: "true"}))
    bad = gpu_nodes[1]
    faults.pods_never_ready([bad])
    create_daemonset(faults, namespace, daemonset("never", {GPU_LABEL: "true"}))
    eventually(lambda: number_ready(faults, namespace, "never") == len(gpu_nodes) - 1, 60, "all but one pod Ready")
    consistently(
        lambda: not ready(on_node(faults, namespace, "never", bad)), for_seconds(3), 10, "the faulted node's pod unready"
    )
    pod = on_node(faults, namespace, "never", bad)
    assert pod.status.phase == "Running" and pod.status.pod_ip
    assert not ready(pod)
    assert all(ready(p) for p in pods(faults, namespace, "never") if p.spec.node_name != bad)


def test_pods_become_ready_after_a_delay(faults, namespace):
    gpu_nodes = sorted(node_names(faults, **{GPU_LABEL: "true"}))
    slow = gpu_nodes[2]
    faults.pods_ready_after([slow], seconds=6)
    create_daemonset(faults, namespace, daemonset("slow", {GPU_LABEL: "true"}))
    eventually(lambda: number_ready(faults, namespace, "slow") == len(gpu_nodes) - 1, 30, "the undelayed pods Ready")
    assert not ready(on_node(faults, namespace, "slow", slow))
    eventually(lambda: ready_daemonset(faults, namespace, "slow", len(gpu_nodes)), 30, "the delayed pod Ready")
    pod = on_node(faults, namespace, "slow", slow)
    ready_at = next(c.last_transition_time for c in pod.status.conditions if c.type == "Ready")
    assert (ready_at - pod.metadata.creation_timestamp).total_seconds() >= 5


def test_crash_loop_raises_restart_count(faults, namespace):
    gpu_nodes = sorted(node_names(faults, **{GPU_LABEL: "true"}))
    crashing = gpu_nodes[3]
    faults.pods_crash_loop([crashing], every=1)
    create_daemonset(faults, namespace, daemonset("crash", {GPU_LABEL: "true"}))

    def restarts():
        pod = on_node(faults, namespace, "crash", crashing)
        statuses = pod and pod.status.container_statuses
        return statuses[0].restart_count if statuses else 0

    eventually(lambda: restarts() >= 1, 30, "a first restart")
    first = restarts()
    eventually(lambda: restarts() >= first + 2, 30, "two more restarts")
    pod = on_node(faults, namespace, "crash", crashing)
    assert not ready(pod)
    assert pod.status.container_statuses[0].state.waiting.reason == "CrashLoopBackOff"
    assert pod.status.container_statuses[0].last_state.terminated.exit_code == 1
    assert number_ready(faults, namespace, "crash") <= len(gpu_nodes) - 1


def test_node_not_ready_is_tainted_then_recovers_when_cleared(faults):
    core = client.CoreV1Api(faults.api())
    node = sorted(node_names(faults, **{GPU_LABEL: "true"}))[4]

    def ready_status():
        return next(c.status for c in core.read_node_status(node).status.conditions if c.type == "Ready")

    def not_ready_taints():
        return {t.effect for t in core.read_node(node).spec.taints or [] if t.key == controlplane.NOT_READY_TAINT}

    fault = faults.nodes_not_ready([node])
    eventually(lambda: ready_status() == "False", 30, f"{node} NotReady")
    eventually(lambda: not_ready_taints() == {"NoSchedule", "NoExecute"}, 30, f"{node} tainted by the node-lifecycle controller")
    # It stays down: kwok does not heal it behind our back.
    consistently(lambda: ready_status() == "False", for_seconds(2), 10, f"{node} NotReady")
    others = node_names(faults, **{GPU_LABEL: "true"}) - {node}
    assert all(
        controlplane.is_schedulable(core.api_client.sanitize_for_serialization(n))
        for n in core.list_node().items
        if n.metadata.name in others
    )
    fault.clear()
    eventually(lambda: ready_status() == "True", 30, f"{node} Ready again")
    eventually(lambda: not not_ready_taints(), 30, f"{node} untainted")


def test_start_refuses_a_port_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(controlplane.ControlPlaneError, match=f"port {port} on 127.0.0.1 is in use"):
            controlplane.ControlPlane.start(tmp_path, port=port)


def test_start_without_binaries_says_which_target_builds_them(tmp_path, monkeypatch):
    monkeypatch.setattr(controlplane, "BIN_DIR", tmp_path / "nothing")
    with pytest.raises(controlplane.ControlPlaneError, match="is missing: run 'make e2e' or 'make demo' first$"):
        controlplane.ControlPlane.start(tmp_path)
