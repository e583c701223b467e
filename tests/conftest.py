"""Shared pytest fixtures, and the test tiers (tests/tiers.py): a test that uses a cluster fixture
is marked `e2e`, and the tier `make test` or `make e2e` runs is guarded.

Control plane (tests/controlplane.py): `control_plane` is one real kube-apiserver, controller
manager, scheduler, etcd and kwok per test session (per xdist worker), with 10 simulated GPU
nodes and 2 plain nodes; `faults` clears every fault a test injected when it ends.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from tests import controlplane, tiers

# How long an example takes to generate or to run depends on the machine's load (two xdist workers
# and the e2e clusters beside them on two cores), not on the code: neither fails a test here.
# A test's own @settings still overrides these.
settings.register_profile("metax", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("metax")


def pytest_configure(config):
    tiers.install_guard()


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the markers
def pytest_collection_modifyitems(items):
    tiers.mark(items)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    try:
        cp = controlplane.ControlPlane.start(tmp_path_factory.mktemp("controlplane"))
    except controlplane.ControlPlaneError as error:
        pytest.fail(f"control plane: {error}", pytrace=False)
    yield cp
    cp.stop()


@pytest.fixture
def faults(control_plane):
    """The control plane, with the faults injected through it cleared after the test."""
    yield control_plane
    control_plane.clear_faults()
