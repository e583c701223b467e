"""Golden traces of the runner: every write of whole runner passes (`runtime.run.Runner`, the
reconcile and the rollout together) against the fake API server of tests/fakeapi.py, on the
chart's real render, compared request for request (method, path, body) with
tests/runtime/data/runner_requests_trace.json, and the CR's status after each pass with
tests/runtime/data/runner_status_trace.json.

Both were first captured from the runner before its modules were moved between layers; the
requests were captured again when one pass came to write the CR's status once instead of up to
three times (conditions, then upgradeStatus, then RunnerHealthy): the statuses after each pass
stayed the same, and so did every other write, in the same order. Both were captured again when
the runner came to read one clock (the reconcile's times had been a frozen second clock): they
differ from the ones before only in the times written. When the chart came to render the driver's
`OnDelete` whatever the policy, the first pass's DaemonSet apply lost its `updateStrategy` (the
chart's render, from values with the staged rollout off, had been `RollingUpdate`), and nothing else.
When the rollout came to record the spec it acts on (`resume.spec`, `rollout.freeze`), the status
writes of the passes with a rollout in progress gained that key, and nothing else changed.
When the runner came to label each node with its upgrade state (`rollout.node_state`), the
requests were captured again: 11 node label writes were added at the end of passes 0-4, and 7
other writes differ only in the fake server's `metadata.resourceVersion` those writes advance;
the statuses stayed the same. When the rollout came to time each node's readiness from its own
deletion, its status gained `resume.deletedAt` (empty here), and nothing else changed; nor did it
when the runner's pass came to compose the reconcile and the rollout itself. The runner's parallel
node writes go out one at a time here, so that the server numbers them in one order on every run.
When the payload init container came to carry its image's reference for the payload contract, the
driver's apply gained that variable and the recorded spec the copier's volume, and nothing else.
The fake server answers the runner's server-side apply as a merge patch here (the driver's
`initContainers` replaced by the one applied, which `lastAppliedSpec` shows), as it did when these
were recorded; it has since learned to merge an apply's lists by their keys, as the API server
does, which the whole-cluster model (tests/runtime/cluster.py) relies on. When the cordon came to
set the node's state label (`deleting`) and the uncordon its `done`, the requests were captured
again: the three cordons and three uncordons gained the label, six state label writes of their
own went (8, 8, 6 and 5 writes in passes 1-4, now 7, 6, 4 and 4), the later writes carry the
fake server's lower resourceVersions, and the statuses stayed the same.

The scenario: the CR asks for a new driver version with a two-step staged rollout over three
nodes; between passes the test plays the DaemonSet controller (a new ControllerRevision for a new
template, a deleted driver pod re-created Ready at the current revision). Clocks are frozen, so
the trace is the same on every run; each pass starts once the runner's caches hold every change
before it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from unittest import mock

from kubernetes.client.exceptions import ApiException

from metax_operator.contract import COMPONENT_UPDATE_STRATEGY, GPU_NODE_LABEL
from metax_operator.runtime import kube
from metax_operator.runtime import run as runner_mod
from tests.fakeapi import FakeApi
from tests.helm import render_chart
from tests.runtime.test_reconcile import VALUES, deep_update
from tests.waiting import eventually

GOLDEN = Path(__file__).parent / "data" / "runner_requests_trace.json"
STATUS_GOLDEN = Path(__file__).parent / "data" / "runner_status_trace.json"
NS = "metax-operator"
CR = "/apis/gpu.metax-tech.com/v1/clusteroperators/cluster-operator"
DS = f"/apis/apps/v1/namespaces/{NS}/daemonsets"
REVISIONS = f"/apis/apps/v1/namespaces/{NS}/controllerrevisions"
PODS = f"/api/v1/namespaces/{NS}/pods"
NODES = ("n0", "n1", "n2")
T0 = 1_800_000_000.0
POLICY = {
    "enableRollout": True,
    "maxParallel": 1,
    "readinessTimeout": "1m",
    "upgradeSteps": [{"replicas": 1, "pauseDuration": 0}, {"replicas": "100%", "pauseDuration": 0}],
}


def path_of(obj: dict) -> str:
    kind, name, ns = obj["kind"], obj["metadata"]["name"], obj["metadata"].get("namespace", NS)
    plural = {"DaemonSet": "apps/v1/namespaces/{ns}/daemonsets", "ConfigMap": "v1/namespaces/{ns}/configmaps"}
    plural["Service"] = "v1/namespaces/{ns}/services"
    prefix = "/apis/" if kind == "DaemonSet" else "/api/"
    return prefix + plural[kind].format(ns=ns) + "/" + name


class Controller:
    """The DaemonSet controller's part for the driver: revisions, generations, pod re-creation."""

    def __init__(self, api: FakeApi):
        self.api, self.template, self.revision, self.serial = api, None, 0, 0

    def sync(self) -> None:
        ds = self.api.get(f"{DS}/metax-driver")
        if ds["spec"]["template"] != self.template:
            self.template = copy.deepcopy(ds["spec"]["template"])
            self.revision += 1
            self.api.put(
                f"{REVISIONS}/metax-driver-r{self.revision}",
                {
                    "metadata": {
                        "name": f"metax-driver-r{self.revision}",
                        "namespace": NS,
                        "labels": {"controller-revision-hash": f"r{self.revision}"},
                        "ownerReferences": [{"kind": "DaemonSet", "uid": ds["metadata"]["uid"], "name": "metax-driver"}],
                    },
                    "revision": self.revision,
                    "data": {"spec": {"template": {**self.template, "$patch": "replace"}}},
                },
            )
            ds["metadata"]["generation"] = ds["metadata"].get("generation", 1) + 1
        if ds.get("status", {}).get("observedGeneration") != ds["metadata"].get("generation"):
            ds.setdefault("status", {})["observedGeneration"] = ds["metadata"]["generation"]
            self.api.put(f"{DS}/metax-driver", ds)
        live = {p["spec"]["nodeName"] for key, p in self.api.objects.items() if key.startswith(f"{PODS}/driver-")}
        for node in NODES:
            if node not in live:
                self.add_pod(node, ds["metadata"]["uid"], f"r{self.revision}")

    def add_pod(self, node: str, owner: str, revision: str) -> None:
        self.serial += 1
        name = f"driver-{node}-{self.serial}"
        self.api.put(f"{PODS}/{name}", driver_pod(name, NS, node, revision, owner, "2027-01-15T07:00:00Z"))


def driver_pod(name: str, namespace: str, node: str, revision: str, owner: str, created: str, ready: bool = True) -> dict:
    """A driver pod as the DaemonSet controller creates it, Running."""
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{name}",
            "creationTimestamp": created,
            "labels": {"controller-revision-hash": revision, "app.kubernetes.io/component": "driver"},
            "ownerReferences": [{"kind": "DaemonSet", "uid": owner, "name": "metax-driver"}],
        },
        "spec": {"nodeName": node},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}]},
    }


def normalized(api: FakeApi) -> list[dict]:
    """The writes in order, with the clocks' and the server's volatile fields as they are."""
    return [{"method": r.method, "path": r.path, "query": r.query, "body": r.body} for r in api.requests if r.method != "GET"]


def scenario(fault=None) -> tuple[list[list[dict]], list[dict]]:
    """The writes of each pass, and the CR's status after it; `fault(api, i)`, if given, runs
    before pass i (a pass that fails then is recorded as it ended)."""
    objects = render_chart(VALUES)
    with FakeApi(apply_as_merge_patch=True) as api:  # as when the goldens were recorded
        for obj in objects:
            if obj["kind"] in ("DaemonSet", "ConfigMap", "Service"):
                live = copy.deepcopy(obj)
                live["metadata"].update(namespace=NS, uid=f"uid-{obj['metadata']['name']}", generation=1)
                if obj["kind"] == "DaemonSet":  # the components' strategy, which the chart leaves to the runner, is set
                    live["spec"].setdefault("updateStrategy", copy.deepcopy(COMPONENT_UPDATE_STRATEGY))
                api.put(path_of(obj), live)
        for node in NODES:
            api.put(f"/api/v1/nodes/{node}", {"metadata": {"name": node, "labels": {GPU_NODE_LABEL: "true"}}, "spec": {}})
        controller = Controller(api)
        controller.sync()
        spec = deep_update(copy.deepcopy(VALUES), {"driver": {"payload": {"version": "2.33.0.1"}, "upgradePolicy": POLICY}})
        api.put(
            CR,
            {
                "apiVersion": "gpu.metax-tech.com/v1",
                "kind": "ClusterOperator",
                "metadata": {"name": "cluster-operator", "generation": 1, "uid": "cr-uid"},
                "spec": spec,
            },
        )
        ticks = iter(range(1000))
        clock = lambda: T0 + 10 * next(ticks)  # noqa: E731 - ten seconds later at each reading
        runner = runner_mod.Runner(api.client(), NS, is_leader=lambda: True, identity="runner-0", clock=clock)
        one_at_a_time = mock.patch.object(kube, "PARALLEL_REQUESTS", 1)  # the server's resourceVersions in one order
        one_at_a_time.start()
        passes, statuses = [], []
        try:
            for _ in range(8):
                # Each pass reads caches holding every change so far (the test's and the runner's).
                eventually(lambda: api.delivered(runner.caches()), 30, "the runner's caches to hold every change")
                api.requests.clear()
                if fault is not None:
                    fault(api, len(passes))
                try:
                    runner.run_pass()
                except ApiException:
                    assert fault is not None, "a pass failed without a fault"
                passes.append(normalized(api))
                statuses.append(api.get(CR)["status"])
                controller.sync()
        finally:
            one_at_a_time.stop()
            runner.close()
    return passes, statuses


def test_the_runner_sends_the_golden_requests_pass_for_pass_and_leaves_the_golden_status():
    got, statuses = scenario()
    assert statuses == json.loads(STATUS_GOLDEN.read_text())
    golden = json.loads(GOLDEN.read_text())
    assert len(got) == len(golden)
    for i, (sent, expected) in enumerate(zip(got, golden, strict=True)):
        assert json.loads(json.dumps(sent, sort_keys=True)) == expected, f"pass {i}"


def status_writes(requests: list[dict]) -> list[dict]:
    return [r["body"]["status"] for r in requests if r["path"] == CR + "/status"]


def test_each_pass_writes_the_cr_status_at_most_once():
    got, _ = scenario()
    assert [len(status_writes(sent)) for sent in got] == [1, 1, 1, 1, 1, 1, 0, 0]
    first = status_writes(got[0])[0]  # the reconcile's conditions and the rollout's status together
    assert {c["type"] for c in first["conditions"]} >= {"SpecValid", "Reconciled", "RunnerHealthy"}
    assert first["observedGeneration"] == 1 and "upgradeStatus" in first


def test_a_pass_failing_in_the_rollout_s_actions_keeps_runner_healthy_false_until_one_succeeds():
    """The deletion of n0's driver pod is refused (403) in passes 1 and 2: RunnerHealthy turns
    False once and stays False, never True in between; pass 3 succeeds and sets it True."""

    def refuse(api: FakeApi, i: int) -> None:
        if i == 1:
            api.fail("DELETE", f"{PODS}/driver-n0-1", 403, times=2)  # a 403 is not retried: two passes

    got, statuses = scenario(refuse)
    healthy = [next(c["status"] for c in s["conditions"] if c["type"] == "RunnerHealthy") for s in statuses]
    assert healthy[:4] == ["True", "False", "False", "True"]
    events = [[r["body"]["message"].split(":")[0] for r in sent if r["path"].endswith("/events")] for sent in got]
    said = [[e for e in pass_events if e.startswith("RunnerHealthy")] for pass_events in events]
    assert said[1:4] == [["RunnerHealthy=False"], [], ["RunnerHealthy=True"]]
