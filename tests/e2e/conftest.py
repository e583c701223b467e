"""The cluster of the user's path (tests/e2e/userpath.py): one per session (per xdist worker),
started by the first test that asks for it. The modules that use it mark themselves
`xdist_group("real-node")`, or `"real-node-2"` for a long module that may run beside them on the
other worker, with its own cluster; `make e2e` runs pytest with `--dist loadgroup`, so one
worker runs each group.
"""

from __future__ import annotations

import pytest
from kubernetes import client

from tests.controlplane import GPU_LABEL, ControlPlaneError
from tests.e2e.tools import CR
from tests.e2e.userpath import CHART_OBJECTS, CRD, NS, ToolsCluster, get_cr
from tests.registry import RegistryError
from tests.waiting import eventually


@pytest.fixture(scope="session")
def tools_cluster(tmp_path_factory):
    try:
        cluster = ToolsCluster.start(tmp_path_factory.mktemp("tools-cluster"))
    except (ControlPlaneError, RegistryError) as error:
        pytest.fail(f"the real node's cluster: {error}", pytrace=False)
    yield cluster
    cluster.cp.stop()


@pytest.fixture(scope="session")
def tools_api(tools_cluster):
    return tools_cluster.cp.api()


@pytest.fixture
def clean_slate(tools_cluster, tools_api):
    """Whatever the test leaves is removed after it (`remove_leftovers`)."""
    yield
    remove_leftovers(tools_cluster, tools_api)


def remove_leftovers(cluster, api) -> None:
    """Remove what a test of the release may leave (a failed install's release and hook objects,
    the CRD Helm keeps, the namespace), and give the GPU nodes their gpu-label label back (the
    cleanup hook removes it; on a real cluster gpu-label's pods set it again)."""
    for release in cluster.helm("helm3", "list", "-n", NS, "-q").stdout.split():
        cluster.helm("helm3", "uninstall", release, "-n", NS, "--no-hooks", "--wait")
    custom, rbac = client.CustomObjectsApi(api), client.RbacAuthorizationV1Api(api)
    if get_cr(api):
        custom.delete_cluster_custom_object(*CR)
    for role in rbac.list_cluster_role(label_selector=CHART_OBJECTS).items:
        rbac.delete_cluster_role(role.metadata.name)
    for binding in rbac.list_cluster_role_binding(label_selector=CHART_OBJECTS).items:
        rbac.delete_cluster_role_binding(binding.metadata.name)
    admission = client.AdmissionregistrationV1Api(api)  # the node write policy, cluster-scoped too
    for policy in admission.list_validating_admission_policy(label_selector=CHART_OBJECTS).items:
        admission.delete_validating_admission_policy(policy.metadata.name)
    for binding in admission.list_validating_admission_policy_binding(label_selector=CHART_OBJECTS).items:
        admission.delete_validating_admission_policy_binding(binding.metadata.name)
    core, extensions = client.CoreV1Api(api), client.ApiextensionsV1Api(api)
    if any(n.metadata.name == NS for n in core.list_namespace().items):
        core.delete_namespace(NS)
    if any(c.metadata.name == CRD for c in extensions.list_custom_resource_definition().items):
        extensions.delete_custom_resource_definition(CRD)
    for node in core.list_node(label_selector="type=kwok").items:
        if node.metadata.name.startswith("gpu-node-"):
            core.patch_node(node.metadata.name, {"metadata": {"labels": {GPU_LABEL: "true"}}})
    eventually(lambda: NS not in {n.metadata.name for n in core.list_namespace().items}, 120, f"namespace {NS} gone")
    eventually(
        lambda: CRD not in {c.metadata.name for c in extensions.list_custom_resource_definition().items}, 60, "the CRD gone"
    )
