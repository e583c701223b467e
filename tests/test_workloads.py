"""The workload rules (metax_operator.workloads) without a cluster: MXMACA version choice, the
projections of nodes and pods, and each check's words."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metax_operator import workloads as wl
from metax_operator.workloads import GpuPod

IMAGES = ["maca-c500:2.18.0.3-ubuntu18.04-amd64", "maca-c500:2.24.0.5-ubuntu20.04-amd64", "maca-c500:2.18.0.1-ubuntu18.04-amd64"]
DEPLOYED = ["maca-2.24.0.5", "maca-2.18.0.3", "maca-2.18.0.1"]


# -- MXMACA versions ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "image, version",
    [
        ("maca-c500:2.18.0.3-ubuntu18.04-amd64", "maca-2.18.0.3"),
        ("maca-c500:2.24.0.5", "maca-2.24.0.5"),
        ("registry.example:5000/maca-c500:3.0-ubuntu22.04", "maca-3.0"),
        ("maca-c500:latest", None),
        ("registry.example:5000/maca-c500", None),
    ],
)
def test_a_payload_image_deploys_the_version_its_tag_starts_with(image, version):
    assert wl.maca_version(image) == version


def test_deployed_versions_are_newest_first_and_unique():
    assert wl.deployed_maca_versions(IMAGES + IMAGES[:1]) == DEPLOYED


@pytest.mark.parametrize(
    "requested, chosen",
    [
        # the seed's examples: every prefix of maca-2.18.0.3 works, the newest match wins
        ("maca-2", "maca-2.24.0.5"),
        ("maca-2.18", "maca-2.18.0.3"),
        ("maca-2.18.0", "maca-2.18.0.3"),
        ("maca-2.18.0.3", "maca-2.18.0.3"),
        ("maca-2.18.0.1", "maca-2.18.0.1"),
        # refused, or matching nothing
        ("maca", None),
        ("maca-", None),
        ("maca-3", None),
        ("2.18.0.3", None),
    ],
)
def test_choose_maca_follows_the_prefix_rule(requested, chosen):
    assert wl.choose_maca(requested, DEPLOYED) == chosen


versions = st.lists(st.integers(0, 30), min_size=1, max_size=4).map(lambda p: "maca-" + ".".join(map(str, p)))


@given(st.lists(versions, min_size=1, max_size=8), st.data())
def test_the_chosen_version_is_the_newest_that_starts_with_the_value(deployed, data):
    requested = data.draw(st.sampled_from(deployed)).rstrip("0123456789") + data.draw(st.sampled_from(["", "1", "2"]))
    chosen = wl.choose_maca(requested, deployed)
    matches = [v for v in deployed if v.startswith(requested)]
    if requested in wl.MACA_REFUSED or not matches:
        assert chosen is None
    else:
        assert chosen.startswith(requested)
        assert all(wl.version_key(v) <= wl.version_key(chosen) for v in matches)


# -- projections -------------------------------------------------------------------------------


def pod(name: str, env=None, resources=None, node: str = "n1", ns: str = "team") -> dict:
    container = {
        "name": "c",
        "image": "app:1",
        "env": env or [],
        "resources": resources if resources is not None else {"limits": {wl.GPU_RESOURCE: "1"}},
    }
    return {"metadata": {"name": name, "namespace": ns}, "spec": {"nodeName": node, "containers": [container]}}


def test_a_gpu_pod_keeps_the_literal_maca_versions_of_its_gpu_containers():
    obj = pod(
        "a",
        env=[
            {"name": wl.MACA_VERSION_ENV, "value": "maca-2.18"},
            {"name": "OTHER", "value": "x"},
            {"name": wl.MACA_VERSION_ENV, "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
        ],
    )
    obj["spec"]["containers"].append({"name": "sidecar", "image": "s:1", "env": [{"name": wl.MACA_VERSION_ENV, "value": "maca"}]})
    assert wl.gpu_pod(obj) == GpuPod("team", "a", "n1", ("maca-2.18",))


def test_a_pod_without_metax_resources_is_not_a_gpu_pod():
    assert wl.gpu_pod(pod("a", resources={"limits": {"nvidia.com/gpu": "1"}})) is None
    assert wl.gpu_pod(pod("a", resources={"requests": {wl.SGPU_RESOURCE: "1"}})) is not None


def test_vfio_annotation_splits_bound_and_failed_gpus_in_index_order():
    assert wl.vfio_gpus('{"0":1,"1":1,"3":0,"10":1}') == (["0", "1", "10"], ["3"])
    assert wl.vfio_gpus(None) == ([], [])
    assert wl.vfio_gpus("not json") == ([], [])


# -- the checks --------------------------------------------------------------------------------


def check(nodes=None, pods=(), runtime=True, images=IMAGES, hami=True):
    return [str(p) for p in wl.problems(nodes or {}, pods, runtime_deployed=runtime, maca_images=images, hami_running=hami)]


def test_a_healthy_cluster_has_no_problem():
    nodes = {"n1": {wl.MODE_LABEL: "sgpu", wl.QOS_LABEL: "fixed-share"}, "n2": {wl.MODE_LABEL: "native"}, "n3": {}}
    pods = [GpuPod("team", "a", "n1", ("maca-2.18",)), GpuPod("team", "b", "n2")]
    assert check(nodes, pods) == []


def test_label_values_outside_the_allowed_ones_name_the_nodes_and_the_fix():
    nodes = {"n1": {wl.MODE_LABEL: "sGPU"}, "n2": {wl.MODE_LABEL: "sGPU", wl.QOS_LABEL: "fair"}}
    assert check(nodes) == [
        "nodes n1, n2: label metax-tech.com/gpu-device.mode=sGPU is not one of native, sgpu; relabel them: "
        "kubectl label node -l metax-tech.com/gpu-device.mode=sGPU metax-tech.com/gpu-device.mode=native --overwrite",
        "node n2: label metax-tech.com/gpu-device.qos-policy=fair is not one of best-effort, fixed-share, "
        "burst-share; relabel them: kubectl label node -l metax-tech.com/gpu-device.qos-policy=fair "
        "metax-tech.com/gpu-device.qos-policy=best-effort --overwrite",
    ]


def test_sgpu_nodes_need_the_runtime_and_hami():
    nodes = {f"n{i}": {wl.MODE_LABEL: "sgpu"} for i in range(7)}
    lines = check(nodes, runtime=False, hami=False)
    assert lines[0].startswith(
        "nodes n0, n1, n2, n3, n4 and 2 more: labelled metax-tech.com/gpu-device.mode=sgpu, "
        "but sGPU needs the container-runtime component and it is not deployed "
        "(runtime.deploy is false); deploy it (helm upgrade --set runtime.deploy=true)"
    )
    assert lines[1].startswith(
        "nodes n0, n1, n2, n3, n4 and 2 more: labelled metax-tech.com/gpu-device.mode=sgpu, "
        "but no HAMi scheduler runs (no Ready pod labelled "
        "app.kubernetes.io/component=hami-scheduler in any namespace)"
    )
    assert len(lines) == 2
    assert check(nodes, hami=None) == []  # HAMi not known: not checked


def test_hami_and_the_runtime_matter_only_with_sgpu_nodes():
    assert check({"n1": {wl.MODE_LABEL: "native"}}, runtime=False, hami=False) == []


def test_maca_versions_refused_or_unmatched_are_grouped_by_value():
    pods = [
        GpuPod("team", "a", "n1", ("maca",)),
        GpuPod("team", "b", "n1", ("maca-3",)),
        GpuPod("lab", "c", "", ("maca-3",)),
        GpuPod("lab", "d", "n2", ("maca-2.24",)),
    ]
    assert check(pods=pods) == [
        "pod team/a: METAX_MACA_VERSION=maca names no version, so the runtime refuses it (deployed: maca-2.24.0.5, "
        "maca-2.18.0.3, maca-2.18.0.1); set a version or a prefix of one, e.g. maca-2.24",
        "pods lab/c, team/b: METAX_MACA_VERSION=maca-3 matches none of the MXMACA versions deployed (maca-2.24.0.5, "
        "maca-2.18.0.3, maca-2.18.0.1); use one of them or a prefix of one, or add a payload image of that version "
        "to maca.payload.images",
    ]


def test_without_maca_no_version_matches_and_the_message_says_why():
    pods = [GpuPod("team", "a", "n1", ("maca-2",))]
    assert "(none: the maca component is not deployed (maca.deploy is false))" in check(pods=pods, images=None)[0]
    assert "(none: maca.payload.images is empty)" in check(pods=pods, images=[])[0]


def test_each_problem_says_which_rule_found_it():
    found = wl.problems({"n1": {wl.MODE_LABEL: "sgpu"}}, [], runtime_deployed=False, maca_images=[], hami_running=True)
    assert [p.rule for p in found] == [wl.SGPU_WITHOUT_RUNTIME]
