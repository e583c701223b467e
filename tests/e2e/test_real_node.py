"""The real node's harness keeps the networking rule: everything of the node lives in its own
network namespace, mount namespace and cgroup tree, and stopping it leaves the host as it was."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from kubernetes import client

from tests.controlplane import ControlPlane
from tests.realnode import NODE_NAME, TOOLS_NODE, cgroup_mounts

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("real-node")]  # starts a cluster of its own


def host_network() -> dict[str, str]:
    """The host's interfaces, addresses, routes and iptables rules (counters left out)."""
    show = {
        name: subprocess.run(command, capture_output=True, text=True).stdout
        for name, command in {
            "links": ["ip", "-o", "link", "show"],
            "addresses": ["ip", "-o", "addr", "show"],
            "routes": ["ip", "route", "show", "table", "all"],
            "iptables": ["iptables-save"],
        }.items()
    }
    show["iptables"] = "\n".join(line for line in show["iptables"].splitlines() if not line.startswith(("#", ":")))
    return show


def test_the_real_node_touches_nothing_of_the_hosts_network_and_leaves_nothing_behind(tmp_path):
    before = host_network()
    cp = ControlPlane.start(tmp_path / "cluster", gpu_nodes=1, plain_nodes=0, real_node=True, timeout=180)
    try:
        node = client.CoreV1Api(cp.api()).read_node(NODE_NAME)
        assert node.metadata.labels[TOOLS_NODE] == "true"
        assert [(t.key, t.effect) for t in node.spec.taints] == [(TOOLS_NODE, "NoSchedule")]
        assert node.status.node_info.container_runtime_version.startswith("containerd://1.6")
        assert host_network() == before, "the node changed the host's network"
        netns, cgroup = cp.node.netns, cp.node.id
        assert netns.exists() and all((m / cgroup).is_dir() for m in cgroup_mounts())
    finally:
        cp.stop()
    assert not netns.exists()
    assert not any((m / cgroup).exists() for m in cgroup_mounts())
    assert str(tmp_path) not in Path("/proc/self/mountinfo").read_text()
    assert host_network() == before
