"""The chart rendered by the real Helm 3.18 and Helm 4.1: lint, Kubernetes schemas, and the chart
contract (names, labels, gating, strategy, scheduling annotations, RBAC, security contexts)."""

from __future__ import annotations

import json
import tarfile
from functools import lru_cache

import pytest
import yaml

from metax_operator import contract
from metax_operator.contract import POOL_LABEL
from tests.helm import (  # noqa: F401
    APP_VERSION,
    CHART,
    CHART_VERSION,
    NAMESPACE,
    RELEASE,
    HelmError,
    find,
    helm_bin,
    lint_chart,
    render_chart,
    run_helm,
    validate_objects,
)

# The seed's install command, its DOMAIN/PROJECT placeholder filled in (an image path must be
# lowercase: `DOMAIN/PROJECT` itself is refused, as the kubelet would refuse its images).
SEED_INSTALL = ("--set", "registry=domain.example/project", "--set", "driver.payload.version=2.32.0.6")
ALL_ON = ("--values", str(CHART / "tests/data/values-all.yaml"))
# Seed §3.2.6.1, as a shell passes `--set ...nodeName='worknode\\d+' --set ...gpus='0\,1\,2'`.
SEED_VFIO = SEED_INSTALL + (
    "--set",
    "vfioManager.vfioConfig[0].nodeName=worknode1",
    "--set",
    "vfioManager.vfioConfig[0].gpus=0\\,1\\,2",
    "--set",
    "vfioManager.vfioConfig[1].nodeName=worknode\\\\d+",
    "--set",
    "vfioManager.vfioConfig[1].gpus=0\\,1\\,2",
)
SCENARIOS = {"seed-install": SEED_INSTALL, "all-components": ALL_ON, "seed-vfio": SEED_VFIO}

# The contract's components: values key -> (DaemonSet, prerequisites of seed §3.2.3).
COMPONENTS = {key: (c.daemonset, list(c.prerequisites)) for key, c in contract.COMPONENTS.items()}
PRIVILEGED = {"runtime", "driver", "vfioManager"}
STANDARD_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/version",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "helm.sh/chart",
)


@lru_cache(maxsize=None)
def rendered(helm: str, args: tuple[str, ...]) -> tuple[dict, ...]:
    """Renders shared by several tests (objects are treated as read-only)."""
    return tuple(render_chart(helm=helm, args=args))


def daemonsets(objects) -> dict[str, dict]:
    """DaemonSets by their component annotation."""
    return {o["metadata"]["annotations"][contract.COMPONENT_ANNOTATION]: o for o in objects if o["kind"] == "DaemonSet"}


def dependents(key: str) -> set[str]:
    """`key` and every component that needs it, directly or not."""
    found = {key}
    while True:
        more = {k for k, (_, needs) in COMPONENTS.items() if found & set(needs)} - found
        if not more:
            return found
        found |= more


def pod_spec(obj: dict) -> dict:
    if obj["kind"] == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return obj["spec"]["template"]["spec"]


# --- lint and Kubernetes schemas ---------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_lint_strict_is_clean(helm_bin, scenario):
    output = lint_chart(helm=helm_bin, args=SCENARIOS[scenario])
    assert "[WARNING]" not in output and "[ERROR]" not in output, output


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_object_is_valid_for_the_kubernetes_api(helm_bin, scenario):
    objects = rendered(helm_bin, SCENARIOS[scenario])
    assert len(objects) > 20
    validate_objects(objects)


def test_runner_cronjob_is_valid_for_the_kubernetes_api(helm_bin):
    objects = rendered(helm_bin, SEED_INSTALL + ("--set", "runner.mode=cronjob"))
    validate_objects(objects)


def test_validator_rejects_an_unknown_field():
    """The schema check itself can fail (strict mode rejects what the API would drop)."""
    daemonset = json.loads(json.dumps(find(rendered("helm3", SEED_INSTALL), "DaemonSet", "metax-driver")))
    daemonset["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(AssertionError, match="metax-driver"):
        validate_objects([daemonset])


# --- the seed's vfio example and the ConfigMaps ------------------------------------------


def test_seed_vfio_set_example_renders_the_vfio_config(helm_bin):
    config = find(rendered(helm_bin, SEED_VFIO), "ConfigMap", "metax-vfio-config")
    assert config["data"]["config"] == "- gpus: 0,1,2\n  nodeName: worknode1\n- gpus: 0,1,2\n  nodeName: worknode\\d+\n"
    assert yaml.safe_load(config["data"]["config"]) == [
        {"nodeName": "worknode1", "gpus": "0,1,2"},
        {"nodeName": "worknode\\d+", "gpus": "0,1,2"},
    ]


# --- gating and names -------------------------------------------------------------------


def test_default_install_deploys_every_component_but_the_exporter(helm_bin):
    objects = rendered(helm_bin, SEED_INSTALL)
    assert {k: o["metadata"]["name"] for k, o in daemonsets(objects).items()} == {
        k: name for k, (name, _) in COMPONENTS.items() if k != "exporter"
    }
    assert not [o for o in objects if o["kind"] == "Service"]


@pytest.mark.parametrize("key", COMPONENTS)
def test_deploy_false_removes_the_component_and_nothing_else(helm_bin, key):
    off = dependents(key)
    args = SEED_INSTALL + ("--set", "exporter.deploy=true")
    for component in sorted(off):
        args += ("--set", f"{component}.deploy=false")
    objects = rendered(helm_bin, args)
    assert set(daemonsets(objects)) == set(COMPONENTS) - off
    service_accounts = {o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"}
    for component, (name, _) in COMPONENTS.items():
        assert (name in service_accounts) == (component not in off)
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert (("ConfigMap", "driver-config") in names) == ("driver" not in off)
    assert (("ConfigMap", "metax-vfio-config") in names) == ("vfioManager" not in off)
    assert (("Service", "metax-data-exporter") in names) == ("exporter" not in off)


# --- labels -----------------------------------------------------------------------------


def test_every_object_carries_the_standard_and_common_labels(helm_bin):
    for obj in rendered(helm_bin, ALL_ON):
        labels = obj["metadata"]["labels"]
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        assert all(labels.get(key) for key in STANDARD_LABELS), where
        assert labels["app.kubernetes.io/name"] == "metax-operator", where
        assert labels["app.kubernetes.io/instance"] == RELEASE, where
        assert labels["app.kubernetes.io/version"] == APP_VERSION, where
        assert labels["helm.sh/chart"] == f"metax-operator-{CHART_VERSION}", where
        assert labels["team"] == "gpu-infra", where
        assert obj["metadata"]["annotations"]["owner"] == "gpu-infra@example.com", where


def test_component_label_is_the_values_key(helm_bin):
    objects = rendered(helm_bin, ALL_ON)
    for key, daemonset in daemonsets(objects).items():
        assert daemonset["metadata"]["labels"]["app.kubernetes.io/component"] == key
    runner = find(objects, "Deployment", "metax-operator-runner")
    assert runner["metadata"]["labels"]["app.kubernetes.io/component"] == "runner"


def test_selectors_use_only_name_instance_and_component(helm_bin):
    objects = rendered(helm_bin, ALL_ON)
    for obj in objects:
        if obj["kind"] in ("DaemonSet", "Deployment"):
            selector = obj["spec"]["selector"]["matchLabels"]
            assert set(selector) == {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component"}
            assert selector.items() <= obj["spec"]["template"]["metadata"]["labels"].items()
    service = find(objects, "Service", "metax-data-exporter")
    assert service["spec"]["selector"] == daemonsets(objects)["exporter"]["spec"]["selector"]["matchLabels"]


def test_pod_templates_do_not_change_with_the_chart_version(helm_bin):
    """A chart upgrade alone must not roll the pods (for the driver it would start a rollout)."""
    for daemonset in daemonsets(rendered(helm_bin, ALL_ON)).values():
        labels = daemonset["spec"]["template"]["metadata"]["labels"]
        assert "helm.sh/chart" not in labels and "app.kubernetes.io/version" not in labels


# --- scheduling and the annotation contract ---------------------------------------------


def test_scheduling_base_annotation_is_exactly_the_rendered_scheduling_fields(helm_bin):
    for key, daemonset in daemonsets(rendered(helm_bin, ALL_ON)).items():
        spec = pod_spec(daemonset)
        base = json.loads(daemonset["metadata"]["annotations"]["gpu.metax-tech.com/scheduling-base"])
        assert base == {f: spec[f] for f in ("nodeSelector", "affinity", "tolerations") if f in spec}, key
        assert {"key": "metax-tech.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        if key == "gpuLabel":
            assert "nodeSelector" not in spec
        else:
            assert spec["nodeSelector"] == {"metax-tech.com/gpu.installed": "true"}


def test_scheduling_inputs_annotation_carries_the_values(helm_bin):
    values = yaml.safe_load((CHART / "tests/data/values-all.yaml").read_text())
    for key, daemonset in daemonsets(rendered(helm_bin, ALL_ON)).items():
        inputs = json.loads(daemonset["metadata"]["annotations"]["gpu.metax-tech.com/scheduling-inputs"])
        assert inputs == {
            "global": values["podTemplateSpec"],
            "component": values.get(key, {}).get("podTemplateSpec") or None,
            "tolerations": values["tolerations"],
        }, key


def test_scheduling_inputs_are_null_when_nothing_is_set(helm_bin):
    for daemonset in daemonsets(rendered(helm_bin, SEED_INSTALL)).values():
        inputs = daemonset["metadata"]["annotations"]["gpu.metax-tech.com/scheduling-inputs"]
        assert json.loads(inputs) == {"global": None, "component": None, "tolerations": None}


SEED_TOLERATIONS = [
    {"key": "key1", "operator": "Equal", "value": "value1", "effect": "NoSchedule"},
    {"key": "key2", "operator": "Equal", "value": "value1", "effect": "NoExecute"},
]


@pytest.mark.parametrize("content", [{"tolerations": SEED_TOLERATIONS}, SEED_TOLERATIONS], ids=["seed-file-format", "plain-list"])
def test_deprecated_tolerations_from_set_file_are_parsed(helm_bin, tmp_path, content):
    path = tmp_path / "tolerations.yaml"
    path.write_text(yaml.safe_dump(content))
    objects = render_chart(helm=helm_bin, args=SEED_INSTALL + ("--set-file", f"tolerations={path}"))
    for daemonset in daemonsets(objects).values():
        inputs = json.loads(daemonset["metadata"]["annotations"]["gpu.metax-tech.com/scheduling-inputs"])
        assert inputs["tolerations"] == SEED_TOLERATIONS


def test_a_tolerations_file_of_another_shape_fails_naming_the_field(helm_bin, tmp_path):
    path = tmp_path / "tolerations.yaml"
    path.write_text("key1: value1\n")
    with pytest.raises(HelmError, match="tolerations: .*--set-file tolerations=FILE"):
        render_chart(helm=helm_bin, args=SEED_INSTALL + ("--set-file", f"tolerations={path}"))


# --- component order, images, security --------------------------------------------------


def test_dependent_components_wait_for_their_prerequisites(helm_bin):
    for key, daemonset in daemonsets(rendered(helm_bin, ALL_ON)).items():
        init = {c["name"]: c for c in pod_spec(daemonset).get("initContainers", [])}
        prerequisites = COMPONENTS[key][1]
        if not prerequisites:
            assert "wait-for" not in init
            continue
        command = init["wait-for"]["command"]
        assert command[:6] == ["metax-operator", "wait-for", "--namespace", "$(POD_NAMESPACE)", "--node", "$(NODE_NAME)"]
        assert command[6:] == [arg for p in prerequisites for arg in ("--component", p)], key
        assert init["wait-for"]["image"] == f"cr.example.com/metax/metax-operator-tools:{APP_VERSION}"


def test_images_come_from_the_registry_with_the_app_version_or_overrides(helm_bin):
    objects = rendered(helm_bin, ALL_ON)
    sets = daemonsets(objects)

    def image(key: str, name: str) -> str:
        spec = pod_spec(sets[key])
        return next(c["image"] for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == name)

    assert image("gpuLabel", "gpu-label") == f"cr.example.com/metax/gpu-label:{APP_VERSION}"
    assert image("runtime", "container-runtime") == "mirror.example.com/metax/container-runtime:0.10.1"
    assert image("driver", "payload") == "payload.example.com/metax/driver-image:2.32.0.6"
    assert image("maca", "payload-0") == "cr.example.com/metax/maca-c500:2.18.0.3-ubuntu18.04-amd64"
    assert image("maca", "payload-1") == "cr.example.com/metax/maca-c500:2.19.0.1-ubuntu22.04-amd64"
    for daemonset in sets.values():
        assert pod_spec(daemonset)["imagePullSecrets"] == [{"name": "metax-pull"}]
        assert pod_spec(daemonset)["priorityClassName"] == "system-node-critical"


def test_only_driver_runtime_and_vfio_manager_are_privileged(helm_bin):
    for key, daemonset in daemonsets(rendered(helm_bin, ALL_ON)).items():
        spec = pod_spec(daemonset)
        for container in spec["containers"] + spec.get("initContainers", []):
            privileged = container.get("securityContext", {}).get("privileged", False)
            assert privileged == (key in PRIVILEGED and container in spec["containers"]), (key, container["name"])
        assert spec.get("hostPID", False) == (key == "runtime")
        assert not spec.get("hostNetwork", False)


def test_unprivileged_components_mount_the_host_read_only_except_their_own_directories(helm_bin):
    writable = {
        "gpuDevice": {"/var/lib/kubelet/device-plugins"},
        "maca": {"/opt/metax/maca", "/run/metax"},
        "gpuLabel": set(),
        "exporter": set(),
    }
    for key, daemonset in daemonsets(rendered(helm_bin, ALL_ON)).items():
        if key in PRIVILEGED:
            continue
        spec = pod_spec(daemonset)
        host = {v["name"]: v["hostPath"]["path"] for v in spec.get("volumes", []) if "hostPath" in v}
        mounted_rw = {
            host[m["name"]]
            for c in spec["containers"]
            for m in c.get("volumeMounts", [])
            if m["name"] in host and not m.get("readOnly")
        }
        assert mounted_rw == writable[key], key
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert "ALL" in context["capabilities"]["drop"]


def assert_restricted(spec: dict) -> None:
    """Pod Security "restricted" (https://kubernetes.io/docs/concepts/security/pod-security-standards/)."""
    assert not any(spec.get(f) for f in ("hostNetwork", "hostPID", "hostIPC"))
    assert all("hostPath" not in v for v in spec.get("volumes", []))
    pod_context = spec.get("securityContext", {})
    assert pod_context.get("seccompProfile", {}).get("type") == "RuntimeDefault"
    for container in spec["containers"] + spec.get("initContainers", []):
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"] and not context["capabilities"].get("add")
        assert context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is True
        assert context.get("runAsUser", pod_context.get("runAsUser", 1)) != 0
        assert not context.get("privileged")
        assert context["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("mode", ["deployment", "cronjob"])
def test_runner_runs_its_command_under_pod_security_restricted(helm_bin, mode):
    objects = rendered(helm_bin, SEED_INSTALL + ("--set", f"runner.mode={mode}", "--set", "runner.interval=7"))
    runner = find(objects, "Deployment" if mode == "deployment" else "CronJob", "metax-operator-runner")
    spec = pod_spec(runner)
    assert_restricted(spec)
    assert spec["serviceAccountName"] == "metax-operator-runner"
    command = spec["containers"][0]["command"]
    if mode == "deployment":
        assert runner["spec"]["replicas"] == 1 and runner["spec"]["strategy"] == {"type": "Recreate"}
        assert command == [
            "metax-operator",
            "run",
            "--namespace",
            NAMESPACE,
            "--interval",
            "7",
            "--health-port",
            "8081",
            "--stall-timeout",
            "300",
        ]
    else:
        assert runner["spec"]["concurrencyPolicy"] == "Forbid"
        assert command == ["metax-operator", "run", "--once", "--namespace", NAMESPACE]


# --- RBAC -------------------------------------------------------------------------------


def rules_of(objects, kind: str, name: str) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) triples a role grants."""
    return {
        (group, resource, verb)
        for rule in find(objects, kind, name)["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_rbac_has_no_wildcards(helm_bin):
    for obj in rendered(helm_bin, ALL_ON):
        for rule in obj.get("rules", []):
            assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"], obj["metadata"]["name"]


def test_every_service_account_is_bound_to_what_its_pods_use(helm_bin):
    objects = rendered(helm_bin, ALL_ON)
    accounts = {o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"}
    for obj in objects:
        if obj["kind"] in ("DaemonSet", "Deployment"):
            assert pod_spec(obj)["serviceAccountName"] in accounts
        if obj["kind"].endswith("Binding"):
            role = find(objects, obj["roleRef"]["kind"], obj["roleRef"]["name"])
            assert role["kind"] == obj["roleRef"]["kind"]
            for subject in obj["subjects"]:
                assert subject["name"] in accounts and subject["namespace"] == NAMESPACE


def test_wait_for_role_reads_pods_for_every_dependent_component(helm_bin):
    objects = rendered(helm_bin, ALL_ON)
    assert rules_of(objects, "Role", "metax-operator-wait-for") == {("", "pods", v) for v in ("get", "list", "watch")}
    subjects = {s["name"] for s in find(objects, "RoleBinding", "metax-operator-wait-for")["subjects"]}
    assert subjects == {name for name, needs in COMPONENTS.values() if needs}


def test_runner_rbac_is_the_contract(helm_bin):
    objects = rendered(helm_bin, SEED_INSTALL)
    assert rules_of(objects, "ClusterRole", "metax-operator-runner") == {
        *{("gpu.metax-tech.com", "clusteroperators", v) for v in ("get", "list", "watch", "patch")},
        *{("gpu.metax-tech.com", "clusteroperators/status", v) for v in ("get", "update", "patch")},
        *{("", r, v) for r in ("nodes", "pods") for v in ("get", "list", "watch")},
        ("", "nodes", "patch"),  # cordon and uncordon around a driver swap
        ("", "pods/eviction", "create"),  # drain
    }
    assert rules_of(objects, "Role", "metax-operator-runner") == {
        *{("apps", "daemonsets", v) for v in ("get", "list", "watch", "patch")},
        *{("apps", "controllerrevisions", v) for v in ("list", "watch")},
        *{("", "pods", v) for v in ("create", "patch", "delete")},  # driver pods deleted, validation pods made
        *{("", "configmaps", v) for v in ("get", "list", "watch", "patch")},  # patch: the two, by name
        *{("", "services", v) for v in ("get", "list", "watch")},  # the exporter's, by name (its watch cache)
        *{("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")},
    }
    # Events about the cluster-scoped CR live in namespace default (as client-go writes them).
    events = find(objects, "Role", "metax-operator-runner-events")
    assert events["metadata"]["namespace"] == "default"
    assert rules_of(objects, "Role", "metax-operator-runner-events") == {
        *{(g, "events", v) for g in ("", "events.k8s.io") for v in ("create", "patch")},
        *{("", "events", v) for v in ("list", "watch")},
    }  # NodeNeedReboot and Rebooted
    binding = find(objects, "RoleBinding", "metax-operator-runner-events")
    assert binding["metadata"]["namespace"] == "default"
    assert binding["roleRef"]["name"] == "metax-operator-runner-events"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "metax-operator-runner", "namespace": NAMESPACE}]


# --- exporter Service -------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"type": "NodePort", "port": 30090},
        {"type": "NodePort"},
        {"type": "LoadBalancer", "port": 9100},
        {"type": "ExternalName", "externalName": "metrics.example.com"},
    ],
    ids=["ClusterIP", "NodePort", "NodePort-any-port", "LoadBalancer", "ExternalName"],
)
def test_exporter_service_of_every_type_is_valid_for_the_kubernetes_api(helm_bin, settings):
    """The Service's shape for each type is the helm-unittest suite's (exporter/service_test.yaml);
    here each rendered shape is checked against the Kubernetes API's schema."""
    args = SEED_INSTALL + ("--set", "exporter.deploy=true")
    for key, value in settings.items():
        args += ("--set", f"exporter.service.{key}={value}")
    validate_objects([find(rendered(helm_bin, args), "Service", "metax-data-exporter")])


# --- packaging --------------------------------------------------------------------------


def test_package_holds_only_the_chart(tmp_path):
    """.helmignore keeps tests, docs, scripts, the Python sources and dev files out of the package."""
    run_helm("helm3", "package", str(CHART), "--destination", str(tmp_path))
    with tarfile.open(next(tmp_path.glob("metax-operator-*.tgz"))) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames()}
    top = {name.split("/")[0] for name in names}
    assert top <= {
        "Chart.yaml",
        "values.yaml",
        "values.schema.json",
        "README.md",
        ".helmignore",
        "crds",
        "files",
        "templates",
        "dashboards",
        "alerts",
    }
    assert {"Chart.yaml", "values.yaml", "templates"} <= top
    assert "templates/driver/daemonset.yaml" in names
    assert {f"crds/{contract.CRD_FILE_NAME}", f"files/{contract.CRD_FILE_NAME}"} <= names  # both CRD forms
    assert "alerts/metax-operator-rules.yaml" in names


POOL_RACK_B = {
    "name": "rack-b",
    "nodeSelector": {"example.com/rack": "b"},
    "payload": {"version": "2.33.0.1"},
    "fwEnableVirt": True,
}


def test_driver_pools_add_a_daemonset_each_and_change_nothing_else_but_the_drivers_node_affinity():
    base = {"registry": "domain.example/project", "driver": {"payload": {"version": "2.32.0.6"}}}
    without = {(o["kind"], o["metadata"]["name"]): o for o in render_chart(base)}
    assert without == {
        (o["kind"], o["metadata"]["name"]): o for o in render_chart({**base, "driver": {**base["driver"], "pools": []}})
    }
    with_pools = {
        (o["kind"], o["metadata"]["name"]): o
        for o in render_chart({**base, "driver": {**base["driver"], "pools": [POOL_RACK_B]}})
    }
    pool = with_pools.pop(("DaemonSet", "metax-driver-pool-rack-b"))
    changed = sorted(key for key in without if without[key] != with_pools[key])
    assert set(with_pools) == set(without)
    assert changed == [("ConfigMap", "metax-operator-values"), ("DaemonSet", "metax-driver")], changed  # the values, the driver
    driver, before = with_pools[("DaemonSet", "metax-driver")], without[("DaemonSet", "metax-driver")]
    term = {"matchExpressions": [{"key": POOL_LABEL, "operator": "DoesNotExist"}]}
    assert driver["spec"]["template"]["spec"]["affinity"] == {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
    }
    del driver["spec"]["template"]["spec"]["affinity"]
    base_annotation = "gpu.metax-tech.com/scheduling-base"
    assert json.loads(driver["metadata"]["annotations"].pop(base_annotation))["affinity"]
    del before["metadata"]["annotations"][base_annotation]
    assert driver == before
    # The pool's DaemonSet: the driver's with the pool's version, firmware switch, label and name.
    spec = pool["spec"]["template"]["spec"]
    assert pool["spec"]["selector"]["matchLabels"][POOL_LABEL] == "rack-b"
    assert spec["nodeSelector"] == {"metax-tech.com/gpu.installed": "true", POOL_LABEL: "rack-b"}
    assert spec["serviceAccountName"] == "metax-driver"
    assert next(c["image"] for c in spec["initContainers"] if c["name"] == "payload").endswith("/driver-image:2.33.0.1")
    assert {"name": "FW_ENABLE_VIRT", "value": "true"} in spec["containers"][0]["env"]
    assert pool["metadata"]["annotations"]["gpu.metax-tech.com/driver-pool"] == "rack-b"
