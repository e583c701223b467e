"""The hook commands' pure parts: prerequisite checks, the bootstrap apply, node cleanup, test checks."""

from __future__ import annotations

import http.server
import json
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metax_operator import contract
from metax_operator.hooks import bootstrap, cleanup, preflight, test


def node(
    name: str,
    runtime: str = "containerd://1.7.13",
    kubelet: str = "v1.34.4",
    os_image: str = "Ubuntu 22.04.4 LTS",
    gpu: bool = True,
    labels: dict | None = None,
    annotations: dict | None = None,
    allocatable: dict | None = None,
) -> dict:
    all_labels = {"kubernetes.io/hostname": name, **(labels or {})}
    if gpu:
        all_labels[preflight.GPU_NODE_LABEL] = "true"
    return {
        "metadata": {"name": name, "labels": all_labels, "annotations": annotations or {}, "resourceVersion": "7"},
        "status": {
            "allocatable": allocatable or {},
            "nodeInfo": {
                "containerRuntimeVersion": runtime,
                "kubeletVersion": kubelet,
                "osImage": os_image,
                "kernelVersion": "5.15.0-105-generic",
            },
        },
    }


# --- preflight: seed §3 prerequisites ------------------------------------------------------------


@pytest.mark.parametrize(
    "runtime, kubelet",
    [
        ("containerd://1.5.0", "v1.23.17"),
        ("containerd://1.7.13", "v1.34.4"),
        ("containerd://2.0.0", "v1.31.0"),
        ("docker://18.9.3", "v1.23.4"),
        ("docker://20.10.24", "v1.23.0"),
    ],
)
def test_supported_runtimes_pass(runtime, kubelet):
    assert preflight.runtime_problem(runtime, kubelet) is None


@pytest.mark.parametrize(
    "runtime, kubelet, fragment",
    [
        ("docker://18.9.2", "v1.23.4", "docker 18.9.2 is older than 18.09.3"),
        ("docker://18.06.1-ce", "v1.23.4", "older than 18.09.3"),
        ("containerd://1.4.13", "v1.23.4", "containerd 1.4.13 is older than 1.5.0"),
        ("containerd://1.4.0", "v1.28.0", "older than 1.5.0"),
        ("docker://24.0.7", "v1.24.0", "docker is not supported on Kubernetes v1.24.0"),
        ("cri-o://1.28.1", "v1.28.0", "cri-o://1.28.1 is not supported"),
    ],
)
def test_unsupported_runtimes_are_named(runtime, kubelet, fragment):
    assert fragment in preflight.runtime_problem(runtime, kubelet)


@pytest.mark.parametrize(
    "os_image, supported",
    [
        ("Ubuntu 18.04.6 LTS", True),
        ("Ubuntu 20.04.6 LTS", True),
        ("Ubuntu 22.04.4 LTS", True),
        ("Ubuntu 24.04 LTS", False),
        ("CentOS Linux 8", True),
        ("CentOS Stream 9", True),
        ("CentOS Linux 7 (Core)", False),
        ("openEuler 20.03 (LTS-SP3)", True),
        ("openEuler 22.03 (LTS-SP1)", True),
        ("openEuler 24.03 (LTS)", False),
        ("Kylin Linux Advanced Server V10 (Lance)", False),
        ("", False),
    ],
)
def test_os_recognised(os_image, supported):
    assert preflight.os_supported(os_image) is supported


def test_old_server_fails_new_passes():
    assert "older than 1.23" in str(preflight.check_server("v1.22.17")[0])
    assert preflight.check_server("v1.23.0") == []
    assert preflight.check_server("v1.34.4+k3s1") == []


def test_gpu_node_with_old_runtime_fails_and_names_the_node():
    findings = preflight.check_cluster(
        "v1.23.4",
        [
            node("gpu-1"),
            node("gpu-2", runtime="docker://18.9.2", kubelet="v1.23.4"),
            node("cpu-1", runtime="cri-o://1.28.1", gpu=False),
        ],
    )
    assert [str(e) for e in findings.errors] == [
        "node gpu-2: docker 18.9.2 is older than 18.09.3; move the node to containerd >= 1.5.0 "
        "(docker >= 18.09.3 works only on Kubernetes 1.23), or keep MetaX components off it"
    ]
    assert not any("cpu-1" in w for w in findings.warnings)  # not a GPU node: not checked


def test_unlisted_os_only_warns_per_node():
    findings = preflight.check_cluster("v1.34.4", [node("gpu-1", os_image="Rocky Linux 9.3 (Blue Onyx)"), node("gpu-2")])
    assert findings.errors == []
    assert len(findings.warnings) == 1 and findings.warnings[0].startswith("node gpu-1: OS Rocky Linux 9.3")


def test_before_gpu_label_ran_every_node_is_checked_but_only_warns():
    findings = preflight.check_cluster("v1.34.4", [node("a", gpu=False, runtime="containerd://1.4.1"), node("b", gpu=False)])
    assert findings.errors == []
    assert any("no node is labelled" in w for w in findings.warnings)
    assert any(w.startswith("node a: containerd 1.4.1 is older than 1.5.0") for w in findings.warnings)


def arch_node(name: str, arch: str) -> dict:
    return node(name, labels={preflight.ARCH_LABEL: arch})


MIXED = [arch_node("x86-1", "amd64"), arch_node("x86-2", "amd64"), arch_node("arm-1", "arm64")]
PAYLOADS = {"driver": {"deploy": True, "payload": {"version": "2.33.0.9"}}, "maca": {"deploy": True, "payload": {}}}


def architecture_errors(values: dict, nodes: list[dict]) -> list[str]:
    findings = preflight.Findings()
    preflight.check_architectures(values, nodes, findings)
    return [str(error) for error in findings.errors]


def test_a_payload_tag_naming_one_architecture_fails_in_a_mixed_cluster():
    values = {**PAYLOADS, "driver": {"deploy": True, "payload": {"version": "2.33.0.9-amd64"}}}
    assert architecture_errors(values, MIXED) == [
        "driver.payload.version: 2.33.0.9-amd64 is tagged for amd64, and the GPU nodes are amd64 (2) and arm64 (1):"
        " its pods would fail on the arm64 ones; publish the payload's images of every architecture the cluster has"
        " under one multi-architecture tag and set that (docs/chart.md, 'Clusters of x86 and Arm GPU servers')"
    ]
    maca = {**PAYLOADS, "maca": {"deploy": True, "payload": {"images": ["maca-c500:2.18.0.3-ubuntu22.04-aarch64"]}}}
    (error,) = architecture_errors(maca, MIXED)
    assert error.startswith("maca.payload.images: maca-c500:2.18.0.3-ubuntu22.04-aarch64 is tagged for arm64")


def test_a_tag_for_another_architecture_fails_and_the_right_one_passes():
    arm = [arch_node("arm-1", "arm64"), arch_node("arm-2", "arm64")]
    values = {**PAYLOADS, "driver": {"deploy": True, "payload": {"version": "2.33.0.9-amd64"}}}
    assert architecture_errors(values, arm) == [
        "driver.payload.version: 2.33.0.9-amd64 is tagged for amd64, and the GPU nodes are arm64 (2):"
        " its pods would fail on the arm64 ones; set the tag of its arm64 image"
    ]
    assert architecture_errors({**PAYLOADS, "driver": {"deploy": True, "payload": {"version": "2.33.0.9-arm64"}}}, arm) == []


def test_tags_without_an_architecture_digests_and_components_left_out_pass():
    pinned = f"maca-c500@sha256:{'a' * 64}"
    values = {**PAYLOADS, "maca": {"deploy": True, "payload": {"images": ["maca-c500:2.18.0.3-ubuntu22.04", pinned]}}}
    assert architecture_errors(values, MIXED) == []
    left_out = {"driver": {"deploy": False, "payload": {"version": "2.33.0.9-amd64"}}, "maca": {"deploy": False}}
    assert architecture_errors(left_out, MIXED) == []
    assert architecture_errors({**PAYLOADS, "driver": {"deploy": True, "payload": {"version": "1-amd64"}}}, []) == []
    pinned_driver = {"deploy": True, "payload": {"version": "2.33.0.9-amd64", "digest": f"sha256:{'b' * 64}"}}
    assert architecture_errors({**PAYLOADS, "driver": pinned_driver}, MIXED) == []


# --- bootstrap: what goes into the CR, and the runtime controls ---------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "registry": {"type": "string"},
        "tolerations": {"type": "array", "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
        "driver": {
            "type": "object",
            "properties": {
                "deploy": {"type": "boolean"},
                "config": {
                    "type": "object",
                    "properties": {
                        "nodeVfnums": {
                            "type": "object",
                            "additionalProperties": {"type": "object", "properties": {"vfnum": {"type": "integer"}}},
                        }
                    },
                },
                "upgradePolicy": {
                    "type": "object",
                    "properties": {"pause": {"type": "boolean"}, "enableRollout": {"type": "boolean"}},
                },
            },
        },
    },
}


def test_prune_keeps_only_what_the_crd_declares():
    values = {
        "registry": "r",
        "runner": {"enabled": True},
        "tolerations": [{"key": "k", "x": 1}],
        "driver": {
            "deploy": True,
            "image": {"name": "x"},
            "resources": {},
            "config": {"nodeVfnums": {"n1": {"vfnum": 4, "junk": 1}}},
            "upgradePolicy": {"pause": False, "enableRollout": None},
        },
    }
    assert bootstrap.prune(values, SCHEMA) == {
        "registry": "r",
        "tolerations": [{"key": "k", "x": 1}],
        "driver": {"deploy": True, "config": {"nodeVfnums": {"n1": {"vfnum": 4}}}, "upgradePolicy": {"pause": False}},
    }


def test_a_block_newer_than_the_release_before_goes_into_the_cr_only_when_turned_on():
    """So that a `helm rollback` to that release meets a CR it can read (contract.UNDEFAULTED)."""
    off = {"driver": {"upgradePolicy": {"pause": False, "validation": {"enable": False, "timeoutSeconds": 600}}}}
    assert bootstrap.without_unused_new_blocks(off) == {"driver": {"upgradePolicy": {"pause": False}}}
    on = {"driver": {"upgradePolicy": {"validation": {"enable": True, "timeoutSeconds": 60}}}}
    assert bootstrap.without_unused_new_blocks(on) == on
    assert bootstrap.without_unused_new_blocks({"driver": {"deploy": False}}) == {"driver": {"deploy": False}}
    gates = {"driver": {"upgradePolicy": {"healthGate": {"enable": False, "maxRegression": {"notReady": 0}}}}}
    assert bootstrap.without_unused_new_blocks(gates) == {"driver": {"upgradePolicy": {}}}
    gated = {"driver": {"upgradePolicy": {"healthGate": {"enable": True}}}}
    assert bootstrap.without_unused_new_blocks(gated) == gated


CR_SPEC = {
    "properties": {
        "a": {"properties": {"b": {}}},
        "driver": {
            "properties": {
                "deploy": {},
                "upgradePolicy": {"properties": {"pause": {}, "enableRollout": {}}},
                "payload": {"properties": {"version": {}}},
            }
        },
    }
}


def controls(pause: bool, enable: bool) -> dict:
    return {"driver": {"deploy": True, "upgradePolicy": {"pause": pause, "enableRollout": enable}}}


def live_cr(spec: dict, applied: dict | None) -> dict:
    """A live CR holding `spec`, bootstrapped last with `applied` (None: no record)."""
    annotations = {} if applied is None else {contract.BOOTSTRAP_APPLIED_ANNOTATION: json.dumps(applied)}
    return {"metadata": {"name": "cluster-operator", "annotations": annotations}, "spec": spec}


def test_first_bootstrap_applies_everything_and_records_it():
    merge = bootstrap.desired(controls(False, True), None, {}, CR_SPEC)
    assert merge.manifest["spec"] == controls(False, True)
    assert json.loads(merge.manifest["metadata"]["annotations"][contract.BOOTSTRAP_APPLIED_ANNOTATION]) == controls(False, True)
    assert merge.kept == merge.overridden == []


def test_a_run_time_edit_the_values_did_not_change_is_left_out():
    live = live_cr(controls(True, False), controls(False, True))
    merge = bootstrap.desired(controls(False, True), live, {}, CR_SPEC)
    assert merge.manifest["spec"] == {"driver": {"deploy": True}}
    assert [c.kept() for c in merge.kept][0] == (
        "spec.driver.upgradePolicy.pause kept at true (changed at run time; the values did not change it)"
    )
    assert merge.overridden == []
    # the record keeps what the values say, so the next values change is seen as one
    assert json.loads(merge.manifest["metadata"]["annotations"][contract.BOOTSTRAP_APPLIED_ANNOTATION]) == controls(False, True)


def test_values_that_change_an_edited_field_win_and_say_so():
    live = live_cr(controls(True, True), controls(False, True))
    merge = bootstrap.desired(controls(False, False), live, {}, CR_SPEC)
    # enableRollout changed in the values (true -> false): applied; pause did not: left to the admin
    assert merge.manifest["spec"]["driver"]["upgradePolicy"] == {"enableRollout": False}
    assert [c.field for c in merge.kept] == ["spec.driver.upgradePolicy.pause"]
    assert merge.overridden == []  # the live enableRollout was the recorded one: no edit lost
    live = live_cr({"driver": {"payload": {"version": "2.33.0.9"}}}, {"driver": {"payload": {"version": "2.32.0.6"}}})
    merge = bootstrap.desired({"driver": {"payload": {"version": "2.34.0.1"}}}, live, {}, CR_SPEC)
    assert [c.overridden() for c in merge.overridden] == [
        'spec.driver.payload.version set from "2.33.0.9" to "2.34.0.1" by the values (a run-time edit overridden)'
    ]


def test_an_older_charts_record_of_the_controls_still_protects_them():
    live = {
        "metadata": {
            "annotations": {
                contract.BOOTSTRAP_CONTROLS_ANNOTATION: (
                    '{"driver.upgradePolicy.enableRollout":true,"driver.upgradePolicy.pause":false}'
                )
            }
        },
        "spec": controls(True, True),
    }
    merge = bootstrap.desired(controls(False, True), live, {}, CR_SPEC)
    assert [c.field for c in merge.kept] == ["spec.driver.upgradePolicy.pause"]


def test_desired_does_not_modify_its_input():
    spec = controls(False, True)
    bootstrap.desired(spec, live_cr(controls(True, True), controls(False, True)), {}, CR_SPEC)
    assert spec == controls(False, True)


_leaf = st.sampled_from([1, 2, 3, None])  # None: the field is absent


@given(recorded=_leaf, values=st.sampled_from([1, 2, 3]), live=_leaf)
def test_three_way_merge_of_one_field(recorded, values, live):
    """Values unchanged since the record: the live value (or its absence) stays; changed: the
    values win, and an override of a live value that was neither is reported."""
    wrap = lambda v: {} if v is None else {"a": {"b": v}}  # noqa: E731
    merge = bootstrap.desired(wrap(values), live_cr(wrap(live), wrap(recorded)), {}, CR_SPEC)
    result = bootstrap.merged_spec(merge, live_cr(wrap(live), None), CR_SPEC).get("a", {}).get("b")
    if recorded == values:  # a deletion at run time is an edit too
        assert result == live and bool(merge.kept) == (live != values)
    else:
        assert result == values and not merge.kept
    assert bool(merge.overridden) == (recorded != values and live not in (values, recorded))


# --- cleanup: exactly our node keys -------------------------------------------------------------


def test_node_patch_removes_only_our_keys():
    n = node(
        "gpu-1",
        labels={
            "metax-tech.com/gpu-device.mode": "sgpu",
            "metax-tech.com/driver-upgrade.skip": "true",  # the admin's
            "metax-tech.com/driver-upgrade.state": "done",  # the runner's
            "metax-tech.com/driver-upgrade.pool": "rack-a",  # the runner's
            "metax-tech.com/driver-upgrade.retry": "true",  # consumed by the runner only
            "team": "a",
        },
        annotations={"metax-tech.com/gpu-vfio": '{"0":1}', "other": "x"},
    )
    assert cleanup.node_patch(n) == {
        "metadata": {
            "labels": dict.fromkeys(
                (
                    "metax-tech.com/gpu.installed",
                    "metax-tech.com/driver-upgrade.state",
                    "metax-tech.com/driver-upgrade.pool",
                    "metax-tech.com/driver-upgrade.retry",
                )
            ),
            "annotations": {"metax-tech.com/gpu-vfio": None},
        }
    }
    assert cleanup.node_patch(node("cpu-1", gpu=False, labels={"metax-tech.com/gpu-device.mode": "sgpu"})) is None


# --- test: each failure one line ----------------------------------------------------------------


def ready_pod(node_name: str, ready: bool) -> dict:
    return {
        "metadata": {"name": f"p-{node_name}"},
        "spec": {"nodeName": node_name},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_daemonset_not_ready_names_the_nodes():
    ds = {"status": {"desiredNumberScheduled": 8, "numberReady": 1}}
    pods = [ready_pod("gpu-0", True)] + [ready_pod(f"gpu-{i}", False) for i in range(1, 8)]
    assert test.check_daemonset("ns", "metax-driver", ds, pods) == [
        "DaemonSet ns/metax-driver: 1 of 8 pods ready (not ready on gpu-1, gpu-2, gpu-3, gpu-4, gpu-5 and 2 more)"
    ]
    assert test.check_daemonset("ns", "metax-driver", {"status": {"desiredNumberScheduled": 2, "numberReady": 2}}, []) == []
    assert test.check_daemonset("ns", "metax-maca", None, []) == ["DaemonSet ns/metax-maca: not found, though the CR enables it"]


def test_a_runner_whose_last_pass_failed_fails_helm_test():
    failed = {"type": "RunnerHealthy", "status": "False", "reason": "Forbidden", "message": 'pods "x" is forbidden; fix'}
    assert test.check_runner({"status": {"conditions": [failed]}}) == [
        'ClusterOperator cluster-operator: RunnerHealthy=False (Forbidden): pods "x" is forbidden; fix'
    ]
    assert test.check_runner({"status": {"conditions": [{**failed, "status": "True"}]}}) == []
    assert test.check_runner({}) == []  # no pass reported yet (or a runner of an older version)


def test_gpu_nodes_need_allocatable_gpus():
    nodes = [
        node("gpu-1", allocatable={"metax-tech.com/gpu": "8"}),
        node("gpu-2", allocatable={"metax-tech.com/gpu": "0"}),
        node("gpu-3", allocatable={"metax-tech.com/sgpu": "16"}),
        node("gpu-4", allocatable={"metax-tech.com/gpu": "0", "metax-tech.com/vfio-gpu": "8"}),  # all bound to vfio-pci
        node("cpu-1", gpu=False),
    ]
    assert test.check_gpu_nodes(nodes) == ["node gpu-2: no allocatable metax-tech.com/gpu (a component is not working there)"]
    assert "none is labelled" in test.check_gpu_nodes([node("cpu-1", gpu=False)])[0]


def test_configmap_problems_are_one_line_each():
    cm = {
        "data": {
            "node-vfnums": "nodes:\n  n1:\n    vfnum: 40\n",
            "module-params": "xcore_page_size: 10\n",
            "node-module-params": ": bad",
        }
    }
    lines = test.check_configmap("ns", "driver-config", cm)
    assert len(lines) == 2 and all(line.startswith("ConfigMap ns/driver-config: ") for line in lines)
    assert "vfnum" in lines[0] and "node-module-params" in lines[1]
    good = {"data": {"config": '- nodeName: worknode\\d+\n  gpus: "0,1,2"\n'}}
    assert test.check_configmap("ns", "metax-vfio-config", good) == []
    assert test.check_configmap("ns", "metax-vfio-config", None) == ["ConfigMap ns/metax-vfio-config: not found"]


@pytest.fixture
def metrics_server():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def test_exporter_answering_passes_and_silence_fails(metrics_server):
    assert test.check_http("Service ns/x", "127.0.0.1", metrics_server, 2) == []
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    closed = server.server_address[1]
    server.server_close()
    [line] = test.check_http("Service ns/x", "127.0.0.1", closed, 2)
    assert line.startswith(f"Service ns/x: http://127.0.0.1:{closed}/metrics does not answer")


# --- the workload checks in preflight and helm test ---------------------------------------------

SGPU_NODE = node("n1", labels={"metax-tech.com/gpu-device.mode": "sgpu", "metax-tech.com/gpu-device.qos-policy": "fair"})
GPU_POD = {
    "metadata": {"name": "job", "namespace": "team"},
    "spec": {
        "nodeName": "n1",
        "containers": [
            {
                "name": "c",
                "env": [{"name": "METAX_MACA_VERSION", "value": "maca-3"}],
                "resources": {"limits": {"metax-tech.com/sgpu": "1"}},
            }
        ],
    },
}
HAMI = {
    "metadata": {
        "name": "hami-scheduler-0",
        "namespace": "kube-system",
        "labels": {"app.kubernetes.io/component": "hami-scheduler"},
    },
    "spec": {"containers": []},
    "status": {"conditions": [{"type": "Ready", "status": "True"}]},
}
VALUES = {"runtime": {"deploy": True}, "maca": {"deploy": True, "payload": {"images": ["maca-c500:2.18.0.3-amd64"]}}}


def test_preflight_fails_only_on_what_the_values_cause_and_warns_of_the_rest():
    findings = preflight.Findings()
    preflight.check_workloads({**VALUES, "runtime": {"deploy": False}}, [SGPU_NODE], [GPU_POD], findings)
    assert [e.rule for e in findings.errors] == ["sgpu-without-runtime"]
    assert str(findings.errors[0]).startswith(
        "node n1: labelled metax-tech.com/gpu-device.mode=sgpu, but sGPU needs the container-runtime component"
    )
    assert len(findings.warnings) == 3  # the QoS value, no HAMi, METAX_MACA_VERSION=maca-3
    assert any(
        "METAX_MACA_VERSION=maca-3 matches none of the MXMACA versions deployed (maca-2.18.0.3)" in w for w in findings.warnings
    )


def test_preflight_and_helm_test_say_the_same_words():
    findings = preflight.Findings()
    preflight.check_workloads(VALUES, [SGPU_NODE], [GPU_POD, HAMI], findings)
    assert test.check_workloads(VALUES, ["runtime", "maca"], [SGPU_NODE], [GPU_POD, HAMI]) == findings.warnings
    assert not findings.errors and len(findings.warnings) == 2
