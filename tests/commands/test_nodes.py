"""`metax-operator nodes` without a cluster: the view built from what its four requests return,
the table and JSON, and one-line errors (the requests themselves: tests/e2e/test_workloads.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from metax_operator import contract
from metax_operator import workloads as wl
from metax_operator.commands import nodes


def node(name: str, labels=None, annotations=None, allocatable=None) -> dict:
    return {
        "metadata": {"name": name, "labels": {wl.GPU_NODE_LABEL: "true", **(labels or {})}, "annotations": annotations or {}},
        "status": {"allocatable": allocatable or {}},
    }


def pod(component: str, node_name: str, revision: str = "", ready: bool = True, images=(), deleting=False) -> dict:
    meta = {
        "name": f"{component}-{node_name}",
        "labels": {"app.kubernetes.io/component": component, "controller-revision-hash": revision},
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {
            "nodeName": node_name,
            "initContainers": [{"name": f"payload-{i}", "image": image} for i, image in enumerate(images)],
        },
        "status": {"conditions": [{"type": "Ready", "status": str(ready)}]},
    }


def revision(hash_: str, number: int, owner: str = "metax-driver") -> dict:
    return {
        "metadata": {"labels": {"controller-revision-hash": hash_}, "ownerReferences": [{"kind": "DaemonSet", "name": owner}]},
        "revision": number,
    }


NODES = [
    node("b", labels={wl.MODE_LABEL: "sgpu"}, allocatable={wl.SGPU_RESOURCE: "16"}),
    node(
        "a",
        labels={wl.GPU_VFNUM_LABEL: "0"},
        annotations={contract.VFIO_ANNOTATION: '{"0":1,"2":0}'},
        allocatable={wl.GPU_RESOURCE: "6", wl.VFIO_RESOURCE: "1"},
    ),
]
PODS = [
    pod("driver", "a", "old"),
    pod("driver", "b", "new"),
    pod("driver", "b", "old", deleting=True),
    pod("maca", "a", images=["r/maca-c500:2.18.0.3-u", "r/maca-c500:2.24.0.5-u"]),
    pod("maca", "b", images=["r/maca-c500:2.18.0.3-u"], ready=False),
]
REVISIONS = [revision("old", 1), revision("new", 2), revision("other", 9, owner="metax-maca")]
CR = {"status": {"conditions": [{"type": "WorkloadsValid", "status": "False", "message": "node b: one\npod x/y: two"}]}}


def test_the_view_joins_nodes_pods_and_revisions():
    view = nodes.build(NODES, PODS, REVISIONS, CR)
    assert view.current_driver_revision == "new"
    a, b = view.nodes
    assert (a.name, a.mode, a.qos_policy, a.vfnum) == ("a", "native", "", "0")
    assert a.allocatable == {wl.GPU_RESOURCE: "6", wl.SGPU_RESOURCE: "0", wl.VFIO_RESOURCE: "1"}
    assert (a.driver_revision, a.driver_current) == ("old", False)
    assert (a.maca_versions, a.maca_ready) == (["maca-2.24.0.5", "maca-2.18.0.3"], True)
    assert (a.vfio_bound, a.vfio_failed) == (["0"], ["2"])
    assert (b.mode, b.qos_policy, b.driver_revision, b.driver_current, b.maca_ready) == (
        "sgpu",
        "best-effort",
        "new",
        True,
        False,
    )
    assert view.problems == ["node b: one", "pod x/y: two"]


def test_a_driver_pools_pod_is_compared_with_its_own_daemonsets_revision():
    pooled = pod("driver", "a", "pool-new")
    pooled["metadata"]["labels"][contract.POOL_LABEL] = "rack-a"
    revisions = [
        *REVISIONS,
        revision("pool-old", 1, "metax-driver-pool-rack-a"),
        revision("pool-new", 2, "metax-driver-pool-rack-a"),
    ]
    view = nodes.build(NODES, [pooled, *PODS[1:]], revisions, CR)
    a, b = view.nodes
    assert (a.driver_revision, a.driver_current) == ("pool-new", True)
    assert (b.driver_revision, b.driver_current) == ("new", True) and view.current_driver_revision == "new"


def whole(obj: dict) -> dict:
    """`obj` as the API server serves it: with what `build` does not read besides."""
    out = json.loads(json.dumps(obj))
    out["metadata"]["managedFields"] = [{"manager": "kubelet", "fieldsV1": {"f:status": {}}}]
    out.setdefault("spec", {})["containers"] = [{"name": "main", "image": "r/x:1", "env": [{"name": "A", "value": "1"}]}]
    for container in out["spec"].get("initContainers") or ():
        container["securityContext"] = {"privileged": True}
    out["status"]["images"] = [{"names": ["r/x:1"], "sizeBytes": 1}]
    return out


def test_read_keeps_of_each_object_all_that_build_reads():
    """`read` slims the nodes and pods it lists page by page: the view is the one of the whole objects."""
    full_nodes, full_pods = [whole(n) for n in NODES], [whole(p) for p in PODS]
    slim = nodes.build([nodes.slim_node(n) for n in full_nodes], [nodes.slim_pod(p) for p in full_pods], REVISIONS, CR)
    assert slim == nodes.build(full_nodes, full_pods, REVISIONS, CR) == nodes.build(NODES, PODS, REVISIONS, CR)
    assert "managedFields" not in json.dumps([nodes.slim_node(n) for n in full_nodes] + [nodes.slim_pod(p) for p in full_pods])


def test_the_table_and_json():
    view = nodes.build(NODES, PODS, REVISIONS, CR)
    lines = nodes.render(view).splitlines()
    assert lines[1].split() == [
        "a",
        "native",
        "-",
        "6",
        "0",
        "1",
        "0",
        "old",
        "(old)",
        "maca-2.24.0.5,maca-2.18.0.3",
        "0",
        "(failed:",
        "2)",
    ]
    assert lines[2].split() == ["b", "sgpu", "best-effort", "0", "16", "0", "-", "new", "maca-2.18.0.3", "(not", "ready)", "-"]
    assert lines[3:] == [
        "current driver revision: new",
        "problems the runner reports (WorkloadsValid=False):",
        "  node b: one",
        "  pod x/y: two",
    ]
    data = json.loads(nodes.render(view, "json"))
    assert data["currentDriverRevision"] == "new"
    assert data["nodes"][0]["vfioFailed"] == ["2"] and wl.GPU_RESOURCE in data["nodes"][0]["allocatable"]


def test_a_node_without_component_pods_shows_dashes():
    view = nodes.build([node("c")], [], [], None)
    assert nodes.render(view).splitlines()[1].split() == ["c", "native", "-", "0", "0", "0", "-", "-", "-", "-"]
    assert view.current_driver_revision == "" and view.problems == []


def test_connection_problems_are_one_line(tmp_path):
    missing = subprocess.run(
        [sys.executable, "-m", "metax_operator.cli", "nodes", "--kubeconfig", str(tmp_path / "none")],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1
    assert missing.stderr.startswith("error: --kubeconfig: ") and "is not a file" in missing.stderr
    config = tmp_path / "kubeconfig"
    config.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: x\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:9'}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
    )
    down = subprocess.run(
        [sys.executable, "-m", "metax_operator.cli", "nodes", "--kubeconfig", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert down.returncode == 1 and down.stderr.count("\n") == 1
    assert down.stderr.startswith("error: https://127.0.0.1:9: the API server does not answer")
