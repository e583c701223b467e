"""The support bundle's pure parts: `--since`, redaction, a Helm release record decoded the way
Helm stores it, a node's summary, whose logs are gathered, the tarball's layout. The bundle of a
real installed release: tests/e2e/test_gather.py."""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import tarfile

import pytest

from metax_operator.commands import gather
from tests.fakeapi import FakeApi


def test_since_takes_durations_and_refuses_the_rest():
    assert gather.since_seconds("90s") == 90
    assert gather.since_seconds("1d12h30m") == 86400 + 12 * 3600 + 1800
    for bad in ("", "10", "1w", "-5m", "1.5h"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a duration such as 30m"):
            gather.since_seconds(bad)


def test_redaction_replaces_secret_keys_and_secret_env_values_only():
    values = {
        "registry": "cr.example.com/metax",
        "hooks": {"annotations": {"example.com/api-token": "s3cr3t"}},
        "env": [{"name": "DB_PASSWORD", "value": "hunter2"}, {"name": "LOG_LEVEL", "value": "info"}],
        "tolerations": [{"key": "metax-tech.com/gpu", "operator": "Exists"}],
    }
    assert gather.redact(values) == {
        "registry": "cr.example.com/metax",
        "hooks": {"annotations": {"example.com/api-token": "<redacted>"}},
        "env": [{"name": "DB_PASSWORD", "value": "<redacted>"}, {"name": "LOG_LEVEL", "value": "info"}],
        "tolerations": [{"key": "metax-tech.com/gpu", "operator": "Exists"}],
    }


def test_an_object_is_shown_redacted_and_without_its_managed_fields():
    config = {
        "kind": "ConfigMap",
        "metadata": {"name": "c", "managedFields": [{"manager": "helm", "fieldsV1": {"f:data": {}}}]},
        "data": {"api-token": "s3cr3t", "level": "info"},
    }
    assert gather.shown(config) == {
        "kind": "ConfigMap",
        "metadata": {"name": "c"},
        "data": {"api-token": "<redacted>", "level": "info"},
    }
    assert config["metadata"]["managedFields"]  # the object read is left as it was


def helm_secret(release: dict) -> dict:
    """A release Secret as Helm 3 writes it (gzip JSON, base64) and the API server serves it (base64 again)."""
    stored = base64.b64encode(gzip.compress(json.dumps(release).encode()))
    return {"kind": "Secret", "type": "helm.sh/release.v1", "data": {"release": base64.b64encode(stored).decode()}}


def test_a_helm_release_keeps_its_name_revision_status_chart_version_and_values_only():
    release = {
        "name": "metax",
        "version": 3,
        "info": {"status": "deployed", "notes": "..."},
        "chart": {"metadata": {"name": "metax-operator", "version": "0.1.0"}, "templates": [{"data": "..."}]},
        "config": {"runner": {"interval": 7}, "commonAnnotations": {"vault-token": "xyz"}},
        "manifest": "apiVersion: v1\nkind: Secret\n...",
    }
    assert gather.helm_release(helm_secret(release)) == {
        "name": "metax",
        "revision": 3,
        "status": "deployed",
        "chartVersion": "0.1.0",
        "values": {"runner": {"interval": 7}, "commonAnnotations": {"vault-token": "<redacted>"}},
    }
    other = {**release, "chart": {"metadata": {"name": "ingress-nginx", "version": "4.0.0"}}}
    assert gather.helm_release(helm_secret(other)) is None


def test_a_node_keeps_its_metax_labels_and_annotations_taints_and_conditions():
    node = {
        "metadata": {
            "name": "gpu-1",
            "labels": {"metax-tech.com/gpu.installed": "true", "kubernetes.io/hostname": "gpu-1"},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", "metax-tech.com/driver": "2.32"},
            "managedFields": [{"manager": "kubelet"}],
        },
        "spec": {"unschedulable": True, "taints": [{"key": "metax-tech.com/gpu", "effect": "NoSchedule"}]},
        "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": "x"}]},
    }
    assert gather.node_summary(node) == {
        "name": "gpu-1",
        "labels": {"metax-tech.com/gpu.installed": "true"},
        "annotations": {"metax-tech.com/driver": "2.32"},
        "unschedulable": True,
        "taints": [{"key": "metax-tech.com/gpu", "effect": "NoSchedule"}],
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": None, "lastTransitionTime": None}
        ],
    }


def test_logs_are_gathered_for_the_runner_the_hooks_and_the_nodes_the_rollout_names():
    cr = {"status": {"upgradeStatus": {"resume": {"wave": ["n1"], "failedNodes": ["n2"], "failedNodeCount": 1}}}}
    nodes = gather.named_nodes(cr)
    assert nodes == ["n2", "n1"]

    def pod(labels: dict, node: str) -> dict:
        return {"metadata": {"name": "p", "labels": labels}, "spec": {"nodeName": node}}

    assert gather.log_rank(pod({"app.kubernetes.io/component": "runner"}, "cp"), nodes) == 0
    assert gather.log_rank(pod({"gpu.metax-tech.com/hook": "bootstrap"}, "cp"), nodes) == 0
    assert gather.log_rank(pod({"app.kubernetes.io/component": "driver"}, "n2"), nodes) == 1
    assert gather.log_rank(pod({"app.kubernetes.io/component": "driver"}, "n1"), nodes) == 2
    assert gather.log_rank(pod({"app.kubernetes.io/component": "driver"}, "n9"), nodes) is None
    # a failed node's validation pod, kept (owned by its driver pod) with the check's log
    assert gather.log_rank(pod({"app.kubernetes.io/component": "driver-validation"}, "n2"), nodes) == 1


def test_the_nodes_the_driver_pools_rollouts_name_are_gathered_too_and_each_pools_status():
    pools = [{"name": "rack-a", "nodeSelector": {"rack": "a"}}]
    failed = {"resume": {"failedNodes": ["a2"], "failedNodeCount": 1}, "phase": "Progressing"}
    cr = {
        "spec": {"driver": {"upgradePolicy": {}, "pools": pools}},
        "status": {"upgradeStatus": {"resume": {"wave": ["n1"]}}, "pools": [{"name": "rack-a", "upgradeStatus": failed}]},
    }
    assert gather.named_nodes(cr) == ["a2", "n1"]
    shown = gather.rollout_status(cr, None, "metax-operator")
    assert shown.count("Phase: ") == 2 and "--pool rack-a\nPhase: Progressing" in shown and "Failed nodes: 1: a2" in shown


def test_at_most_log_nodes_of_a_10000_node_rollout_have_their_logs_gathered_the_failed_first():
    """A step of 10% of 10,000 nodes puts 1,000 in the wave: the bundle keeps the logs of
    `--node`'s nodes and of the first LOG_NODES the status names, failed and timed out first."""
    wave = [f"gpu-{i:05d}" for i in range(1000)]
    resume = {
        "wave": wave,
        "timedOutNodes": ["gpu-09998", "gpu-00003"],
        "failedNodes": ["gpu-09999", "gpu-00001"],
        "failedNodeCount": 400,
        "heldNodes": ["gpu-05000"],
        "heldNodeCount": 1,
    }
    cr = {"status": {"upgradeStatus": {"resume": resume}}}
    nodes, left_out = gather.log_nodes(cr, ["gpu-07777", "gpu-00001"])
    assert nodes[:6] == ["gpu-07777", "gpu-00001", "gpu-09999", "gpu-00003", "gpu-09998", "gpu-05000"]
    rest_of_wave = [n for n in wave if n not in ("gpu-00001", "gpu-00003")]  # named before
    assert len(nodes) == 2 + gather.LOG_NODES and nodes[6:] == rest_of_wave[: gather.LOG_NODES - 4]
    assert left_out == len(rest_of_wave) - (gather.LOG_NODES - 4)


def test_the_logs_stop_at_the_bundles_budget(monkeypatch):
    """Each log asks for at most what is left of LOG_BUDGET; once it is spent the rest are not
    gathered, and the manifest says why."""
    with FakeApi() as fake:
        fake.put(f"{PODS}/metax-operator-runner-x", RUNNER_POD)
        size = len(json.dumps(fake.put(f"{PODS}/metax-operator-runner-x/log", {"line": "x" * 60})))
        monkeypatch.setattr(gather, "LOG_BUDGET", 2 * size + 10)
        gatherer = gather.Gatherer(fake.client(), NS, None, [], 1_800_000_000.0)
        bundle = gather.Bundle()
        gatherer.logs(fake.client().list("v1", "Pod", NS)[0], bundle)
        asked = [r.query["limitBytes"] for r in fake.sent("GET", "/log")]
    assert asked == [str(2 * size + 10), str(size + 10), "10"]  # the fake ignores limitBytes: a real server keeps 10
    assert list(bundle.files) == [
        "logs/metax-operator-runner-x/wait.log",
        *(f"logs/metax-operator-runner-x/{n}.log" for n in ("wait.previous", "runner")),
    ]
    spent = "not gathered: the bundle's 0 MiB for logs are spent (--node NAME puts a node's first)"
    assert bundle.outcomes["logs/metax-operator-runner-x/runner.previous.log"] == spent


def test_the_tarball_holds_the_manifest_and_each_file_under_one_directory(tmp_path):
    bundle = gather.Bundle()
    bundle.part("cr.yaml", lambda: "kind: ClusterOperator\n")
    bundle.part("metrics.txt", lambda: (_ for _ in ()).throw(ValueError("no runner pod is running")))
    out = tmp_path / "ticket-42.tar.gz"
    gather.write(bundle, str(out), {"created": "2026-01-01T00:00:00Z", "createdUnix": 1767225600, "namespace": "x"})
    with tarfile.open(out) as archive:
        names = archive.getnames()
        manifest = json.load(archive.extractfile("ticket-42/manifest.json"))
    assert names == ["ticket-42/manifest.json", "ticket-42/cr.yaml"]
    assert manifest["parts"] == {"cr.yaml": "ok", "metrics.txt": "not gathered: no runner pod is running"}


NS = "metax-operator"
RUNNER_POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "metax-operator-runner-x", "labels": {"app.kubernetes.io/component": "runner"}},
    "spec": {
        "nodeName": "cp-1",
        "initContainers": [{"name": "wait"}],
        "containers": [{"name": "runner", "ports": [{"name": "health", "containerPort": 8081}]}],
    },
    "status": {"phase": "Running"},
}
PODS = f"/api/v1/namespaces/{NS}/pods"
WAITING = 'container "wait" in pod "metax-operator-runner-x" is waiting to start'


def test_logs_and_the_scrape_are_asked_of_the_api_server_with_their_bounds():
    """On the fake API server (a real one would ask kwok's nodes, which have no kubelet): each
    container's current and previous log with limitBytes and sinceSeconds, the scrape through
    the pod proxy, and a refusal kept in the manifest as one line."""
    with FakeApi() as fake:
        fake.put(f"{PODS}/metax-operator-runner-x", RUNNER_POD)
        fake.put(f"{PODS}/metax-operator-runner-x/log", {"line": "pass writes=0"})
        fake.put(f"{PODS}/metax-operator-runner-x:8081/proxy/metrics", {"metax_operator_leader": 1})
        fake.fail("GET", f"{PODS}/metax-operator-runner-x/log", 400, times=1, message=WAITING)
        gatherer = gather.Gatherer(fake.client(), NS, 600, [], 1_800_000_000.0)
        bundle = gather.Bundle()
        pods = fake.client().list("v1", "Pod", NS)
        for pod in pods:
            gatherer.logs(pod, bundle)
        bundle.part("metrics.txt", lambda: gatherer.metrics(pods))
        asked = [r.query for r in fake.sent("GET", "/log")]
    assert [(q["container"], q.get("previous")) for q in asked] == [
        ("wait", None),
        ("wait", "true"),
        ("runner", None),
        ("runner", "true"),
    ]
    assert all(q["limitBytes"] == str(gather.LOG_BYTES) and q["sinceSeconds"] == "600" for q in asked)
    refused = f"GET {PODS}/metax-operator-runner-x/log: 400 Bad Request: {WAITING}"
    assert bundle.outcomes["logs/metax-operator-runner-x/wait.log"] == f"not gathered: {refused}"
    assert json.loads(bundle.files["logs/metax-operator-runner-x/runner.previous.log"])["line"] == "pass writes=0"
    assert json.loads(bundle.files["metrics.txt"])["metax_operator_leader"] == 1
