"""`metax-operator images`: the images the values make the cluster pull, from the real Helm render,
under Helm 3.18 and Helm 4.1, over several sets of values; each list is checked against the images
worked out here from values.yaml and the values (the reference format of images.reference)."""

from __future__ import annotations

import json

import pytest
import yaml

from metax_operator import cli
from metax_operator.chart import images
from metax_operator.contract import DAEMONSETS
from tests.helm import APP_VERSION, CHART, helm_bin, helm_path, overlay  # noqa: F401

DIGEST = "sha256:" + "0123456789abcdef" * 4
SEED = {"registry": "cr.example.com/metax", "driver": {"payload": {"version": "2.32.0.6"}}}
VALUES = {
    "seed": SEED,
    "pinned": {
        "registry": "cr.example.com/metax",
        "gpuLabel": {"image": {"registry": "mirror.example:5000/gpu", "tag": "1.2.3", "digest": DIGEST}},
        "tools": {"image": {"digest": "sha512:" + "ab" * 64}},
        "driver": {"payload": {"version": "2.32.0.6", "digest": DIGEST, "registry": "payloads.example/drivers"}},
        "maca": {"payload": {"images": ["maca-c500:2.18.0.3-ubuntu18.04-amd64", f"sdk/maca-c500@{DIGEST}"]}},
    },
    "exporter-on-vfio-off": overlay(SEED, {"exporter": {"deploy": True}, "vfioManager": {"deploy": False}}),
    "host-driver-no-maca": {
        "registry": "cr.example.com/metax",
        "driver": {"deployPolicy": "Never"},
        "maca": {"deploy": False},
        "gpuDevice": {"deploy": False},
        "runner": {"enabled": False},
        "tests": {"enabled": False},
    },
}


def expected_images(values: dict) -> set[str]:
    """Each deployed component's image, the driver payload (unless the host's driver is used), each
    MXMACA payload, and the tools image (the hook Jobs always run it)."""
    v = overlay(yaml.safe_load((CHART / "values.yaml").read_text()), values)

    def image(own: dict) -> str:
        return images.reference(own["registry"] or v["registry"], own["name"], own["tag"] or APP_VERSION, own["digest"])

    out = {image(v["tools"]["image"])}
    out |= {image(v[key]["image"]) for key in DAEMONSETS if v[key]["deploy"]}
    payload = v["driver"]["payload"]
    if v["driver"]["deploy"] and v["driver"]["deployPolicy"] != "Never":
        out.add(images.reference(payload["registry"] or v["registry"], payload["name"], payload["version"], payload["digest"]))
    if v["maca"]["deploy"]:
        out |= {f"{v['maca']['payload']['registry'] or v['registry']}/{entry}" for entry in v["maca"]["payload"]["images"]}
    return out


def run_images(capsys, helm: str, *args: str) -> tuple[int, str, str]:
    status = cli.main(["images", "--helm", str(helm_path(helm)), *args])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("name", VALUES)
def test_the_list_is_every_image_the_values_pull(helm_bin, capsys, tmp_path, name):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(VALUES[name]))
    status, out, err = run_images(capsys, helm_bin, "-f", str(values))
    assert (status, err) == (0, "")
    assert out.splitlines() == sorted(expected_images(VALUES[name]))


def test_json_names_each_image_s_parts_and_the_pods_pulling_it(helm_bin, capsys, tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(VALUES["pinned"]))
    status, out, _ = run_images(capsys, helm_bin, "-f", str(values), "--output", "json")
    listed = {entry["reference"]: entry for entry in json.loads(out)["images"]}
    assert status == 0 and set(listed) == expected_images(VALUES["pinned"])
    for ref, entry in listed.items():
        assert (entry["repository"], entry["tag"], entry["digest"]) == images.split(ref)
    payload = listed[f"payloads.example/drivers/driver-image:2.32.0.6@{DIGEST}"]
    assert payload["pulledBy"] == ["DaemonSet/metax-driver/payload"]
    assert listed[f"cr.example.com/metax/sdk/maca-c500@{DIGEST}"]["pulledBy"] == ["DaemonSet/metax-maca/payload-1"]
    tools = listed[f"cr.example.com/metax/metax-operator-tools:{APP_VERSION}@sha512:{'ab' * 64}"]["pulledBy"]
    kinds = {where.split("/")[0] for where in tools}
    assert kinds == {"DaemonSet", "Deployment", "Job", "Pod"}, tools  # wait-for, the runner, the hooks, helm test
    assert "DaemonSet/metax-driver/wait-for" in tools


def test_set_flags_change_the_list_as_helm_takes_them(helm_bin, capsys):
    status, out, _ = run_images(
        capsys,
        helm_bin,
        "--set",
        "registry=r.example/metax,driver.payload.version=2.33.0.9",
        "--set-string",
        "driver.image.tag=0.13.0",
        "--set-json",
        'maca.payload.images=["maca-native:3.0.0-ubuntu22.04-amd64"]',
    )
    assert status == 0
    lines = out.splitlines()
    assert {"r.example/metax/driver-image:2.33.0.9", "r.example/metax/driver-manager:0.13.0"} <= set(lines)
    assert "r.example/metax/maca-native:3.0.0-ubuntu22.04-amd64" in lines
    assert f"r.example/metax/driver-manager:{APP_VERSION}" in lines  # maca's own driver-manager image keeps the default tag


def test_bad_values_are_refused_as_validate_refuses_them(helm_bin, capsys):
    flags = ["--set", "registry=DOMAIN/PROJECT", "--set-string", "driver.payload.version=1"]
    status, out, err = run_images(capsys, helm_bin, *flags)
    assert (status, out) == (1, "")
    assert err.startswith("error: registry: 'DOMAIN/PROJECT' is not valid; ")
    assert len(err.splitlines()) == 1
