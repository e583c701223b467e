"""Argo CD installs, keeps, upgrades and deletes the chart on the local control plane, from the
Application in docs/gitops.md (read from the docs, so they cannot drift).

Argo CD v3.2.6 (application-controller, repo-server, Redis) runs as local processes against the
session's control plane (tests/gitops.py). The chart comes from a Helm repository on loopback
(`helm package` of this checkout) in place of the docs' OCI registry; the values are the seed's
(registry, driver version) plus its 10-node staged rollout policy (examples/rollout-10-nodes.yaml).

Until the control plane has a node that runs containers, the pods of the tools image (the hook
Jobs' and the runner's) are run by `ToolsPods` as local processes with their pod's arguments,
ConfigMaps and ServiceAccount token; everything else is real: Argo CD's rendering, sync waves,
health, pruning and PostDelete hooks, the Job and DaemonSet controllers, kwok's pods of the MetaX
images.
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
from tests.gitops import APPLICATIONS, ArgoCD, GitOpsError, snippet, summary, synced_healthy

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("gitops")]

APP = "metax-operator"
RECONCILIATION = 30  # seconds: how often Argo CD compares the Application with its source
QUIET_WINDOW = 150  # seconds the installed application is watched while nothing changes in Git


# -- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def argocd(control_plane, tmp_path_factory):
    try:
        argo = ArgoCD.start(control_plane, tmp_path_factory.mktemp("argocd"), reconciliation=f"{RECONCILIATION}s")
    except GitOpsError as error:
        pytest.fail(f"Argo CD: {error}", pytrace=False)
    yield argo
    argo.stop()


def application(chart: dict) -> dict:
    """The docs' Application with the local chart source and the test's values."""
    app = yaml.safe_load(snippet("argocd-application"))
    helm = app["spec"]["source"]["helm"]
    app["spec"]["source"] = {"repoURL": chart["url"], "chart": "metax-operator", "targetRevision": chart["version"],
                             "helm": helm}
    values = helm["valuesObject"]
    values["registry"] = "cr.example.com/metax"  # the docs' DOMAIN/PROJECT
    values["driver"]["upgradePolicy"] = POLICY
    return app


@pytest.fixture(scope="module")
def installed(control_plane, api, argocd, chart, tools_pods):
    """The docs' Application applied, Synced and Healthy; deleted at the end if a test did not."""
    with release_scope(api):
        started = time.monotonic()
        argocd.apply([application(chart)])
        argocd.wait_application(APP, synced_healthy, 300, "Synced and Healthy after the install")
        yield {"install_seconds": time.monotonic() - started, "version": chart["version"]}
        if argocd.application(APP) is not None:
            kubectl(control_plane, "delete", "application", "-n", "argocd", APP, "--wait=false")
            eventually(lambda: argocd.application(APP) is None, 180, "the Application deleted")


# -- helpers -----------------------------------------------------------------------------------

def jobs(api) -> dict[str, client.V1Job]:
    return {j.metadata.name: j for j in client.BatchV1Api(api).list_namespaced_job(NS).items}


def patch_values(api, values: dict) -> None:
    """A commit to the Application's values in Git, as Argo CD sees it."""
    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        *APPLICATIONS, APP, {"spec": {"source": {"helm": {"valuesObject": values}}}})


def history(argocd) -> list:
    return (argocd.application(APP).get("status") or {}).get("history") or []


def sync_state(app: dict) -> tuple[str | None, str | None]:
    """The sync status and when the last sync operation started (a self-heal sync of a few
    resources starts an operation without adding to the history)."""
    status = app.get("status") or {}
    return (status.get("sync") or {}).get("status"), (status.get("operationState") or {}).get("startedAt")


def watch_sync(api) -> StatusWatch:
    return StatusWatch(api, APPLICATIONS, APP, sync_state)


def reconciles(argocd) -> float:
    return sum(v for k, v in argocd.metrics().items() if k.startswith("argocd_app_reconcile_count"))


# -- the scenario, in order --------------------------------------------------------------------

def test_install_runs_the_hooks_in_sync_waves_before_everything_else(api, argocd, installed):
    found = jobs(api)
    by_hook = {name.rsplit("-", 1)[0].removeprefix("metax-operator-"): job for name, job in found.items()}
    assert sorted(by_hook) == ["bootstrap", "preflight", "upgrade-crds"], sorted(found)
    assert all(job.status.succeeded == 1 for job in by_hook.values())
    # each wave starts when the one before is complete (timestamps have 1 s resolution)
    waves = [by_hook["preflight"], by_hook["upgrade-crds"], by_hook["bootstrap"]]
    for before, after in zip(waves, waves[1:]):
        assert after.metadata.creation_timestamp >= before.status.completion_time
    driver = client.AppsV1Api(api).read_namespaced_daemon_set("metax-driver", NS)
    assert driver.metadata.creation_timestamp >= by_hook["bootstrap"].status.completion_time
    cr = get_cr(api)
    assert cr["spec"]["driver"]["payload"]["version"] == "2.32.0.6"
    assert cr["spec"]["driver"]["upgradePolicy"]["upgradeSteps"] == POLICY["upgradeSteps"]
    eventually(lambda: reconciled(api), 60, "the runner to reconcile the CR")
    assert len(history(argocd)) == 1  # one sync did it all


def test_stays_synced_and_quiet_while_the_runner_applies_a_runtime_edit(control_plane, api, argocd, installed):
    """An admin's edit of the CR, applied by the runner to a DaemonSet, is not drift for Argo CD;
    over the window Argo CD compares the application every RECONCILIATION seconds and nothing
    syncs, and nothing but the runner's one change is written to the chart's objects."""
    before = {"generations": generations(api), "revisions": driver_revisions(api), "jobs": set(jobs(api)),
              "reconciles": reconciles(argocd)}
    sync = watch_sync(api)
    runtime_edit(control_plane, 9)
    eventually(lambda: runner_applied(api, 9), 60, "the runner to apply the CR's healthyInterval to metax-gpu-device")

    window(QUIET_WINDOW)
    updates = len(sync.seen)
    seen = sync.stop()
    synced = [status for i, (status, _) in enumerate(seen) if i == 0 or seen[i - 1][0] != status]
    operations = len({started for _, started in seen if started}) - 1  # None: between two operations
    after = {"generations": generations(api), "revisions": driver_revisions(api), "jobs": set(jobs(api)),
             "reconciles": reconciles(argocd)}
    changed = {k: (v, after["generations"][k]) for k, v in before["generations"].items() if after["generations"][k] != v}
    figures = (f"window {QUIET_WINDOW} s: {after['reconciles'] - before['reconciles']:.0f} reconciles, "
               f"{updates} Application updates, {operations} sync operations, "
               f"spec changes {changed}, sync statuses {synced}; Argo CD started in {argocd.start_seconds:.1f} s, "
               f"install {installed['install_seconds']:.0f} s, RSS MB "
               f"{ {k: round(v / 2**20) for k, v in argocd.rss().items()} }")
    print(figures)
    assert synced == ["Synced"] and operations == 0, figures
    assert changed == {"DaemonSet/metax-gpu-device": (before["generations"]["DaemonSet/metax-gpu-device"],
                                                      before["generations"]["DaemonSet/metax-gpu-device"] + 1)}, figures
    assert after["revisions"] == before["revisions"] and after["jobs"] == before["jobs"], figures
    assert after["reconciles"] - before["reconciles"] >= QUIET_WINDOW // RECONCILIATION - 1, figures
    argocd.wait_application(APP, synced_healthy, 60, "Synced and Healthy after the window")


def test_a_new_driver_version_in_git_makes_one_staged_rollout_by_the_runner(control_plane, api, argocd, tools_pods,
                                                                         installed):
    before = driver_revisions(api)
    synced_before = len(history(argocd))
    sync = watch_sync(api)
    patch_values(api, {"driver": {"payload": {"version": "2.33.0.1"}}})
    argocd.wait_application(APP, lambda a: len((a.get("status") or {}).get("history") or []) > synced_before
                            and synced_healthy(a), 180, "the new values synced")
    assert get_cr(api)["spec"]["driver"]["payload"]["version"] == "2.33.0.1"

    confirm_rollout(control_plane, api)
    seen = sync.stop()
    assert_one_staged_rollout(api, tools_pods, before)
    # OutOfSync only until the new values were synced, never during the rollout: one sync operation
    synced = [status for i, (status, _) in enumerate(seen) if i == 0 or seen[i - 1][0] != status]
    assert synced in (["Synced", "OutOfSync", "Synced"], ["OutOfSync", "Synced"]), seen
    assert len({started for _, started in seen if started}) == 2, seen  # the install's operation, then this one
    argocd.wait_application(APP, synced_healthy, 60, "Synced and Healthy after the rollout")


def test_a_runtime_pause_survives_the_next_syncs(control_plane, api, argocd, installed):
    seed_patch(control_plane, "pause", True)
    try:
        # a sync with nothing new (as `argocd app sync` starts it)
        synced_before = len(history(argocd))
        client.CustomObjectsApi(api).patch_namespaced_custom_object(*APPLICATIONS, APP, {"operation": {
            "initiatedBy": {"username": "admin"}, "sync": {"revision": installed["version"], "prune": True}}})
        argocd.wait_application(APP, lambda a: len((a.get("status") or {}).get("history") or []) > synced_before
                                and synced_healthy(a), 120, "the manual sync")
        assert get_cr(api)["spec"]["driver"]["upgradePolicy"]["pause"] is True
        # a values change that runs the bootstrap Job again (new inputs, new Job)
        bootstraps = {n for n in jobs(api) if n.startswith("metax-operator-bootstrap-")}
        patch_values(api, {"gpuDevice": {"healthyInterval": 11}})
        argocd.wait_application(APP, lambda a: synced_healthy(a) and {
            n for n in jobs(api) if n.startswith("metax-operator-bootstrap-")} - bootstraps, 180,
            "the new values synced by a new bootstrap Job")
        cr = get_cr(api)
        assert cr["spec"]["gpuDevice"]["healthyInterval"] == 11
        assert cr["spec"]["driver"]["upgradePolicy"]["pause"] is True
    finally:
        seed_patch(control_plane, "pause", False)


def test_deleting_the_application_cleans_up_as_helm_uninstall_does(control_plane, api, argocd, tools_pods, installed):
    kubectl(control_plane, "delete", "application", "-n", "argocd", APP, "--wait=false")
    try:
        eventually(lambda: argocd.application(APP) is None, 180, "the Application deleted")
    except AssertionError:
        raise AssertionError(f"Application not deleted: {summary(argocd.application(APP))}; "
                             f"logs in {argocd.workdir / 'logs'}") from None
    assert left_behind(control_plane, api) == []
    assert kubectl(control_plane, "get", "crd", "clusteroperators.gpu.metax-tech.com", "-o", "name")  # crds.keep
    eventually(lambda: not tools_pods.running, 30, "the runner stopped with its pod")
