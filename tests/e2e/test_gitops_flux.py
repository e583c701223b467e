"""Flux installs, keeps, upgrades and deletes the chart on the local control plane, from the
HelmRepository and HelmRelease in docs/gitops.md (read from the docs, so they cannot drift).

Flux's source-controller and helm-controller run as local processes against the session's
control plane (tests/gitops.py), from the binaries METAX_SOURCE_CONTROLLER_BIN and
METAX_HELM_CONTROLLER_BIN with the CRDs in METAX_FLUX_CRDS; helm-controller is not on the Go
module proxy, so `make setup` cannot build it, and without them the tests are skipped, saying so
(docs/gitops.md: how they were built and run, and what was seen). The chart comes from a Helm
repository on loopback in place of the docs' OCI registry; the values are the seed's plus its
10-node staged policy. Until the control plane has a node that runs containers, the tools
image's pods (the Helm hook Jobs, the runner) run as local processes (`ToolsPods`).
"""
from __future__ import annotations

import time

import pytest
import yaml
from kubernetes import client

from tests.e2e.gitops_scenario import (NS, POLICY, StatusWatch, api, assert_one_staged_rollout, chart,  # noqa: F401
                                       confirm_rollout, driver_revisions, generations, get_cr, left_behind,
                                       reconciled, release_scope, runner_applied, runtime_edit, seed_patch,
                                       tools_pods, window)
from tests.e2e.tools import eventually, kubectl
from tests.gitops import FLUX_NAMESPACE, HELMRELEASES, Flux, GitOpsError, apply, flux_unavailable, snippet

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("gitops")]

RELEASE = "metax-operator"
INTERVAL = 30  # seconds between the HelmRelease's reconciliations (the docs say 10m)
QUIET_WINDOW = 150  # seconds the installed release is watched while nothing changes in Git
HELMRELEASE = (*HELMRELEASES, FLUX_NAMESPACE, "helmreleases")


# -- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="session", autouse=True)  # session: decided before the control plane starts
def flux_binaries():
    """Skip this module's tests, saying why, where the Flux controllers were not given."""
    reason = flux_unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def flux(control_plane, tmp_path_factory):
    try:
        controllers = Flux.start(control_plane, tmp_path_factory.mktemp("flux"))
    except GitOpsError as error:
        pytest.fail(f"Flux: {error}", pytrace=False)
    yield controllers
    controllers.stop()


def manifests(chart: dict) -> list[dict]:
    """The docs' HelmRepository and HelmRelease with the local chart source and the test's values."""
    repository, release = yaml.safe_load_all(snippet("flux-helmrelease"))
    repository["spec"] = {"url": chart["url"], "interval": repository["spec"]["interval"]}  # an HTTP repository
    release["spec"]["chart"]["spec"]["version"] = chart["version"]
    release["spec"]["interval"] = f"{INTERVAL}s"
    release["spec"]["values"]["registry"] = "cr.example.com/metax"  # the docs' DOMAIN/PROJECT
    release["spec"]["values"]["driver"]["upgradePolicy"] = POLICY
    return [repository, release]


def helm_release(api) -> dict:
    return client.CustomObjectsApi(api).get_namespaced_custom_object(*HELMRELEASE, RELEASE)


def ready(release: dict) -> str | None:
    """The HelmRelease's Ready condition, as `status reason`."""
    condition = next((c for c in (release.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), None)
    return f"{condition['status']} {condition['reason']}" if condition else None


def is_ready(api, generation: int = 0) -> bool:
    release = helm_release(api)
    return (ready(release) or "").startswith("True") and \
        (release.get("status") or {}).get("observedGeneration", 0) >= max(generation, release["metadata"]["generation"])


def revisions(api) -> list[int]:
    """The Helm release's revisions (its storage Secrets)."""
    secrets = client.CoreV1Api(api).list_namespaced_secret(NS, label_selector=f"owner=helm,name={RELEASE}").items
    return sorted(int(s.metadata.labels["version"]) for s in secrets)


def patch_values(api, values: dict) -> None:
    """A commit to the HelmRelease's values in Git, as Flux sees it."""
    client.CustomObjectsApi(api).patch_namespaced_custom_object(*HELMRELEASE, RELEASE, {"spec": {"values": values}})


def reconcile_now(api) -> str:
    """What `flux reconcile helmrelease` does: request a reconciliation; returns the token."""
    token = str(time.time())
    client.CustomObjectsApi(api).patch_namespaced_custom_object(*HELMRELEASE, RELEASE, {
        "metadata": {"annotations": {"reconcile.fluxcd.io/requestedAt": token}}})
    return token


def watch_ready(api) -> StatusWatch:
    return StatusWatch(api, HELMRELEASE, RELEASE, ready)


@pytest.fixture(scope="module")
def installed(control_plane, api, flux, chart, tools_pods):
    """The docs' HelmRelease applied and Ready; deleted at the end if a test did not."""
    with release_scope(api):
        started = time.monotonic()
        apply(control_plane, manifests(chart))
        try:
            eventually(lambda: is_ready(api), 300, "the HelmRelease Ready after the install")
        except AssertionError:
            raise AssertionError(f"HelmRelease not Ready: {(helm_release(api).get('status') or {}).get('conditions')}; "
                                 f"logs in {flux.workdir / 'logs'}") from None
        yield {"install_seconds": time.monotonic() - started}
        kubectl(control_plane, "delete", "helmrelease", "-n", FLUX_NAMESPACE, RELEASE, "--ignore-not-found",
                "--wait=false")
        eventually(lambda: not kubectl(control_plane, "get", "helmrelease", "-n", FLUX_NAMESPACE, "-o", "name"), 180,
                   "the HelmRelease deleted")
        kubectl(control_plane, "delete", "helmrepository", "-n", FLUX_NAMESPACE, "metax", "--ignore-not-found")


# -- the scenario, in order --------------------------------------------------------------------

def test_install_runs_the_helm_hooks_and_the_release_is_ready(api, tools_pods, installed):
    assert revisions(api) == [1]
    for hook in ("preflight", "upgrade-crds", "bootstrap"):
        assert tools_pods.finished_as(f"metax-operator-{hook}-") == [0], hook
    cr = get_cr(api)
    assert cr["spec"]["driver"]["payload"]["version"] == "2.32.0.6"
    assert cr["spec"]["driver"]["upgradePolicy"]["upgradeSteps"] == POLICY["upgradeSteps"]
    eventually(lambda: reconciled(api), 60, "the runner to reconcile the CR")


def test_stays_ready_and_quiet_while_the_runner_applies_a_runtime_edit(control_plane, api, flux, installed):
    """An admin's edit of the CR, applied by the runner, is not drift for Flux (its paths are
    ignored); over the window the HelmRelease is reconciled every INTERVAL seconds, with drift
    detection, and nothing upgrades."""
    before = {"generations": generations(api), "revisions": driver_revisions(api), "release": revisions(api),
              "reconciles": flux.reconciles(RELEASE)}
    readiness = watch_ready(api)
    runtime_edit(control_plane, 9)
    eventually(lambda: runner_applied(api, 9), 60, "the runner to apply the CR's healthyInterval to metax-gpu-device")
    window(QUIET_WINDOW)
    seen = readiness.stop()
    after = {"generations": generations(api), "revisions": driver_revisions(api), "release": revisions(api),
             "reconciles": flux.reconciles(RELEASE)}
    changed = {k: (v, after["generations"][k]) for k, v in before["generations"].items() if after["generations"][k] != v}
    figures = (f"window {QUIET_WINDOW} s: {after['reconciles'] - before['reconciles']} reconciles, Ready {seen}, "
               f"release revisions {after['release']}, spec changes {changed}; Flux started in "
               f"{flux.start_seconds:.1f} s, install {installed['install_seconds']:.0f} s, RSS MB "
               f"{ {k: round(v / 2**20) for k, v in flux.rss().items()} }")
    print(figures)
    assert all(s.startswith("True") for s in seen), figures
    assert after["release"] == before["release"], figures
    gpu_device = before["generations"]["DaemonSet/metax-gpu-device"]
    assert changed == {"DaemonSet/metax-gpu-device": (gpu_device, gpu_device + 1)}, figures
    assert after["revisions"] == before["revisions"], figures
    assert after["reconciles"] - before["reconciles"] >= QUIET_WINDOW // INTERVAL - 1, figures


def test_a_new_driver_version_in_git_makes_one_staged_rollout_by_the_runner(control_plane, api, tools_pods,
                                                                         installed):
    before, release = driver_revisions(api), revisions(api)
    readiness = watch_ready(api)
    patch_values(api, {"driver": {"payload": {"version": "2.33.0.1"}}})
    eventually(lambda: revisions(api)[-1] == release[-1] + 1 and is_ready(api), 180, "the upgrade")
    assert get_cr(api)["spec"]["driver"]["payload"]["version"] == "2.33.0.1"
    confirm_rollout(control_plane, api)
    seen = readiness.stop()
    assert_one_staged_rollout(api, tools_pods, before)
    assert revisions(api)[-1] == release[-1] + 1  # one upgrade, no drift correction after it
    assert seen[-1].startswith("True"), seen


def test_a_runtime_pause_survives_the_next_reconciliations(control_plane, api, installed):
    seed_patch(control_plane, "pause", True)
    try:
        release = revisions(api)
        token = reconcile_now(api)  # nothing new: no upgrade, drift detection only
        eventually(lambda: (helm_release(api).get("status") or {}).get("lastHandledReconcileAt") == token, 60,
                   "the requested reconciliation")
        assert revisions(api) == release
        assert get_cr(api)["spec"]["driver"]["upgradePolicy"]["pause"] is True
        patch_values(api, {"gpuDevice": {"healthyInterval": 11}})  # an upgrade: the hooks run again
        eventually(lambda: revisions(api)[-1] == release[-1] + 1 and is_ready(api), 180, "the upgrade")
        cr = get_cr(api)
        assert cr["spec"]["gpuDevice"]["healthyInterval"] == 11
        assert cr["spec"]["driver"]["upgradePolicy"]["pause"] is True
    finally:
        seed_patch(control_plane, "pause", False)


def test_deleting_the_helmrelease_cleans_up_as_helm_uninstall_does(control_plane, api, tools_pods, installed):
    kubectl(control_plane, "delete", "helmrelease", "-n", FLUX_NAMESPACE, RELEASE, "--wait=false")
    eventually(lambda: not kubectl(control_plane, "get", "helmrelease", "-n", FLUX_NAMESPACE, "-o", "name"), 180,
               "the HelmRelease deleted")
    assert tools_pods.finished_as("metax-operator-cleanup-") == [0]
    assert left_behind(control_plane, api) == []
    assert revisions(api) == []
    assert kubectl(control_plane, "get", "crd", "clusteroperators.gpu.metax-tech.com", "-o", "name")  # crds.keep
    eventually(lambda: not tools_pods.running, 30, "the runner stopped with its pod")
