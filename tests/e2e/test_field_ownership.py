"""One writer per field after a runtime edit of the CR, on the user's path (the chart from the
local OCI registry without the post-renderer, every hook and the runner as containers of the
tools image on the real node), under Helm 3 and Helm 4.

The administrator edits gpu-device's `podTemplateSpec` and log level in the CR (seed §3.2.8), and
the runner writes them to the DaemonSet. Then:
- a routine `helm upgrade` of the same chart to a new driver version succeeds, leaves gpu-device's
  pod template as the CR has it (before: Helm 3 wrote the values' copy back and the runner the
  CR's again, two new pod generations; Helm 4 failed on a field conflict with the runner), and
  the driver rolls out in waves within `maxParallel`;
- a values change of a field the runner writes (`gpuDevice.healthyInterval`) reaches the pods
  once, through the bootstrap hook and the runner, and the runtime edit stays.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from kubernetes import client, watch

from tests.controlplane import GPU_LABEL
from tests.e2e.disruption import DriverDownWatch, down_now, quiet
from tests.e2e.tools import kubectl, ready
from tests.e2e.userpath import (
    GPU_NODES,
    NS,
    driver_daemonset,
    driver_pods,
    ok,
    payload_image,
    release_name,
    rollout_completed,
    seed_install,
)
from tests.waiting import eventually

pytestmark = pytest.mark.xdist_group("real-node-2")  # a cluster of its own: conftest.py

MAX_PARALLEL = 1
POLICY = {"enableRollout": True, "maxParallel": MAX_PARALLEL, "upgradeSteps": [{"replicas": "100%", "pauseDuration": 0}]}
NEW = "2.33.0.1"
MAINTENANCE = {"key": "example.com/maintenance", "operator": "Exists", "effect": "NoSchedule"}
RUNTIME_EDIT = json.dumps(
    {"spec": {"gpuDevice": {"podTemplateSpec": {"spec": {"tolerations": [MAINTENANCE]}}, "log": {"level": "debug"}}}}
)


def gpu_device(api) -> client.V1DaemonSet:
    return client.AppsV1Api(api).read_namespaced_daemon_set("metax-gpu-device", NS)


def rolled_out(ds: client.V1DaemonSet) -> bool:
    s = ds.status
    return (
        s.observed_generation == ds.metadata.generation
        and s.desired_number_scheduled == s.updated_number_scheduled == s.number_ready
    )


def env(ds: client.V1DaemonSet) -> dict[str, str]:
    return {e.name: e.value for e in ds.spec.template.spec.containers[0].env if e.value_from is None}


def edited(ds: client.V1DaemonSet) -> bool:
    tolerations = [t.to_dict() for t in ds.spec.template.spec.tolerations or []]
    carries = any({k: t.get(k) for k in MAINTENANCE} == MAINTENANCE for t in tolerations)
    return carries and env(ds).get("LOG_LEVEL") == "debug"


@pytest.mark.parametrize("which", ["helm3", "helm4"])
def test_routine_helm_upgrades_after_a_runtime_edit_of_the_cr(tools_cluster, tools_api, clean_slate, tmp_path, which):
    cluster, api = tools_cluster, tools_api
    values = cluster.user_values(tmp_path, runner={"interval": 1}, driver={"upgradePolicy": POLICY})
    release = release_name(ok(seed_install(cluster, which, values)))
    eventually(lambda: len(driver_pods(api)) == GPU_NODES and not down_now(api, NS), 120, "a driver pod on every GPU node")
    watch = DriverDownWatch(api, NS)

    kubectl(cluster.cp, "patch", "clusteroperators.gpu.metax-tech.com", "cluster-operator", "--type=merge", "-p", RUNTIME_EDIT)
    eventually(lambda: edited(gpu_device(api)) and rolled_out(gpu_device(api)), 120, "the runtime edit on gpu-device's pods")
    generation = gpu_device(api).metadata.generation

    upgrade = ("upgrade", release, cluster.chart, "-n", NS, "--reuse-values", "--wait", "--timeout", "5m")
    ok(cluster.helm(which, *upgrade, "--set", f"driver.payload.version={NEW}"))
    eventually(lambda: rollout_completed(api), 240, "the staged rollout to the new driver completed")
    assert payload_image(driver_daemonset(api)).endswith(f":{NEW}")
    ds = gpu_device(api)
    assert edited(ds) and ds.metadata.generation == generation, (generation, ds.metadata.generation, ds.spec.template.spec)

    ok(cluster.helm(which, *upgrade, "--set", "gpuDevice.healthyInterval=7"))
    eventually(lambda: env(gpu_device(api)).get("HEALTHY_INTERVAL") == "7", 120, "the values' change on gpu-device")
    ds = gpu_device(api)
    assert edited(ds) and ds.metadata.generation == generation + 1, (generation, ds.metadata.generation)
    quiet(api, watch, MAX_PARALLEL)


def memory_limit(ds: client.V1DaemonSet) -> str:
    return ds.spec.template.spec.containers[0].resources.limits["memory"]


def gpu_device_selector(api) -> str:
    return ",".join(f"{k}={v}" for k, v in gpu_device(api).spec.selector.match_labels.items())


def pods_created_since(api, version: str) -> dict[str | None, int]:
    """The gpu-device pods created after resourceVersion `version`, counted by the node they were
    bound to (None: never bound). The API server replays the changes since then; a version it no
    longer has fails the watch."""
    created, node = set(), {}
    changes = watch.Watch().stream(
        client.CoreV1Api(api).list_namespaced_pod,
        NS,
        label_selector=gpu_device_selector(api),
        resource_version=version,
        timeout_seconds=3,
    )
    for change in changes:
        pod = change["object"]
        if change["type"] == "ADDED":
            created.add(pod.metadata.uid)
        node[pod.metadata.uid] = pod.spec.node_name or node.get(pod.metadata.uid)
    return dict(Counter(node[uid] for uid in created))


@pytest.mark.parametrize("which", ["helm3", "helm4"])
def test_helm_rollback_replaces_component_pods_once(tools_cluster, tools_api, clean_slate, tmp_path, which):
    """`helm rollback` to a revision whose upgrade changed a field the runner writes
    (`gpuDevice.log.level`): the stored manifest holds the value from before that change, Helm
    writes it, and the runner then writes the revision's. The rollback also changes a field only
    Helm writes (gpu-device's memory limit), so a runner writing the CR as it was before the
    post-rollback bootstrap would make a template of its own. The pre-rollback hook sets
    gpu-device to OnDelete and holds the runner until that bootstrap, so the pods are replaced
    once, straight to the final template."""
    cluster, api = tools_cluster, tools_api
    values = cluster.user_values(tmp_path, runner={"interval": 1})
    release = release_name(ok(seed_install(cluster, which, values)))
    upgrade = ("upgrade", release, cluster.chart, "-n", NS, "--reuse-values", "--wait", "--timeout", "5m")
    ok(cluster.helm(which, *upgrade, "--set", "gpuDevice.log.level=debug"))
    eventually(lambda: env(gpu_device(api)).get("LOG_LEVEL") == "debug" and rolled_out(gpu_device(api)), 120, "debug logs")
    revision_2 = env(gpu_device(api)), memory_limit(gpu_device(api))
    ok(cluster.helm(which, *upgrade, "--set", "gpuDevice.healthyInterval=7", "--set", "gpuDevice.resources.limits.memory=300Mi"))
    eventually(lambda: env(gpu_device(api)).get("HEALTHY_INTERVAL") == "7" and rolled_out(gpu_device(api)), 120, "interval 7")
    assert memory_limit(gpu_device(api)) == "300Mi" != revision_2[1]
    strategy = gpu_device(api).spec.update_strategy.to_dict()
    assert strategy["type"] == "RollingUpdate" and strategy["rolling_update"]["max_unavailable"] == "10%", strategy
    before = client.CoreV1Api(api).list_namespaced_pod(NS).metadata.resource_version

    # Helm 4 applies server-side: the runner owns LOG_LEVEL, which the stored manifest holds at
    # its older value, so the rollback needs --force-conflicts (docs/rollout-admin.md).
    ok(cluster.helm(which, "rollback", release, "2", "-n", NS, "--wait", *(["--force-conflicts"] if which == "helm4" else [])))
    eventually(
        lambda: (env(gpu_device(api)), memory_limit(gpu_device(api))) == revision_2 and rolled_out(gpu_device(api)),
        180,
        "gpu-device back at revision 2's fields",
    )
    assert gpu_device(api).spec.update_strategy.to_dict() == strategy, "the runner put the rolling update back"
    created = pods_created_since(api, before)
    pods = client.CoreV1Api(api).list_namespaced_pod(NS, label_selector=gpu_device_selector(api)).items
    nodes = {p.spec.node_name for p in pods}
    assert created and set(created) == nodes and set(created.values()) == {1}, created


POOL = {"name": "rack-a", "nodeSelector": {"example.com/rack": "a"}}


def payload(pod) -> str:
    return next(c.image for c in pod.spec.init_containers if c.name == "payload")


def pool_pods(api) -> list:
    return [p for p in driver_pods(api) if p.metadata.owner_references[0].name == "metax-driver-pool-rack-a"]


@pytest.mark.parametrize("which", ["helm3", "helm4"])
def test_a_driver_pools_version_set_by_helm_upgrade_beside_the_runners_writes(
    tools_cluster, tools_api, clean_slate, tmp_path, which
):
    """A driver pool of one GPU node beside the driver's own DaemonSet: the runner moves the node
    into it and writes the pool DaemonSet's fields from the CR, as it does the driver's. A routine
    `helm upgrade` of the pool's version then succeeds under Helm 3 and Helm 4 (no field
    conflict with the runner), rolls the pool out, and leaves the driver's own nodes alone."""
    cluster, api = tools_cluster, tools_api
    core = client.CoreV1Api(api)
    gpu = sorted(n.metadata.name for n in core.list_node(label_selector=f"{GPU_LABEL}=true").items)
    rack_a = gpu[0]
    core.patch_node(rack_a, {"metadata": {"labels": {"example.com/rack": "a"}}})
    try:
        values = cluster.user_values(tmp_path, runner={"interval": 1}, driver={"upgradePolicy": POLICY, "pools": [POOL]})
        release = release_name(ok(seed_install(cluster, which, values)))
        in_pool = lambda: [p.spec.node_name for p in pool_pods(api) if ready(p)] == [rack_a]  # noqa: E731
        eventually(lambda: in_pool() and len(driver_pods(api)) == GPU_NODES, 120, f"{rack_a} in the pool")
        others = {p.metadata.uid for p in driver_pods(api) if p.spec.node_name != rack_a}

        pools = json.dumps([{**POOL, "payload": {"version": NEW}}])
        upgrade = ("upgrade", release, cluster.chart, "-n", NS, "--reuse-values", "--wait", "--timeout", "5m")
        ok(cluster.helm(which, *upgrade, "--set-json", f"driver.pools={pools}"))
        pool_ds = client.AppsV1Api(api).read_namespaced_daemon_set
        eventually(
            lambda: (
                payload_image(pool_ds("metax-driver-pool-rack-a", NS)).endswith(f":{NEW}")
                and in_pool()
                and all(p.spec.init_containers[-1].image.endswith(f":{NEW}") for p in pool_pods(api))
            ),
            240,
            "the pool's driver at the new version",
        )
        assert payload_image(driver_daemonset(api)).endswith(":2.32.0.6")
        assert {p.metadata.uid for p in driver_pods(api) if p.spec.node_name != rack_a} == others
    finally:
        core.patch_node(rack_a, {"metadata": {"labels": {"example.com/rack": None, "metax-tech.com/driver-upgrade.pool": None}}})
