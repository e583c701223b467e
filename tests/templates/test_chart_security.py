"""The chart's security posture, rendered by the real Helm 3.18 and 4.1 (docs/security.md): the
ServiceAccount token only in containers whose code calls the API, seccomp on every pod, resources
on every container. Checkov's view of the same renders is tests/templates/test_checkov.py."""

from __future__ import annotations

from functools import lru_cache

import pytest

from tests.helm import CHART, helm_bin, render_chart  # noqa: F401

ALL_ON = ("--values", str(CHART / "tests/data/values-all.yaml"), "--set", "runner.mode={mode}")
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
# The containers that run our own API clients, whatever the pod: the wait-for init containers,
# the runner, the hooks and the test pod.
OUR_CLIENTS = {"wait-for", "runner", "preflight", "upgrade-crds", "bootstrap", "cleanup", "test"}


@lru_cache(maxsize=None)
def rendered(helm: str, mode: str) -> tuple[dict, ...]:
    return tuple(render_chart(helm=helm, args=tuple(a.format(mode=mode) for a in ALL_ON)))


def pod_specs(objects) -> dict[tuple[str, str], dict]:
    """Every pod spec the chart renders, by (kind, name)."""
    specs = {}
    for obj in objects:
        spec = obj.get("spec") or {}
        if obj["kind"] == "CronJob":
            spec = spec["jobTemplate"]["spec"]
        if obj["kind"] != "Pod":
            spec = (spec.get("template") or {}).get("spec") or {}
        if "containers" in spec:
            specs[(obj["kind"], obj["metadata"]["name"])] = spec
    return specs


def bound_accounts(objects) -> set[str]:
    """ServiceAccounts granted API access by a binding of their own (the pods-read binding that
    every dependent component's wait-for init container uses does not count)."""
    return {
        s["name"]
        for o in objects
        if o["kind"] in ("RoleBinding", "ClusterRoleBinding") and o["metadata"]["name"] != "metax-operator-wait-for"
        for s in o["subjects"]
    }


@pytest.mark.parametrize("mode", ["deployment", "cronjob"])
def test_the_token_is_mounted_exactly_into_the_containers_that_call_the_api(helm_bin, mode):
    objects = rendered(helm_bin, mode)
    bound = bound_accounts(objects)
    for where, spec in pod_specs(objects).items():
        assert spec["automountServiceAccountToken"] is False, where
        for container in spec["containers"] + spec.get("initContainers", []):
            mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
            calls_api = container["name"] in OUR_CLIENTS or (
                container in spec["containers"] and spec["serviceAccountName"] in bound
            )
            assert (TOKEN_PATH in mounts) == calls_api, (where, container["name"])
            if calls_api:
                assert mounts[TOKEN_PATH]["readOnly"] is True and mounts[TOKEN_PATH]["name"] == "kube-api-access"
        if any(
            TOKEN_PATH in {m["mountPath"] for m in c.get("volumeMounts", [])}
            for c in spec["containers"] + spec.get("initContainers", [])
        ):
            volume = next(v for v in spec["volumes"] if v["name"] == "kube-api-access")
            sources = [next(iter(s)) for s in volume["projected"]["sources"]]
            assert sources == ["serviceAccountToken", "configMap", "downwardAPI"], where


def test_the_components_that_call_the_api_are_those_the_docs_name(helm_bin):
    """docs/security.md: gpu-label, driver, gpu-device and vfio-manager call the API themselves."""
    objects = rendered(helm_bin, "deployment")
    callers = {
        name
        for (kind, name), spec in pod_specs(objects).items()
        if kind == "DaemonSet" and any(m["mountPath"] == TOKEN_PATH for m in spec["containers"][0].get("volumeMounts", []))
    }
    assert callers == {"metax-gpu-label", "metax-driver", "metax-gpu-device", "metax-vfio-manager"}


@pytest.mark.parametrize("mode", ["deployment", "cronjob"])
def test_every_pod_runs_under_seccomp_runtime_default_and_privileged_containers_say_unconfined(helm_bin, mode):
    for where, spec in pod_specs(rendered(helm_bin, mode)).items():
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        for container in spec["containers"] + spec.get("initContainers", []):
            context = container["securityContext"]
            expected = "Unconfined" if context.get("privileged") else "RuntimeDefault"
            assert context["seccompProfile"] == {"type": expected}, (where, container["name"])


@pytest.mark.parametrize("mode", ["deployment", "cronjob"])
def test_every_container_requests_cpu_and_memory_and_has_a_memory_limit(helm_bin, mode):
    for where, spec in pod_specs(rendered(helm_bin, mode)).items():
        for container in spec["containers"] + spec.get("initContainers", []):
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), (where, container["name"])
            assert "memory" in resources["limits"], (where, container["name"])


def test_only_the_driver_and_maca_have_no_cpu_limit(helm_bin):
    unlimited = {
        where[1]
        for where, spec in pod_specs(rendered(helm_bin, "deployment")).items()
        for c in spec["containers"] + spec.get("initContainers", [])
        if "cpu" not in c["resources"]["limits"]
    }
    assert unlimited == {"metax-driver", "metax-maca"}


def test_unprivileged_containers_have_a_read_only_root_filesystem(helm_bin):
    for where, spec in pod_specs(rendered(helm_bin, "deployment")).items():
        for container in spec["containers"] + spec.get("initContainers", []):
            if not container["securityContext"].get("privileged"):
                assert container["securityContext"]["readOnlyRootFilesystem"] is True, (where, container["name"])


def test_the_runner_is_probed_on_its_health_port(helm_bin):
    spec = pod_specs(rendered(helm_bin, "deployment"))[("Deployment", "metax-operator-runner")]
    container = spec["containers"][0]
    assert container["ports"] == [{"name": "health", "containerPort": 8081, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    command = container["command"]
    assert command[command.index("--health-port") + 1] == "8081"
    assert command[command.index("--stall-timeout") + 1] == "300"


VAP = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"
SEED = ("--set", "registry=domain.example/project", "--set", "driver.payload.version=2.32.0.6")


def node_write_policy(helm: str, *args: str) -> list[dict]:
    return [
        o
        for o in render_chart(helm=helm, args=SEED + args)
        if o["kind"].startswith("ValidatingAdmissionPolicy")
        and o["metadata"]["name"].endswith("-node-writes")
        and not o["metadata"]["name"].endswith("-runner-node-writes")
    ]


def test_the_node_write_policy_names_every_component_that_patches_nodes_when_the_cluster_serves_it(helm_bin):
    policy, binding = node_write_policy(helm_bin, "--api-versions", VAP, "--set", "vfioManager.deploy=true")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    (condition,) = policy["spec"]["matchConditions"]
    named = set(condition["expression"].split(" in ", 1)[1].strip("[]").replace('"', "").split(","))
    assert named == {
        f"system:serviceaccount:metax-operator:metax-{c}" for c in ("gpu-label", "driver", "gpu-device", "vfio-manager")
    }
    patchers = {
        o["metadata"]["name"]
        for o in render_chart(helm=helm_bin, args=SEED + ("--set", "vfioManager.deploy=true"))
        if o["kind"] == "ClusterRole" and any("nodes" in r["resources"] and "patch" in r["verbs"] for r in o["rules"])
    }
    assert patchers == {
        "metax-operator-gpu-label",
        "metax-operator-driver",
        "metax-operator-gpu-device",
        "metax-operator-vfio-manager",
        "metax-operator-runner",
        "metax-operator-cleanup",
    }  # cordons; the uninstall hook's unlabelling
    assert "k.startsWith(p)" in str(policy["spec"]["variables"]) and '["metax-tech.com/"]' in str(policy["spec"])


def test_the_node_write_policy_is_left_out_where_it_is_not_served_or_turned_off(helm_bin):
    assert node_write_policy(helm_bin) == []  # `helm template` without --api-versions: a pre-1.30 cluster
    assert node_write_policy(helm_bin, "--api-versions", VAP, "--set", "nodeWritePolicy.enabled=false") == []


def test_the_runner_s_node_write_policy_is_rendered_only_where_the_cluster_serves_it(helm_bin):
    def runner_policy(*args: str) -> list[str]:
        objects = render_chart(helm=helm_bin, args=SEED + args)
        return [o["kind"] for o in objects if o["metadata"]["name"].endswith("-runner-node-writes")]

    assert runner_policy("--api-versions", VAP) == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    assert runner_policy() == []  # before Kubernetes 1.30
    assert runner_policy("--api-versions", VAP, "--set", "runner.enabled=false") == []
