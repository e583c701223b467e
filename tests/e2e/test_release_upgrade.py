"""An upgrade from the previous release to this working tree, as a site makes it, and the
rollback to it (what `ct install --upgrade` does, with the real hooks, runner and images), the
upgrade and rollback run by Helm 3 and by Helm 4 (sites move to Helm 4 between releases; the
install is the previous release's Helm 3 command, as the site typed it then).

The previous release is the newest one CHANGELOG.md records a commit for, made again from that
commit (tests/e2e/previous_release.py: its chart, and its tools image by its own image build).
Its site installs it with the seed's command from its registry, the tools image pinned by digest,
and waits until it has settled; the administrator then edits the CR at run time (`kubectl patch`
of `driver.upgradePolicy.maxParallel` and `maxUnavailable`, fields the values do not change, which
the bootstrap hook keeps across upgrades: docs/hooks.md), cordons a GPU node (out of service: the
`maxUnavailable: 1` they set lets the waves go on beside it), and rolls a new driver version
out with the seed's `kubectl patch` of `/spec/driver/payload/version` (not a `helm upgrade --set`
of the previous chart: the seed's command leaves the version in the CR alone, out of the values,
the harder case for the new release, whose bootstrap hook must keep it and whose runner must
carry on from the status the previous runner wrote). That rollout completes in stages under the
previous release's runner. `helm upgrade` to this tree's chart, pinned to this tree's image as
the site pins it, with the same flags and values file (not `--reuse-values`, which would render
the new chart with the old chart's defaults).

The driver's pod template changes in that upgrade, for the reasons the test asserts: the tools
image of its `wait-for` init container (every component has one) is the new release's, as in every
upgrade between releases (the tag is the release version; here the digest, both being 0.10.0);
and, from a release before the payload contract, the contract's copier init container and the
checked copy of the payload container.
So the driver pods are replaced, and what is asserted is that they were replaced by the staged
rollout with the admin's policy: one node without a ready driver at a time (the admin's 25% of
4 nodes; the values' 50% would allow two), the admin's cordon left in place, from the site's
revision (the previous status read as it is: no pod of any other revision created, so neither
a rollout of the version again nor a rollback of it), the driver still at the site's version.
The rollout is started by whichever runner sees the new template first, the old one or the new
one, and the other carries on from the CR's status: the watch of the driver pods sees both.

`helm rollback` to the previous release is not refused (docs/rollout-admin.md refuses it only
while a rollout is in flight and the release rolled back to names other driver settings): it
runs the previous release's hooks and runner again, keeps the CRD (Helm never downgrades a CRD,
and the previous release's upgrade-crds hook runs before install and upgrade only), and the
driver goes back to the site's template (the site's version, the previous tools image) in the
same stages.
"""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from kubernetes import client, watch

from metax_operator.chart import admission, schema
from metax_operator.contract import DRIVER_PAYLOAD_CONTAINER, PAYLOAD_COPIER_CONTAINER, PAYLOAD_IMAGE_ENV
from tests.controlplane import GPU_LABEL, REPO
from tests.e2e import previous_release
from tests.e2e.tools import DRIVER_PODS, kubectl, ready, seed_patch
from tests.e2e.userpath import (
    CRD,
    GPU_NODES,
    NS,
    POLICY,
    PodWatch,
    driver_pods,
    get_cr,
    ok,
    release_name,
    runner_pod,
    seed_install,
    terminated,
    upgrade_status,
)
from tests.realnode import NODE_NAME
from tests.waiting import eventually

pytestmark = pytest.mark.xdist_group("real-node")

ADMIN_MAX_PARALLEL = "25%"  # the admin's run-time edit: one GPU node of 4 per wave
ADMIN_MAX_UNAVAILABLE = 1  # and the node they cordon, out of service beside the waves
SITE_VERSION = "2.33.0.9"  # the driver version the site rolls out under the previous release
#: The seed's command that starts a rollout of a new driver version (docs/rollout-admin.md).
SITE_ROLLOUT = [{"op": "replace", "path": "/spec/driver/payload/version", "value": SITE_VERSION}]
RUNNER_CORDON = "metax-tech.com/driver-upgrade.cordoned"  # the label of the runner's own cordons
UPGRADE_HOOKS = ("preflight", "upgrade-crds", "bootstrap")


@pytest.fixture(scope="module")
def previous(tools_cluster, tmp_path_factory) -> previous_release.Release:
    return previous_release.publish(tools_cluster, tmp_path_factory.mktemp("previous-release"))


@pytest.fixture
def admin_cordons(tools_cluster):
    """The nodes the test cordons as the administrator; uncordoned after it."""
    nodes: list[str] = []
    yield nodes
    for node in nodes:
        kubectl(tools_cluster.cp, "uncordon", node)


class DriverOutages:
    """From a watch of the driver pods started before the action: the GPU nodes whose driver pod
    went away, in order, the most nodes at once without a Ready driver pod (a node is out from
    its pod's deletion until a pod there is Ready; watch events come in the API server's order),
    and the revisions of the pods created since."""

    def __init__(self, api):
        core = client.CoreV1Api(api)
        start = core.list_namespaced_pod(NS, label_selector=DRIVER_PODS)
        self.deleted: list[str] = []
        self.most = 0
        self.created: set[str] = set()
        self._gone: set[str] = set()
        self._out: set[str] = set()
        self._watch = watch.Watch()
        threading.Thread(target=self._follow, args=(core, start.metadata.resource_version), daemon=True).start()

    def _follow(self, core, version: str) -> None:
        try:
            for change in self._watch.stream(
                core.list_namespaced_pod, NS, label_selector=DRIVER_PODS, resource_version=version, timeout_seconds=1800
            ):
                pod = change["object"]
                if change["type"] == "ADDED":
                    self.created.add(pod.metadata.labels["controller-revision-hash"])
                if pod.metadata.deletion_timestamp or change["type"] == "DELETED":
                    if pod.metadata.uid not in self._gone:
                        self._gone.add(pod.metadata.uid)
                        self.deleted.append(pod.spec.node_name)
                        self._out.add(pod.spec.node_name)
                elif ready(pod):
                    self._out.discard(pod.spec.node_name)
                self.most = max(self.most, len(self._out))
        except Exception:  # noqa: BLE001 - the control plane stopping ends the watch
            pass

    def stop(self) -> None:
        self._watch.stop()


def ran_hooks(pods: PodWatch, hooks, digest: str, count: int = 1) -> None:
    """Each hook ran `count` pods of the tools image `digest` on the real node, every one exit 0."""
    for hook in hooks:
        runs = lambda hook=hook: [  # noqa: E731
            p for p in pods.hook(hook) if terminated(p) and p.status.container_statuses[0].image_id.endswith(digest)
        ]
        eventually(lambda runs=runs: len(runs()) == count, 60, f"{count} {hook} hook pod(s) of {digest} seen ended")
        for pod in runs():
            assert pod.spec.node_name == NODE_NAME, f"{pod.metadata.name} ran on {pod.spec.node_name}"
            assert terminated(pod).exit_code == 0, f"{pod.metadata.name} ended {terminated(pod)}"


def ready_runner(api, digest: str, other_than: str | None = None) -> client.V1Pod | None:
    """The one runner pod, Ready, running the tools image `digest` (and not pod `other_than`)."""
    pod = runner_pod(api)
    if pod is None or pod.metadata.uid == other_than or not ready(pod):
        return None
    return pod if pod.status.container_statuses[0].image_id.endswith(digest) else None


def settled(api) -> bool:
    """Every DaemonSet's controller caught up, and each of its pods current and Ready."""
    return all(
        (s := ds.status).observed_generation == ds.metadata.generation
        and s.desired_number_scheduled == s.number_ready == (s.updated_number_scheduled or 0)
        for ds in client.AppsV1Api(api).list_namespaced_daemon_set(NS).items
    )


def reconciled(api) -> bool:
    found = ((get_cr(api) or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Reconciled" and c["status"] == "True" for c in found)


def rolled_out(api, revision: str) -> dict | None:
    """The CR's upgradeStatus once the rollout to driver revision `revision` Completed."""
    s = upgrade_status(api)
    step = s.get("status") or {}
    done = s.get("phase") == "Idling" and not s.get("upgrading") and step.get("currentStepState") == "Completed"
    return s if done and step.get("upgradingPodSpecRevision") == revision else None


def driver_revision(cp) -> str:
    """The driver DaemonSet's current revision: the hash its controller labels new pods with."""
    revisions = json.loads(kubectl(cp, "get", "controllerrevisions", "-n", NS, "-l", DRIVER_PODS, "-o", "json"))["items"]
    return max(revisions, key=lambda r: r["revision"])["metadata"]["labels"]["controller-revision-hash"]


def driver_template(cp) -> dict:
    return json.loads(kubectl(cp, "get", "daemonset", "metax-driver", "-n", NS, "-o", "json"))["spec"]["template"]


def payload_image(template: dict) -> str:
    """The image of the driver payload's init container: its tag is the driver version."""
    return next(c["image"] for c in template["spec"]["initContainers"] if c["name"] == "payload")


def without_tools_image(template: dict) -> dict:
    """The pod template less its `wait-for` init container's image (the tools image) and what the
    payload contract brought (the copier init container and its volume; the payload container's
    command, its image's reference in PAYLOAD_IMAGE, its termination message and the copier's
    mount): the same of a release with the contract and of one before it."""
    template = json.loads(json.dumps(template))
    spec = template["spec"]
    spec["initContainers"] = [c for c in spec["initContainers"] if c["name"] != PAYLOAD_COPIER_CONTAINER]
    spec["volumes"] = [v for v in spec.get("volumes", []) if v["name"] != PAYLOAD_COPIER_CONTAINER]
    for container in spec["initContainers"]:
        if container["name"] == "wait-for":
            container.pop("image")
        if container["name"] == DRIVER_PAYLOAD_CONTAINER:
            for key in ("command", "args", "terminationMessagePolicy"):
                container.pop(key, None)
            env = [e for e in container.pop("env", []) if e["name"] != PAYLOAD_IMAGE_ENV]
            if env:
                container["env"] = env
            container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != PAYLOAD_COPIER_CONTAINER]
    return template


def release_crd(api, tree: Path) -> dict:
    """The CRD the chart in `tree` serves on this API server: its crds/ one, or where the API server
    admits it the whole one in files/ that its upgrade-crds hook applies (a release without files/
    has only the first)."""
    minor = int("".join(c for c in client.VersionApi(api).get_code().minor if c.isdigit()))
    portable = yaml.safe_load((tree / schema.CRD_FILE).read_text())
    full = tree / schema.FULL_CRD_FILE
    return admission.for_server(portable, yaml.safe_load(full.read_text()) if full.exists() else portable, minor)


def served_crd(cp) -> dict:
    return json.loads(kubectl(cp, "get", "crd", CRD, "-o", "json"))


def assert_staged(outages: DriverOutages, api, revision: str) -> None:
    """The rollout to `revision` completed node by node: every GPU node's driver replaced once,
    never two nodes without a Ready driver at once, no pod of another revision created or left."""
    eventually(lambda: rolled_out(api, revision), 180, f"the staged rollout to driver revision {revision} Completed")
    outages.stop()
    assert sorted(outages.deleted) == sorted(set(outages.deleted)) and len(outages.deleted) == GPU_NODES, outages.deleted
    assert outages.most == 1, f"{outages.most} GPU nodes were without a Ready driver at once"
    assert outages.created == {revision}, f"driver pods of revisions {outages.created} created, not only {revision}"
    pods = driver_pods(api)
    assert sorted(p.metadata.labels["controller-revision-hash"] for p in pods) == [revision] * GPU_NODES


def assert_admin_state_kept(api, cordoned: str) -> None:
    """The admin's run-time edits of the CR and their cordon, and no cordon of the runner left."""
    driver = get_cr(api)["spec"]["driver"]
    assert driver["upgradePolicy"]["maxParallel"] == ADMIN_MAX_PARALLEL, driver["upgradePolicy"]
    assert driver["upgradePolicy"]["maxUnavailable"] == ADMIN_MAX_UNAVAILABLE, driver["upgradePolicy"]
    assert driver["payload"]["version"] == SITE_VERSION, driver["payload"]
    nodes = client.CoreV1Api(api).list_node(label_selector=f"{GPU_LABEL}=true").items
    assert {n.metadata.name for n in nodes if n.spec.unschedulable} == {cordoned}
    assert not [n.metadata.name for n in nodes if RUNNER_CORDON in (n.metadata.labels or {})]


@pytest.mark.parametrize("which", ["helm3", "helm4"])
def test_upgrade_from_the_previous_release_and_roll_back(
    tools_cluster, tools_api, clean_slate, previous, admin_cordons, tmp_path, which
):
    cluster, api = tools_cluster, tools_api
    values = cluster.user_values(tmp_path, runner={"interval": 1}, driver={"upgradePolicy": POLICY})
    seed_flags = ["--set", f"registry={cluster.registry}", "--set", "driver.payload.version=2.32.0.6", "-f", str(values)]
    pods = PodWatch(api, NS)

    # The previous release, installed by its site with the seed's command, and settled.
    pinned = ["--set", f"tools.image.digest={previous.digest}"]
    release = release_name(ok(seed_install(replace(cluster, chart=previous.chart), "helm3", values, *pinned)))
    ran_hooks(pods, UPGRADE_HOOKS, previous.digest)
    old_runner = eventually(lambda: ready_runner(api, previous.digest), 90, "the previous release's runner Ready")
    eventually(lambda: reconciled(api), 60, "the previous runner's Reconciled condition on the CR")
    eventually(lambda: settled(api), 120, "the previous release's DaemonSets rolled out")
    assert served_crd(cluster.cp)["spec"]["versions"] == release_crd(api, previous.tree)["spec"]["versions"]
    new_crd = release_crd(api, REPO)

    # The administrator's run-time state.
    seed_patch(cluster.cp, "maxParallel", ADMIN_MAX_PARALLEL)
    seed_patch(cluster.cp, "maxUnavailable", ADMIN_MAX_UNAVAILABLE)
    cordoned = sorted(p.spec.node_name for p in driver_pods(api))[0]
    kubectl(cluster.cp, "cordon", cordoned)
    admin_cordons.append(cordoned)

    # The site rolls a new driver version out under the previous release, with the seed's command;
    # the site's revision is the one the upgrade starts from and the rollback returns to.
    installed = driver_revision(cluster.cp)
    outages = DriverOutages(api)
    kubectl(cluster.cp, "patch", "ClusterOperator/cluster-operator", "--type", "json", "--patch", json.dumps(SITE_ROLLOUT))
    old_revision = eventually(lambda: (r := driver_revision(cluster.cp)) != installed and r, 60, "the new version's revision")
    assert_staged(outages, api, old_revision)
    assert upgrade_status(api)["status"]["lastPodSpecRevision"] == installed
    assert_admin_state_kept(api, cordoned)
    old_template = driver_template(cluster.cp)
    assert payload_image(old_template).endswith(f":{SITE_VERSION}"), payload_image(old_template)
    outages = DriverOutages(api)

    # helm upgrade to this tree's chart, as the site upgrades: its hooks run this tree's image.
    upgrade = ["upgrade", release, cluster.chart, "-n", NS, *seed_flags, "--set", f"tools.image.digest={cluster.digest}"]
    ok(cluster.helm(which, *upgrade, "--wait", "--timeout", "5m"))
    ran_hooks(pods, UPGRADE_HOOKS, cluster.digest)
    assert served_crd(cluster.cp)["spec"]["versions"] == new_crd["spec"]["versions"], "the CRD is not this tree's"
    eventually(lambda: ready_runner(api, cluster.digest, other_than=old_runner.metadata.uid), 90, "this tree's runner Ready")
    new_template = driver_template(cluster.cp)
    assert without_tools_image(new_template) == without_tools_image(old_template), "more than the tools image changed"
    new_revision = driver_revision(cluster.cp)
    assert new_revision != old_revision
    assert_staged(outages, api, new_revision)
    # Carried on from the previous runner's status: from the site's revision, not the installed one,
    # and a rollback of it would write the site's version back.
    done = upgrade_status(api)
    assert done["status"]["lastPodSpecRevision"] == old_revision, done["status"]
    assert json.loads(done["lastCoDriverSpec"])["payload"]["version"] == SITE_VERSION, done["lastCoDriverSpec"]
    assert_admin_state_kept(api, cordoned)
    report = ok(cluster.helm(which, "test", release, "-n", NS, "--logs", "--timeout", "3m"))
    assert "test: the install is healthy" in report
    test_pod = client.CoreV1Api(api).read_namespaced_pod("metax-operator-test", NS)
    assert test_pod.status.container_statuses[0].image_id.endswith(cluster.digest)

    # helm rollback to the previous release: its hooks and runner again, this tree's CRD kept.
    outages = DriverOutages(api)
    ok(cluster.helm(which, "rollback", release, "1", "-n", NS, "--wait", "--timeout", "5m"))
    ran_hooks(pods, ("bootstrap",), previous.digest, count=2)
    eventually(lambda: ready_runner(api, previous.digest, other_than=old_runner.metadata.uid), 90, "the previous runner Ready")
    assert served_crd(cluster.cp)["spec"]["versions"] == new_crd["spec"]["versions"]
    assert driver_template(cluster.cp) == old_template
    assert_staged(outages, api, old_revision)
    assert_admin_state_kept(api, cordoned)
    history = json.loads(ok(cluster.helm(which, "history", release, "-n", NS, "-o", "json")))
    assert [(h["revision"], h["status"]) for h in history] == [(1, "superseded"), (2, "superseded"), (3, "deployed")]
    pods.stop()
