"""`metax-operator images` is what the cluster is asked to pull: the seed's install from the local
OCI registry (Helm 4) with an administrator's values, `helm test` and `helm uninstall`; every pod
seen on the way (the components on the kwok nodes, the hook Jobs, the runner and the test pod on
the real node) asks for exactly the images the command lists for the same values."""

from __future__ import annotations

import pytest

from metax_operator import cli
from tests.e2e.userpath import NS, PodWatch, get_cr, ok, release_name, runner_pod, seed_install, terminated
from tests.helm import BIN
from tests.realnode import NODE_NAME
from tests.waiting import eventually

pytestmark = pytest.mark.xdist_group("real-node")


def reconciled(api) -> bool:
    found = ((get_cr(api) or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Reconciled" and c["status"] == "True" for c in found)


def test_the_listed_images_are_the_images_the_pods_ask_for(tools_cluster, tools_api, clean_slate, tmp_path, capsys):
    cluster = tools_cluster
    # The exporter stays off (its default): helm test scrapes it, and kwok pods serve nothing.
    # A multi-architecture tag: the fleet has x86 and Arm GPU nodes (docs/chart.md).
    values = cluster.user_values(tmp_path, maca={"payload": {"images": ["maca-c500:2.18.0.3-ubuntu22.04"]}})
    pods = PodWatch(tools_api, NS)
    release = release_name(ok(seed_install(cluster, "helm4", values)))
    eventually(lambda: runner_pod(tools_api), 60, "one running runner pod")
    eventually(lambda: reconciled(tools_api), 60, "the runner's Reconciled condition on the CR")
    ok(cluster.helm("helm4", "test", release, "-n", NS, "--logs", "--timeout", "3m"))
    ok(cluster.helm("helm4", "uninstall", release, "-n", NS, "--wait", "--timeout", "3m"))
    eventually(lambda: [p for p in pods.hook("cleanup") if terminated(p)], 30, "the cleanup hook's pod seen ended")
    pods.stop()
    asked = {c.image for p in pods.pods.values() for c in [*(p.spec.init_containers or []), *p.spec.containers]}
    assert {p.spec.node_name for p in pods.pods.values()} - {NODE_NAME}, "pods on the kwok nodes"
    assert cluster.image in {c.image for p in pods.pods.values() if p.spec.node_name == NODE_NAME for c in p.spec.containers}

    flags = ["--set", f"registry={cluster.registry}", "--set", "driver.payload.version=2.32.0.6", "-f", str(values)]
    assert cli.main(["images", "--helm", str(BIN / "helm4"), *flags]) == 0
    listed = capsys.readouterr().out.split()
    assert set(listed) == asked
    assert len(listed) == 8  # six components (driver and maca share driver-manager), tools, two payloads
