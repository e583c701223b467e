"""The hook Jobs, their RBAC and ConfigMaps, and the helm test pod, rendered by real Helm 3 and 4."""

from __future__ import annotations

import json
import shutil

from tests.helm import APP_VERSION, CHART, find, helm_bin, render_chart, validate_objects  # noqa: F401 (fixture)

BASE = {"registry": "cr.example.com/metax", "driver": {"payload": {"version": "2.32.0.6"}}}
PHASES = {
    "preflight": "pre-install,pre-upgrade",
    "upgrade-crds": "pre-install,pre-upgrade",
    "bootstrap": "post-install,pre-upgrade,pre-rollback",
    "rollback-hold": "pre-rollback",
    "cleanup": "pre-delete",
    "test": "test",
}
JOB_WEIGHTS = {
    "preflight": "0",
    "upgrade-crds": "1",
    "bootstrap": "2",
    "rollback-hold": "3",
    "cleanup": "3",
}
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


def render(values: dict | None = None, helm: str = "helm3", args=(), tests: bool = True) -> list[dict]:
    """The hook objects (and the test pod and its RBAC, with `tests`) of the whole chart."""
    merged = json.loads(json.dumps(BASE))
    for key, value in (values or {}).items():
        merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
    components = {"hooks", "tests"} if tests else {"hooks"}
    return [
        o
        for o in render_chart(merged, helm=helm, args=args)
        if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") in components
    ]


def hook_of(obj: dict) -> str:
    return obj["metadata"]["name"].removeprefix("metax-operator-")


def annotations(obj: dict) -> dict:
    return obj["metadata"].get("annotations") or {}


def pod_spec(obj: dict) -> dict:
    return obj["spec"] if obj["kind"] == "Pod" else obj["spec"]["template"]["spec"]


def test_every_object_is_valid_kubernetes(helm_bin):
    validate_objects(render(helm=helm_bin))


def test_weights_chain_rbac_then_configmaps_then_jobs(helm_bin):
    objects = render(helm=helm_bin)
    for obj in objects:
        weight = annotations(obj)["helm.sh/hook-weight"]
        if obj["kind"] in RBAC_KINDS:
            assert weight == "-5", obj["metadata"]["name"]
            assert annotations(obj)["helm.sh/hook"] == PHASES[hook_of(obj)]
        elif obj["kind"] == "ConfigMap":
            assert weight == {"metax-operator-values": "-4", "metax-operator-crds": "-3"}[obj["metadata"]["name"]]
        elif obj["kind"] == "Job":
            assert weight == JOB_WEIGHTS[hook_of(obj)]
            assert annotations(obj)["helm.sh/hook"] == PHASES[hook_of(obj)]
    assert sorted(hook_of(o) for o in objects if o["kind"] == "Job") == sorted(JOB_WEIGHTS)


def test_delete_policy_and_job_limits_come_from_values(helm_bin):
    objects = render(
        {
            "hooks": {
                "ttlSecondsAfterFinished": 60,
                "activeDeadlineSeconds": 120,
                "backoffLimit": 1,
                "resources": {"requests": {"cpu": "20m"}, "limits": {"memory": "100Mi"}},
            }
        },
        helm=helm_bin,
    )
    for obj in objects:
        policy = annotations(obj)["helm.sh/hook-delete-policy"]
        # The test pod is kept after a pass so that `helm test --logs` can read it.
        assert policy == ("before-hook-creation" if obj["kind"] == "Pod" else "before-hook-creation,hook-succeeded")
    for job in (o for o in objects if o["kind"] == "Job"):
        assert (job["spec"]["ttlSecondsAfterFinished"], job["spec"]["activeDeadlineSeconds"], job["spec"]["backoffLimit"]) == (
            60,
            120,
            1,
        )
        [container] = pod_spec(job)["containers"]
        # Helm merges maps: the default memory request and CPU limit stay
        assert container["resources"] == {"requests": {"cpu": "20m", "memory": "64Mi"}, "limits": {"cpu": "1", "memory": "100Mi"}}


def test_pods_meet_pod_security_restricted(helm_bin):
    pods = [o for o in render(helm=helm_bin) if o["kind"] in ("Job", "Pod")]
    assert len(pods) == 6
    for obj in pods:
        spec = pod_spec(obj)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["restartPolicy"] == "Never"
        assert not spec.get("hostNetwork") and not spec.get("hostPID")
        assert all(
            v.get("configMap") or v.get("emptyDir") is not None or (v["name"] == "kube-api-access" and v["projected"])
            for v in spec["volumes"]
        )
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["readOnlyRootFilesystem"] is True
            assert context["capabilities"] == {"drop": ["ALL"]}
            assert context["runAsNonRoot"] is True
            assert container["image"] == f"cr.example.com/metax/metax-operator-tools:{APP_VERSION}"
            assert container["command"] == ["metax-operator"]


def test_rbac_has_no_wildcards_and_names_what_it_can(helm_bin):
    roles = [o for o in render({"crds": {"keep": False}}, helm=helm_bin) if o["kind"] in ("Role", "ClusterRole")]
    assert roles
    for role in roles:
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert "*" not in rule.get(field, []), (role["metadata"]["name"], rule)
            if "create" not in rule["verbs"] and "list" not in rule["verbs"] and rule["resources"] != ["nodes"]:
                assert rule.get("resourceNames"), (role["metadata"]["name"], rule)  # get/patch/delete by name


def test_crd_configmap_holds_the_charts_crd(helm_bin):
    cm = find(render(helm=helm_bin), "ConfigMap", "metax-operator-crds")
    text = cm["data"]["clusteroperators.gpu.metax-tech.com.yaml"]
    assert text == (CHART / "crds" / "clusteroperators.gpu.metax-tech.com.yaml").read_text()


def test_crds_upgrade_false_renders_no_crd_hook(helm_bin):
    objects = render({"crds": {"upgrade": False}}, helm=helm_bin)
    assert not [o for o in objects if "crds" in o["metadata"]["name"]]


def test_cleanup_budget_fits_its_job_deadline_and_the_test_pod_has_one(helm_bin):
    """The cleanup's waits share one budget, a minute under the Job's deadline, so it ends with a
    line naming what is left instead of being killed; the test pod stops when `helm test` stops
    waiting (docs/hooks.md)."""
    for deadline, budget in ((300, "240"), (1200, "1140"), (45, "30")):
        objects = render({"hooks": {"activeDeadlineSeconds": deadline}}, helm=helm_bin)
        job = find(objects, "Job", "metax-operator-cleanup")
        args = pod_spec(job)["containers"][0]["args"]
        assert job["spec"]["activeDeadlineSeconds"] == deadline and args[args.index("--timeout") + 1] == budget
    test_pod = find(render({"tests": {"activeDeadlineSeconds": 600}}, helm=helm_bin), "Pod", "metax-operator-test")
    assert test_pod["spec"]["activeDeadlineSeconds"] == 600


def test_values_configmap_carries_the_values_with_tolerations_as_a_list(helm_bin, tmp_path):
    file = tmp_path / "tolerations.yaml"
    file.write_text("tolerations:\n- key: node-type\n  operator: Equal\n  value: gpu\n  effect: NoSchedule\n")
    cm = find(render(helm=helm_bin, args=("--set-file", f"tolerations={file}")), "ConfigMap", "metax-operator-values")
    values = json.loads(cm["data"]["values.json"])
    assert values["tolerations"] == [{"key": "node-type", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}]
    assert values["registry"] == "cr.example.com/metax"
    assert values["driver"]["payload"]["version"] == "2.32.0.6"


def test_hook_annotations_from_values_extend_and_override(helm_bin):
    objects = render(
        {
            "hooks": {
                "annotations": {
                    "argocd.argoproj.io/sync-options": "Replace=true",
                    "helm.sh/hook-delete-policy": "before-hook-creation",
                }
            }
        },
        helm=helm_bin,
        tests=False,
    )
    for obj in objects:
        assert annotations(obj)["argocd.argoproj.io/sync-options"] == "Replace=true"
        assert annotations(obj)["helm.sh/hook-delete-policy"] == "before-hook-creation"


def test_use_helm_hooks_false_renders_plain_resources_except_cleanup_and_test(helm_bin):
    objects = render({"hooks": {"useHelmHooks": False}}, helm=helm_bin)
    for obj in objects:
        hook = hook_of(obj)
        if hook == "test" or (hook == "cleanup" and obj["kind"] not in ("ClusterRole", "ClusterRoleBinding")):
            assert "helm.sh/hook" in annotations(obj)  # a plain cleanup Job would run at install
        else:
            assert not any(k.startswith("helm.sh/hook") for k in annotations(obj)), obj["metadata"]["name"]
    jobs = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Job"}
    plain = [name for name in jobs if not name.endswith("cleanup")]
    assert len(plain) == 3
    for name in plain:  # named after their inputs, kept (no TTL) so GitOps does not re-create them
        assert len(name.rsplit("-", 1)[1]) == 10
        assert "ttlSecondsAfterFinished" not in jobs[name]["spec"]
    # the Jobs' service accounts are the hook's, whatever the Job's name; no rollback hooks (no rollback there)
    without_rollback = set(JOB_WEIGHTS) - {"rollback-hold"}
    assert {pod_spec(j)["serviceAccountName"] for j in jobs.values()} == {f"metax-operator-{h}" for h in without_rollback}


def test_plain_job_names_change_with_their_inputs(helm_bin):
    def names(values):
        return sorted(o["metadata"]["name"] for o in render(values, helm=helm_bin, tests=False) if o["kind"] == "Job")

    first = names({"hooks": {"useHelmHooks": False}})
    assert first == names({"hooks": {"useHelmHooks": False}})
    changed = names({"hooks": {"useHelmHooks": False}, "driver": {"payload": {"version": "2.33.0.1"}}})
    assert [n for n in changed if n.startswith("metax-operator-bootstrap")] != [
        n for n in first if n.startswith("metax-operator-bootstrap")
    ]


def test_plain_job_names_change_with_the_chart_version(helm_bin, tmp_path):
    """A new chart version (a new tools image tag) changes the Jobs' templates, which Kubernetes
    refuses to update in place: the Jobs get new names."""
    chart = tmp_path / "chart"
    top = {"Chart.yaml", "values.yaml", "values.schema.json", "crds", "files", "templates"}
    shutil.copytree(CHART, chart, ignore=lambda d, names: [n for n in names if d == str(CHART) and n not in top])
    meta = chart / "Chart.yaml"
    meta.write_text(meta.read_text().replace(f'appVersion: "{APP_VERSION}"', 'appVersion: "0.0.1-next"'))

    def jobs(path) -> dict[str, str]:
        objects = render_chart({**BASE, "hooks": {"useHelmHooks": False}}, helm=helm_bin, chart=path)
        return {
            o["metadata"]["name"].rsplit("-", 1)[0]: o["metadata"]["name"]
            for o in objects
            if o["kind"] == "Job" and "argocd.argoproj.io/hook" not in annotations(o)
        }

    before, after = jobs(CHART), jobs(chart)
    assert (
        before.keys() == after.keys() == {"metax-operator-preflight", "metax-operator-upgrade-crds", "metax-operator-bootstrap"}
    )
    assert all(before[k] != after[k] for k in before)


# Argo CD's sync waves in GitOps mode: preflight, then the CRD (static in crds/) and upgrade-crds,
# then bootstrap, each wave's Jobs complete before the next; everything else is wave 0.
WAVES = {"preflight": "-3", "values": "-3", "upgrade-crds": "-2", "crds": "-2", "bootstrap": "-1"}


def test_plain_hooks_run_in_argo_cd_sync_waves_before_everything_else(helm_bin):
    objects = render({"hooks": {"useHelmHooks": False}}, helm=helm_bin, tests=False)
    waves = {}
    for obj in objects:
        name = hook_of(obj)
        if name == "cleanup":
            continue
        hook = name if obj["kind"] != "Job" else name.rsplit("-", 1)[0]
        waves[f"{obj['kind']}/{hook}"] = annotations(obj).get("argocd.argoproj.io/sync-wave")
        assert waves[f"{obj['kind']}/{hook}"] == WAVES[hook], obj["metadata"]["name"]
    assert len(waves) == 3 * 4 + 2  # each hook's Job, ServiceAccount, ClusterRole and binding; two ConfigMaps
    crd = next(o for o in render_chart(BASE, helm=helm_bin, args=["--include-crds"]) if o["kind"] == "CustomResourceDefinition")
    assert annotations(crd)["argocd.argoproj.io/sync-wave"] == WAVES["crds"]
    # as Helm hooks they carry no wave (Argo CD would take helm.sh/hook-weight instead)
    assert not [o for o in render(helm=helm_bin) if "argocd.argoproj.io/sync-wave" in annotations(o)]


def test_cleanup_is_an_argo_cd_post_delete_hook_that_removes_its_own_cluster_rbac(helm_bin):
    """Argo CD ignores pre-delete hooks and runs PostDelete ones after deleting the application;
    before 3.4 it never finishes when one of them is cluster-scoped, so the cleanup's ClusterRole
    and binding are plain resources Argo CD keeps (Delete=false), which the cleanup deletes."""
    objects = {
        f"{o['kind']}/{hook_of(o)}": o
        for o in render({"hooks": {"useHelmHooks": False}}, helm=helm_bin)
        if hook_of(o) == "cleanup"
    }
    for key in ("ServiceAccount/cleanup", "Role/cleanup", "RoleBinding/cleanup", "Job/cleanup"):
        assert annotations(objects[key])["argocd.argoproj.io/hook"] == "PostDelete", key
        assert annotations(objects[key])["helm.sh/hook"] == "pre-delete", key
    for key in ("ClusterRole/cleanup", "ClusterRoleBinding/cleanup"):
        assert annotations(objects[key]) == {"argocd.argoproj.io/sync-options": "Delete=false"}, key
    assert pod_spec(objects["Job/cleanup"])["containers"][0]["args"][-2:] == ["--delete-own-rbac", "metax-operator-cleanup"]
    own = [r for r in objects["ClusterRole/cleanup"]["rules"] if r["apiGroups"] == ["rbac.authorization.k8s.io"]]
    assert own == [
        {
            "apiGroups": ["rbac.authorization.k8s.io"],
            "resources": ["clusterroles"],
            "resourceNames": ["metax-operator-cleanup"],
            "verbs": ["get", "delete"],
        },
        {
            "apiGroups": ["rbac.authorization.k8s.io"],
            "resources": ["clusterrolebindings"],
            "resourceNames": ["metax-operator-cleanup"],
            "verbs": ["get", "patch"],
        },
    ]
    # as Helm hooks (the Helm CLI, Flux): Helm deletes them; nothing of Argo CD's
    helm_mode = [o for o in render(helm=helm_bin) if hook_of(o) == "cleanup"]
    assert not [o for o in helm_mode if any(k.startswith("argocd.argoproj.io/") for k in annotations(o))]
    assert "--delete-own-rbac" not in pod_spec(find(helm_mode, "Job", "metax-operator-cleanup"))["containers"][0]["args"]


def test_tests_enabled_false_renders_no_test_pod(helm_bin):
    objects = render({"tests": {"enabled": False}}, helm=helm_bin)
    assert objects and not [o for o in objects if "test" in o["metadata"]["name"]]


def test_no_rollback_hold_without_the_runner(helm_bin):
    # With runner.enabled: false the chart renders the components' RollingUpdate and nobody would put it back.
    jobs = {hook_of(o) for o in render({"runner": {"enabled": False}}, helm=helm_bin) if o["kind"] == "Job"}
    assert "bootstrap" in jobs and "rollback-hold" not in jobs
