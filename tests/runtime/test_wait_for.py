"""wait-for without a cluster: which prerequisites are still pending, the selectors, the CLI's errors.

The waiting itself (watch, kwok pods turning Ready) is in tests/e2e/test_runner.py.
"""

from __future__ import annotations

import pytest

from metax_operator import cli
from metax_operator.runtime.wait_for import pending, selectors


def pod(name: str, component: str, ready: bool | None, phase: str = "Running", deleting: bool = False) -> dict:
    conditions = [] if ready is None else [{"type": "Ready", "status": "True" if ready else "False"}]
    meta = {"name": name, "labels": {"app.kubernetes.io/component": component}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "conditions": conditions}}


def by_name(*pods: dict) -> dict:
    return {p["metadata"]["name"]: p for p in pods}


def test_all_prerequisites_ready_means_nothing_pending():
    pods = by_name(pod("label-a", "gpuLabel", True), pod("runtime-a", "runtime", True))
    assert pending(pods, ["gpuLabel", "runtime"]) == {}


def test_a_prerequisite_without_a_pod_on_the_node_is_pending():
    assert pending(by_name(pod("label-a", "gpuLabel", True)), ["gpuLabel", "runtime"]) == {"runtime": "no pod on this node yet"}


def test_a_pod_not_ready_is_pending_with_its_name_and_phase():
    pods = by_name(pod("label-a", "gpuLabel", True), pod("runtime-a", "runtime", False, phase="Pending"))
    assert pending(pods, ["gpuLabel", "runtime"]) == {"runtime": "pod runtime-a is Pending, not Ready"}


def test_a_pod_without_conditions_is_not_ready():
    assert "maca" in pending(by_name(pod("maca-a", "maca", None)), ["maca"])


def test_a_ready_pod_being_deleted_does_not_count():
    pods = by_name(pod("runtime-old", "runtime", True, deleting=True))
    assert pending(pods, ["runtime"]) == {"runtime": "pod runtime-old is terminating"}


def test_one_ready_pod_is_enough_while_the_old_one_goes():
    pods = by_name(pod("runtime-old", "runtime", True, deleting=True), pod("runtime-new", "runtime", True))
    assert pending(pods, ["runtime"]) == {}


def test_pods_of_other_components_do_not_count():
    assert pending(by_name(pod("driver-a", "driver", True)), ["runtime"]) == {"runtime": "no pod on this node yet"}


def test_the_watch_is_restricted_to_the_node_and_the_prerequisites():
    assert selectors("gpu-node-3", ["runtime", "gpuLabel"]) == (
        "spec.nodeName=gpu-node-3",
        "app.kubernetes.io/component in (gpuLabel,runtime)",
    )


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--component", "drivers"], "--component: drivers is not a component; use values keys: gpuLabel"),
        (["--component", "runtime", "--node", ""], "--node: is empty"),
    ],
)
def test_bad_arguments_name_the_option_and_the_fix(capsys, argv, fragment):
    base = {"--namespace": "ns", "--node": "n1"}
    args = ["wait-for"]
    for key, value in base.items():
        if key not in argv:
            args += [key, value]
    assert cli.main(args + argv + ["--kubeconfig", "/nonexistent"]) == 1
    assert fragment in capsys.readouterr().err


def test_the_chart_s_wait_for_init_containers_call_this_command_with_each_component_s_prerequisites():
    from metax_operator.contract import PREREQUISITES
    from tests.helm import render_chart

    objects = render_chart({"registry": "r.example/metax", "driver": {"payload": {"version": "1"}}, "exporter": {"deploy": True}})
    seen = {}
    for ds in (o for o in objects if o["kind"] == "DaemonSet"):
        key = ds["metadata"]["annotations"]["gpu.metax-tech.com/component"]
        for init in ds["spec"]["template"]["spec"].get("initContainers") or []:
            if init["name"] == "wait-for":
                assert init["command"][0] == "metax-operator"
                args = cli.build_parser().parse_args(init["command"][1:])
                assert args.func.__module__ == "metax_operator.runtime.wait_for"
                assert (args.namespace, args.node) == ("$(POD_NAMESPACE)", "$(NODE_NAME)")
                seen[key] = sorted(args.component)
    assert seen == {key: sorted(prereqs) for key, prereqs in PREREQUISITES.items()}
