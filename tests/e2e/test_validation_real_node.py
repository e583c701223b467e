"""The default validation pod (`driver.upgradePolicy.validation`) on the real node: made by the
runner's code (`validation_pod.manifest`) from the driver DaemonSet's template as the chart
renders it and created as the runner creates it (a server-side apply of its field manager), on
the real node cordoned as a wave node is. The kubelet runs it with containerd and runc from the
tools image in the local registry: the node's cordon does not keep it out, it reads the host's
/sys read-only, and, this machine having no MetaX driver, `check-node` fails at its first check
with its one line as the container's termination message, which is what the runner records as
the validation's failure (`validation_pod.check`). Deleting the driver pod it validates takes it
away (its owner). The checks themselves, on /sys trees with and without a good driver: the unit
tests of `check-node` and the image's test under runc."""

from __future__ import annotations

import uuid

import pytest
from kubernetes import client

from metax_operator.chart.upgrade_policy import Validation
from metax_operator.contract import RUNNER_FIELD_MANAGER
from metax_operator.rollout.decision import PodRef
from metax_operator.runtime import validation_pod
from metax_operator.runtime.kube import Client
from tests.helm import render_chart
from tests.realnode import NODE_NAME
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("real-node")]

NAMESPACE = "default"
MODULE_MISSING = "the metax kernel module is not loaded (/host/sys/module/metax is missing)"


def driver_template(cluster) -> dict:
    """The driver DaemonSet's pod template as the chart renders it for this registry and image."""
    values = {
        "registry": cluster.registry,
        "driver": {"payload": {"version": "2.32.0.6"}},
        "tools": {"image": {"digest": cluster.digest}},
    }
    (ds,) = render_chart(values, show_only=["templates/driver/daemonset.yaml"])
    return ds["spec"]["template"]


def test_the_default_validation_pod_runs_on_the_cordoned_node_and_reports_its_first_failed_check(tools_cluster, tools_api):
    core = client.CoreV1Api(tools_api)
    owner = core.create_namespaced_pod(
        NAMESPACE,
        {  # stands in for the new driver pod: never scheduled (a node of that name does not exist)
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"metax-driver-{uuid.uuid4().hex[:6]}"},
            "spec": {"nodeName": "no-such-node", "containers": [{"name": "driver-manager", "image": "driver-manager:1"}]},
        },
    )
    core.patch_node(NODE_NAME, {"spec": {"unschedulable": True}})
    name = f"{owner.metadata.name}-validation"
    try:
        pod = validation_pod.manifest(
            PodRef(owner.metadata.name, owner.metadata.uid, NODE_NAME), NAMESPACE, driver_template(tools_cluster), Validation()
        )
        Client.connect(str(tools_cluster.cp.kubeconfig)).apply(pod, field_manager=RUNNER_FIELD_MANAGER)
        ended = eventually(
            lambda: (p := core.read_namespaced_pod(name, NAMESPACE)).status.phase in ("Succeeded", "Failed") and p,
            180,
            "the validation pod to end",
        )
        assert ended.spec.node_name == NODE_NAME and core.read_node(NODE_NAME).spec.unschedulable
        assert ended.status.phase == "Failed"
        (status,) = ended.status.container_statuses
        assert (status.name, status.state.terminated.exit_code) == ("check-node", 1)
        assert status.state.terminated.message.strip() == MODULE_MISSING
        log = core.read_namespaced_pod_log(name, NAMESPACE, container="check-node")
        assert log.strip() == f"error: {MODULE_MISSING}"
        as_read = client.ApiClient().sanitize_for_serialization(ended)
        driver_uid, check = validation_pod.check(as_read)
        assert driver_uid == owner.metadata.uid
        assert (check.done, check.passed, check.reason) == (True, False, f"check-node: {MODULE_MISSING}")
        core.delete_namespaced_pod(owner.metadata.name, NAMESPACE, grace_period_seconds=0)
        eventually(
            lambda: not core.list_namespaced_pod(NAMESPACE, field_selector=f"metadata.name={name}").items,
            120,
            "the validation pod to go with the driver pod it validated",
        )
    finally:
        core.patch_node(NODE_NAME, {"spec": {"unschedulable": False}})
        for leftover in (name, owner.metadata.name):
            if core.list_namespaced_pod(NAMESPACE, field_selector=f"metadata.name={leftover}").items:
                core.delete_namespaced_pod(leftover, NAMESPACE, grace_period_seconds=0)
