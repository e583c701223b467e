"""Administrators' everyday actions in the middle of a staged rollout, on the user's path (the
chart from the local OCI registry, every hook and the runner as containers of the tools image on
the real node, the driver pods on kwok GPU nodes), under Helm 3 and Helm 4, the whole of it
watched by `DriverDownWatch`: never more GPU nodes without a working driver at once than the
policy's `maxParallel`, and no node left cordoned once the fleet is quiet.

The rollout: one node, then the runner's pause (an empty `pauseDuration`), then the rest, one at a
time (`maxParallel: 1`). Two installs per Helm version, each walking actions in turn, each
action checked where it ends. Before the fixes they check, each failed: a routine `helm upgrade`
during a rollout started by the seed's `kubectl patch` of the version (Helm 3 wrote the values'
version back, Helm 4 failed on a field conflict), `helm upgrade --set
driver.upgradePolicy.enableRollout=false` during it (every driver pod replaced at once, twice),
and `helm rollback` during a rollout started through the values (the DaemonSets rolled back,
then the post-rollback hook refused).
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


def driver_daemonset(api) -> client.V1DaemonSet:
    return client.AppsV1Api(api).read_namespaced_daemon_set("metax-driver", NS)


def payload_image(ds: client.V1DaemonSet) -> str:
    return next(c.image for c in ds.spec.template.spec.init_containers if c.name == "payload")


def seed_patch_version(cluster, version: str) -> None:
    """Seed 001 step 8: the version changed in the CR with kubectl."""
    patch = [{"op": "replace", "path": "/spec/driver/payload/version", "value": version}]
    kubectl(
        cluster.cp, "patch", "clusteroperators.gpu.metax-tech.com", "cluster-operator", "--type=json", "-p", json.dumps(patch)
    )


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


def quiet(api, watch: DriverDownWatch) -> None:
    watch.stop()
    assert watch.most_down <= MAX_PARALLEL, f"{watch.most_down} GPU nodes without a driver at once: {sorted(watch.worst)}"
    eventually(lambda: not cordoned(api), 60, "no node left cordoned")


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
    quiet(api, watch)


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
    assert refused.returncode != 0 and "bootstrap-check" in refused.stderr, refused.stderr
    log = kubectl(cluster.cp, "logs", "-n", NS, "job/metax-operator-bootstrap-check")
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
    quiet(api, watch)
