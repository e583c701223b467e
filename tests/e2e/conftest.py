"""The cluster of the user's path (tests/e2e/userpath.py): one per session, started by the first
test that asks for it. The modules that use it mark themselves `xdist_group("real-node")` and
`make test` runs pytest with `--dist loadgroup`, so one xdist worker starts it.
"""
from __future__ import annotations

import pytest

from tests.controlplane import ControlPlaneError
from tests.e2e.userpath import ToolsCluster
from tests.registry import RegistryError


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
