"""Administrators' everyday actions in the middle of a staged rollout, on the user's path (the
chart from the local OCI registry, every hook and the runner as containers of the tools image on
the real node, the driver pods on kwok GPU nodes), each watched by `DriverDownWatch`: never more
GPU nodes without a working driver at once than the policy's `maxParallel`, and no node left
cordoned once the fleet is quiet.

The rollout: one node, then the runner's pause (an empty `pauseDuration`), then the rest, one at a
time (`maxParallel: 1`).
"""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from tests.e2e.disruption import DriverDownWatch, down_now
from tests.e2e.tools import kubectl
from tests.e2e.userpath import GPU_NODES, NS, driver_pods, get_cr, ok, release_name, seed_install, upgrade_status
from tests.waiting import consistently, eventually, for_seconds

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("real-node")]

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


def revisions(api) -> list[str]:
    return sorted(p.metadata.labels["controller-revision-hash"] for p in driver_pods(api))


def paused_after_the_first_step(api) -> bool:
    status = upgrade_status(api)
    policy = (get_cr(api) or {})["spec"]["driver"]["upgradePolicy"]
    step = status.get("status") or {}
    return bool(
        status.get("upgrading")
        and policy.get("pause")
        and step.get("currentStepIndex") == 0
        and step.get("currentStepState") == "StepPaused"
    )


def cordoned(api) -> list[str]:
    return [n.metadata.name for n in client.CoreV1Api(api).list_node().items if n.spec.unschedulable]


@pytest.mark.parametrize("which", ["helm3", "helm4"])
def test_enable_rollout_false_through_the_values_mid_rollout_rolls_back_in_waves(
    tools_cluster, tools_api, clean_slate, tmp_path, which
):
    """The seed's forced rollback (`enableRollout: false`), made the way a values file in Git
    makes it: `helm upgrade --reuse-values --set driver.upgradePolicy.enableRollout=false`."""
    cluster, api = tools_cluster, tools_api
    values = cluster.user_values(tmp_path, runner={"interval": 1}, driver={"upgradePolicy": POLICY})
    release = release_name(ok(seed_install(cluster, which, values)))
    eventually(lambda: len(driver_pods(api)) == GPU_NODES, 120, "a driver pod on every GPU node")
    before = revisions(api)
    assert len(set(before)) == 1

    watch = DriverDownWatch(api, NS)
    upgrade = ("upgrade", release, cluster.chart, "-n", NS, "--reuse-values", "--timeout", "5m")
    ok(cluster.helm(which, *upgrade, "--set", f"driver.payload.version={NEW}"))
    eventually(lambda: paused_after_the_first_step(api), 120, "the rollout paused after its first step")
    assert len(set(revisions(api))) == 2, "one node at the new revision, the others at the old"

    ok(cluster.helm(which, *upgrade, "--set", "driver.upgradePolicy.enableRollout=false"))
    eventually(
        lambda: upgrade_status(api).get("phase") == "Disabled" and revisions(api) == before and not watch.down(),
        180,
        "every driver pod back at the old revision and Ready",
    )
    watch.stop()
    assert watch.most_down <= MAX_PARALLEL, f"{watch.most_down} GPU nodes without a driver at once: {sorted(watch.worst)}"
    assert client.AppsV1Api(api).read_namespaced_daemon_set("metax-driver", NS).spec.update_strategy.type == "OnDelete"
    eventually(lambda: not cordoned(api), 60, "no node left cordoned")


def driver_daemonset(api) -> client.V1DaemonSet:
    return client.AppsV1Api(api).read_namespaced_daemon_set("metax-driver", NS)


def payload_image(ds: client.V1DaemonSet) -> str:
    return next(c.image for c in ds.spec.template.spec.init_containers if c.name == "payload")


@pytest.mark.parametrize("which", ["helm3", "helm4"])
def test_a_routine_upgrade_after_the_seeds_kubectl_patch_of_the_version_changes_no_driver(
    tools_cluster, tools_api, clean_slate, tmp_path, which
):
    """Seed 001 step 8 starts the rollout with `kubectl patch` of the CR's version; the values keep
    the old one. A later `helm upgrade` for an unrelated reason must leave the driver alone: no
    template change (Helm 3 wrote the values' version back), no field conflict (Helm 4)."""
    cluster, api = tools_cluster, tools_api
    policy = {**POLICY, "upgradeSteps": [{"replicas": 1, "pauseDuration": 0}, {"replicas": "100%", "pauseDuration": 0}]}
    values = cluster.user_values(tmp_path, runner={"interval": 1}, driver={"upgradePolicy": policy})
    release = release_name(ok(seed_install(cluster, which, values)))
    eventually(lambda: len(driver_pods(api)) == GPU_NODES, 120, "a driver pod on every GPU node")
    before = set(revisions(api))
    kubectl(
        cluster.cp,
        "patch",
        "clusteroperators.gpu.metax-tech.com",
        "cluster-operator",
        "--type=json",
        "-p",
        json.dumps([{"op": "replace", "path": "/spec/driver/payload/version", "value": NEW}]),
    )
    eventually(
        lambda: (
            (s := upgrade_status(api)).get("phase") == "Idling"
            and (s.get("status") or {}).get("currentStepState") == "Completed"
            and not set(revisions(api)) & before
            and not down_now(api, NS)
        ),
        180,
        "the kubectl-started rollout Completed",
    )
    ds = driver_daemonset(api)
    assert payload_image(ds).endswith(f":{NEW}")

    watch = DriverDownWatch(api, NS)
    ok(cluster.helm(which, "upgrade", release, cluster.chart, "-n", NS, "--reuse-values", "--set", "runner.interval=2"))
    consistently(
        lambda: driver_daemonset(api).metadata.generation == ds.metadata.generation,
        for_seconds(15),
        30,
        "the driver's template unchanged after the upgrade",
    )
    watch.stop()
    assert payload_image(driver_daemonset(api)) == payload_image(ds)
    assert watch.most_down == 0, f"driver pods went down: {sorted(watch.worst)}"


@pytest.mark.parametrize("which", ["helm3", "helm4"])
def test_helm_rollback_mid_rollout_is_refused_before_anything_changes(tools_cluster, tools_api, clean_slate, tmp_path, which):
    """`helm rollback RELEASE 1` while the upgrade's rollout waits after its first step: release
    1's values change the driver's version, which the freeze forbids during a rollout. The
    pre-rollback check asks the API server first, so the rollback fails before Helm touches a
    DaemonSet. Stopped the seed's way (`enableRollout: false`), the rollout rolls back in waves,
    and the same `helm rollback` then succeeds."""
    cluster, api = tools_cluster, tools_api
    values = cluster.user_values(tmp_path, runner={"interval": 1}, driver={"upgradePolicy": POLICY})
    release = release_name(ok(seed_install(cluster, which, values)))
    eventually(lambda: len(driver_pods(api)) == GPU_NODES, 120, "a driver pod on every GPU node")
    before = revisions(api)

    watch = DriverDownWatch(api, NS)
    ok(
        cluster.helm(
            which, "upgrade", release, cluster.chart, "-n", NS, "--reuse-values", "--set", f"driver.payload.version={NEW}"
        )
    )
    eventually(lambda: paused_after_the_first_step(api), 120, "the rollout paused after its first step")
    generation = driver_daemonset(api).metadata.generation
    refused = cluster.helm(which, "rollback", release, "1", "-n", NS)
    assert refused.returncode != 0 and "bootstrap-check" in refused.stderr, refused.stderr
    log = kubectl(cluster.cp, "logs", "-n", NS, "job/metax-operator-bootstrap-check")
    assert "cannot change while a driver rollout is in progress" in log, log
    assert driver_daemonset(api).metadata.generation == generation, "Helm changed the driver DaemonSet"
    assert get_cr(api)["spec"]["driver"]["payload"]["version"] == NEW and upgrade_status(api).get("upgrading")

    kubectl(
        cluster.cp,
        "patch",
        "clusteroperators.gpu.metax-tech.com",
        "cluster-operator",
        "--type=json",
        "-p",
        json.dumps([{"op": "replace", "path": "/spec/driver/upgradePolicy/enableRollout", "value": False}]),
    )
    eventually(
        lambda: upgrade_status(api).get("phase") == "Disabled" and revisions(api) == before and not watch.down(),
        180,
        "the rollout rolled back in waves",
    )
    ok(cluster.helm(which, "rollback", release, "1", "-n", NS))
    consistently(lambda: revisions(api) == before, for_seconds(10), 30, "the driver pods left at release 1's revision")
    watch.stop()
    assert watch.most_down <= MAX_PARALLEL, f"{watch.most_down} GPU nodes without a driver at once: {sorted(watch.worst)}"
    assert get_cr(api)["spec"]["driver"]["payload"]["version"] == OLD
    assert payload_image(driver_daemonset(api)).endswith(f":{OLD}")
    eventually(lambda: not cordoned(api), 60, "no node left cordoned")
