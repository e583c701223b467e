"""The workload checks and the per-node view on the real control plane (kwok nodes carrying the
sGPU labels and resources).

The chart is installed with Helm 3 without hooks and the CR bootstrapped, as in test_runner.py.
Misconfigurations are made the way admins and users make them (kubectl label, a pod with
METAX_MACA_VERSION, HAMi's scheduler going away, `runtime.deploy` turned off in the CR); the
runner (`metax-operator run`, as the chart's runner ServiceAccount), `helm test`'s command and the
preflight hook's command (each as the ServiceAccount and RBAC the chart renders for it) must then
report them in the same words.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from metax_operator import cli, contract
from metax_operator import workloads as wl
from metax_operator.runtime import kube
from tests.doc_blocks import blocks
from tests.e2e.test_runner import Runner
from tests.e2e.tools import (
    CR,
    METAX,
    bootstrap,
    cr_condition,
    install_chart,
    kubectl,
    ready,
    release_values,
    service_account_kubeconfig,
    uninstall_chart,
)
from tests.helm import BIN, CHART, render_chart
from tests.waiting import eventually

NS = "workloads-e2e"
RELEASE = "metax"
# Multi-architecture tags: the simulated fleet has x86 and Arm GPU nodes (docs/chart.md).
IMAGES = ["maca-c500:2.18.0.3-ubuntu18.04", "maca-c500:2.24.0.5-ubuntu20.04"]
VALUES = {
    "registry": "cr.example.com/metax",
    "driver": {"payload": {"version": "2.32.0.6"}},
    "maca": {"payload": {"images": IMAGES}},
}
HAMI_NS = "hami-system"
PAGE = CHART / "docs" / "workloads.md"
ALL_TOLERATED = [{"operator": "Exists"}]


@pytest.fixture(scope="module")
def api(control_plane):
    return control_plane.api()


@pytest.fixture(scope="module")
def cluster(control_plane, api, tmp_path_factory):
    """The chart installed, the CR bootstrapped, and three kwok nodes in sGPU mode (fixed-share QoS,
    16 allocatable sGPUs) plus one with two GPUs bound to vfio-pci; removed afterwards."""
    tmp = tmp_path_factory.mktemp("workloads")
    cp = control_plane
    sgpu = cp.add_nodes(
        3, prefix="wl-sgpu", gpus=0, resources={wl.SGPU_RESOURCE: 16}, labels={wl.MODE_LABEL: "sgpu", wl.QOS_LABEL: "fixed-share"}
    )
    vfio = cp.add_nodes(1, prefix="wl-vfio", gpus=6, resources={wl.VFIO_RESOURCE: 2}, labels={wl.GPU_VFNUM_LABEL: "0"})
    kubectl(cp, "annotate", "node", vfio[0], f'{contract.VFIO_ANNOTATION}={{"0":1,"1":1,"3":0}}')
    install_chart(cp, api, tmp, RELEASE, NS, VALUES)
    bootstrap(cp, tmp, RELEASE, release_values(cp, RELEASE, NS))
    yield {"sgpu": sgpu, "vfio": vfio, "tmp": tmp}
    uninstall_chart(cp, api, RELEASE, NS)
    cp.remove_nodes(sgpu + vfio)


@pytest.fixture(scope="module")
def hami(control_plane, api, cluster):
    """A HAMi scheduler pod (the label HAMi's chart gives it), Ready under kwok."""
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": HAMI_NS}})
    eventually(lambda: core.list_namespaced_service_account(HAMI_NS).items, 20, "the default service account")
    pod = scheduler_pod(cluster["sgpu"][0])
    core.create_namespaced_pod(HAMI_NS, pod)
    eventually(
        lambda: wl.ready(api.sanitize_for_serialization(core.read_namespaced_pod("hami-scheduler", HAMI_NS))),
        30,
        "the HAMi scheduler pod Ready",
    )
    yield pod
    core.delete_namespace(HAMI_NS)


def scheduler_pod(node: str) -> dict:
    key, value = wl.HAMI_SCHEDULER_LABEL
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "hami-scheduler", "labels": {key: value, "app.kubernetes.io/name": "hami"}},
        "spec": {
            "nodeName": node,
            "tolerations": ALL_TOLERATED,
            "containers": [{"name": "vgpu-scheduler-extender", "image": "projecthami/hami:v2.6.1"}],
        },
    }


def gpu_job(name: str, maca_version: str) -> dict:
    """A job as seed §3.3.2-3.3.3 writes it: an sGPU and an MXMACA version."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [
                {
                    "name": "app",
                    "image": "registry.example/app:1.0",
                    "env": [{"name": wl.MACA_VERSION_ENV, "value": maca_version}],
                    "resources": {"limits": {wl.SGPU_RESOURCE: "1"}},
                }
            ]
        },
    }


def patch_cr(api, spec: dict) -> None:
    client.CustomObjectsApi(api).patch_cluster_custom_object(*CR, {"spec": spec})


def hook_kubeconfig(cp, tmp: Path, template: str, account: str) -> Path:
    """Apply the RBAC the chart renders for a hook (not the hook itself) and return a kubeconfig
    of its ServiceAccount, so the command runs with exactly the permissions it gets in production."""
    objects = [
        o
        for o in render_chart({**VALUES, "hooks": {"useHelmHooks": False}}, show_only=[template], args=["--namespace", NS])
        if o["kind"] not in ("Job", "Pod")
    ]
    path = tmp / f"{account}-rbac.yaml"
    path.write_text(yaml.safe_dump_all(objects))
    kubectl(cp, "apply", "-n", NS, "-f", str(path))
    return service_account_kubeconfig(cp, tmp, account, NS)


def helm_test(kubeconfig: Path) -> str:
    """`metax-operator test` (what `helm test` runs); its stderr."""
    done = subprocess.run(
        [METAX, "test", "--namespace", NS, "--kubeconfig", str(kubeconfig)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    return done.stderr


def preflight(kubeconfig: Path, tmp: Path, values: dict) -> tuple[int, str]:
    """`metax-operator preflight` on `values` (what the pre-install/pre-upgrade hook runs)."""
    path = tmp / "values.json"
    path.write_text(json.dumps(values))
    done = subprocess.run(
        [METAX, "preflight", "--values", str(path), "--kubeconfig", str(kubeconfig)], capture_output=True, text=True, timeout=60
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stderr


def workload_lines(output: str, prefix: str) -> list[str]:
    """The workload problems in a command's output (node and pod lines after `prefix`)."""
    return [
        line[len(prefix) :]
        for line in output.splitlines()
        if line.startswith((f"{prefix}node", f"{prefix}pod"))
        and ("metax-tech.com/gpu-device" in line or wl.MACA_VERSION_ENV in line)
    ]


# -- the checks: runner, helm test, preflight ----------------------------------------------------


def test_misconfigurations_are_reported_by_the_runner_helm_test_and_preflight_in_the_same_words(
    control_plane, api, cluster, hami, tmp_path
):
    cp, core = control_plane, client.CoreV1Api(api)
    sgpu = cluster["sgpu"]
    runner = Runner(service_account_kubeconfig(cp, tmp_path, "metax-operator-runner", NS), tmp_path, "wl-runner", namespace=NS)
    try:
        valid = eventually(
            lambda: (c := cr_condition(api, "WorkloadsValid")) and c["status"] == "True" and c,
            30,
            "WorkloadsValid=True with HAMi running",
        )
        assert valid["reason"] == "Valid"

        # An admin mistypes a label value, a user asks for an MXMACA version that is not deployed
        # and another for none, and HAMi's scheduler goes away.
        kubectl(cp, "label", "node", sgpu[1], f"{wl.QOS_LABEL}=fair", "--overwrite")
        core.create_namespaced_pod("default", gpu_job("job-unmatched", "maca-3"))
        core.create_namespaced_pod("default", gpu_job("job-refused", "maca-"))
        core.create_namespaced_pod("default", gpu_job("job-fine", "maca-2.18"))
        core.delete_namespaced_pod("hami-scheduler", HAMI_NS, grace_period_seconds=0)
        back = f"kubectl label node -l {wl.MODE_LABEL}=sgpu {wl.MODE_LABEL}=native --overwrite"
        expected = [
            f"node {sgpu[1]}: label {wl.QOS_LABEL}=fair is not one of best-effort, fixed-share, burst-share; "
            f"relabel them: kubectl label node -l {wl.QOS_LABEL}=fair {wl.QOS_LABEL}=best-effort --overwrite",
            f"nodes {', '.join(sgpu)}: labelled {wl.MODE_LABEL}=sgpu, but no HAMi scheduler runs (no Ready pod "
            f"labelled {wl.HAMI_SCHEDULER_SELECTOR} in any namespace), so pods requesting {wl.SGPU_RESOURCE} "
            f"cannot be scheduled; install HAMi or set the nodes back to native: {back}",
            "pod default/job-refused: METAX_MACA_VERSION=maca- names no version, so the runtime refuses it "
            "(deployed: maca-2.24.0.5, maca-2.18.0.3); set a version or a prefix of one, e.g. maca-2.24",
            "pod default/job-unmatched: METAX_MACA_VERSION=maca-3 matches none of the MXMACA versions deployed "
            "(maca-2.24.0.5, maca-2.18.0.3); use one of them or a prefix of one, or add a payload image of that "
            "version to maca.payload.images",
        ]
        bad = eventually(
            lambda: (
                (c := cr_condition(api, "WorkloadsValid"))
                and c["status"] == "False"
                and c["message"].splitlines() == expected
                and c
            ),
            30,
            "WorkloadsValid=False naming all four",
        )
        assert bad["reason"] == "WorkloadMisconfigured"
        events = eventually(
            lambda: [
                e
                for e in core.list_namespaced_event("default").items
                if e.reason == "WorkloadMisconfigured" and e.type == "Warning" and e.involved_object.name == "cluster-operator"
            ],
            10,
            "a Warning event",
        )
        assert events[-1].message.startswith("WorkloadsValid=False: " + expected[0])

        # helm test, as its ServiceAccount: one FAIL line each, the same words.
        test_kubeconfig = hook_kubeconfig(cp, tmp_path, "templates/tests/test-pod.yaml", "metax-operator-test")
        assert workload_lines(helm_test(test_kubeconfig), "FAIL ") == expected

        # preflight, as its ServiceAccount, with the release's values: only warnings.
        preflight_kubeconfig = hook_kubeconfig(cp, tmp_path, "templates/hooks/preflight.yaml", "metax-operator-preflight")
        values = release_values(cp, RELEASE, NS)
        code, err = preflight(preflight_kubeconfig, tmp_path, values)
        assert code == 0, err
        assert workload_lines(err, "warning: ") == expected

        # container-runtime turned off (and what needs it, or the API server refuses the edit):
        # sGPU nodes are left without it. Preflight fails a release with such values.
        off = {key: {"deploy": False} for key in ("runtime", "driver", "maca", "gpuDevice")}
        patch_cr(api, off)
        no_runtime = (
            f"nodes {', '.join(sgpu)}: labelled {wl.MODE_LABEL}=sgpu, but sGPU needs the container-runtime "
            "component and it is not deployed (runtime.deploy is false); deploy it (helm upgrade --set "
            f"runtime.deploy=true) or set the nodes back to native: {back}"
        )
        now = eventually(
            lambda: (c := cr_condition(api, "WorkloadsValid")) and no_runtime in c["message"] and c,
            30,
            "WorkloadsValid naming the nodes left without container-runtime",
        )
        assert no_runtime in workload_lines(helm_test(test_kubeconfig), "FAIL ")
        code, err = preflight(preflight_kubeconfig, tmp_path, {**values, **{k: {**values[k], **v} for k, v in off.items()}})
        assert code == 1
        assert f"error: {no_runtime}" in err.splitlines()
        assert sorted(workload_lines(err, "warning: ") + [no_runtime]) == sorted(now["message"].splitlines())
        # without maca no version is deployed: the pods' lines say so, in all three
        unmatched = next(line for line in now["message"].splitlines() if "job-fine" in line)
        assert "(none: the maca component is not deployed (maca.deploy is false))" in unmatched
        assert f"warning: {unmatched}" in err.splitlines()

        # Everything fixed: the condition recovers, with a Normal event.
        kubectl(cp, "label", "node", sgpu[1], f"{wl.QOS_LABEL}=burst-share", "--overwrite")
        for name in ("job-unmatched", "job-refused"):
            core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
        core.create_namespaced_pod(HAMI_NS, {**hami, "metadata": {**hami["metadata"], "name": "hami-scheduler-2"}})
        patch_cr(api, {key: {"deploy": True} for key in off})
        eventually(lambda: cr_condition(api, "WorkloadsValid")["status"] == "True", 30, "WorkloadsValid=True again")
        eventually(
            lambda: [
                e
                for e in core.list_namespaced_event("default").items
                if e.reason == "Valid" and e.type == "Normal" and "WorkloadsValid=True" in e.message
            ],
            10,
            "a Normal event",
        )
    finally:
        runner.stop()
        for name in ("job-unmatched", "job-refused", "job-fine"):
            kubectl(cp, "delete", "pod", name, "-n", "default", "--ignore-not-found", "--wait=false")
        kubectl(cp, "label", "node", sgpu[1], f"{wl.QOS_LABEL}=fixed-share", "--overwrite")
        patch_cr(api, {key: {"deploy": True} for key in ("runtime", "driver", "maca", "gpuDevice")})


# -- the per-node view ---------------------------------------------------------------------------


def test_nodes_view_prints_every_gpu_node_from_one_list(control_plane, api, cluster, monkeypatch, capsys):
    cp = control_plane
    apps = client.AppsV1Api(api)
    # An older driver pod: OnDelete, then a new template, so existing pods stay at their revision.
    old_node = cluster["vfio"][0]
    apps.patch_namespaced_daemon_set(
        "metax-driver",
        NS,
        {
            "spec": {
                "updateStrategy": {"type": "OnDelete", "rollingUpdate": None},
                "template": {"metadata": {"annotations": {"test/rev": "2"}}},
            }
        },
    )
    revisions = lambda: (  # noqa: E731
        client.AppsV1Api(api).list_namespaced_controller_revision(NS, label_selector="app.kubernetes.io/component=driver").items
    )
    eventually(lambda: len(revisions()) >= 2, 30, "a second driver ControllerRevision")
    current = max(revisions(), key=lambda r: r.revision).metadata.labels["controller-revision-hash"]
    gpu_nodes = sorted(n.metadata.name for n in client.CoreV1Api(api).list_node(label_selector=f"{wl.GPU_NODE_LABEL}=true").items)
    # the sGPU and vfio nodes' driver and maca pods are scheduled and Ready
    eventually(
        lambda: all(
            n in _ready_nodes(api, "driver") and n in _ready_nodes(api, "maca") for n in cluster["sgpu"] + cluster["vfio"]
        ),
        60,
        "driver and maca pods Ready",
    )
    kubectl(
        cp,
        "delete",
        "pod",
        "-n",
        NS,
        "-l",
        "app.kubernetes.io/component=driver",
        "--field-selector",
        f"spec.nodeName={cluster['sgpu'][0]}",
        "--wait=true",
    )
    eventually(lambda: _driver_revision(api, cluster["sgpu"][0]) == current, 30, "a current driver pod")

    calls: list[tuple[str, str]] = []
    real_call = kube.Client.call

    def counted(self, method, path, **kwargs):
        calls.append((method, path))
        return real_call(self, method, path, **kwargs)

    monkeypatch.setattr(kube.Client, "call", counted)
    capsys.readouterr()
    assert cli.main(["nodes", "-n", NS, "--kubeconfig", str(cp.kubeconfig), "-o", "json"]) == 0
    view = json.loads(capsys.readouterr().out)
    resource_calls = [c for c in calls if not _discovery(c[1])]
    assert resource_calls == [
        ("GET", "/api/v1/nodes"),
        ("GET", f"/api/v1/namespaces/{NS}/pods"),
        ("GET", f"/apis/apps/v1/namespaces/{NS}/controllerrevisions"),
        ("GET", "/apis/gpu.metax-tech.com/v1/clusteroperators/cluster-operator"),
    ], calls
    print(
        f"metax-operator nodes over {len(gpu_nodes)} GPU nodes: {len(resource_calls)} requests "
        f"(+{len(calls) - len(resource_calls)} discovery)"
    )

    rows = {r["name"]: r for r in view["nodes"]}
    assert sorted(rows) == gpu_nodes
    assert view["currentDriverRevision"] == current
    sgpu = rows[cluster["sgpu"][0]]
    assert (sgpu["mode"], sgpu["qosPolicy"]) == ("sgpu", "fixed-share")
    assert sgpu["allocatable"] == {wl.GPU_RESOURCE: "0", wl.SGPU_RESOURCE: "16", wl.VFIO_RESOURCE: "0"}
    assert (sgpu["driverRevision"], sgpu["driverCurrent"]) == (current, True)
    assert sgpu["macaVersions"] == ["maca-2.24.0.5", "maca-2.18.0.3"] and sgpu["macaReady"] is True
    vfio = rows[old_node]
    assert (vfio["mode"], vfio["qosPolicy"], vfio["vfnum"]) == ("native", "", "0")
    assert vfio["allocatable"] == {wl.GPU_RESOURCE: "6", wl.SGPU_RESOURCE: "0", wl.VFIO_RESOURCE: "2"}
    assert vfio["driverCurrent"] is False and vfio["driverRevision"] != current
    assert (vfio["vfioBound"], vfio["vfioFailed"]) == (["0", "1"], ["3"])

    # The table, from the real command line.
    out = subprocess.run(
        [METAX, "nodes", "-n", NS, "--kubeconfig", str(cp.kubeconfig)], capture_output=True, text=True, timeout=60, check=True
    ).stdout.splitlines()
    assert out[0].split() == ["NODE", "MODE", "QOS", "GPU", "SGPU", "VFIO-GPU", "VFNUM", "DRIVER", "MXMACA", "VFIO-BOUND"]
    line = next(line for line in out if line.startswith(old_node))
    assert line.split()[1:8] == ["native", "-", "6", "0", "2", "0", vfio["driverRevision"]]
    assert "(old)" in line and re.search(r" maca-2\.24\.0\.5,maca-2\.18\.0\.3 +0,1 \(failed: 3\)$", line), line
    assert out[-1] == f"current driver revision: {current}"


def _discovery(path: str) -> bool:
    return path in ("/api/v1", "/apis/apps/v1", "/apis/gpu.metax-tech.com/v1")


def _ready_nodes(api, component: str) -> set[str]:
    pods = client.CoreV1Api(api).list_namespaced_pod(NS, label_selector=f"app.kubernetes.io/component={component}")
    return {p.spec.node_name for p in pods.items if ready(p)}


def _driver_revision(api, node: str) -> str:
    pods = (
        client.CoreV1Api(api)
        .list_namespaced_pod(NS, label_selector="app.kubernetes.io/component=driver", field_selector=f"spec.nodeName={node}")
        .items
    )
    live = [p for p in pods if p.metadata.deletion_timestamp is None]
    return live[0].metadata.labels.get("controller-revision-hash", "") if live else ""


# -- docs/workloads.md against the cluster -------------------------------------------------------


def test_the_pages_commands_and_manifests_work_on_a_cluster(control_plane, cluster, tmp_path):
    """Every `kubectl`/`metax-operator` block of docs/workloads.md, run in page order with the real
    kubectl (`sample-node1` is a kwok node reporting 1 GPU, 16 sGPUs and 2 vfio GPUs, and
    vfio-manager's annotation; the namespace is this module's), each output block compared with the
    output of the command before it; every manifest admitted by the API server (server dry run)."""
    cp = control_plane
    node = cp.add_nodes(1, prefix="wl-doc", gpus=1, resources={wl.SGPU_RESOURCE: 16, wl.VFIO_RESOURCE: 2})[0]
    kubectl(cp, "annotate", "node", node, f'{contract.VFIO_ANNOTATION}={{"0":1,"1":1,"3":0}}')
    env = {**os.environ, "PATH": f"{BIN}:{Path(METAX).parent}:{os.environ['PATH']}", "KUBECONFIG": str(cp.kubeconfig)}
    ran, last = [], ""
    try:
        for block in blocks(PAGE):
            text = block.text.replace("sample-node1", node).replace("-n metax-operator", f"-n {NS}")
            if block.kind in ("kubectl", "metax-operator"):
                for line in text.splitlines():
                    done = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True, timeout=60)
                    assert done.returncode == 0, f"docs/workloads.md:{block.line}: {line}: {done.stderr}"
                    ran.append(line)
                    last = done.stdout
            elif block.kind == "output":
                assert last.strip() == text.strip(), f"docs/workloads.md:{block.line}"
            elif block.kind == "manifest":
                path = tmp_path / f"manifest-{block.line}.yaml"
                path.write_text(text)
                kubectl(cp, "apply", "--dry-run=server", "-n", "default", "-f", str(path))
                ran.append(f"kubectl apply --dry-run=server -f {path.name}")
        nodes_out = subprocess.run(
            [METAX, "nodes", "-n", NS], env=env, capture_output=True, text=True, timeout=60, check=True
        ).stdout
        assert any(line.startswith(node) for line in nodes_out.splitlines())
        print(f"ran {len(ran)} commands of docs/workloads.md")
    finally:
        cp.remove_nodes([node])
