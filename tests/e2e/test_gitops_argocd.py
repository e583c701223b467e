"""Argo CD installs, keeps, upgrades and deletes the chart on the local cluster, from the
Application in docs/gitops.md (read from the docs, so they cannot drift).

Argo CD v3.2.6 (application-controller, repo-server, Redis) runs as local processes against the
cluster of the user's path (tests/gitops.py, tests/e2e/gitops_scenario.py): it pulls the chart
from the local OCI registry (`oci://127.0.0.1:PORT/metax/metax-operator`, the registry's CA in
argocd-tls-certs-cm), the hook Jobs and the runner run as containers of the tools image on the
real node, the MetaX components on kwok nodes.
"""

from __future__ import annotations

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
from tests.gitops import APPLICATIONS, ArgoCD, GitOpsError, snippet, summary, synced_healthy
from tests.waiting import eventually

pytestmark = [pytest.mark.long_build, pytest.mark.xdist_group("real-node")]

APP = "metax-operator"
RECONCILIATION = 30  # seconds: how often Argo CD compares the Application with its source
QUIET_RECONCILES = 4  # Argo CD's comparisons the installed application is watched for while nothing changes in Git


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def argocd(tools_cluster, tmp_path_factory):
    try:
        argo = ArgoCD.start(tools_cluster.cp, tmp_path_factory.mktemp("argocd"), reconciliation=f"{RECONCILIATION}s")
        argo.trust("127.0.0.1", tools_cluster.cp.ca.read_text())  # the registry's CA, by host name
    except GitOpsError as error:
        pytest.fail(f"Argo CD: {error}", pytrace=False)
    yield argo
    argo.stop()


def application(cluster) -> dict:
    """The docs' Application, DOMAIN/PROJECT being the local registry, with the user's values."""
    app = yaml.safe_load(snippet("argocd-application").replace("DOMAIN/PROJECT", cluster.registry))
    helm = app["spec"]["source"]["helm"]
    helm["valuesObject"] = user_values(cluster, helm["valuesObject"])
    return app


@pytest.fixture(scope="module")
def installed(tools_cluster, tools_api, argocd, pods):
    """The docs' Application applied, Synced and Healthy; deleted at the end if a test did not."""
    with release_scope(tools_cluster, tools_api):
        started = time.monotonic()
        argocd.apply([application(tools_cluster)])
        argocd.wait_application(APP, synced_healthy, 300, "Synced and Healthy after the install")
        yield {"install_seconds": time.monotonic() - started}
        if argocd.application(APP) is not None:
            kubectl(tools_cluster.cp, "delete", "application", "-n", "argocd", APP, "--wait=false")
            eventually(lambda: argocd.application(APP) is None, 180, "the Application deleted")


# -- helpers -----------------------------------------------------------------------------------


def jobs(api) -> dict[str, client.V1Job]:
    return {j.metadata.name: j for j in client.BatchV1Api(api).list_namespaced_job(NS).items}


def patch_values(api, values: dict) -> None:
    """A commit to the Application's values in Git, as Argo CD sees it."""
    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        *APPLICATIONS, APP, {"spec": {"source": {"helm": {"valuesObject": values}}}}
    )


def history(argocd) -> list:
    return (argocd.application(APP).get("status") or {}).get("history") or []


def bootstraps(api) -> dict[str, bool]:
    """The bootstrap Jobs, by name: whether each succeeded."""
    return {n: bool(j.status.succeeded) for n, j in jobs(api).items() if n.startswith("metax-operator-bootstrap-")}


def commit(api, argocd, values: dict) -> None:
    """`values` committed to Git (values the CR holds: the bootstrap Job runs again) and synced:
    returns once a new bootstrap Job has written them into the CR and the sync ended."""
    before = set(bootstraps(api))
    patch_values(api, values)
    argocd.wait_application(
        APP,
        lambda a: any(done for name, done in bootstraps(api).items() if name not in before) and synced_healthy(a),
        180,
        "the new values synced by a new bootstrap Job",
    )


def sync_now(api, argocd, hard_refresh: bool = False) -> None:
    """What `argocd app sync` does (after `argocd app get --hard-refresh` with `hard_refresh`: the
    chart rendered again rather than taken from the repo-server's cache); returns once the sync
    is in the history, Synced and Healthy."""
    if hard_refresh:
        client.CustomObjectsApi(api).patch_namespaced_custom_object(
            *APPLICATIONS, APP, {"metadata": {"annotations": {"argocd.argoproj.io/refresh": "hard"}}}
        )
        argocd.wait_application(
            APP,
            lambda a: "argocd.argoproj.io/refresh" not in (a["metadata"].get("annotations") or {}),
            60,
            "the hard refresh done (Argo CD removes its annotation)",
        )
    synced_before = len(history(argocd))
    revision = argocd.application(APP)["spec"]["source"]["targetRevision"]
    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        *APPLICATIONS,
        APP,
        {"operation": {"initiatedBy": {"username": "admin"}, "sync": {"revision": revision, "prune": True}}},
    )
    argocd.wait_application(
        APP,
        lambda a: len((a.get("status") or {}).get("history") or []) > synced_before and synced_healthy(a),
        120,
        "the manual sync",
    )


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


def test_install_runs_the_hooks_in_sync_waves_before_everything_else(tools_cluster, tools_api, argocd, pods, installed):
    api = tools_api
    found = jobs(api)
    by_hook = {name.rsplit("-", 1)[0].removeprefix("metax-operator-"): job for name, job in found.items()}
    assert sorted(by_hook) == ["bootstrap", "preflight", "upgrade-crds"], sorted(found)
    assert all(job.status.succeeded == 1 for job in by_hook.values())
    assert_hooks_ran_on_the_real_node(pods, tools_cluster)
    # each wave starts when the one before is complete (timestamps have 1 s resolution)
    waves = [by_hook["preflight"], by_hook["upgrade-crds"], by_hook["bootstrap"]]
    for before, after in zip(waves, waves[1:], strict=False):
        assert after.metadata.creation_timestamp >= before.status.completion_time
    driver = client.AppsV1Api(api).read_namespaced_daemon_set("metax-driver", NS)
    assert driver.metadata.creation_timestamp >= by_hook["bootstrap"].status.completion_time
    cr = get_cr(api)
    assert cr["spec"]["driver"]["payload"]["version"] == "2.32.0.6"
    assert cr["spec"]["driver"]["upgradePolicy"]["upgradeSteps"] == POLICY["upgradeSteps"]
    eventually(lambda: reconciled(api), 60, "the runner to reconcile the CR")
    assert len(history(argocd)) == 1  # one sync did it all
    assert_pool_installed(api)


def test_stays_synced_and_quiet_while_the_runner_applies_a_runtime_edit(tools_cluster, tools_api, argocd, installed):
    """An admin's edit of the CR, applied by the runner to a DaemonSet, is not drift for Argo CD;
    over the window Argo CD compares the application every RECONCILIATION seconds and nothing
    syncs, and nothing but the runner's one change is written to the chart's objects."""
    api = tools_api
    before = {
        "generations": generations(api),
        "revisions": driver_revisions(api),
        "jobs": set(jobs(api)),
        "reconciles": reconciles(argocd),
    }
    sync = watch_sync(api)
    runtime_edit(tools_cluster.cp, 9)
    eventually(lambda: runner_applied(api, 9), 60, "the runner to apply the CR's healthyInterval to metax-gpu-device")
    started = time.monotonic()
    eventually(
        lambda: reconciles(argocd) - before["reconciles"] >= QUIET_RECONCILES,
        (QUIET_RECONCILES + 2) * RECONCILIATION,
        f"{QUIET_RECONCILES} comparisons by Argo CD",
    )
    window = time.monotonic() - started
    updates = len(sync.seen)
    seen = sync.stop()
    synced = [status for i, (status, _) in enumerate(seen) if i == 0 or seen[i - 1][0] != status]
    operations = len({started for _, started in seen if started}) - 1  # None: between two operations
    after = {
        "generations": generations(api),
        "revisions": driver_revisions(api),
        "jobs": set(jobs(api)),
        "reconciles": reconciles(argocd),
    }
    changed = {k: (v, after["generations"][k]) for k, v in before["generations"].items() if after["generations"][k] != v}
    figures = (
        f"window {window:.0f} s: {after['reconciles'] - before['reconciles']:.0f} reconciles, "
        f"{updates} Application updates, {operations} sync operations, "
        f"spec changes {changed}, sync statuses {synced}; Argo CD started in {argocd.start_seconds:.1f} s, "
        f"install {installed['install_seconds']:.0f} s, RSS MB "
        f"{ {k: round(v / 2**20) for k, v in argocd.rss().items()} }"
    )
    print(figures)
    assert synced == ["Synced"] and operations == 0, figures
    gpu_device = before["generations"]["DaemonSet/metax-gpu-device"]
    assert changed == {"DaemonSet/metax-gpu-device": (gpu_device, gpu_device + 1)}, figures
    assert after["revisions"] == before["revisions"] and after["jobs"] == before["jobs"], figures
    argocd.wait_application(APP, synced_healthy, 60, "Synced and Healthy after the window")


def test_a_new_driver_version_in_git_makes_one_staged_rollout_by_the_runner(tools_cluster, tools_api, argocd, installed):
    api = tools_api
    before, pool_before = driver_revisions(api), pool_driver(api)
    synced_before = len(history(argocd))
    sync = watch_sync(api)
    patch_values(api, {"driver": {"payload": {"version": "2.33.0.1"}}})
    argocd.wait_application(
        APP,
        lambda a: len((a.get("status") or {}).get("history") or []) > synced_before and synced_healthy(a),
        180,
        "the new values synced",
    )
    assert get_cr(api)["spec"]["driver"]["payload"]["version"] == "2.33.0.1"
    assert_one_staged_rollout(tools_cluster.cp, api, before, pool_before)
    seen = sync.stop()
    # OutOfSync only until the new values were synced, never during the rollout: one sync operation
    synced = [status for i, (status, _) in enumerate(seen) if i == 0 or seen[i - 1][0] != status]
    assert synced in (["Synced", "OutOfSync", "Synced"], ["OutOfSync", "Synced"]), seen
    assert len({started for _, started in seen if started}) == 2, seen  # the install's operation, then this one
    argocd.wait_application(APP, synced_healthy, 60, "Synced and Healthy after the rollout")


def test_a_runtime_pause_survives_the_next_syncs(tools_cluster, tools_api, argocd, installed):
    api, cp = tools_api, tools_cluster.cp
    seed_patch(cp, "pause", True)
    try:
        sync_now(api, argocd)  # nothing new
        assert get_cr(api)["spec"]["driver"]["upgradePolicy"]["pause"] is True
        commit(api, argocd, {"gpuDevice": {"healthyInterval": 11}})  # new inputs, a new bootstrap Job
        cr = get_cr(api)
        assert cr["spec"]["gpuDevice"]["healthyInterval"] == 11
        assert cr["spec"]["driver"]["upgradePolicy"]["pause"] is True
    finally:
        seed_patch(cp, "pause", False)


def test_a_sync_mid_rollout_leaves_a_kubectl_started_rollout_to_the_runner(tools_cluster, tools_api, argocd, installed):
    """The admin's `kubectl patch` of the version (Git still names the old one) starts a rollout
    that pauses after its first node; a hard refresh and sync then changes nothing (the payload
    image is the runner's, which Argo CD ignores and leaves), the Application stays Synced, and
    the rollout, resumed, completes at the CR's version, one node at a time."""
    api = tools_api
    started = time.monotonic()
    seen = sync_mid_rollout(
        tools_cluster,
        api,
        commit=lambda values: commit(api, argocd, values),
        sync=lambda: sync_now(api, argocd, hard_refresh=True),
        status=lambda: watch_sync(api),
    )
    print(f"sync mid-rollout: {time.monotonic() - started:.0f} s, Application {seen}")
    # Synced throughout; one sync operation: the one before the sync (the policy's commit), then ours
    assert [s for i, (s, _) in enumerate(seen) if i == 0 or seen[i - 1][0] != s] == ["Synced"], seen
    assert len({operation for _, operation in seen if operation}) == 2, seen
    argocd.wait_application(APP, synced_healthy, 60, "Synced and Healthy after the rollout")


def test_deleting_the_application_cleans_up_as_helm_uninstall_does(tools_cluster, tools_api, argocd, pods, installed):
    started = time.monotonic()
    kubectl(tools_cluster.cp, "delete", "application", "-n", "argocd", APP, "--wait=false")
    try:
        eventually(lambda: argocd.application(APP) is None, 180, "the Application deleted")
    except AssertionError:
        raise AssertionError(
            f"Application not deleted: {summary(argocd.application(APP))}; logs in {argocd.workdir / 'logs'}"
        ) from None
    print(f"Application deleted in {time.monotonic() - started:.0f} s")
    assert_hooks_ran_on_the_real_node(pods, tools_cluster, ("cleanup",))
    assert left_behind(tools_cluster.cp, tools_api) == []
    assert kubectl(tools_cluster.cp, "get", "crd", "clusteroperators.gpu.metax-tech.com", "-o", "name")  # crds.keep
