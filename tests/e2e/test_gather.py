"""`metax-operator gather` against the real control plane (kube-apiserver, etcd, kwok nodes): the
chart installed and upgraded with the real Helm 3 (two release revisions, hence two of Helm's
release Secrets), the CR bootstrapped; the bundle is read back and each part found. A value
that looks like a secret must appear nowhere in the bundle.

kwok runs no containers and its nodes have no kubelet: a log request would make the API server
look the node's name up in DNS, off this machine. So the release runs without the runner
(`runner.enabled: false`), no rollout names a node, and the bundle asks for no log and no scrape:
the manifest says why there is no scrape. The log and scrape requests themselves are checked on
the fake API server (tests/test_gather.py)."""

from __future__ import annotations

import json
import tarfile

import pytest
import yaml

from metax_operator.commands.gather import PARTS
from tests.controlplane import GPU_LABEL
from tests.e2e.tools import METAX, bootstrap, helm3, install_chart, kubectl, release_values, run, uninstall_chart
from tests.helm import CHART
from tests.waiting import eventually

NS = "gather-e2e"
RELEASE = "metax"
SECRET = "s3cr3t-do-not-ship"
VALUES = {
    "registry": "cr.example.com/metax",
    "driver": {"payload": {"version": "2.32.0.6"}},
    "commonAnnotations": {"example.com/api-token": SECRET},
    "runner": {"enabled": False},
}


@pytest.fixture(scope="module")
def bundle(control_plane, tmp_path_factory) -> dict[str, bytes]:
    cp, tmp = control_plane, tmp_path_factory.mktemp("gather")
    api = cp.api()
    install_chart(cp, api, tmp, RELEASE, NS, VALUES)
    try:
        run(*helm3(cp), "upgrade", RELEASE, str(CHART), "-n", NS, "--no-hooks", "--reuse-values", "--set", "runner.interval=7")
        bootstrap(cp, tmp, RELEASE, release_values(cp, RELEASE, NS))
        eventually(lambda: "pod/metax-driver-" in kubectl(cp, "get", "pods", "-n", NS, "-o", "name"), 60, "the driver pods")
        out = tmp / "ticket.tar.gz"
        printed = run(METAX, "gather", "--kubeconfig", str(cp.kubeconfig), "-n", NS, "--output", str(out), "--since", "1h")
        assert printed.startswith(f"wrote {out} ("), printed
        with tarfile.open(out) as archive:
            assert {m.name.split("/", 1)[0] for m in archive.getmembers()} == {"ticket"}
            yield {m.name.split("/", 1)[1]: archive.extractfile(m).read() for m in archive.getmembers()}
    finally:
        uninstall_chart(cp, api, RELEASE, NS)


def test_the_manifest_accounts_for_every_part(bundle):
    manifest = json.loads(bundle["manifest.json"])
    assert manifest["namespace"] == NS and manifest["sinceSeconds"] == 3600
    assert set(PARTS) == set(manifest["parts"])
    gathered = {name for name, outcome in manifest["parts"].items() if outcome == "ok"}
    assert gathered == {name for name in bundle if name != "manifest.json"}
    assert gathered == set(PARTS) - {"metrics.txt"}, manifest["parts"]


def test_the_cr_events_workloads_and_configmaps_are_the_clusters(bundle):
    cr = yaml.safe_load(bundle["cr.yaml"])
    assert cr["kind"] == "ClusterOperator" and cr["metadata"]["name"] == "cluster-operator"
    assert cr["spec"]["driver"]["payload"]["version"] == "2.32.0.6"
    events = yaml.safe_load(bundle["events.yaml"])
    assert any(e["reason"] == "SuccessfulCreate" and e["involvedObject"]["kind"] == "DaemonSet" for e in events)
    daemonsets = {d["metadata"]["name"] for d in yaml.safe_load(bundle["daemonsets.yaml"])}
    assert {"metax-driver", "metax-gpu-label"} <= daemonsets
    revisions = yaml.safe_load(bundle["controllerrevisions.yaml"])
    assert any(r["metadata"]["name"].startswith("metax-driver-") for r in revisions)
    configmaps = {c["metadata"]["name"] for c in yaml.safe_load(bundle["configmaps.yaml"])}
    assert "driver-config" in configmaps


def test_pods_nodes_and_the_commands_output_are_there(bundle):
    table = bundle["pods.txt"].decode().splitlines()
    assert any(line.startswith("metax-driver-") and " gpu-node-" in line for line in table), table
    assert yaml.safe_load(bundle["pods.yaml"]) == []  # no runner, no hook, no node named: no log asked for
    nodes = yaml.safe_load(bundle["nodes.yaml"])
    gpu = [n for n in nodes if n["labels"].get(GPU_LABEL) == "true"]
    assert len(gpu) == 10 and all(not k.startswith("kubernetes.io/") for n in gpu for k in n["labels"])
    assert all(any(c["type"] == "Ready" for c in n["conditions"]) for n in gpu)
    status = bundle["rollout-status.txt"].decode()
    assert status.startswith("Phase: ") and "Stopped: no runner leads: no runner has ever taken the Lease" in status
    assert "gpu-node-0000" in bundle["nodes.txt"].decode()


def test_the_helm_history_is_values_only(bundle):
    history = yaml.safe_load(bundle["helm-history.yaml"])
    assert [(r["revision"], r["status"]) for r in history] == [(1, "superseded"), (2, "deployed")]
    assert all(set(r) == {"name", "revision", "status", "chartVersion", "values"} for r in history)
    assert history[0]["values"]["runner"] == {"enabled": False}
    assert history[1]["values"]["runner"] == {"enabled": False, "interval": 7}
    assert history[1]["values"]["commonAnnotations"] == {"example.com/api-token": "<redacted>"}


def test_no_secret_value_is_in_the_bundle(bundle):
    assert not [name for name, content in bundle.items() if SECRET.encode() in content]


def test_without_a_runner_pod_the_manifest_says_why_there_is_no_scrape(bundle):
    parts = json.loads(bundle["manifest.json"])["parts"]
    assert not [name for name in parts if name.startswith("logs/")]
    assert parts["metrics.txt"] == "not gathered: no runner pod is running (the metrics are served in runner.mode: deployment)"
