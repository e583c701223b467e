"""The user's path of test_user_path.py (the seed's `helm install oci://...` with every hook as a
pod of the tools image on the real node, `helm test`, a staged upgrade through the values, `helm
uninstall`) on every `rollout` version of scripts/controlplane/versions/matrix: the oldest the
product supports, one of each class of what an API server enforces, and the newest, each with its
own API server, controller manager and scheduler. The real node's kubelet and kube-proxy are the
newest that setup builds within the version skew policy (tests.controlplane.node_version): the
version's own where its matrix line builds them, else an older one (1.25 runs 1.23's, 1.30 runs
1.28's; the newest releases' kubelets need containerd 2 and cgroup v2, so the newest API server
runs the default version's).

Each version is its own cluster, one after the other in an xdist group of their own: the other
worker runs them beside the default version's real-node tests.
"""

from __future__ import annotations

import pytest

from tests import controlplane, registry
from tests.e2e.test_user_path import seed_path
from tests.e2e.userpath import ToolsCluster

pytestmark = [pytest.mark.matrix, pytest.mark.xdist_group("versions-user-path")]

VERSIONS = [v for v in controlplane.matrix() if v.runs == "rollout"]


@pytest.fixture(scope="module", params=VERSIONS, ids=[v.version for v in VERSIONS])
def cluster(request, tmp_path_factory):
    version = request.param.version
    try:
        cluster = ToolsCluster.start(tmp_path_factory.mktemp(f"user-path-{version}"), kubernetes=version)
    except (controlplane.ControlPlaneError, registry.RegistryError) as error:
        pytest.fail(f"Kubernetes {version}: {error}", pytrace=False)
    yield cluster
    cluster.cp.stop()


def test_the_seed_path_on_every_class_of_kubernetes(cluster, tmp_path):
    seed_path(cluster, cluster.cp.api(), tmp_path, "helm3")
