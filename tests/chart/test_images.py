"""Image references: what the chart renders (templates/_helpers.tpl) and what the runner applies
(`daemonset.desired_daemonset`) are both `images.reference` of the values, under Helm 3.18 and
Helm 4.1."""

from __future__ import annotations

import pytest
import yaml

from metax_operator.chart import images
from metax_operator.chart.daemonset import desired_daemonset
from metax_operator.contract import DAEMONSETS, PAYLOAD_COPIER_CONTAINER
from tests.helm import APP_VERSION, CHART, helm_bin, render_chart  # noqa: F401

DIGEST = "sha256:" + "0123456789abcdef" * 4
PINNED = {
    "registry": "cr.example.com/metax",
    "gpuLabel": {"image": {"registry": "mirror.example:5000/gpu", "tag": "1.2.3", "digest": DIGEST}},
    "vfioManager": {"image": {"tag": "0.9.1_rc-2"}},
    "tools": {"image": {"digest": "sha512:" + "ab" * 64}},
    "driver": {"payload": {"version": "2.32.0.6", "digest": DIGEST, "registry": "payloads.example/drivers"}},
    "maca": {"payload": {"images": ["maca-c500:2.18.0.3-ubuntu18.04-amd64", f"sdk/maca-c500@{DIGEST}"]}},
}
PLAIN = {"registry": "cr.example.com/metax", "driver": {"payload": {"version": "2.32.0.6"}}}


def expected_references(values: dict) -> dict[str, str]:
    """`<DaemonSet>/<container>` -> the reference `images` gives for the values (and the defaults)."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    common = values["registry"]

    def image(key: str) -> str:
        own = {**defaults[key]["image"], **(values.get(key) or {}).get("image", {})}
        return images.reference(own["registry"] or common, own["name"], own["tag"] or APP_VERSION, own["digest"])

    payload = {**defaults["driver"]["payload"], **values["driver"]["payload"]}
    out = {}
    for key, name in DAEMONSETS.items():
        if defaults[key]["deploy"]:
            out[f"{name}/main"] = image(key)
            if key != "gpuLabel":
                out[f"{name}/wait-for"] = image("tools")
    out["metax-driver/payload"] = images.reference(
        payload["registry"] or common, payload["name"], payload["version"], payload["digest"]
    )
    out[f"metax-driver/{PAYLOAD_COPIER_CONTAINER}"] = image("tools")
    maca = {**defaults["maca"]["payload"], **(values.get("maca") or {}).get("payload", {})}
    for i, entry in enumerate(maca["images"]):
        out[f"metax-maca/payload-{i}"] = f"{maca['registry'] or common}/{entry}"
    if maca["images"]:
        out[f"metax-maca/{PAYLOAD_COPIER_CONTAINER}"] = image("tools")
    return out


def rendered_references(objects: list[dict]) -> tuple[dict[str, str], set[str]]:
    """The DaemonSets' images by `<DaemonSet>/<container>` (the first container as `main`), and
    every image of the hook Jobs, the test pod and the runner (all the tools image)."""
    out, tools = {}, set()
    for obj in objects:
        pod = (
            obj.get("spec", {}).get("template", {}).get("spec")
            or obj.get("spec", {}).get("jobTemplate", {}).get("spec", {}).get("template", {}).get("spec")
            or (obj["spec"] if obj["kind"] == "Pod" else None)
        )
        if pod is None:
            continue
        if obj["kind"] == "DaemonSet":
            name = obj["metadata"]["name"]
            out[f"{name}/main"] = pod["containers"][0]["image"]
            out.update({f"{name}/{c['name']}": c["image"] for c in pod.get("initContainers") or []})
        else:
            tools.update(c["image"] for c in pod["containers"])
    return out, tools


@pytest.mark.parametrize("values", [PLAIN, PINNED], ids=["tags", "digests-and-own-registries"])
def test_every_rendered_image_is_the_reference_format(helm_bin, values):
    rendered, tools = rendered_references(render_chart(values, helm=helm_bin))
    assert rendered == expected_references(values)
    assert tools == {expected_references(values)["metax-driver/wait-for"]}


def test_the_runner_builds_the_payload_references_the_chart_renders():
    objects = render_chart(PINNED)
    daemonsets = {
        ds["metadata"]["annotations"]["gpu.metax-tech.com/component"]: ds for ds in objects if ds["kind"] == "DaemonSet"
    }
    spec = {
        "registry": PINNED["registry"],
        "driver": PINNED["driver"] | {"payload": {"name": "driver-image", **PINNED["driver"]["payload"]}},
        "maca": PINNED["maca"],
    }
    for key in ("driver", "maca"):
        desired, _ = desired_daemonset(key, daemonsets[key], spec)
        live = {c["name"]: c["image"] for c in daemonsets[key]["spec"]["template"]["spec"]["initContainers"]}
        wanted = desired["spec"]["template"]["spec"]["initContainers"]
        assert wanted and all(live[c["name"]] == c["image"] for c in wanted)


@pytest.mark.parametrize(
    "ref, parts",
    [
        ("r.example/metax/driver-image:2.32.0.6", ("r.example/metax/driver-image", "2.32.0.6", "")),
        (f"localhost:5000/a/b:1@{DIGEST}", ("localhost:5000/a/b", "1", DIGEST)),
        (f"localhost:5000/a/b@{DIGEST}", ("localhost:5000/a/b", "", DIGEST)),
        ("localhost:5000/a/b", ("localhost:5000/a/b", "", "")),
    ],
)
def test_split_is_the_inverse_of_reference(ref, parts):
    assert images.split(ref) == parts
    repository, tag, digest = parts
    registry, _, name = repository.rpartition("/")
    assert images.reference(registry, name, tag, digest) == ref
