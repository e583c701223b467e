"""Flux installs, keeps, upgrades and deletes the chart on the local cluster, from the
HelmRepository and HelmRelease in docs/gitops.md (read from the docs, so they cannot drift).

Flux's source-controller and helm-controller run as local processes against the cluster of the
user's path (tests/gitops.py, tests/e2e/gitops_scenario.py), from the binaries
METAX_SOURCE_CONTROLLER_BIN and METAX_HELM_CONTROLLER_BIN with the CRDs in METAX_FLUX_CRDS.
helm-controller is not on the Go module proxy, so `make e2e` cannot build it; without them the
tests are skipped, saying so (docs/gitops.md: the versions, the command, what was seen). The
chart comes from the local OCI registry (its CA in the HelmRepository's certSecretRef); the Helm
hooks and the runner run as containers of the tools image on the real node.
"""

from __future__ import annotations

import base64
import time

import pytest
import yaml
from kubernetes import client

from tests.e2e.gitops_scenario import (  # noqa: F401
    NS,
    POLICY,
    StatusWatch,
    assert_hooks_ran_on_the_real_node,
    assert_one_staged_rollout,
    assert_pool_installed,
    driver_revisions,
    generations,
    left_behind,
    pods,
    pool_driver,
    reconciled,
    release_scope,
    runner_applied,
    runtime_edit,
    sync_mid_rollout,
    user_values,
)
from tests.e2e.tools import get_cr, kubectl, seed_patch
from tests.gitops import FLUX_NAMESPACE, HELMRELEASES, Flux, GitOpsError, apply, flux_unavailable, snippet
from tests.waiting import eventually

pytestmark = [pytest.mark.long_build, pytest.mark.xdist_group("real-node")]

RELEASE = "metax-operator"
INTERVAL = 30  # seconds between the HelmRelease's reconciliations (the docs say 10m)
QUIET_RECONCILES = 4  # reconciliations the installed release is watched for while nothing changes in Git
HELMRELEASE = (*HELMRELEASES, FLUX_NAMESPACE, "helmreleases")
CA_SECRET = "metax-registry-ca"


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)  # session: decided before the cluster starts
def flux_binaries():
    """Skip this module's tests, saying why, where the Flux controllers were not given."""
    reason = flux_unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def flux(tools_cluster, tmp_path_factory):
    try:
        controllers = Flux.start(tools_cluster.cp, tmp_path_factory.mktemp("flux"))
    except GitOpsError as error:
        pytest.fail(f"Flux: {error}", pytrace=False)
    yield controllers
    controllers.stop()


def manifests(cluster) -> list[dict]:
    """The docs' HelmRepository and HelmRelease, DOMAIN/PROJECT being the local registry (its CA
    in a Secret of the HelmRepository's certSecretRef), with the user's values."""
    repository, release = yaml.safe_load_all(snippet("flux-helmrelease").replace("DOMAIN/PROJECT", cluster.registry))
    repository["spec"]["certSecretRef"] = {"name": CA_SECRET}
    ca = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": CA_SECRET, "namespace": FLUX_NAMESPACE},
        "data": {"ca.crt": base64.b64encode(cluster.cp.ca.read_bytes()).decode()},
    }
    release["spec"]["interval"] = f"{INTERVAL}s"
    release["spec"]["values"] = user_values(cluster, release["spec"]["values"])
    return [ca, repository, release]


def helm_release(api) -> dict:
    return client.CustomObjectsApi(api).get_namespaced_custom_object(*HELMRELEASE, RELEASE)


def ready(release: dict) -> str | None:
    """The HelmRelease's Ready condition, as `status reason`."""
    condition = next((c for c in (release.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), None)
    return f"{condition['status']} {condition['reason']}" if condition else None


def is_ready(api) -> bool:
    release = helm_release(api)
    return (ready(release) or "").startswith("True") and (release.get("status") or {}).get("observedGeneration", 0) >= release[
        "metadata"
    ]["generation"]


def revisions(api) -> list[int]:
    """The Helm release's revisions (its storage Secrets)."""
    secrets = client.CoreV1Api(api).list_namespaced_secret(NS, label_selector=f"owner=helm,name={RELEASE}").items
    return sorted(int(s.metadata.labels["version"]) for s in secrets)


def patch_values(api, values: dict) -> None:
    """A commit to the HelmRelease's values in Git, as Flux sees it."""
    client.CustomObjectsApi(api).patch_namespaced_custom_object(*HELMRELEASE, RELEASE, {"spec": {"values": values}})


def commit(api, values: dict) -> None:
    """`values` committed to Git, and the helm upgrade they make done: one release revision more, Ready."""
    release = revisions(api)
    patch_values(api, values)
    eventually(lambda: revisions(api)[-1] == release[-1] + 1 and is_ready(api), 180, "the upgrade")


def reconcile_now(api) -> str:
    """What `flux reconcile helmrelease` does: request a reconciliation; returns the token."""
    token = str(time.time())
    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        *HELMRELEASE, RELEASE, {"metadata": {"annotations": {"reconcile.fluxcd.io/requestedAt": token}}}
    )
    return token


def watch_ready(api) -> StatusWatch:
    return StatusWatch(api, HELMRELEASE, RELEASE, ready)


def delete_helm_release(cp) -> None:
    kubectl(cp, "delete", "helmrelease", "-n", FLUX_NAMESPACE, RELEASE, "--ignore-not-found", "--wait=false")
    eventually(lambda: not kubectl(cp, "get", "helmrelease", "-n", FLUX_NAMESPACE, "-o", "name"), 180, "the HelmRelease deleted")


@pytest.fixture(scope="module")
def installed(tools_cluster, tools_api, flux, pods):
    """The docs' HelmRelease applied and Ready; deleted at the end if a test did not."""
    cp, api = tools_cluster.cp, tools_api
    with release_scope(tools_cluster, api):
        started = time.monotonic()
        apply(cp, manifests(tools_cluster))
        try:
            eventually(lambda: is_ready(api), 300, "the HelmRelease Ready after the install")
        except AssertionError:
            raise AssertionError(
                f"HelmRelease not Ready: {(helm_release(api).get('status') or {}).get('conditions')}; "
                f"logs in {flux.workdir / 'logs'}"
            ) from None
        yield {"install_seconds": time.monotonic() - started}
        delete_helm_release(cp)
        kubectl(cp, "delete", "helmrepository,secret", "-n", FLUX_NAMESPACE, "metax", CA_SECRET, "--ignore-not-found")


# -- the scenario, in order --------------------------------------------------------------------


def test_install_runs_the_helm_hooks_and_the_release_is_ready(tools_cluster, tools_api, pods, installed):
    api = tools_api
    assert revisions(api) == [1]
    assert_hooks_ran_on_the_real_node(pods, tools_cluster)
    cr = get_cr(api)
    assert cr["spec"]["driver"]["payload"]["version"] == "2.32.0.6"
    assert cr["spec"]["driver"]["upgradePolicy"]["upgradeSteps"] == POLICY["upgradeSteps"]
    eventually(lambda: reconciled(api), 60, "the runner to reconcile the CR")
    assert_pool_installed(api)


def test_stays_ready_and_quiet_while_the_runner_applies_a_runtime_edit(tools_cluster, tools_api, flux, installed):
    """An admin's edit of the CR, applied by the runner, is not drift for Flux (its paths are
    ignored); over the window the HelmRelease is reconciled every INTERVAL seconds, with drift
    detection, and nothing upgrades."""
    api = tools_api
    before = {
        "generations": generations(api),
        "revisions": driver_revisions(api),
        "release": revisions(api),
        "reconciles": flux.reconciles(RELEASE),
    }
    readiness = watch_ready(api)
    runtime_edit(tools_cluster.cp, 9)
    eventually(lambda: runner_applied(api, 9), 60, "the runner to apply the CR's healthyInterval to metax-gpu-device")
    started = time.monotonic()
    eventually(
        lambda: flux.reconciles(RELEASE) - before["reconciles"] >= QUIET_RECONCILES,
        (QUIET_RECONCILES + 2) * INTERVAL,
        f"{QUIET_RECONCILES} reconciliations by Flux",
    )
    window = time.monotonic() - started
    seen = readiness.stop()
    after = {
        "generations": generations(api),
        "revisions": driver_revisions(api),
        "release": revisions(api),
        "reconciles": flux.reconciles(RELEASE),
    }
    changed = {k: (v, after["generations"][k]) for k, v in before["generations"].items() if after["generations"][k] != v}
    figures = (
        f"window {window:.0f} s: {after['reconciles'] - before['reconciles']} reconciles, Ready {seen}, "
        f"release revisions {after['release']}, spec changes {changed}; Flux started in "
        f"{flux.start_seconds:.1f} s, install {installed['install_seconds']:.0f} s, RSS MB "
        f"{ {k: round(v / 2**20) for k, v in flux.rss().items()} }"
    )
    print(figures)
    assert all(s.startswith("True") for s in seen), figures
    assert after["release"] == before["release"], figures
    gpu_device = before["generations"]["DaemonSet/metax-gpu-device"]
    assert changed == {"DaemonSet/metax-gpu-device": (gpu_device, gpu_device + 1)}, figures
    assert after["revisions"] == before["revisions"], figures


def test_a_new_driver_version_in_git_makes_one_staged_rollout_by_the_runner(tools_cluster, tools_api, installed):
    api = tools_api
    before, release, pool_before = driver_revisions(api), revisions(api), pool_driver(api)
    readiness = watch_ready(api)
    patch_values(api, {"driver": {"payload": {"version": "2.33.0.1"}}})
    eventually(lambda: revisions(api)[-1] == release[-1] + 1 and is_ready(api), 180, "the upgrade")
    assert get_cr(api)["spec"]["driver"]["payload"]["version"] == "2.33.0.1"
    assert_one_staged_rollout(tools_cluster.cp, api, before, pool_before)
    seen = readiness.stop()
    assert revisions(api)[-1] == release[-1] + 1  # one upgrade, no drift correction after it
    assert seen[-1].startswith("True"), seen


def test_a_runtime_pause_survives_the_next_reconciliations(tools_cluster, tools_api, installed):
    api, cp = tools_api, tools_cluster.cp
    seed_patch(cp, "pause", True)
    try:
        release = revisions(api)
        token = reconcile_now(api)  # nothing new: no upgrade, drift detection only
        eventually(
            lambda: (helm_release(api).get("status") or {}).get("lastHandledReconcileAt") == token,
            60,
            "the requested reconciliation",
        )
        assert revisions(api) == release
        assert get_cr(api)["spec"]["driver"]["upgradePolicy"]["pause"] is True
        commit(api, {"gpuDevice": {"healthyInterval": 11}})  # an upgrade: the hooks run again
        cr = get_cr(api)
        assert cr["spec"]["gpuDevice"]["healthyInterval"] == 11
        assert cr["spec"]["driver"]["upgradePolicy"]["pause"] is True
    finally:
        seed_patch(cp, "pause", False)


def test_a_helm_upgrade_mid_rollout_leaves_a_kubectl_started_rollout_to_the_runner(tools_cluster, tools_api, installed):
    """The admin's `kubectl patch` of the version (Git still names the old one) starts a rollout
    that pauses after its first node; a commit unrelated to the driver (the runner's dashboard)
    then makes helm-controller run a helm upgrade, hooks and all, which changes nothing of the
    driver (its payload image is rendered from the live DaemonSet, the bootstrap keeps the CR's
    run-time version), and the rollout, resumed, completes at the CR's version, one node at a time."""
    api = tools_api
    started = time.monotonic()
    release = revisions(api)
    seen = sync_mid_rollout(
        tools_cluster,
        api,
        commit=lambda values: commit(api, values),
        sync=lambda: commit(api, {"runner": {"dashboard": {"enabled": True}}}),
        status=lambda: watch_ready(api),
    )
    print(f"helm upgrade mid-rollout: {time.monotonic() - started:.0f} s, Ready {seen}")
    assert client.CoreV1Api(api).read_namespaced_config_map("metax-operator-runner-dashboard", NS)
    assert revisions(api)[-1] == release[-1] + 2  # the policy's upgrade, then the dashboard's: no drift correction
    assert seen == ["True UpgradeSucceeded", "Unknown Progressing", "True UpgradeSucceeded"], seen


def test_deleting_the_helmrelease_cleans_up_as_helm_uninstall_does(tools_cluster, tools_api, pods, installed):
    started = time.monotonic()
    delete_helm_release(tools_cluster.cp)
    print(f"HelmRelease deleted in {time.monotonic() - started:.0f} s")
    assert_hooks_ran_on_the_real_node(pods, tools_cluster, ("cleanup",))
    assert left_behind(tools_cluster.cp, tools_api) == []
    assert revisions(tools_api) == []
    assert kubectl(tools_cluster.cp, "get", "crd", "clusteroperators.gpu.metax-tech.com", "-o", "name")  # crds.keep
