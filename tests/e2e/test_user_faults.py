"""Faults an administrator could plant on the user's path (tests/e2e/userpath.py), each seen the
way the administrator sees it: helm's output and the hook pod's status, the runner's log
(`kubectl logs`), a Job's log. Each runs under one Helm version (the path itself is tested under
both in test_user_path.py).
"""

from __future__ import annotations

import json
import re

import pytest
import yaml
from kubernetes import client

from tests.e2e.tools import cr_condition, kubectl
from tests.e2e.userpath import (
    NS,
    POLICY,
    TOOLS_UID,
    PodWatch,
    driver_pods,
    ok,
    release_name,
    runner_pod,
    seed_install,
    upgrade_status,
)
from tests.waiting import eventually

pytestmark = pytest.mark.xdist_group("real-node")

RUNNER_ROLE = "metax-operator-runner"


def test_a_hook_image_tag_that_does_not_exist_fails_the_install_naming_the_image(tools_cluster, tools_api, clean_slate, tmp_path):
    cluster, api = tools_cluster, tools_api
    pods = PodWatch(api, NS)
    missing = f"{cluster.registry}/metax-operator-tools:0.0.0-missing"
    failed = seed_install(
        cluster, "helm4", cluster.user_values(tmp_path), "--set", "tools.image.tag=0.0.0-missing", "--timeout", "60s"
    )
    pods.stop()
    assert failed.returncode != 0 and "pre-install" in failed.stderr, failed.stderr
    # What `kubectl get pods` / `kubectl describe pod` show: the preflight hook cannot pull the tag.
    preflight = pods.hook("preflight")
    assert preflight, "the preflight hook's pod was created"
    waiting = [s.state.waiting for p in preflight for s in p.status.container_statuses or [] if s.state.waiting]
    assert any(w.reason in ("ErrImagePull", "ImagePullBackOff") for w in waiting), waiting
    events = client.CoreV1Api(api).list_namespaced_event(NS, field_selector="reason=Failed").items
    assert any(missing in e.message and "not found" in e.message for e in events), [e.message for e in events]


def test_a_runner_role_without_pod_deletion_stalls_the_rollout_and_the_runner_log_names_it(
    tools_cluster, tools_api, clean_slate, tmp_path
):
    cluster, api = tools_cluster, tools_api
    values = cluster.user_values(tmp_path, runner={"interval": 1}, driver={"upgradePolicy": POLICY})
    release = release_name(ok(seed_install(cluster, "helm3", values)))
    eventually(lambda: upgrade_status(api).get("phase") == "Idling", 90, "the runner's idle rollout status")
    # An administrator tightens the runner's Role: no more `delete` on pods.
    rules = json.loads(kubectl(cluster.cp, "get", "role", RUNNER_ROLE, "-n", NS, "-o", "json"))["rules"]
    index = next(i for i, r in enumerate(rules) if r["resources"] == ["pods"])
    patch_runner_role(cluster, {"op": "remove", "path": f"/rules/{index}"})
    before = {p.metadata.uid for p in driver_pods(api)}
    kubectl(
        cluster.cp,
        "patch",
        "ClusterOperator/cluster-operator",
        "--type",
        "json",
        "--patch",
        json.dumps([{"op": "replace", "path": "/spec/driver/payload/version", "value": "2.33.0.9"}]),
    )
    runner = runner_pod(api).metadata.name

    def forbidden() -> list[str]:
        log = kubectl(cluster.cp, "logs", "-n", NS, runner)
        return [line for line in log.splitlines() if '"pass-failed"' in line and "cannot delete resource" in line]

    line = json.loads(eventually(forbidden, 90, "the runner's log naming the missing permission")[0])
    assert re.search(r'cannot delete resource \\?"pods\\?"', line["error"]), line["error"]
    assert "system:serviceaccount:metax-operator:metax-operator-runner" in line["error"]
    # `kubectl describe clusteroperator` shows it too: the condition, its Warning event, the metric.
    condition = eventually(
        lambda: (c := cr_condition(api, "RunnerHealthy")) and c["status"] == "False" and c, 30, "RunnerHealthy=False on the CR"
    )
    assert condition["reason"] == "Forbidden" and "\n" not in condition["message"], condition
    assert re.search(r'cannot delete resource "pods"', condition["message"]), condition["message"]
    assert "helm upgrade renders its RBAC" in condition["message"], condition["message"]
    eventually(
        lambda: any(
            e.reason == "Forbidden" and e.type == "Warning" and "RunnerHealthy=False" in e.message for e in cr_events(api)
        ),
        30,
        "a Warning event about the CR",
    )
    assert failures_counted(cluster, runner) >= 1
    # helm test fails and says why (the rest of the install is healthy).
    tested = cluster.helm("helm3", "test", release, "-n", NS, "--timeout", "3m")
    assert tested.returncode != 0, tested.stdout
    report = kubectl(cluster.cp, "logs", "-n", NS, "metax-operator-test")
    assert re.search(r"^FAIL ClusterOperator cluster-operator: RunnerHealthy=False \(Forbidden\): .*cannot delete", report, re.M)
    assert [line for line in report.splitlines() if line.startswith("FAIL")] == [
        line for line in report.splitlines() if "RunnerHealthy" in line
    ], report
    assert {p.metadata.uid for p in driver_pods(api)} == before, "no driver pod was replaced"
    # Giving the permission back lets the rollout finish.
    patch_runner_role(cluster, {"op": "add", "path": f"/rules/{index}", "value": rules[index]})
    eventually(
        lambda: (upgrade_status(api).get("status") or {}).get("currentStepState") == "Completed",
        120,
        "the rollout Completed once the Role allows it",
    )
    assert cr_condition(api, "RunnerHealthy")["status"] == "True", cr_condition(api, "RunnerHealthy")
    assert any(e.reason == "PassSucceeded" and e.type == "Normal" for e in cr_events(api)), "the recovery's event"


def patch_runner_role(cluster, operation: dict) -> None:
    """One JSON-patch operation on the runner's Role, as an administrator runs it."""
    kubectl(cluster.cp, "patch", "role", RUNNER_ROLE, "-n", NS, "--type", "json", "-p", json.dumps([operation]))


def cr_events(api) -> list:
    """The events about the cluster-scoped CR (the API server keeps them in namespace default)."""
    selector = "involvedObject.kind=ClusterOperator,involvedObject.name=cluster-operator"
    return client.CoreV1Api(api).list_namespaced_event("default", field_selector=selector).items


def failures_counted(cluster, runner: str) -> float:
    """metax_operator_runner_pass_failures_total{reason="Forbidden"} as the runner's /metrics serve it."""
    scrape = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8081/metrics').read().decode())"
    text = kubectl(cluster.cp, "exec", "-n", NS, runner, "--", "python3", "-c", scrape)
    lines = [
        line for line in text.splitlines() if line.startswith('metax_operator_runner_pass_failures_total{reason="Forbidden"}')
    ]
    assert lines, "the failure counter is exported"
    return float(lines[0].split()[-1])


def test_a_write_outside_tmp_fails_on_the_read_only_root_filesystem(tools_cluster, tools_api, clean_slate, tmp_path):
    """The tools image run with the chart's own pod spec (a hook Job's, rendered by Helm from the
    pushed chart with the user's values): /tmp is writable, anything else is not."""
    cluster, api = tools_cluster, tools_api
    rendered = ok(
        cluster.helm(
            "helm3",
            "template",
            "probe",
            cluster.chart,
            "-n",
            NS,
            "--set",
            f"registry={cluster.registry}",
            "--set",
            "driver.payload.version=2.32.0.6",
            "-f",
            str(cluster.user_values(tmp_path)),
            "--show-only",
            "templates/hooks/preflight.yaml",
        )
    )
    job = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Job")
    job["metadata"] = {"name": "write-probe", "namespace": NS}
    job["spec"]["backoffLimit"] = 0
    job["spec"]["template"]["metadata"] = {}
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    pod["serviceAccountName"] = "default"  # the hook's own account is a hook object: not installed here
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] == "tmp"]  # the chart's writable /tmp only
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] == "tmp"]
    container["command"] = ["sh", "-c"]
    container["args"] = ["id -u && touch /tmp/ok && echo /tmp is writable && touch /etc/metax-probe"]
    client.CoreV1Api(api).create_namespace({"metadata": {"name": NS}})
    client.BatchV1Api(api).create_namespaced_job(NS, job)
    eventually(
        lambda: (client.BatchV1Api(api).read_namespaced_job("write-probe", NS).status.failed or 0) >= 1,
        120,
        "the probe Job failed",
    )
    log = kubectl(cluster.cp, "logs", "-n", NS, "job/write-probe")
    # stdout and stderr interleave in any order in the container log
    assert {str(TOOLS_UID), "/tmp is writable", "touch: cannot touch '/etc/metax-probe': Read-only file system"} == set(
        log.splitlines()
    ), log
