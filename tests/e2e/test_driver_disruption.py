"""Administrators' everyday actions in the middle of a staged rollout, on the user's path (the
chart from the local OCI registry, every hook and the runner as containers of the tools image on
the real node, the driver pods on kwok GPU nodes), under Helm 3 and Helm 4, the whole of it
watched by `DriverDownWatch`: never more GPU nodes without a working driver at once than the
policy's `maxParallel`, and no node left cordoned once the fleet is quiet.

The rollout: one node, then the runner's pause (an empty `pauseDuration`), then the rest, one at a
time (`maxParallel: 1`). One install per test, each action checked where it ends:
- a routine `helm upgrade` during a rollout started by the seed's `kubectl patch` of the version,
  then `helm upgrade --set driver.upgradePolicy.enableRollout=false` during it (before their
  fixes: Helm 3 wrote the values' version back, Helm 4 failed on a field conflict; every driver
  pod replaced at once, twice);
- `helm rollback` during a rollout started through the values: refused before anything changes,
  then through once the rollout is stopped (before: the DaemonSets rolled back, then the
  post-rollback hook refused);
- `metax-operator rollout undo` at the runner's pause, as docs/rollout-admin.md gives it;
- `kubectl delete node` of the kwok node whose driver pod the wave has just deleted: the
  rollout completes on the other nodes (before its fix, the node's leftover pod, until pod GC
  deleted it, held the only slot while not Ready and counted among the upgraded once Ready:
  `upgraded 4/4` on 3 nodes);
- `helm uninstall --wait` while a wave node is cordoned and its new driver never turns Ready
  (Helm 3 and Helm 4): the cleanup hook runs, and no cordon, runner label or GPU label is left.
  The watch counts the nodes labelled GPU nodes; the cleanup hook unlabels each node before the
  DaemonSet controller takes its driver, so the bound holds through the whole uninstall.
"""

from __future__ import annotations

import json
import time

import pytest
from kubernetes import client

from metax_operator.contract import NODE_LABEL_PREFIX, ROLLOUT_NODE_KEY_PREFIX
from tests.controlplane import ARCH_LABEL, GPU_LABEL, GPUS_ANNOTATION, node_manifest
from tests.e2e.disruption import DriverDownWatch, down_now, gpu_nodes, quiet
from tests.e2e.tools import METAX, kubectl, run, seed_patch
from tests.e2e.userpath import (
    GPU_NODES,
    NS,
    PodWatch,
    assert_ran_as_tools_pod,
    cordoned,
    driver_daemonset,
    driver_pods,
    get_cr,
    ok,
    paused_after_the_first_step,
    payload_image,
    release_name,
    seed_install,
    seed_patch_version,
    terminated,
    upgrade_status,
)
from tests.waiting import consistently, eventually, for_seconds

pytestmark = pytest.mark.xdist_group("real-node-2")  # a cluster of its own: conftest.py

MAX_PARALLEL = 1
POLICY = {
    "enableRollout": True,
    "pause": False,
    "maxParallel": MAX_PARALLEL,
    "maxUnavailable": 0,
    "fallback": "pause",
    "upgradeSteps": [{"replicas": 1}, {"replicas": "100%", "pauseDuration": 0}],
}
OLD, NEW = "2.32.0.6", "2.33.0.1"
CORDON_TAINT = "node.kubernetes.io/unschedulable"  # the node lifecycle controller's, while cordoned


def revisions(api) -> list[str]:
    return sorted(p.metadata.labels["controller-revision-hash"] for p in driver_pods(api))


def installed(cluster, api, tmp_path, which) -> tuple[str, list[str], DriverDownWatch]:
    """The seed's install with POLICY, every driver pod Ready: the release, the pods' revisions,
    and the watch started."""
    values = cluster.user_values(tmp_path, runner={"interval": 1}, driver={"upgradePolicy": POLICY})
    release = release_name(ok(seed_install(cluster, which, values)))
    eventually(lambda: len(driver_pods(api)) == GPU_NODES and not down_now(api, NS), 120, "a driver pod on every GPU node")
    before = revisions(api)
    assert len(set(before)) == 1
    return release, before, DriverDownWatch(api, NS)


def rolled_back_in_waves(api, watch: DriverDownWatch, before: list[str]) -> None:
    eventually(
        lambda: upgrade_status(api).get("phase") == "Disabled" and revisions(api) == before and not watch.down(),
        180,
        "every driver pod back at the old revision and Ready",
    )
    assert driver_daemonset(api).spec.update_strategy.type == "OnDelete"


@pytest.mark.parametrize("which", ["helm3", "helm4"])
def test_helm_upgrades_during_a_kubectl_started_rollout(tools_cluster, tools_api, clean_slate, tmp_path, which):
    cluster, api = tools_cluster, tools_api
    release, before, watch = installed(cluster, api, tmp_path, which)
    upgrade = ("upgrade", release, cluster.chart, "-n", NS, "--reuse-values", "--timeout", "5m")
    seed_patch_version(cluster, NEW)
    eventually(lambda: paused_after_the_first_step(api), 120, "the rollout paused after its first step")
    ds = driver_daemonset(api)
    assert payload_image(ds).endswith(f":{NEW}") and len(set(revisions(api))) == 2

    # A routine `helm upgrade` for another reason leaves the driver alone (the values keep OLD).
    ok(cluster.helm(which, *upgrade, "--set", "runner.interval=2"))
    consistently(
        lambda: driver_daemonset(api).metadata.generation == ds.metadata.generation,
        for_seconds(10),
        30,
        "the driver's template unchanged by the routine upgrade",
    )
    assert payload_image(driver_daemonset(api)) == payload_image(ds)

    # The seed's forced rollback, made the way a values file in Git makes it: in waves.
    ok(cluster.helm(which, *upgrade, "--set", "driver.upgradePolicy.enableRollout=false"))
    rolled_back_in_waves(api, watch, before)
    quiet(api, watch, MAX_PARALLEL)


@pytest.mark.parametrize("which", ["helm3", "helm4"])
def test_helm_rollback_during_a_rollout_is_refused_before_anything_changes(
    tools_cluster, tools_api, clean_slate, tmp_path, which
):
    cluster, api = tools_cluster, tools_api
    release, before, watch = installed(cluster, api, tmp_path, which)
    ok(
        cluster.helm(
            which, "upgrade", release, cluster.chart, "-n", NS, "--reuse-values", "--set", f"driver.payload.version={NEW}"
        )
    )
    eventually(lambda: paused_after_the_first_step(api), 120, "the rollout paused after its first step")
    generation = driver_daemonset(api).metadata.generation

    # Release 1 names the old version, which the freeze forbids changing during a rollout.
    refused = cluster.helm(which, "rollback", release, "1", "-n", NS)
    assert refused.returncode != 0 and "metax-operator-bootstrap" in refused.stderr, refused.stderr
    log = kubectl(cluster.cp, "logs", "-n", NS, "job/metax-operator-bootstrap")
    assert "cannot change while a driver rollout is in progress" in log, log
    assert driver_daemonset(api).metadata.generation == generation, "Helm changed the driver DaemonSet"
    assert get_cr(api)["spec"]["driver"]["payload"]["version"] == NEW and upgrade_status(api).get("upgrading")

    # Stopped the seed's way, the rollout rolls back in waves; the same `helm rollback` then goes
    # through and changes no driver.
    kubectl(
        cluster.cp,
        "patch",
        "clusteroperators.gpu.metax-tech.com",
        "cluster-operator",
        "--type=json",
        "-p",
        json.dumps([{"op": "replace", "path": "/spec/driver/upgradePolicy/enableRollout", "value": False}]),
    )
    rolled_back_in_waves(api, watch, before)
    ok(cluster.helm(which, "rollback", release, "1", "-n", NS))
    consistently(lambda: revisions(api) == before, for_seconds(10), 30, "the driver pods left at the old revision")
    assert get_cr(api)["spec"]["driver"]["payload"]["version"] == OLD
    assert payload_image(driver_daemonset(api)).endswith(f":{OLD}")
    quiet(api, watch, MAX_PARALLEL)


def test_rollout_undo_mid_rollout(tools_cluster, tools_api, clean_slate, tmp_path):
    cluster, api = tools_cluster, tools_api
    _, before, watch = installed(cluster, api, tmp_path, "helm3")
    seed_patch_version(cluster, NEW)
    eventually(lambda: paused_after_the_first_step(api), 120, "the rollout paused after its first step")
    abandoned = upgrade_status(api)["status"]["upgradingPodSpecRevision"]

    # The admin's command from docs/rollout-admin.md, run where an admin runs it: their
    # machine, with the cluster's kubeconfig.
    said = run(METAX, "rollout", "undo", "--kubeconfig", str(cluster.cp.kubeconfig))
    assert said.strip() == "clusteroperator/cluster-operator: spec.driver.upgradePolicy.enableRollout set to false", said
    rolled_back_in_waves(api, watch, before)
    status = upgrade_status(api)
    terminating = next(c for c in status["condition"] if c["type"] == "Terminating")
    assert (terminating["status"], terminating["reason"]) == ("False", "RolledBack"), terminating
    assert status["resume"]["abandonedRevision"] == abandoned
    quiet(api, watch, MAX_PARALLEL)


@pytest.fixture
def deleted_nodes(tools_cluster, tools_api):
    """`kubectl delete node` for a test; the nodes are made again after it, as the cluster made them."""
    core, gone = client.CoreV1Api(tools_api), []

    def delete(name: str) -> None:
        gone.append(core.read_node(name))
        kubectl(tools_cluster.cp, "delete", "node", name)

    yield delete
    for node in gone:
        labels, gpus = node.metadata.labels, int(node.metadata.annotations[GPUS_ANNOTATION])
        core.create_node(node_manifest(node.metadata.name, gpus, {ARCH_LABEL: labels[ARCH_LABEL]}, None))
    tools_cluster.cp.wait_nodes_ready(time.monotonic() + 60, [n.metadata.name for n in gone])


def test_a_gpu_node_deleted_mid_wave(tools_cluster, tools_api, clean_slate, deleted_nodes, tmp_path):
    cluster, api = tools_cluster, tools_api
    _, _, watch = installed(cluster, api, tmp_path, "helm4")
    seed_patch_version(cluster, NEW)
    eventually(lambda: paused_after_the_first_step(api), 120, "the rollout paused after its first step")
    seed_patch(cluster.cp, "pause", False)

    # The node whose driver pod the wave has just deleted goes away: the slot it held
    # (maxParallel 1) must come free, not wait for a pod that will never be Ready.
    def swapping() -> str | None:
        wave = ((upgrade_status(api).get("resume") or {}).get("wave")) or []
        return next((n for n in wave if n in watch.down()), None)

    node = eventually(swapping, 60, "a node of the wave with its driver pod deleted", interval=0.05)
    deleted_nodes(node)
    done = eventually(
        lambda: (s := upgrade_status(api)).get("phase") == "Idling" and s["status"].get("currentStepState") == "Completed" and s,
        180,
        "the rollout Completed on the other nodes",
    )
    assert done["status"]["totalUpgradeReplicas"] == done["status"]["totalUpgradeReadyReplicas"] == GPU_NODES - 1
    conditions = {c["type"]: c["status"] for c in done["condition"]}
    assert conditions["Succeed"] == "True" and conditions["Failed"] == "False", conditions
    assert not (done["resume"].get("failedNodes") or {}).get("names"), done["resume"]
    # The node's last pod stays until pod GC deletes it, tens of seconds later; the rest are new.
    left = [p for p in driver_pods(api) if p.spec.node_name != node]
    assert [p.metadata.labels["controller-revision-hash"] for p in left] == [done["status"]["upgradingPodSpecRevision"]] * 3
    quiet(api, watch, MAX_PARALLEL)


def rollout_marks(api) -> dict[str, list[str]]:
    """Per node, what the rollout and the release put there: the runner's labels
    (`metax-tech.com/driver-upgrade.*`, the state labels included), the GPU label, a metax taint,
    the cordon's taint."""
    found = {}
    for node in client.CoreV1Api(api).list_node().items:
        keys = [k for k in node.metadata.labels if k.startswith(ROLLOUT_NODE_KEY_PREFIX) or k == GPU_LABEL]
        keys += [t.key for t in node.spec.taints or [] if t.key.startswith(NODE_LABEL_PREFIX) or t.key == CORDON_TAINT]
        if keys:
            found[node.metadata.name] = keys
    return found


@pytest.mark.parametrize("which", ["helm3", "helm4"])
def test_helm_uninstall_mid_wave(tools_cluster, tools_api, clean_slate, tmp_path, which):
    cluster, api = tools_cluster, tools_api
    release, _, watch = installed(cluster, api, tmp_path, which)
    seed_patch_version(cluster, NEW)
    eventually(lambda: paused_after_the_first_step(api), 120, "the rollout paused after its first step")

    # The wave's new driver pod never turns Ready: its node stays cordoned and down, and the
    # uninstall comes in the middle of the wave.
    fault = cluster.cp.pods_never_ready(sorted(gpu_nodes(api)))
    try:
        seed_patch(cluster.cp, "pause", False)
        eventually(lambda: watch.down() and cordoned(api), 60, "a wave node cordoned, its driver down")
        pods = PodWatch(api, NS)
        ok(cluster.helm(which, "uninstall", release, "-n", NS, "--wait", "--timeout", "3m"))
    finally:
        fault.clear()
    eventually(lambda: [p for p in pods.hook("cleanup") if terminated(p)], 30, "the cleanup hook's pod seen ended")
    pods.stop()
    for pod in pods.hook("cleanup"):
        assert_ran_as_tools_pod(pod, cluster)
    quiet(api, watch, MAX_PARALLEL)
    try:
        eventually(lambda: not rollout_marks(api), 60, "no rollout mark left on a node")
    except AssertionError:
        raise AssertionError(f"left on the nodes after helm uninstall --wait: {rollout_marks(api)}") from None
