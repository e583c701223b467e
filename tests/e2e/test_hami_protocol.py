"""HAMi's allocation protocol in sGPU mode, on the real API server with the chart's RBAC and
policies (docs/workloads.md, "What HAMi and gpu-device write"): HAMi's scheduler's writes (a pod
bound to a GPU node with its allocation annotations, the node lock `hami.io/mutex.lock`) are made
as HAMi's chart grants them, then gpu-device's half with a token of its ServiceAccount bound to its
pod on that node, as the kubelet mounts it: find the pod the lock names, empty its
`hami.io/metax-sgpu-devices-to-allocate` as it allocates (as HAMi's own device plugins do), mark it
`hami.io/bind-phase: success`, release the lock, publish its devices. Everything else gpu-device
might try with those rights is refused, with the policy's line.
"""

from __future__ import annotations

import time

import pytest
from kubernetes import client

from metax_operator.contract import HAMI_BIND_PHASE, HAMI_NODE_LOCK, HAMI_TO_ALLOCATE
from tests.e2e.test_node_safety import nodes, refusal, token_client
from tests.e2e.test_rollout_cluster import NS, api, installed  # noqa: F401 - fixtures used by name
from tests.e2e.tools import kubectl
from tests.waiting import eventually

pytestmark = pytest.mark.e2e

OWN, OTHER = "gpu-node-0002", "gpu-node-0005"
GPU_DEVICE = "metax-gpu-device"
WORKLOADS = "default"
DEVICES = "metax-tech.com/node-gpu-devices"


def gpu_device_token(cp, api, node: str) -> str:
    """A token of gpu-device's ServiceAccount bound to its pod on `node`, as the kubelet mounts it."""
    (pod,) = (
        client.CoreV1Api(api)
        .list_namespaced_pod(NS, label_selector="app.kubernetes.io/component=gpuDevice", field_selector=f"spec.nodeName={node}")
        .items
    )
    return kubectl(
        cp,
        "create",
        "token",
        GPU_DEVICE,
        "-n",
        NS,
        "--duration",
        "10m",
        "--bound-object-kind",
        "Pod",
        "--bound-object-name",
        pod.metadata.name,
        "--bound-object-uid",
        pod.metadata.uid,
    ).strip()


def hami_binds(api, name: str, node: str) -> None:
    """HAMi's scheduler's part (its own ServiceAccount, its chart's rights): the sGPU pod with the
    decision in its annotations, bound to `node`, and the node locked for it."""
    core = client.CoreV1Api(api)
    allocation = "GPU-0001,Metax-SGPU,4096,60:;"
    core.create_namespaced_pod(
        WORKLOADS,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "annotations": {
                    HAMI_TO_ALLOCATE: allocation,
                    "hami.io/metax-sgpu-devices-allocated": allocation,
                    "metax-tech.com/gpu-devices-allocated": '[{"uuid":"GPU-0001","compute":60,"vRam":4096}]',
                    HAMI_BIND_PHASE: "allocating",
                    "hami.io/bind-time": str(int(time.time())),
                },
            },
            "spec": {
                "nodeName": node,
                "containers": [{"name": "app", "image": "DOMAIN/PROJECT/application:1.0"}],
            },
        },
    )
    lock = f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())},{WORKLOADS},{name}"
    core.patch_node(node, {"metadata": {"annotations": {HAMI_NODE_LOCK: lock}}})


def test_gpu_device_takes_its_half_of_an_sgpu_allocation_and_nothing_more(control_plane, api, installed):
    cp, core = control_plane, client.CoreV1Api(api)
    policies = [p.metadata.name for p in client.AdmissionregistrationV1Api(api).list_validating_admission_policy().items]
    assert any(name.endswith(f"{NS}-gpu-device-pod-writes") for name in policies), policies
    gpu_device = token_client(cp, gpu_device_token(cp, api, OWN))
    try:
        hami_binds(api, "sgpu-job", OWN)
        hami_binds(api, "sgpu-elsewhere", OTHER)
        # The policy's binding takes effect within a moment of its creation.
        eventually(
            lambda: (
                "may change only pods on the node its pod runs on (gpu-node-0002), not default/sgpu-elsewhere"
                in refusal(
                    lambda: gpu_device.patch_namespaced_pod(
                        "sgpu-elsewhere", WORKLOADS, {"metadata": {"annotations": {HAMI_BIND_PHASE: "success"}}}
                    )
                )
            ),
            30,
            "a pod on another node refused",
        )

        # gpu-device's half: the pod its node's lock names, or the pending ones on its node.
        lock = gpu_device.read_node(OWN).metadata.annotations[HAMI_NODE_LOCK]
        _, namespace, name = lock.split(",")
        pod = gpu_device.read_namespaced_pod(name, namespace)
        assert pod.metadata.annotations[HAMI_BIND_PHASE] == "allocating"
        pending = gpu_device.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={OWN}").items
        assert "sgpu-job" in [p.metadata.name for p in pending]
        # The container's devices allocated, its entry emptied (HAMi's EncodePodSingleDevice of one
        # container with none left), then the pod marked allocated.
        gpu_device.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": {HAMI_TO_ALLOCATE: ";"}}})
        gpu_device.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": {HAMI_BIND_PHASE: "success"}}})
        gpu_device.patch_node(OWN, {"metadata": {"annotations": {HAMI_NODE_LOCK: None, DEVICES: '[{"uuid":"GPU-0001"}]'}}})
        annotations = core.read_namespaced_pod(name, namespace).metadata.annotations
        assert (annotations[HAMI_TO_ALLOCATE], annotations[HAMI_BIND_PHASE]) == (";", "success")
        annotations = nodes(api)[OWN].metadata.annotations
        assert HAMI_NODE_LOCK not in annotations and annotations[DEVICES] == '[{"uuid":"GPU-0001"}]'

        # Nothing more: another annotation or a label of the pod, the lock set (it is HAMi's to
        # set), another node's lock, deleting the pod.
        message = refusal(
            lambda: gpu_device.patch_namespaced_pod(
                name, namespace, {"metadata": {"annotations": {"hami.io/metax-sgpu-devices-allocated": ""}}}
            )
        )
        assert (
            "may change only the hami.io/metax-sgpu-devices-to-allocate and hami.io/bind-phase annotations of a pod"
            " (HAMi's allocation protocol), not hami.io/metax-sgpu-devices-allocated" in message
        )
        assert "metadata.labels" in refusal(
            lambda: gpu_device.patch_namespaced_pod(name, namespace, {"metadata": {"labels": {"team": "ml"}}})
        )
        message = refusal(lambda: gpu_device.patch_node(OWN, {"metadata": {"annotations": {HAMI_NODE_LOCK: "x"}}}))
        assert f"may change only labels and annotations under metax-tech.com/ on its node, not {HAMI_NODE_LOCK}" in message
        message = refusal(lambda: gpu_device.patch_node(OTHER, {"metadata": {"annotations": {HAMI_NODE_LOCK: None}}}))
        assert "may change only the node its pod runs on (gpu-node-0002), not gpu-node-0005" in message
        with pytest.raises(client.ApiException) as denied:
            gpu_device.delete_namespaced_pod(name, namespace)
        assert denied.value.status == 403
        # Only gpu-device releases the lock: another component's token is refused it.
        driver_pod = next(
            p
            for p in core.list_namespaced_pod(NS, label_selector="app.kubernetes.io/component=driver").items
            if p.spec.node_name == OTHER
        )
        driver = token_client(
            cp,
            kubectl(
                cp,
                *("create", "token", "metax-driver", "-n", NS, "--duration", "10m"),
                *("--bound-object-kind", "Pod", "--bound-object-name", driver_pod.metadata.name),
                *("--bound-object-uid", driver_pod.metadata.uid),
            ).strip(),
        )
        message = refusal(lambda: driver.patch_node(OTHER, {"metadata": {"annotations": {HAMI_NODE_LOCK: None}}}))
        assert f"not {HAMI_NODE_LOCK}" in message
    finally:
        for pod_name in ("sgpu-job", "sgpu-elsewhere"):
            core.delete_namespaced_pod(pod_name, WORKLOADS, grace_period_seconds=0)
        for node in (OWN, OTHER):
            core.patch_node(node, {"metadata": {"annotations": {HAMI_NODE_LOCK: None, DEVICES: None}}})
