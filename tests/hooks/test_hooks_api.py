"""Each hook command against a real kube-apiserver (the `control_plane` fixture, kwok nodes).

Hook Jobs cannot run under kwok (no containers), so each test runs the command a Job runs, in
process through `cli.main`, with the Job's arguments: the values file is the `values.json` of the
hook values ConfigMap as `helm template` renders it, the CRD the chart's `crds/` file.
"""

from __future__ import annotations

import copy
import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from metax_operator import cli, contract
from metax_operator.chart import schema
from metax_operator.hooks import bootstrap, cleanup, common, rollback_hold
from metax_operator.runtime import helm_hold, kube
from tests.controlplane import GPU_LABEL
from tests.e2e.tools import service_account_kubeconfig
from tests.helm import BIN, CHART, UPGRADE_CRDS_ARGS, find, render_chart
from tests.waiting import consistently, eventually, for_seconds

BASE_VALUES = {"registry": "cr.example.com/metax", "driver": {"payload": {"version": "2.32.0.6"}}}
CRD = (common.CRD_API_VERSION, "CustomResourceDefinition", contract.CRD_NAME)
CR = (contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME)


def merged(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def values_file(tmp_path: Path, extra: dict | None = None, name: str = "values.json") -> Path:
    """The values.json the hook Jobs mount, as Helm 3 renders it for BASE_VALUES + `extra`."""
    objects = render_chart(merged(BASE_VALUES, extra or {}), show_only=["templates/hooks/values-configmap.yaml"])
    path = tmp_path / name
    path.write_text(find(objects, "ConfigMap", "metax-operator-values")["data"]["values.json"])
    return path


class Hooks:
    """Runs `metax-operator ARGS --kubeconfig K` in process; returns (exit status, stdout, stderr)."""

    def __init__(self, kubeconfig: Path, capsys):
        self.kubeconfig, self.capsys = str(kubeconfig), capsys

    def __call__(self, *args: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        code = cli.main([*args, "--kubeconfig", self.kubeconfig])
        out, err = self.capsys.readouterr()
        return code, out, err


@pytest.fixture
def hooks(control_plane, capsys) -> Hooks:
    return Hooks(control_plane.kubeconfig, capsys)


@pytest.fixture
def client(control_plane) -> kube.Client:
    return kube.Client.connect(str(control_plane.kubeconfig))


@pytest.fixture
def crd(client, hooks):
    """The chart's CRD installed, as upgrade-crds applies it on upgrade."""
    code, _, err = hooks("upgrade-crds", *UPGRADE_CRDS_ARGS)
    assert code == 0, err
    return client.get(*CRD)


@pytest.fixture
def no_cr(client, crd):
    """No cluster-operator CR before and after the test (other tests may use it too)."""

    def delete():
        current = client.get(*CR)
        if current:
            client.delete(*CR)
            client.wait_deleted(*CR, uid=current["metadata"]["uid"], timeout=30)

    delete()
    yield
    delete()


@pytest.fixture
def namespace(client):
    name = f"hooks-{uuid.uuid4().hex[:8]}"
    client.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}, field_manager="test")
    yield name
    client.delete("v1", "Namespace", name)


@pytest.fixture
def gpu_nodes(client):
    """The GPU nodes' names; cleanup removes their gpu label, so it is put back afterwards for
    the session's other tests (the test keys written here are removed too)."""
    names = sorted(n["metadata"]["name"] for n in client.list("v1", "Node", label_selector=f"{GPU_LABEL}=true"))
    assert names
    yield names
    for name in names:
        client.patch(
            "v1",
            "Node",
            name,
            {
                "metadata": {
                    "labels": {GPU_LABEL: "true", "metax-tech.com/gpu-device.mode": None},
                    "annotations": {"team.example.com/owner": None, "metax-tech.com/gpu-vfio": None},
                }
            },
        )


def managed(cr: dict) -> dict[str, dict]:
    """managedFields by manager (without timestamps)."""
    return {m["manager"]: m["fieldsV1"] for m in cr["metadata"]["managedFields"]}


# --- kube.py against the API server ---------------------------------------------------------


def test_list_follows_continue_tokens(client, monkeypatch):
    everything = client.list("v1", "Node")
    monkeypatch.setattr(kube, "PAGE_SIZE", 5)
    assert len(everything) >= 12
    assert [n["metadata"]["name"] for n in client.list("v1", "Node")] == [n["metadata"]["name"] for n in everything]


def test_delete_preconditions_refuse_another_object_of_the_same_name(client, namespace):
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "probe", "namespace": namespace}, "data": {"a": "1"}}
    first = client.apply(cm, field_manager="test")
    client.apply({**cm, "data": {"a": "2"}}, field_manager="test")
    with pytest.raises(kube.ApiException) as err:  # changed since it was read
        client.delete("v1", "ConfigMap", "probe", namespace, resource_version=first["metadata"]["resourceVersion"])
    assert err.value.status == 409
    with pytest.raises(kube.ApiException):  # not the object it was read as
        client.delete("v1", "ConfigMap", "probe", namespace, uid="00000000-0000-0000-0000-000000000000")
    assert client.delete("v1", "ConfigMap", "probe", namespace, uid=first["metadata"]["uid"]) is True
    assert client.delete("v1", "ConfigMap", "probe", namespace) is False  # already gone
    assert client.get("v1", "ConfigMap", "probe", namespace) is None


def test_apply_conflicts_without_force_and_takes_over_with_it(client, namespace):
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owned", "namespace": namespace}, "data": {"a": "1"}}
    client.apply(cm, field_manager="first")
    with pytest.raises(kube.ApiException) as err:
        client.apply({**cm, "data": {"a": "2"}}, field_manager="second")
    assert err.value.status == 409
    taken = client.apply({**cm, "data": {"a": "2"}}, field_manager="second", force=True)
    assert taken["data"] == {"a": "2"}
    assert [m["manager"] for m in taken["metadata"]["managedFields"]] == ["second"]


def test_unknown_kinds_are_named(client):
    with pytest.raises(LookupError, match="does not serve Gadget in v1"):
        client.get("v1", "Gadget", "x")


# --- upgrade-crds ----------------------------------------------------------------------------


def test_upgrade_crds_updates_an_older_crd_and_then_changes_nothing(client, hooks, crd):
    # An older chart's CRD, as Helm left it (a description differs): the hook brings it current.
    def spec_schema(obj: dict) -> dict:
        return next(v for v in obj["spec"]["versions"] if v["storage"])["schema"]["openAPIV3Schema"]["properties"]["spec"]

    chart_description = spec_schema(crd)["description"]
    old = copy.deepcopy(crd)
    spec_schema(old)["description"] = "an older chart's CRD"
    client.call("PUT", client.resource(*CRD[:2]).path(contract.CRD_NAME), body=old)
    assert spec_schema(client.get(*CRD))["description"] == "an older chart's CRD"
    code, out, err = hooks("upgrade-crds", *UPGRADE_CRDS_ARGS)
    assert (code, err) == (0, "") and "applied" in out
    current = client.get(*CRD)
    assert spec_schema(current)["description"] == chart_description
    assert any(c["type"] == "Established" and c["status"] == "True" for c in current["status"]["conditions"])

    code, out, _ = hooks("upgrade-crds", *UPGRADE_CRDS_ARGS, "--if-exists")
    assert code == 0 and "already current" in out
    assert client.get(*CRD)["metadata"]["resourceVersion"] == current["metadata"]["resourceVersion"]


def test_a_later_apply_of_crds_dir_does_not_conflict_with_the_hook(client, hooks, crd):
    # Helm 4 installs crds/ by server-side apply without force, also over a CRD kept from an
    # earlier release. On 1.34 the hook applied the whole form, whose rules differ from crds/'s.
    assert contract.UPGRADE_CRDS_FIELD_MANAGER not in managed(crd)
    portable = yaml.safe_load((CHART / schema.CRD_FILE).read_text())
    assert portable["spec"] != crd["spec"]  # the whole form is in place
    client.apply(portable, field_manager="helm")  # raises ApiException 409 on a conflict
    assert client.get(*CRD)["spec"]["versions"][0]["schema"] == portable["spec"]["versions"][0]["schema"]
    code, out, err = hooks("upgrade-crds", *UPGRADE_CRDS_ARGS, "--if-exists")  # the pre-install hook after it
    assert (code, err) == (0, "") and "applied" in out
    assert client.get(*CRD)["spec"] == crd["spec"]


def test_upgrade_crds_on_install_never_creates(client, hooks, crd):
    client.delete(*CRD)
    client.wait_deleted(*CRD, timeout=60)
    try:
        code, out, _ = hooks("upgrade-crds", *UPGRADE_CRDS_ARGS, "--if-exists")
        assert code == 0 and "not installed" in out
        assert client.get(*CRD) is None
    finally:
        assert hooks("upgrade-crds", *UPGRADE_CRDS_ARGS)[0] == 0  # the others' tests need it


# --- preflight -------------------------------------------------------------------------------


def test_preflight_passes_on_supported_nodes(hooks, tmp_path):
    code, out, err = hooks("preflight", "--values", str(values_file(tmp_path)))
    assert code == 0, err
    assert "prerequisites met" in out


def test_preflight_rejects_bad_values_in_one_line(hooks, tmp_path):
    path = values_file(tmp_path)
    values = json.loads(path.read_text())
    values["maca"]["deploy"] = False  # gpuDevice needs maca (the render would refuse it too)
    path.write_text(json.dumps(values))
    code, _, err = hooks("preflight", "--values", str(path))
    assert code == 1
    assert "error: gpuDevice.deploy: is true but its prerequisite maca.deploy is false" in err


def test_preflight_fails_on_a_gpu_node_with_old_containerd(client, hooks, tmp_path):
    name = f"old-runtime-{uuid.uuid4().hex[:6]}"  # not kwok-managed: its status is ours to write
    client.apply(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {GPU_LABEL: "true"}},
            "spec": {"unschedulable": True},
        },
        field_manager="test",
    )
    try:
        client.patch(
            "v1",
            "Node",
            name,
            {
                "status": {
                    "nodeInfo": {
                        "containerRuntimeVersion": "containerd://1.4.13",
                        "kubeletVersion": "v1.34.4",
                        "osImage": "CentOS Linux 7 (Core)",
                        "kernelVersion": "3.10.0",
                        "machineID": "",
                        "systemUUID": "",
                        "bootID": "",
                        "kubeProxyVersion": "",
                        "operatingSystem": "linux",
                        "architecture": "amd64",
                    }
                }
            },
            subresource="status",
        )
        code, _, err = hooks("preflight", "--values", str(values_file(tmp_path)))
        assert code == 1
        assert f"error: node {name}: containerd 1.4.13 is older than 1.5.0" in err
        assert f"warning: node {name}: OS CentOS Linux 7 (Core) is not one the seed lists" in err
        assert err.count("error:") == 1  # the kwok nodes (containerd 1.7.13, Ubuntu 22.04) pass
    finally:
        client.delete("v1", "Node", name)


# --- bootstrap -------------------------------------------------------------------------------


def test_bootstrap_creates_the_cr_from_values_only(client, hooks, no_cr, tmp_path):
    code, out, err = hooks("bootstrap", "--release", "metax", "--values", str(values_file(tmp_path)))
    assert code == 0, err
    cr = client.get(*CR)
    spec = cr["spec"]
    assert spec["registry"] == "cr.example.com/metax"
    assert spec["driver"]["payload"]["version"] == "2.32.0.6"
    assert spec["driver"]["upgradePolicy"]["pause"] is False
    # chart-only keys stay out of the CR
    assert not {"runner", "tools", "hooks", "crds", "tests", "imagePullSecrets", "commonLabels"} & set(spec)
    assert "image" not in spec["driver"] and "resources" not in spec["gpuDevice"]
    assert list(managed(cr)) == [contract.BOOTSTRAP_FIELD_MANAGER]
    assert cr["metadata"]["labels"]["app.kubernetes.io/instance"] == "metax"

    # Re-run (every Argo CD sync): nothing changes, not even managedFields.
    assert hooks("bootstrap", "--release", "metax", "--values", str(values_file(tmp_path)))[0] == 0
    again = client.get(*CR)
    assert again["metadata"]["resourceVersion"] == cr["metadata"]["resourceVersion"]
    assert again["metadata"]["managedFields"] == cr["metadata"]["managedFields"]


def test_bootstrap_records_the_release_revision_it_ran_for(client, hooks, no_cr, tmp_path):
    # The runner holds its writes while a DaemonSet carries an older revision (runtime.helm_hold).
    args = ("bootstrap", "--release", "metax", "--values", str(values_file(tmp_path)))
    assert hooks(*args, "--release-revision", "4")[0] == 0
    cr = client.get(*CR)
    assert cr["metadata"]["annotations"][contract.RELEASE_REVISION_ANNOTATION] == "4"
    assert hooks(*args, "--release-revision", "4")[0] == 0  # the same hook again: nothing changes
    assert client.get(*CR)["metadata"]["resourceVersion"] == cr["metadata"]["resourceVersion"]
    assert hooks(*args, "--release-revision", "5")[0] == 0
    assert client.get(*CR)["metadata"]["annotations"][contract.RELEASE_REVISION_ANNOTATION] == "5"
    code, _, err = hooks(*args, "--release-revision", "0")
    assert code == 1 and "--release-revision" in err and "Traceback" not in err


def test_bootstrap_updates_what_the_values_change(client, hooks, no_cr, tmp_path):
    assert hooks("bootstrap", "--release", "metax", "--values", str(values_file(tmp_path)))[0] == 0
    changed = values_file(
        tmp_path,
        {
            "driver": {"payload": {"version": "2.33.0.1"}},
            "vfioManager": {"vfioConfig": [{"nodeName": "gpu-node-\\d+", "gpus": "0,1"}]},
        },
        name="v2.json",
    )
    assert hooks("bootstrap", "--release", "metax", "--values", str(changed))[0] == 0
    spec = client.get(*CR)["spec"]
    assert spec["driver"]["payload"]["version"] == "2.33.0.1"
    assert spec["vfioManager"]["vfioConfig"] == [{"nodeName": "gpu-node-\\d+", "gpus": "0,1"}]


def test_runtime_controls_set_by_an_admin_survive_upgrades_that_do_not_set_them(client, hooks, no_cr, tmp_path):
    def run(extra: dict, name: str) -> list[str]:
        code, out, err = hooks("bootstrap", "--release", "metax", "--values", str(values_file(tmp_path, extra, name)))
        assert code == 0, err
        return [line for line in out.splitlines() if "kept at" in line]

    def admin_patch(path: str, value: bool) -> None:  # what `kubectl patch --type=json` sends
        client.patch(
            *CR,
            [{"op": "replace", "path": f"/spec/driver/upgradePolicy/{path}", "value": value}],
            patch_type="json",
            field_manager="kubectl-patch",
        )

    def policy() -> dict:
        return client.get(*CR)["spec"]["driver"]["upgradePolicy"]

    rollout = {"driver": {"upgradePolicy": {"enableRollout": True, "upgradeSteps": [{"replicas": "100%"}]}}}
    run(rollout, "v1.json")
    admin_patch("pause", True)  # the admin pauses the rollout
    admin_patch("enableRollout", False)  # and flips the rollout off

    # helm upgrade with a new driver version, not touching the controls: the admin's values stay
    notes = run(merged(rollout, {"driver": {"payload": {"version": "2.33.0.1"}}}), "v2.json")
    assert len(notes) == 2
    cr = client.get(*CR)
    assert cr["spec"]["driver"]["payload"]["version"] == "2.33.0.1"
    assert (policy()["pause"], policy()["enableRollout"]) == (True, False)
    # the bootstrap manager no longer owns the admin's fields, kubectl-patch does
    owned = managed(cr)
    assert "f:pause" in json.dumps(owned["kubectl-patch"])
    assert "f:pause" not in json.dumps(owned[contract.BOOTSTRAP_FIELD_MANAGER])

    # again (Argo CD sync): no change at all
    run(merged(rollout, {"driver": {"payload": {"version": "2.33.0.1"}}}), "v2.json")
    assert client.get(*CR)["metadata"]["resourceVersion"] == cr["metadata"]["resourceVersion"]

    # values that set a control win: pause set to true, then back to false, overrides the admin
    run(merged(rollout, {"driver": {"payload": {"version": "2.33.0.1"}, "upgradePolicy": {"pause": True}}}), "v3.json")
    assert policy()["pause"] is True
    notes = run(merged(rollout, {"driver": {"payload": {"version": "2.33.0.1"}, "upgradePolicy": {"pause": False}}}), "v4.json")
    assert policy()["pause"] is False and all("pause" not in n for n in notes)
    # enableRollout: the values still say true, unchanged since v1, so the admin's false stays
    assert policy()["enableRollout"] is False


def test_bootstrap_waits_for_the_crd_to_be_served(client, hooks, no_cr, tmp_path):
    """With hooks as plain resources (GitOps) bootstrap may start before the CRD is there."""
    import threading

    client.delete(*CRD)
    client.wait_deleted(*CRD, timeout=60)
    values = json.loads(values_file(tmp_path).read_text())
    result: dict = {}
    worker = threading.Thread(
        target=lambda: result.update(
            cr=bootstrap.bootstrap(kube.Client.connect(hooks.kubeconfig), values, "metax", timeout=60)[0]
        )
    )
    worker.start()
    consistently(worker.is_alive, for_seconds(3), 10, "bootstrap waiting for the CRD (not failed)")
    assert hooks("upgrade-crds", *UPGRADE_CRDS_ARGS)[0] == 0
    worker.join(60)
    assert result["cr"]["spec"]["registry"] == "cr.example.com/metax"


def test_bootstrap_survives_a_concurrent_admin_edit(client, hooks, no_cr, tmp_path):
    """The apply carries the resourceVersion it decided on: an edit in between is re-read, not lost."""
    path = str(values_file(tmp_path))
    assert hooks("bootstrap", "--release", "metax", "--values", path)[0] == 0
    real_get, calls = client.get, []

    def get_then_edit(*args, **kwargs):
        result = real_get(*args, **kwargs)
        if args[1] == contract.CR_KIND and not calls:
            calls.append(1)
            client.patch(*CR, {"spec": {"driver": {"upgradePolicy": {"pause": True}}}}, field_manager="kubectl-edit")
        return result

    client.get = get_then_edit
    bootstrap.bootstrap(client, json.loads(Path(path).read_text()), "metax")
    assert real_get(*CR)["spec"]["driver"]["upgradePolicy"]["pause"] is True


# --- cleanup ---------------------------------------------------------------------------------


def daemonset(name: str, namespace: str) -> dict:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "main", "image": "registry.invalid/metax/probe:1"}]},
            },
        },
    }


def test_cleanup_leaves_nothing_of_ours_and_nothing_else_touched(client, hooks, no_cr, namespace, gpu_nodes, tmp_path):
    assert hooks("bootstrap", "--release", "metax", "--values", str(values_file(tmp_path)))[0] == 0
    for name in cleanup.NODE_WRITERS:
        client.apply(daemonset(name, namespace), field_manager="helm")
    client.patch(
        "v1",
        "Node",
        gpu_nodes[0],
        {
            "metadata": {
                "annotations": {"metax-tech.com/gpu-vfio": '{"0":1,"1":0}', "team.example.com/owner": "ml"},
                "labels": {"metax-tech.com/gpu-device.mode": "sgpu", "metax-tech.com/driver-upgrade.state": "done"},
            }
        },
    )
    eventually(lambda: len(client.list("v1", "Pod", namespace)) >= 2 * len(gpu_nodes), 60, "node-writer pods")
    code, out, err = hooks("cleanup", "--namespace", namespace)
    assert code == 0, err
    assert client.get(*CR) is None
    assert all(client.get("apps/v1", "DaemonSet", n, namespace) is None for n in cleanup.NODE_WRITERS)
    assert client.list("v1", "Pod", namespace) == []
    assert client.list("v1", "Node", label_selector=GPU_LABEL) == []
    first = client.get("v1", "Node", gpu_nodes[0])["metadata"]
    assert "metax-tech.com/gpu-vfio" not in first["annotations"]
    assert first["annotations"]["team.example.com/owner"] == "ml"  # not ours: kept
    assert first["labels"]["metax-tech.com/gpu-device.mode"] == "sgpu"  # the admin's: kept
    assert "metax-tech.com/driver-upgrade.state" not in first["labels"]  # the runner's: removed
    assert client.get(*CRD) is not None  # crds.keep (default)
    assert f"node {gpu_nodes[0]}" in out

    code, out, _ = hooks("cleanup", "--namespace", namespace)  # idempotent
    assert code == 0 and out.strip() == "cleanup: nothing to clean up"


def test_cleanup_uncordons_the_nodes_the_runner_cordoned_and_no_other(client, hooks, no_cr, namespace, gpu_nodes):
    # `helm uninstall` during a rollout: the runner had cordoned a wave node; an admin had
    # cordoned another node for their own reasons; gpu-label had described the GPUs.
    runner_cordoned, admin_cordoned = gpu_nodes[0], gpu_nodes[1]
    gpu = {"metax-tech.com/gpu.product": "C500", "metax-tech.com/gpu.vfnum": "4"}
    labels = {runner_cordoned: {contract.CORDONED_LABEL: "true", **gpu}, admin_cordoned: {"team.example.com/hold": "true"}}
    try:
        for name, extra in labels.items():
            client.patch("v1", "Node", name, {"metadata": {"labels": extra}, "spec": {"unschedulable": True}})
        code, out, err = hooks("cleanup", "--namespace", namespace, "--runner", "metax-operator-runner")
        assert code == 0, err
        assert f"uncordoned node {runner_cordoned}" in out
        first, second = client.get("v1", "Node", runner_cordoned), client.get("v1", "Node", admin_cordoned)
        assert not first["spec"].get("unschedulable")
        assert not {contract.CORDONED_LABEL, *gpu} & set(first["metadata"]["labels"])
        assert second["spec"]["unschedulable"] is True  # the admin's cordon stays
        assert second["metadata"]["labels"]["team.example.com/hold"] == "true"
    finally:
        for name in labels:
            client.patch(
                "v1",
                "Node",
                name,
                {
                    "metadata": {"labels": dict.fromkeys([contract.CORDONED_LABEL, "team.example.com/hold", *gpu])},
                    "spec": {"unschedulable": None},
                },
            )


def test_cleanup_stops_the_runner_then_deletes_its_lease_and_the_kept_test_pod(client, hooks, namespace, gpu_nodes):
    labels = {"app": "runner"}
    pod_spec = {"containers": [{"name": "main", "image": "registry.invalid/metax/probe:1"}]}
    client.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "r", "namespace": namespace},
            "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels}, "spec": pod_spec}},
        },
        field_manager="helm",
    )
    client.apply(
        {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": "r", "namespace": namespace},
            "spec": {"holderIdentity": "r-0_abc"},
        },
        field_manager="metax-operator-runner",
    )
    client.apply(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "t", "namespace": namespace}, "spec": pod_spec},
        field_manager="helm",
    )
    eventually(lambda: len(client.list("v1", "Pod", namespace)) == 2, 60, "the runner's and the test pod")
    code, out, err = hooks("cleanup", "--namespace", namespace, "--runner", "r", "--test-pod", "t")
    assert code == 0, err
    lines = out.splitlines()
    # The runner stops with the first deletions; its Lease goes only once it has stopped.
    assert f"cleanup: deleted Deployment {namespace}/r and its pods" in lines[:-2]
    assert lines[-2:] == [f"cleanup: deleted Lease {namespace}/r", f"cleanup: deleted Pod {namespace}/t"]
    assert client.list("v1", "Pod", namespace) == [] and client.get("coordination.k8s.io/v1", "Lease", "r", namespace) is None
    code, out, _ = hooks("cleanup", "--namespace", namespace, "--runner", "r", "--test-pod", "t")  # idempotent
    assert code == 0 and "Deployment" not in out and "Lease" not in out and "Pod" not in out


def test_cleanup_deletes_the_crd_only_when_asked(client, hooks, crd, namespace, gpu_nodes):
    try:
        code, out, err = hooks("cleanup", "--namespace", namespace, "--delete-crd")
        assert code == 0, err
        assert client.get(*CRD) is None and f"deleted CRD {contract.CRD_NAME}" in out
    finally:
        assert hooks("upgrade-crds", *UPGRADE_CRDS_ARGS)[0] == 0


def hook_job(control_plane, client, hooks, namespace: str, tmp_path: Path, values: dict, hook: str) -> tuple[Hooks, list[str]]:
    """Hook `hook` as its Job runs it in `namespace`: its ServiceAccount and RBAC rendered for
    `values` and applied there, and the Job's arguments; returns a runner of the command as that
    ServiceAccount, and the arguments."""
    rendered = render_chart(values, show_only=[f"templates/hooks/{hook}.yaml"])
    for obj in rendered:
        if "namespace" in obj["metadata"]:
            obj["metadata"]["namespace"] = namespace
        for subject in obj.get("subjects", []):
            subject["namespace"] = namespace
        if obj["kind"] != "Job":
            client.apply(obj, field_manager="deployer")
    args = find(rendered, "Job", f"metax-operator-{hook}")["spec"]["template"]["spec"]["containers"][0]["args"]
    kubeconfig = service_account_kubeconfig(control_plane, tmp_path, f"metax-operator-{hook}", namespace)
    return Hooks(kubeconfig, hooks.capsys), [namespace if a == "metax-operator" else a for a in args]


def test_cleanup_with_its_own_rbac_deletes_that_rbac_last(control_plane, client, hooks, no_cr, namespace, gpu_nodes, tmp_path):
    """GitOps mode (Argo CD): the cleanup Job's ClusterRole and binding are not hooks, and the
    cleanup, running as its own ServiceAccount with exactly the chart's rules, deletes them."""
    assert hooks("bootstrap", "--release", "metax", "--values", str(values_file(tmp_path)))[0] == 0
    as_hook, args = hook_job(
        control_plane, client, hooks, namespace, tmp_path, merged(BASE_VALUES, {"hooks": {"useHelmHooks": False}}), "cleanup"
    )
    code, out, err = as_hook(*args)
    assert code == 0, err
    assert client.get(*CR) is None
    assert "deleted its ClusterRole and ClusterRoleBinding metax-operator-cleanup" in out
    rbac = "rbac.authorization.k8s.io/v1"
    assert client.get(rbac, "ClusterRole", "metax-operator-cleanup") is None
    eventually(
        lambda: client.get(rbac, "ClusterRoleBinding", "metax-operator-cleanup") is None,
        30,
        "the garbage collector to delete the binding, a dependent of the deleted role",
    )


# --- rollback-hold ---------------------------------------------------------------------------


def test_pre_rollback_hooks_hold_the_runner_and_stop_rolling_updates(control_plane, client, hooks, no_cr, namespace, tmp_path):
    """Release 4 rolls back to release 2: the pre-rollback bootstrap writes release 2's values and
    revision, then rollback-hold runs as its Job does (its ServiceAccount with exactly the chart's
    rules). Until Helm has applied release 2 the runner writes nothing."""
    bootstrap_at = lambda revision: hooks(  # noqa: E731
        "bootstrap", "--release", "metax", "--values", str(values_file(tmp_path)), "--release-revision", revision
    )
    assert bootstrap_at("4")[0] == 0
    for name in [*rollback_hold.COMPONENTS.values(), contract.DRIVER_DAEMONSET]:
        ds = daemonset(name, namespace)
        ds["metadata"]["annotations"] = {contract.RELEASE_REVISION_ANNOTATION: "4"}
        if name == contract.DRIVER_DAEMONSET:
            ds["spec"]["updateStrategy"] = contract.DRIVER_UPDATE_STRATEGY
        client.apply(ds, field_manager="helm")
    as_hook, args = hook_job(control_plane, client, hooks, namespace, tmp_path, BASE_VALUES, "rollback-hold")

    assert bootstrap_at("2")[0] == 0
    code, out, err = as_hook(*args)
    assert code == 0, err
    daemonsets = {name: client.get("apps/v1", "DaemonSet", name, namespace) for name in rollback_hold.COMPONENTS.values()}
    for name, ds in daemonsets.items():
        assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}, name
        assert name in out
    driver = client.get("apps/v1", "DaemonSet", contract.DRIVER_DAEMONSET, namespace)
    assert rollback_hold.FIELD_MANAGER not in {m["manager"] for m in driver["metadata"]["managedFields"]}
    held = helm_hold.hold(client.get(*CR), daemonsets, time.time)
    assert held is not None and held.revision == 2 and held.behind == sorted(daemonsets)

    code, out, err = as_hook(*args)  # retried (a second `helm rollback`): nothing more to stop
    assert code == 0 and "nothing to stop" in out, (out, err)


def test_rollback_hold_leaves_missing_daemonsets_alone(hooks, namespace):
    code, out, err = hooks("rollback-hold", "--namespace", namespace)
    assert code == 0 and "nothing to stop" in out, (out, err)


# --- helm test -------------------------------------------------------------------------------


def test_test_command_reports_each_problem_then_passes_on_a_healthy_install(client, hooks, no_cr, gpu_nodes, tmp_path):
    """The chart installed for real (Helm 3, hooks run here instead of as Jobs)."""
    release, ns = f"t{uuid.uuid4().hex[:6]}", f"hooks-install-{uuid.uuid4().hex[:6]}"
    kubeconfig = ["--kubeconfig", hooks.kubeconfig]
    values = tmp_path / "install.yaml"
    values.write_text(json.dumps(BASE_VALUES))
    code, out, err = hooks("test", "--namespace", ns)
    assert code == 1 and "FAIL ClusterOperator cluster-operator: not found" in err

    subprocess.run(
        [
            BIN / "helm3",
            "install",
            release,
            str(CHART),
            "-n",
            ns,
            "--create-namespace",
            "--no-hooks",
            "-f",
            str(values),
            "--wait",
            "--timeout",
            "120s",
            *kubeconfig,
        ],
        check=True,
        capture_output=True,
    )
    try:
        assert hooks("bootstrap", "--release", release, "--values", str(values_file(tmp_path)))[0] == 0
        last: list = []

        def healthy() -> bool:
            last[:] = hooks("test", "--namespace", ns)
            return last[0] == 0

        try:
            eventually(healthy, 60, "a healthy install", interval=2)
        except AssertionError:
            raise AssertionError(last[2]) from None
        code, out, err = last
        assert (code, err) == (0, "") and "healthy" in out, err

        # break three things: one line each, naming what and where
        client.patch(
            "v1", "ConfigMap", "driver-config", {"data": {"node-vfnums": "nodes:\n  n1:\n    vfnum: 99\n"}}, namespace=ns
        )
        client.delete("apps/v1", "DaemonSet", "metax-maca", ns)
        node = gpu_nodes[0]
        client.patch("v1", "Node", node, {"status": {"allocatable": {"metax-tech.com/gpu": "0"}}}, subresource="status")
        try:
            code, _, err = hooks("test", "--namespace", ns)
            lines = err.strip().splitlines()
            assert code == 1
            assert f"FAIL DaemonSet {ns}/metax-maca: not found, though the CR enables it" in lines
            assert any(line.startswith(f"FAIL ConfigMap {ns}/driver-config: ") and "vfnum" in line for line in lines)
            assert f"FAIL node {node}: no allocatable metax-tech.com/gpu (a component is not working there)" in lines
            assert len(lines) == 3
        finally:
            client.patch("v1", "Node", node, {"status": {"allocatable": {"metax-tech.com/gpu": "8"}}}, subresource="status")
    finally:
        code, _, err = hooks("cleanup", "--namespace", ns)
        subprocess.run(
            [BIN / "helm3", "uninstall", release, "-n", ns, "--no-hooks", "--wait", *kubeconfig], check=True, capture_output=True
        )
        client.delete("v1", "Namespace", ns)
        assert code == 0, err
