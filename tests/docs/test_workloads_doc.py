"""docs/workloads.md: every code block is marked for checking and each is checked here, except the
`kubectl`/`metax-operator` commands and their outputs, which run against the real API server in
tests/e2e/test_workloads.py. Every label, label value and resource name must be one the
operator's checks use (metax_operator.workloads)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import jsonschema
import pytest
import yaml

from metax_operator import contract
from metax_operator import workloads as wl
from metax_operator.chart import validation
from metax_operator.commands import nodes
from tests.doc_blocks import blocks, table_rows, unmarked_code_blocks
from tests.helm import CHART, find, helm_path, render_chart, validate_objects

PAGE = CHART / "docs" / "workloads.md"
BLOCKS = blocks(PAGE)
KINDS = {
    "kubectl",
    "output",
    "metax-operator",
    "manifest",
    "kubevirt",
    "values",
    "dockerfile",
    "build",
    "host",
    "qos-table",
    "maca-table",
    "problem",
    "nodes-output",
}
NODE_LABELS = {**dict.fromkeys(wl.GPU_LABELS), contract.MODE_LABEL: wl.MODES, contract.QOS_LABEL: tuple(wl.QOS_POLICIES)}


def of_kind(kind: str) -> list:
    found = [b for b in BLOCKS if b.kind == kind]
    assert found, f"no {kind} block in {PAGE}"
    return found


def ids(items) -> list[str]:
    return [f"line-{b.line}" for b in items]


def test_every_code_block_is_marked_for_checking():
    assert unmarked_code_blocks(PAGE) == []
    assert {b.kind for b in BLOCKS} <= KINDS, {b.kind for b in BLOCKS} - KINDS
    # each output follows the commands it shows the result of
    for i, block in enumerate(BLOCKS):
        if block.kind == "output":
            assert BLOCKS[i - 1].kind == "kubectl", f"line {block.line}: an output must follow a kubectl block"


def check_names(obj) -> None:
    """Labels, label values and resource names in a manifest are the operator's."""
    for spec in _pod_specs(obj):
        for key, value in (spec.get("nodeSelector") or {}).items():
            assert key in NODE_LABELS, f"nodeSelector {key} is not a label gpu-label or the admin sets"
            assert NODE_LABELS[key] is None or value in NODE_LABELS[key], f"{key}={value} is not an allowed value"
        for container in spec.get("containers") or []:
            limits = (container.get("resources") or {}).get("limits") or {}
            for name in limits:
                if name.startswith(contract.RESOURCE_PREFIX):
                    assert name in wl.GPU_RESOURCES + contract.HAMI_RESOURCES, f"{name} is not a MetaX resource"
            for env in container.get("env") or []:
                if env["name"] == wl.MACA_VERSION_ENV:
                    assert env["value"] not in wl.MACA_REFUSED and env["value"].startswith(wl.MACA_PREFIX)


def _pod_specs(obj) -> list[dict]:
    return [obj["spec"]] if obj["kind"] == "Pod" else []


@pytest.mark.parametrize("block", of_kind("manifest"), ids=ids(of_kind("manifest")))
def test_manifests_are_valid_kubernetes_objects_with_the_operators_names(block):
    objects = list(yaml.safe_load_all(block.text))
    validate_objects(objects)
    for obj in objects:
        check_names(obj)


# KubeVirt's API (kubevirt.io/api/core/v1) for the fields the page uses; anything else is refused.
def _obj(properties: dict, required: tuple = ()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_STRING, _META = {"type": "string"}, _obj({"name": {"type": "string"}, "namespace": {"type": "string"}}, ("name",))
KUBEVIRT_SCHEMAS = {
    "KubeVirt": _obj(
        {
            "apiVersion": {"const": "kubevirt.io/v1"},
            "kind": _STRING,
            "metadata": _META,
            "spec": _obj(
                {
                    "configuration": _obj(
                        {
                            "developerConfiguration": _obj({"featureGates": {"type": "array", "items": _STRING}}),
                            "permittedHostDevices": _obj(
                                {
                                    "pciHostDevices": {
                                        "type": "array",
                                        "items": _obj(
                                            {
                                                "pciVendorSelector": {"type": "string", "pattern": "^[0-9a-f]{4}:[0-9a-f]{4}$"},
                                                "resourceName": _STRING,
                                                "externalResourceProvider": {"type": "boolean"},
                                            },
                                            ("pciVendorSelector", "resourceName"),
                                        ),
                                    }
                                }
                            ),
                        }
                    )
                }
            ),
        },
        ("apiVersion", "kind", "metadata", "spec"),
    ),
    "VirtualMachine": _obj(
        {
            "apiVersion": {"const": "kubevirt.io/v1"},
            "kind": _STRING,
            "metadata": _META,
            "spec": _obj(
                {
                    "runStrategy": {"enum": ["Always", "RerunOnFailure", "Manual", "Halted", "Once", "WaitAsReceiver"]},
                    "template": _obj(
                        {
                            "spec": _obj(
                                {
                                    "domain": _obj(
                                        {
                                            "devices": _obj(
                                                {
                                                    "hostDevices": {
                                                        "type": "array",
                                                        "items": _obj(
                                                            {"deviceName": _STRING, "name": _STRING}, ("deviceName", "name")
                                                        ),
                                                    },
                                                    "disks": {
                                                        "type": "array",
                                                        "items": _obj(
                                                            {
                                                                "name": _STRING,
                                                                "disk": _obj(
                                                                    {"bus": {"enum": ["virtio", "sata", "scsi", "usb"]}}
                                                                ),
                                                            },
                                                            ("name",),
                                                        ),
                                                    },
                                                }
                                            ),
                                            "resources": _obj({"requests": {"type": "object", "additionalProperties": _STRING}}),
                                        },
                                        ("devices",),
                                    ),
                                    "volumes": {
                                        "type": "array",
                                        "items": _obj(
                                            {"name": _STRING, "containerDisk": _obj({"image": _STRING}, ("image",))}, ("name",)
                                        ),
                                    },
                                },
                                ("domain",),
                            )
                        }
                    ),
                },
                ("template",),
            ),
        },
        ("apiVersion", "kind", "metadata", "spec"),
    ),
}


@pytest.mark.parametrize("block", of_kind("kubevirt"), ids=ids(of_kind("kubevirt")))
def test_kubevirt_manifests_use_kubevirts_fields_and_the_vfio_resource(block):
    obj = yaml.safe_load(block.text)
    jsonschema.validate(obj, KUBEVIRT_SCHEMAS[obj["kind"]])
    if obj["kind"] == "KubeVirt":
        devices = obj["spec"]["configuration"]["permittedHostDevices"]["pciHostDevices"]
        assert all(d["pciVendorSelector"].split(":")[0] == wl.PCI_VENDOR_ID for d in devices)
        assert all(d["resourceName"] == contract.VFIO_RESOURCE and d["externalResourceProvider"] for d in devices)
    else:
        host_devices = obj["spec"]["template"]["spec"]["domain"]["devices"]["hostDevices"]
        assert [d["deviceName"] for d in host_devices] == [contract.VFIO_RESOURCE]


def test_kubevirt_schemas_refuse_what_kubevirt_would():
    vm = yaml.safe_load(next(b for b in of_kind("kubevirt") if "VirtualMachine" in b.text).text)
    vm["spec"]["template"]["spec"]["domain"]["devices"]["hostDevices"][0]["resource"] = "x"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(vm, KUBEVIRT_SCHEMAS["VirtualMachine"])


@pytest.mark.parametrize("block", of_kind("values"), ids=ids(of_kind("values")))
def test_values_pass_validation_and_render_into_metax_vfio_config(block, tmp_path):
    path = tmp_path / "values.yaml"
    path.write_text(block.text)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "metax_operator.cli",
            "validate",
            "--helm",
            str(helm_path("helm3")),
            "-f",
            str(path),
            "--set",
            "registry=r.example/metax",
            "--set-string",
            "driver.payload.version=2.32.0.6",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    values = yaml.safe_load(block.text)
    rendered = render_chart(
        {**values, "registry": "r.example/metax", "driver": {"payload": {"version": "1"}}},
        show_only=["templates/vfio-manager/configmap.yaml"],
    )
    config = find(rendered, "ConfigMap", "metax-vfio-config")["data"]["config"]
    assert validation.parse_vfio_config(config) == values["vfioManager"]["vfioConfig"]


def test_the_dockerfile_builds_in_an_mxmaca_image_and_ships_a_plain_one():
    text = of_kind("dockerfile")[0].text
    stages = re.findall(r"^FROM (\S+)(?: AS (\S+))?$", text, re.M)
    assert len(stages) == 2
    (builder_image, builder), (final_image, _) = stages
    assert "/maca-" in builder_image and wl.maca_version(builder_image) and builder == "builder"
    assert "maca" not in final_image
    final = text.split(f"FROM {final_image}", 1)[1]
    assert "COPY --from=builder /app /app" in final
    assert {"libelf1", "libltdl7", "libnuma1"} <= set(final.split())  # MXMACA's runtime dependencies
    build = shlex.split(of_kind("build")[0].text)
    assert build[:2] == ["docker", "build"] and build[build.index("-f") + 1] == "Dockerfile"


def test_host_commands_parse_and_name_the_metax_vendor():
    text = of_kind("host")[0].text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    assert f"lspci -nnk -d {wl.PCI_VENDOR_ID}:" in text and "modprobe vfio-pci" in text


def test_the_qos_table_is_the_operators():
    rows = table_rows(of_kind("qos-table")[0].text)
    assert dict(rows) == wl.QOS_POLICIES


def test_the_maca_table_is_what_choose_maca_does():
    block = of_kind("maca-table")[0]
    deployed = wl.deployed_maca_versions(block.args)
    for value, chosen in table_rows(block.text):
        expected = wl.choose_maca(value, deployed)
        assert (chosen == expected) if expected else chosen.startswith("refused"), (value, chosen, expected)


def test_the_example_problem_is_the_checks_own_line():
    shown = of_kind("problem")[0].text.strip()
    nodes = {name: {contract.MODE_LABEL: "sgpu"} for name in ("gpu-7", "gpu-8")}
    assert [str(p) for p in wl.problems(nodes, [], runtime_deployed=True, maca_images=[], hami_running=False)] == [shown]


def test_kubectl_commands_use_the_operators_labels_and_resources():
    for block in of_kind("kubectl"):
        for line in block.text.splitlines():
            words = shlex.split(line)
            assert words[0] == "kubectl"
            if words[1] == "label":
                for key, _, value in (w.partition("=") for w in words[3:] if "=" in w):
                    assert key in NODE_LABELS and value in (NODE_LABELS[key] or (value,)), line
            for field in re.findall(r"\.(?:allocatable|annotations)\.([\w.\\-]+/[\w-]+)", line):
                assert field.replace("\\.", ".") in wl.GPU_RESOURCES + (contract.VFIO_ANNOTATION,), line


def test_the_nodes_example_has_the_commands_columns():
    shown = of_kind("nodes-output")[0].text.splitlines()
    view = nodes.View([], "", [])
    assert shown[0].split() == nodes.render(view).splitlines()[0].split()
    assert shown[-1].startswith("current driver revision: ")


def test_the_page_is_linked_from_the_readme():
    assert "docs/workloads.md" in (CHART / "README.md").read_text()
