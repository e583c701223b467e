"""What the Argo CD and Flux scenarios (test_gitops_*.py) share. Both run on the cluster of the
user's path (tests/e2e/userpath.py: the control plane with its real node and local OCI registry,
the tools image of this working tree and the chart pushed there), with the values a user would
give: the seed's registry and driver version, the tools pods' scheduling on the real node, and a
staged rollout policy. Then what they observe and do alike: the CR, the driver's revisions, the
runner's log, the admin's seed commands, what a deletion must leave, and the story both tell of
a sync in the middle of a rollout an admin started with `kubectl patch` (`sync_mid_rollout`).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable

import pytest
from kubernetes import client, watch

from tests.controlplane import GPU_LABEL
from tests.e2e.conftest import remove_leftovers
from tests.e2e.disruption import DriverDownWatch, quiet
from tests.e2e.test_rollout_cluster import deletions_per_step
from tests.e2e.tools import get_cr, kubectl, ready, seed_patch
from tests.e2e.userpath import (
    GPU_NODES,
    NS,
    ON_TOOLS_NODE,
    POLICY,
    PodWatch,
    assert_ran_as_tools_pod,
    driver_daemonset,
    driver_pods,
    paused_after_the_first_step,
    payload_image,
    seed_patch_version,
    terminated,
)
from tests.waiting import consistently, eventually, for_seconds

# Pods the runner deletes per pass in each step of POLICY on the cluster's 4 GPU nodes.
POLICY_WAVES = {0: [1], 1: [2, 1]}
# The policy of the sync-mid-rollout story, set in Git: one node, the runner's pause (an empty
# pauseDuration) for the admin to answer, then the rest one node at a time.
MAX_PARALLEL = 1
PAUSING_POLICY = {
    **POLICY,
    "maxParallel": MAX_PARALLEL,
    "upgradeSteps": [{"replicas": 1, "pauseDuration": {}}, {"replicas": "100%", "pauseDuration": 0}],
}
KUBECTL_VERSION = "2.34.0.1"  # the admin's `kubectl patch` of the CR: no commit to Git names it
OURS = "app.kubernetes.io/part-of=metax-operator"
HOOKS = ("preflight", "upgrade-crds", "bootstrap")


# A driver pool of its own version beside the driver's: its DaemonSet is synced and its fields the
# runner writes are left alone as the driver's are. It selects no node, so the story's nodes,
# pods and revisions stay the driver's own.
POOL = {"name": "spare-rack", "nodeSelector": {"example.com/rack": "spare"}, "payload": {"version": "2.32.0.6"}}
POOL_DAEMONSET = "metax-driver-pool-spare-rack"


def pool_driver(api) -> tuple[int, str]:
    """The pool's DaemonSet: its generation and payload image."""
    ds = client.AppsV1Api(api).read_namespaced_daemon_set(POOL_DAEMONSET, NS)
    return ds.metadata.generation, payload_image(ds)


def assert_pool_installed(api) -> None:
    """The pool is in the CR as in the values, its DaemonSet at its own version."""
    assert get_cr(api)["spec"]["driver"]["pools"] == [POOL]
    assert pool_driver(api)[1].endswith(f":{POOL['payload']['version']}")


def user_values(cluster, values: dict) -> dict:
    """The docs' values with the cluster's registry for DOMAIN/PROJECT, plus what the user adds
    here: the tools pods on the real node, a 1 s runner interval, the staged policy and a pool."""
    return {
        **values,
        "registry": cluster.registry,
        "hooks": {**values.get("hooks", {}), **ON_TOOLS_NODE},
        "runner": {**ON_TOOLS_NODE, "interval": 1},
        "driver": {**values["driver"], "upgradePolicy": POLICY, "pools": [POOL]},
    }


@pytest.fixture(scope="module")
def pods(tools_api):
    """The release namespace's pods as last seen (hook pods go with their Jobs)."""
    watcher = PodWatch(tools_api, NS)
    yield watcher
    watcher.stop()


@contextlib.contextmanager
def release_scope(cluster, api):
    """Around a module's release: nothing of it before, and nothing left after it for the
    session's other tests (the namespace and the CRD, which a GitOps deletion keeps, too)."""
    remove_leftovers(cluster, api)
    try:
        yield
    finally:
        remove_leftovers(cluster, api)


def assert_hooks_ran_on_the_real_node(pods, cluster, hooks: tuple[str, ...] = HOOKS) -> None:
    """Each of `hooks` ran, as a container of the tools image on the real node, and succeeded.
    The pod watch may lag behind the tool that saw the hook finish (Flux's deletion ends as soon
    as the Job completed): wait until it has seen the pods end."""

    def ended(hook: str) -> list | None:
        seen = pods.hook(hook)
        return seen if seen and all(map(terminated, seen)) else None

    for hook in hooks:
        for pod in eventually(lambda hook=hook: ended(hook), 60, f"the pods of the {hook} hook seen ended"):
            assert_ran_as_tools_pod(pod, cluster)


def step_status(api) -> dict:
    return ((get_cr(api).get("status") or {}).get("upgradeStatus") or {}).get("status") or {}


def reconciled(api) -> bool:
    return any(
        c["type"] == "Reconciled" and c["status"] == "True" for c in (get_cr(api).get("status") or {}).get("conditions") or []
    )


def driver_revisions(api) -> set[str]:
    return {
        r.metadata.name
        for r in client.AppsV1Api(api)
        .list_namespaced_controller_revision(NS, label_selector="app.kubernetes.io/component=driver")
        .items
    }


def generations(api) -> dict[str, int]:
    """metadata.generation of every DaemonSet and Deployment: it moves with each spec change."""
    apps = client.AppsV1Api(api)
    return {f"DaemonSet/{d.metadata.name}": d.metadata.generation for d in apps.list_namespaced_daemon_set(NS).items} | {
        f"Deployment/{d.metadata.name}": d.metadata.generation for d in apps.list_namespaced_deployment(NS).items
    }


def runtime_edit(cp, interval: int) -> None:
    """An admin's `kubectl patch` of the CR, which the runner applies to metax-gpu-device."""
    kubectl(
        cp,
        "patch",
        "clusteroperators.gpu.metax-tech.com",
        "cluster-operator",
        "--type=merge",
        "-p",
        json.dumps({"spec": {"gpuDevice": {"healthyInterval": interval}}}),
    )


def runner_applied(api, interval: int) -> bool:
    """metax-gpu-device has the CR's healthyInterval, applied by the runner."""
    ds = client.AppsV1Api(api).read_namespaced_daemon_set("metax-gpu-device", NS)
    env = {e.name: e.value for c in ds.spec.template.spec.containers for e in c.env or []}
    return env.get("HEALTHY_INTERVAL") == str(interval) and any(
        m.manager == "metax-operator-runner" for m in ds.metadata.managed_fields
    )


class RunnerLog:
    """The in-cluster runner's JSON log lines (`kubectl logs`), read as tests/e2e/
    test_rollout_cluster's `deletions_per_step` reads a runner's."""

    def __init__(self, cp):
        text = kubectl(cp, "logs", "-n", NS, "deployment/metax-operator-runner")
        self.entries = [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    def lines(self, action: str) -> list[dict]:
        return [e for e in self.entries if e.get("action") == action]


def assert_one_staged_rollout(cp, api, revisions_before: set[str], pool_before: tuple[int, str]) -> None:
    """Once the rollout is Completed: exactly one new driver revision, rolled out by the runner
    with POLICY's waves; the pool's DaemonSet (`pool_before`, from `pool_driver`) untouched at its
    own version."""
    eventually(
        lambda: (
            step_status(api).get("currentStepState") == "Completed"
            and step_status(api).get("upgradingPodSpecRevision") not in revisions_before
        ),
        180,
        "the rollout of the new revision Completed",
    )
    assert len(driver_revisions(api) - revisions_before) == 1, sorted(driver_revisions(api))
    log = RunnerLog(cp)
    passes = [
        {k: e.get(k) for k in ("ts", "rollout", "step", "state", "deleted", "message")}
        for e in log.lines("rollout-pass")
        if e.get("deleted") or e.get("rollout") == "driver"
    ]
    assert deletions_per_step([log]) == POLICY_WAVES, passes
    assert pool_driver(api) == pool_before


def left_behind(cp, api) -> list[str]:
    """What of the release is still there after an uninstall, besides the CRD and namespace
    that are kept on purpose: anything in the namespace, our cluster-scoped objects, the CR,
    the GPU label on nodes."""
    kept = {"configmap/kube-root-ca.crt", "serviceaccount/default"}  # every namespace's own
    left = [
        name
        for name in kubectl(cp, "get", "all,configmaps,serviceaccounts,roles,rolebindings,leases", "-n", NS, "-o", "name").split()
        if name not in kept
    ]
    left += kubectl(cp, "get", "clusterroles,clusterrolebindings", "-l", OURS, "-o", "name").split()
    if get_cr(api) is not None:
        left.append("clusteroperator/cluster-operator")
    left += [f"node/{n.metadata.name} label {GPU_LABEL}" for n in client.CoreV1Api(api).list_node(label_selector=GPU_LABEL).items]
    return sorted(set(left))


class StatusWatch:
    """What `extract(object)` gives for every change of one custom object (an Application, a
    HelmRelease), from a watch, until `stop()`."""

    def __init__(self, api, resource: tuple[str, str, str, str], name: str, extract):
        self.seen: list = []
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, args=(api, resource, name, extract), daemon=True)
        self._thread.start()

    def _run(self, api, resource, name, extract) -> None:
        objects = client.CustomObjectsApi(api)
        try:
            for event in self._watch.stream(
                objects.list_namespaced_custom_object, *resource, field_selector=f"metadata.name={name}", timeout_seconds=1800
            ):
                self.seen.append(extract(event["object"]))
        except Exception:  # noqa: BLE001 - the control plane stopping ends the watch
            pass

    def stop(self) -> list:
        """What was seen, consecutive repeats collapsed."""
        self._watch.stop()
        self._thread.join(5)
        return [v for i, v in enumerate(self.seen) if i == 0 or self.seen[i - 1] != v]


def steady_pods(api) -> dict[str, str]:
    """name -> uid of the release namespace's pods but the Jobs' (the hooks'): a restart of any
    component, driver or runner pod shows as a new uid."""
    return {
        p.metadata.name: p.metadata.uid
        for p in client.CoreV1Api(api).list_namespaced_pod(NS).items
        if not any(o.kind == "Job" for o in p.metadata.owner_references or [])
    }


def paused_state(api) -> dict:
    """What a sync during the runner's pause must leave as it is."""
    driver = driver_daemonset(api)
    return {
        "driver": (driver.metadata.generation, payload_image(driver)),
        "generations": generations(api),
        "pods": steady_pods(api),
        "paused after the first step": paused_after_the_first_step(api),
    }


def completed_at(api, version: str) -> bool:
    """The rollout Completed, every GPU node's driver pod at `version` and Ready."""
    pods = driver_pods(api)
    return (
        step_status(api).get("currentStepState") == "Completed"
        and len(pods) == GPU_NODES
        and all(c.image.endswith(f":{version}") for p in pods for c in p.spec.init_containers if c.name == "payload")
        and all(ready(p) for p in pods)
    )


def sync_mid_rollout(cluster, api, commit: Callable[[dict], None], sync: Callable[[], None], status: Callable[[], StatusWatch]):
    """The GitOps tool's sync in the middle of a staged rollout started by the admin's `kubectl
    patch` of the CR's version, Git still naming the old one, all of it under DriverDownWatch.
    `commit(values)` commits values to Git and returns once the tool applied them; `sync()` is the
    tool's sync (or reconcile) and returns once it ended; `status()` starts a watch of the tool's
    object, run from just before the sync to the rollout's end: what it saw is returned."""
    down = DriverDownWatch(api, NS)
    commit({"driver": {"upgradePolicy": PAUSING_POLICY}})
    cr = get_cr(api)["spec"]["driver"]
    assert (cr["upgradePolicy"]["maxParallel"], cr["upgradePolicy"]["upgradeSteps"]) == (
        MAX_PARALLEL,
        PAUSING_POLICY["upgradeSteps"],
    ), cr["upgradePolicy"]
    git_version = cr["payload"]["version"]

    seed_patch_version(cluster, KUBECTL_VERSION)
    eventually(lambda: paused_after_the_first_step(api), 120, "the rollout paused after its first step")
    before = paused_state(api)
    assert before["driver"][1].endswith(f":{KUBECTL_VERSION}"), before["driver"]

    seen = status()
    sync()

    def unchanged() -> bool:
        now = paused_state(api)
        assert now == before, f"the sync changed { ({k: (before[k], v) for k, v in now.items() if before[k] != v}) }"
        return True

    consistently(unchanged, for_seconds(10), 30, "the paused rollout untouched by the sync")
    assert get_cr(api)["spec"]["driver"]["payload"]["version"] == KUBECTL_VERSION

    seed_patch(cluster.cp, "pause", False)  # the admin's answer to the runner's pause
    eventually(lambda: completed_at(api, KUBECTL_VERSION), 180, f"the rollout completed at {KUBECTL_VERSION}")
    assert payload_image(driver_daemonset(api)).endswith(f":{KUBECTL_VERSION}")
    assert get_cr(api)["spec"]["driver"]["payload"]["version"] == KUBECTL_VERSION != git_version
    quiet(api, down, MAX_PARALLEL)
    return seen.stop()
