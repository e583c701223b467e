"""Driver pools on the real control plane (kube-apiserver, the real DaemonSet controller, kwok GPU
nodes): the chart installed with two pools beside the driver's own DaemonSet, `metax-operator run`
as the chart's runner ServiceAccount.

The runner puts each GPU node into its pool (the runner's label `metax-tech.com/driver-upgrade.pool`)
inside the budget, and each pool then rolls its own version out on its own schedule: one pool
paused while the other completes, a rollback of one leaving the other and the driver's own nodes
untouched. Evidence: the API server's pods, nodes and the CR's status, and a watch of every driver
pod deletion.
"""

from __future__ import annotations

import json
import signal
import threading
from collections import Counter

import pytest
from kubernetes import client, watch

from metax_operator.contract import POOL_LABEL
from tests.e2e.test_node_safety import Witness
from tests.e2e.test_rollout_cluster import DRIVER_PODS, NODES, NS, RELEASE, Runner
from tests.e2e.tools import (
    bootstrap,
    driver_pods,
    get_cr,
    install_chart,
    kubectl,
    more_passes,
    ready,
    release_values,
    service_account_kubeconfig,
    uninstall_chart,
)
from tests.waiting import consistently, eventually

RACK = "example.com/rack"
RACK_A = [f"gpu-node-{i:04d}" for i in range(0, 3)]
RACK_B = [f"gpu-node-{i:04d}" for i in range(3, 6)]
REST = [f"gpu-node-{i:04d}" for i in range(6, NODES)]
POLICY = {
    "enableRollout": True,
    "upgradeSteps": [{"replicas": 1, "pauseDuration": 0}, {"replicas": "100%", "pauseDuration": 0}],
    "maxParallel": 1,
}
VALUES = {
    "registry": "cr.example.com/metax",
    "driver": {
        "payload": {"version": "2.32.0.6"},
        "upgradePolicy": POLICY,
        "pools": [
            {
                "name": "rack-a",
                "nodeSelector": {RACK: "a"},
                "payload": {"version": "2.32.0.6"},
                # Its own steps: the first waits for the admin.
                "upgradePolicy": {"upgradeSteps": [{"replicas": 1}, {"replicas": "100%", "pauseDuration": 0}]},
            },
            {"name": "rack-b", "nodeSelector": {RACK: "b"}},
        ],
    },
}
DAEMONSETS = {"rack-a": "metax-driver-pool-rack-a", "rack-b": "metax-driver-pool-rack-b", None: "metax-driver"}


@pytest.fixture(scope="module")
def api(control_plane):
    return control_plane.api()


def label_nodes(api, nodes: list[str], key: str, value: str | None) -> None:
    for node in nodes:
        client.CoreV1Api(api).patch_node(node, {"metadata": {"labels": {key: value}}})


@pytest.fixture(scope="module")
def pools(control_plane, api, tmp_path_factory):
    """Racks a and b labelled, the chart installed with a pool for each, a runner."""
    tmp = tmp_path_factory.mktemp("pools")
    label_nodes(api, RACK_A, RACK, "a")
    label_nodes(api, RACK_B, RACK, "b")
    install_chart(control_plane, api, tmp, RELEASE, NS, VALUES)
    bootstrap(control_plane, tmp, RELEASE, release_values(control_plane, RELEASE, NS))
    kubeconfig = service_account_kubeconfig(control_plane, tmp, "metax-operator-runner", NS)
    runner = Runner(kubeconfig, tmp, "runner-pools")
    try:
        yield {"runner": runner, "kubeconfig": kubeconfig, "tmp": tmp}
    finally:
        runner.stop(signal.SIGKILL)
        uninstall_chart(control_plane, api, RELEASE, NS)
        label_nodes(api, [*RACK_A, *RACK_B, *REST], RACK, None)
        label_nodes(api, [*RACK_A, *RACK_B, *REST], POOL_LABEL, None)


def placement(api) -> dict[str, tuple[str | None, str]]:
    """Each node's pool label and the DaemonSet of its live driver pod(s)."""
    nodes = {n.metadata.name: (n.metadata.labels or {}).get(POOL_LABEL) for n in client.CoreV1Api(api).list_node().items}
    owners: dict[str, list[str]] = {}
    for pod in driver_pods(api, NS):
        if pod.metadata.deletion_timestamp is None:
            owners.setdefault(pod.spec.node_name, []).append(pod.metadata.owner_references[0].name)
    return {node: (pool, ",".join(sorted(owners.get(node, [])))) for node, pool in nodes.items() if node.startswith("gpu-")}


def in_place(api) -> bool:
    """Every GPU node labelled for its pool and running one Ready driver pod, of its pool's DaemonSet."""
    want = {**dict.fromkeys(RACK_A, "rack-a"), **dict.fromkeys(RACK_B, "rack-b"), **dict.fromkeys(REST, None)}
    pods = [p for p in driver_pods(api, NS) if p.metadata.deletion_timestamp is None]
    return placement(api) == {n: (pool, DAEMONSETS[pool]) for n, pool in want.items()} and all(ready(p) for p in pods)


def pool_status(api, name: str) -> dict:
    entries = (get_cr(api).get("status") or {}).get("pools") or []
    return next((e["upgradeStatus"] for e in entries if e["name"] == name), {})


def revisions(api, pool: str | None) -> Counter:
    return Counter(
        p.metadata.labels["controller-revision-hash"]
        for p in driver_pods(api, NS)
        if p.metadata.owner_references[0].name == DAEMONSETS[pool] and p.metadata.deletion_timestamp is None
    )


def patch_pool(cp, index: int, ops: list[dict]) -> None:
    """The admin's kubectl patch of one pool's fields (a JSON patch under spec.driver.pools[index])."""
    at = f"/spec/driver/pools/{index}"
    ops = [{**op, "path": f"{at}{op['path']}"} for op in ops]
    kubectl(cp, "patch", "ClusterOperator/cluster-operator", "--type", "json", "--patch", json.dumps(ops))


def test_two_pools_roll_out_on_their_own_schedules_and_one_rolls_back_alone(control_plane, api, pools):
    cp = control_plane
    eventually(lambda: in_place(api), 120, f"every GPU node in its pool: {placement(api)}")
    eventually(
        lambda: pool_status(api, "rack-a").get("phase") == "Idling" and pool_status(api, "rack-b").get("phase") == "Idling",
        30,
        "both pools idle",
    )
    rest_pods = {p.metadata.uid for p in driver_pods(api, NS) if p.spec.node_name in REST}
    [old_a], [old_b] = revisions(api, "rack-a"), revisions(api, "rack-b")
    witness = Witness(api)
    try:
        # rack-a paused by the admin, then both pools get a new version.
        patch_pool(cp, 0, [{"op": "add", "path": "/upgradePolicy/pause", "value": True}])
        patch_pool(cp, 0, [{"op": "replace", "path": "/payload/version", "value": "2.33.0.1"}])
        patch_pool(cp, 1, [{"op": "add", "path": "/payload", "value": {"version": "2.34.0.1"}}])
        eventually(
            lambda: pool_status(api, "rack-b").get("status", {}).get("currentStepState") == "Completed", 120, "rack-b completed"
        )
        [new_b] = revisions(api, "rack-b")
        assert new_b != old_b and sum(revisions(api, "rack-b").values()) == len(RACK_B)
        a = pool_status(api, "rack-a")
        assert a["phase"] == "Progressing" and revisions(api, "rack-a") == Counter({old_a: len(RACK_A)}), a
        assert "paused by the admin (spec.driver.pools[0].upgradePolicy.pause: true)" in a["message"]

        # rack-a resumed: its first step swaps one node and waits for the admin, who rolls it back.
        patch_pool(cp, 0, [{"op": "replace", "path": "/upgradePolicy/pause", "value": False}])
        step_paused = lambda: pool_status(api, "rack-a").get("status", {}).get("currentStepState") == "StepPaused"  # noqa: E731
        eventually(step_paused, 60, "rack-a's first step done and waiting for the admin")
        assert revisions(api, "rack-a")[old_a] == len(RACK_A) - 1
        assert get_cr(api)["spec"]["driver"]["pools"][0]["upgradePolicy"]["pause"] is True  # the runner's pause, the pool's own
        patch_pool(cp, 0, [{"op": "replace", "path": "/upgradePolicy/enableRollout", "value": False}])
        eventually(
            lambda: revisions(api, "rack-a") == Counter({old_a: len(RACK_A)}) and all(ready(p) for p in driver_pods(api, NS)),
            90,
            "rack-a rolled back",
        )
        eventually(lambda: pool_status(api, "rack-a").get("phase") == "Disabled", 30, "rack-a's rollback done")
        assert get_cr(api)["spec"]["driver"]["pools"][0]["payload"]["version"] == "2.32.0.6"  # the spec set back too
        untouched = lambda: revisions(api, "rack-b") == Counter({new_b: len(RACK_B)})  # noqa: E731
        consistently(untouched, more_passes(pools["runner"], 3), 30, "rack-b untouched")
    finally:
        witness.stop()
    deleted_on = Counter(node for _, node in witness.deleted.values())
    assert not set(deleted_on) & set(REST), f"the driver's own nodes were touched: {deleted_on}"
    assert {p.metadata.uid for p in driver_pods(api, NS) if p.spec.node_name in REST} == rest_pods
    assert all(deleted_on[n] == 1 for n in RACK_B), deleted_on  # each rack-b node swapped once
    assert get_cr(api)["status"]["upgradeStatus"]["phase"] in ("Idling", "Disabled")


class OutOfService:
    """The GPU nodes without a Ready live driver pod, at every driver pod change a watch delivers,
    and the most of them at once."""

    def __init__(self, api, nodes: list[str]):
        self.core, self.nodes, self.most, self.seen = client.CoreV1Api(api), set(nodes), 0, []
        self.pods: dict[str, tuple[str, bool]] = {}  # uid -> (node, Ready and not deleting)
        listed = self.core.list_namespaced_pod(NS, label_selector=DRIVER_PODS)
        for pod in listed.items:
            self.pods[pod.metadata.uid] = (pod.spec.node_name, ready(pod) and pod.metadata.deletion_timestamp is None)
        self._count()
        self.watch = watch.Watch()
        self.thread = threading.Thread(target=self._follow, args=(listed.metadata.resource_version,), daemon=True)
        self.thread.start()

    def _see(self, pod, gone: bool = False) -> None:
        if gone:
            self.pods.pop(pod.metadata.uid, None)
        else:
            self.pods[pod.metadata.uid] = (pod.spec.node_name, ready(pod) and pod.metadata.deletion_timestamp is None)
        self._count()

    def _count(self) -> None:
        serving = {node for node, up in self.pods.values() if up}
        out = sorted(self.nodes - serving)
        self.most = max(self.most, len(out))
        self.seen.append(out)

    def _follow(self, since: str) -> None:
        try:
            for change in self.watch.stream(
                self.core.list_namespaced_pod, NS, label_selector=DRIVER_PODS, resource_version=since, timeout_seconds=300
            ):
                self._see(change["object"], gone=change["type"] == "DELETED")
        except Exception:  # noqa: BLE001 - the control plane stopping ends the watch
            pass

    def stop(self) -> None:
        self.watch.stop()


def test_two_pools_rolling_out_at_once_share_one_budget(control_plane, api, pools):
    """Both pools at `maxParallel: 1` and `maxUnavailable: 0`, given new versions in one edit: their
    waves take turns, so no more than one GPU node of the whole fleet is out of service at once."""
    cp = control_plane
    eventually(lambda: in_place(api), 120, "every GPU node in its pool")
    quick = {"enableRollout": True, "pause": False, "upgradeSteps": [{"replicas": "100%", "pauseDuration": 0}]}
    patch_pool(cp, 0, [{"op": "add", "path": "/upgradePolicy", "value": quick}])
    eventually(lambda: pool_status(api, "rack-a").get("phase") == "Idling", 30, "rack-a idle again")
    before = {pool: revisions(api, pool) for pool in ("rack-a", "rack-b")}
    outages = OutOfService(api, [*RACK_A, *RACK_B, *REST])
    try:
        ops = [
            {"op": "add", "path": "/spec/driver/pools/0/payload", "value": {"version": "2.35.0.1"}},
            {"op": "add", "path": "/spec/driver/pools/1/payload", "value": {"version": "2.35.0.2"}},
        ]
        kubectl(cp, "patch", "ClusterOperator/cluster-operator", "--type", "json", "--patch", json.dumps(ops))
        for pool, size in (("rack-a", len(RACK_A)), ("rack-b", len(RACK_B))):
            done = lambda pool=pool, size=size: (  # noqa: E731
                pool_status(api, pool).get("status", {}).get("currentStepState") == "Completed"
                and sum(revisions(api, pool).values()) == size
                and not set(revisions(api, pool)) & set(before[pool])
            )
            eventually(done, 120, f"{pool} completed")
    finally:
        outages.stop()
    assert outages.most == 1, [out for out in outages.seen if len(out) > 1][:5]
    assert in_place(api)
