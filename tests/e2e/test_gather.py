"""`metax-operator gather` against the real control plane (kube-apiserver, etcd, kwok nodes): the
chart installed and upgraded with the real Helm 3 (two release revisions, hence two of Helm's
release Secrets), the CR bootstrapped; the bundle is read back and each part found. kwok runs
no containers, so there are no container logs and no runner to scrape: the manifest must say
why for those (a reachable runner's scrape and logs are what the same requests return on a real
cluster). A value that looks like a secret must appear nowhere in the bundle."""

from __future__ import annotations

import json
import tarfile

import pytest
import yaml

from metax_operator.gather import PARTS
from tests.controlplane import GPU_LABEL
from tests.e2e.tools import METAX, bootstrap, helm3, install_chart, kubectl, release_values, run, uninstall_chart
from tests.helm import CHART
from tests.waiting import eventually

pytestmark = pytest.mark.e2e

NS = "gather-e2e"
RELEASE = "metax"
SECRET = "s3cr3t-do-not-ship"
VALUES = {
    "registry": "cr.example.com/metax",
    "driver": {"payload": {"version": "2.32.0.6"}},
    "commonAnnotations": {"example.com/api-token": SECRET},
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
    assert set(PARTS) <= set(manifest["parts"])
    gathered = {name for name, outcome in manifest["parts"].items() if outcome == "ok"}
    assert gathered == {name for name in bundle if name != "manifest.json"}
    assert set(PARTS) - {"metrics.txt"} <= gathered, manifest["parts"]


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
    runner = [p for p in yaml.safe_load(bundle["pods.yaml"]) if p["metadata"]["name"].startswith("metax-operator-runner-")]
    assert runner, "the runner's pod is among the pods whose logs are gathered"
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
    assert history[1]["values"]["runner"] == {"interval": 7}
    assert history[1]["values"]["commonAnnotations"] == {"example.com/api-token": "<redacted>"}


def test_no_secret_value_is_in_the_bundle(bundle):
    assert not [name for name, content in bundle.items() if SECRET.encode() in content]


def test_logs_and_the_scrape_that_kwok_cannot_give_say_why(bundle):
    parts = json.loads(bundle["manifest.json"])["parts"]
    runner_logs = [name for name in parts if name.startswith("logs/metax-operator-runner-") and name.endswith("/runner.log")]
    assert runner_logs, sorted(parts)
    for name in runner_logs:
        assert parts[name].startswith("not gathered: GET /api/v1/namespaces/gather-e2e/pods/"), parts[name]
    assert parts["metrics.txt"].startswith("not gathered: GET /api/v1/namespaces/gather-e2e/pods/metax-operator-runner-")
    assert "/proxy/metrics:" in parts["metrics.txt"]
