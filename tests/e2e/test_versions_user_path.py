"""The user's path of test_user_path.py (the seed's `helm install oci://...` with every hook as a
pod of the tools image on the real node, `helm test`, a staged upgrade through the values, `helm
uninstall`) on the oldest and the newest Kubernetes the product supports: the oldest and the
newest `rollout` versions of scripts/controlplane/versions/matrix, each with its own API server,
controller manager and scheduler. The real node's kubelet and kube-proxy are the version's own where the matrix builds
them (1.23); the newest releases' kubelets need containerd 2 and cgroup v2, so the newest API
server gets the default version's kubelet, within the version skew policy
(tests.controlplane.node_version).

Each version is its own cluster, in an xdist group of its own: the other worker runs it beside
the default version's real-node tests.
"""

from __future__ import annotations

import pytest

from tests import controlplane, registry
from tests.e2e.test_user_path import seed_path
from tests.e2e.userpath import ToolsCluster

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("versions-user-path")]

ROLLOUT = [v for v in controlplane.matrix() if v.runs == "rollout"]
VERSIONS = [min(ROLLOUT, key=lambda v: v.minor), max(ROLLOUT, key=lambda v: v.minor)]


@pytest.fixture(scope="module", params=VERSIONS, ids=[v.version for v in VERSIONS])
def cluster(request, tmp_path_factory):
    version = request.param.version
    try:
        cluster = ToolsCluster.start(tmp_path_factory.mktemp(f"user-path-{version}"), kubernetes=version)
    except (controlplane.ControlPlaneError, registry.RegistryError) as error:
        pytest.fail(f"Kubernetes {version}: {error}", pytrace=False)
    yield cluster
    cluster.cp.stop()


def test_the_seed_path_on_the_oldest_and_the_newest_kubernetes(cluster, tmp_path):
    seed_path(cluster, cluster.cp.api(), tmp_path, "helm3")
