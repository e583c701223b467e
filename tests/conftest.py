"""Shared pytest fixtures.

Control plane (tests/controlplane.py): `control_plane` is one real kube-apiserver, controller
manager, scheduler, etcd and kwok per test session (per xdist worker), with 10 simulated GPU
nodes and 2 plain nodes; `faults` clears every fault a test injected when it ends.
"""

from __future__ import annotations

import pytest

from tests import controlplane


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
