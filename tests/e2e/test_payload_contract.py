"""The payload contract (docs/chart.md, "Payload images") on the real node: the driver pod's
`copier` and `payload` init containers as the chart renders them, run by the kubelet with
containerd against payload images built here `FROM scratch` (no shell, no `cp`) and pushed to the
local registry. An image with its files under /payload is copied into the pod; one without ends
the `payload` container at once with exit code 3 and the one line of docs/chart.md, naming the
image, as its termination message (`kubectl describe`, `.lastState.terminated.message` under a
DaemonSet's restarts).

The pod is the driver DaemonSet's template with its own main container swapped for the tools
image listing what the payload container copied, on the real node, `restartPolicy: Never` so one
run decides; the MetaX driver-manager image is not available to the project.
"""

from __future__ import annotations

import copy
import time
import uuid
from pathlib import Path

import pytest
from kubernetes import client

from image import oci
from metax_operator.contract import DRIVER_PAYLOAD_CONTAINER, PAYLOAD_CONTRACT_EXIT, PAYLOAD_COPIER_CONTAINER
from tests import registry
from tests.doc_blocks import blocks
from tests.e2e.userpath import TOLERATE_TOOLS_NODE
from tests.helm import CHART, render_chart
from tests.realnode import NODE_NAME
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("real-node")]

NAMESPACE = "default"
(DOCUMENTED,) = [b.text.strip() for b in blocks(CHART / "docs" / "chart.md") if b.kind == "payload-message"]
EXAMPLE_IMAGE = "cr.example.com/metax/driver-image:2.32.0.6"


def payload_image(cluster, work: Path, name: str, files: dict[str, str]) -> str:
    """An image FROM scratch holding `files` (path -> content) and nothing else, pushed to the
    local registry; its reference."""
    root = work / name / "root"
    for path, content in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(content)
    layer = oci.write_layer(root, work / name / "blobs", 0)
    image = ([(oci.blob_path(work / name / "blobs", layer), layer)], {"architecture": "amd64", "os": "linux"})
    oci.write_layout(work / name / "layout", {"amd64": image}, "1.0")
    reference = f"{cluster.cp.registry}/{registry.PROJECT}/{name}:1.0"
    registry.push_image(work / name / "layout", "1.0", reference, cluster.cp.ca)
    return reference


def driver_pod(cluster, image: str) -> dict:
    """A pod of the chart's driver DaemonSet for payload `image`: its copier and payload init
    containers as rendered, a tools-image container listing /mnt/payload instead of
    driver-manager, on the real node."""
    name, version = image.rpartition(f"/{registry.PROJECT}/")[2].split(":")
    (ds,) = [
        o
        for o in render_chart(
            {
                "registry": cluster.registry,
                "driver": {"payload": {"name": name, "version": version}},
                "tools": {"image": {"digest": cluster.digest}},
            },
            show_only=["templates/driver/daemonset.yaml"],
        )
    ]
    spec = copy.deepcopy(ds["spec"]["template"]["spec"])
    init = [c for c in spec["initContainers"] if c["name"] in (PAYLOAD_COPIER_CONTAINER, DRIVER_PAYLOAD_CONTAINER)]
    tools = init[0]["image"]
    lister = {
        "name": "list",
        "image": tools,
        "command": ["find", "/mnt/payload", "-type", "f"],
        "securityContext": init[0]["securityContext"],
        "volumeMounts": [{"name": "payload", "mountPath": "/mnt/payload", "readOnly": True}],
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"payload-{uuid.uuid4().hex[:8]}", "namespace": NAMESPACE},
        "spec": {
            "nodeName": NODE_NAME,
            "restartPolicy": "Never",
            "tolerations": [TOLERATE_TOOLS_NODE],
            "securityContext": spec.get("securityContext", {}),
            "initContainers": init,
            "containers": [lister],
            "volumes": [v for v in spec["volumes"] if v["name"] in ("payload", "copier")],
        },
    }


def finished(core, name: str):
    pod = core.read_namespaced_pod(name, NAMESPACE)
    return pod if pod.status.phase in ("Succeeded", "Failed") else None


def test_a_payload_image_of_files_alone_is_copied_and_one_without_payload_fails_at_once(tools_cluster, tools_api, tmp_path):
    cluster, core = tools_cluster, client.CoreV1Api(tools_api)
    good = payload_image(
        cluster, tmp_path, "driver-image-good", {"payload/lib/metax.ko": "module\n", "payload/fw/c500.bin": "fw\n"}
    )
    bad = payload_image(cluster, tmp_path, "driver-image-bad", {"opt/driver/metax.ko": "module\n"})
    names = []
    try:
        pod = driver_pod(cluster, good)
        names.append(pod["metadata"]["name"])
        core.create_namespaced_pod(NAMESPACE, pod)
        done = eventually(lambda: finished(core, pod["metadata"]["name"]), 120, "the good payload's pod finished")
        assert done.status.phase == "Succeeded", done.status
        listed = core.read_namespaced_pod_log(pod["metadata"]["name"], NAMESPACE, container="list").split()
        assert sorted(listed) == ["/mnt/payload/fw/c500.bin", "/mnt/payload/lib/metax.ko"]

        pod = driver_pod(cluster, bad)
        names.append(pod["metadata"]["name"])
        start = time.monotonic()
        core.create_namespaced_pod(NAMESPACE, pod)
        done = eventually(lambda: finished(core, pod["metadata"]["name"]), 120, "the bad payload's pod finished")
        took = time.monotonic() - start
        assert done.status.phase == "Failed"
        (status,) = [s for s in done.status.init_container_statuses if s.name == DRIVER_PAYLOAD_CONTAINER]
        terminated = status.state.terminated
        assert (terminated.exit_code, terminated.reason) == (PAYLOAD_CONTRACT_EXIT, "Error")
        assert terminated.message.strip() == DOCUMENTED.replace(EXAMPLE_IMAGE, bad)
        assert took < 60, f"{took:.0f} s to fail"
        print(f"the payload contract failure took {took:.1f} s from pod creation")
    finally:
        for name in names:
            core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)
