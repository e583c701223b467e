"""The post-renderer: exact pass-through, idempotence, errors, and end to end under real Helm 3 and Helm 4."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings

from metax_operator.chart.postrender import error_document, postrender, split_documents
from metax_operator.contract import SCHEDULING_BASE_ANNOTATION, SCHEDULING_INPUTS_ANNOTATION, SHARED_FIELDS_ANNOTATION
from tests.chart.test_merge_properties import all_inputs

REPO = Path(__file__).resolve().parents[2]
FIXTURE_CHART = REPO / "tests" / "data" / "fixture-chart"
EXECUTABLE = REPO / "postrender" / "metax-postrender"
BIN = Path(os.environ.get("METAX_CACHE", Path.home() / ".cache" / "metax-operator")) / "bin"
HELM3, HELM4 = BIN / "helm3", BIN / "helm4"
HELM4_FILENAME = "postrenderer.helm.sh/postrender-filename"

toleration = lambda key, value, effect="NoSchedule": {  # noqa: E731
    "key": key,
    "operator": "Equal",
    "value": value,
    "effect": effect,
}
# Seed 000 §3.2.5.2: global node-type=general, maca node-type=gpu.
SEED_VALUES = {
    "podTemplateSpec": {"spec": {"tolerations": [toleration("node-type", "general")]}},
    "maca": {"podTemplateSpec": {"spec": {"tolerations": [toleration("node-type", "gpu")]}}},
}
# Documents a first pass leaves as they were, whatever they look like.
UNTOUCHED = """\
# leading comment of the stream
apiVersion: v1
kind: ConfigMap
metadata: {name: a, annotations: {x: "gpu.metax-tech.com/scheduling-inputs"}}
data:
  weird:    'spacing'   # kept
---   # a marker with a comment
--- |
  a bare literal document
---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: not-ours
spec: {template: {spec: {tolerations: [{operator: Exists}]}}}
...
---
"""


def helm_env(home: Path) -> dict:
    """Helm's homes inside `home`, so that no plugin or repository leaks in or out of the test."""
    return {
        **os.environ,
        "HELM_DATA_HOME": str(home / "data"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_CACHE_HOME": str(home / "cache"),
    }


@pytest.fixture(scope="module")
def helm_home(tmp_path_factory) -> dict:
    """A Helm home with postrender/ installed as the Helm 4 plugin, and a capture plugin that
    records the exact stream Helm 4 hands a post-renderer (and passes it on unchanged)."""
    home = tmp_path_factory.mktemp("helm-home")
    env = helm_env(home)
    capture = home / "capture"
    capture.mkdir()
    (capture / "plugin.yaml").write_text(
        "apiVersion: v1\ntype: postrenderer/v1\nname: capture\nversion: 0.1.0\nruntime: subprocess\n"
        "runtimeConfig:\n  platformCommand:\n    - command: ${HELM_PLUGIN_DIR}/capture.sh\n"
    )
    (capture / "capture.sh").write_text(f'#!/bin/sh\ntee "{home}/captured.yaml"\n')
    (capture / "capture.sh").chmod(0o755)
    for plugin in (REPO / "postrender", capture):
        subprocess.run([HELM4, "plugin", "install", plugin], env=env, check=True, capture_output=True)
    env["CAPTURED"] = str(home / "captured.yaml")
    return env


def write_values(tmp_path: Path, values: dict) -> Path:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def helm_template(helm: Path, env: dict, chart: Path, values: Path | None = None, *flags: str):
    command = [helm, "template", "release", chart, "--namespace", "gpu", *flags]
    if values:
        command += ["-f", values]
    return subprocess.run(command, env=env, capture_output=True, text=True)


def run_executable(text: str, *args: str):
    return subprocess.run([EXECUTABLE, *args], input=text, capture_output=True, text=True)


def daemonsets(stream: str) -> dict:
    return {d["metadata"]["name"]: d for d in yaml.safe_load_all(stream) if d and d.get("kind") == "DaemonSet"}


def pairs(tolerations: list) -> list:
    return [(t["key"], t["value"]) for t in tolerations]


# --- the stream, in process -------------------------------------------------------------


@pytest.mark.parametrize("text", [UNTOUCHED, "", "---\n", "a: 1", "---\na: 1\n---\nb: 2", "x: |\n  ---\n  y\n"])
def test_split_documents_joins_back_exactly(text):
    assert "".join(split_documents(text)) == text


def test_documents_without_the_contract_pass_through_byte_for_byte():
    assert postrender(UNTOUCHED) == (UNTOUCHED, [])


def test_default_render_passes_through_byte_for_byte(helm_home):
    rendered = helm_template(HELM3, helm_home, FIXTURE_CHART).stdout
    assert SCHEDULING_INPUTS_ANNOTATION in rendered
    assert postrender(rendered) == (rendered, [])


def test_only_the_scheduling_fields_of_component_daemonsets_change(helm_home, tmp_path):
    rendered = helm_template(HELM3, helm_home, FIXTURE_CHART, write_values(tmp_path, SEED_VALUES)).stdout
    output, _ = postrender(rendered)
    before, after = split_documents(rendered), split_documents(output)
    assert len(before) == len(after)
    for old, new in zip(before, after, strict=True):
        if SCHEDULING_INPUTS_ANNOTATION not in old or "kind: DaemonSet" not in old:
            assert new == old
            continue
        old_doc, new_doc = yaml.safe_load(old), yaml.safe_load(new)
        for doc in (old_doc, new_doc):
            doc["spec"]["template"]["spec"].pop("tolerations", None)
        assert new_doc == old_doc
        # Text outside the pod spec keeps its order, quotes and comments.
        assert new.split("\n    spec:\n")[0] == old.split("\n    spec:\n")[0]
        assert "# trailing comment kept" in new and new.startswith("---\n# Source: ")


def test_output_run_through_again_is_byte_identical(helm_home, tmp_path):
    values = {
        **SEED_VALUES,
        "tolerations": [toleration("key1", "value1")],
        "driver": {
            "podTemplateSpec": {
                "spec": {
                    "nodeSelector": {"pool": "gpu"},
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]
                            }
                        }
                    },
                }
            }
        },
    }
    rendered = helm_template(HELM3, helm_home, FIXTURE_CHART, write_values(tmp_path, values)).stdout
    once, _ = postrender(rendered)
    assert once != rendered
    assert postrender(once)[0] == once


def test_helm4_stream_keeps_the_filename_annotation_and_is_idempotent(helm_home, tmp_path):
    result = helm_template(HELM4, helm_home, FIXTURE_CHART, write_values(tmp_path, SEED_VALUES), "--post-renderer", "capture")
    assert result.returncode == 0, result.stderr
    stream = Path(helm_home["CAPTURED"]).read_text()
    output, _ = postrender(stream)
    assert output != stream
    assert output.count(HELM4_FILENAME) == stream.count(HELM4_FILENAME) > 0
    assert daemonsets(output)["metax-maca"]["metadata"]["annotations"][HELM4_FILENAME].endswith("daemonsets.yaml")
    assert postrender(output)[0] == output


def contract_daemonset(pod_spec: str, base: str = "{}", inputs: str = "{}") -> str:
    """A component DaemonSet as the chart renders it, with `pod_spec` as the pod spec's text."""
    return (
        "---\n# Source: chart/templates/maca.yaml\n# 注释: non-ASCII text before the edit\n"
        "apiVersion: apps/v1\nkind: DaemonSet\nmetadata:\n  name: metax-maca\n  annotations:\n"
        "    gpu.metax-tech.com/component: maca\n"
        f"    gpu.metax-tech.com/scheduling-base: '{base}'\n"
        f"    gpu.metax-tech.com/scheduling-inputs: '{inputs}'\n"
        "spec:\n  template:\n    spec:" + pod_spec + "status: {}\n"
    )


GPU_INPUTS = '{"component":{"spec":{"tolerations":[{"key":"node-type","value":"gpu"}],"nodeSelector":{"pool":"gpu"}}}}'


def test_changed_field_is_replaced_in_place_keeping_the_text_around_it():
    pod_spec = (
        "\n      tolerations:   # ours\n        - key: node-role  # last\n      # after tolerations\n"
        "      containers: [{name: c}]\n"
    )
    text = contract_daemonset(pod_spec, '{"tolerations":[{"key":"node-role"}]}', GPU_INPUTS)
    output, _ = postrender(text)
    assert output == contract_daemonset(
        "\n      tolerations:\n        - key: node-role\n        - key: node-type\n          value: gpu\n"
        "      # after tolerations\n      containers: [{name: c}]\n      nodeSelector:\n        pool: gpu\n",
        '{"tolerations":[{"key":"node-role"}]}',
        GPU_INPUTS,
    )
    assert postrender(output)[0] == output


def test_a_daemonset_rendered_from_the_live_one_passes_through():
    """Once installed, the chart renders the scheduling fields as the live DaemonSet holds them
    (the runner's, from the CR): the values' inputs must not be merged over them."""
    live = "\n      tolerations:\n        - key: from-the-cr\n      containers: []\n"
    text = contract_daemonset(live, '{"tolerations":[{"key":"node-role"}]}', GPU_INPUTS)
    marked = text.replace("  annotations:\n", f"  annotations:\n    {SHARED_FIELDS_ANNOTATION}: live\n")
    assert postrender(text)[0] != text  # without the mark, the inputs would be merged
    assert postrender(marked) == (marked, [])


def test_a_block_scalar_at_the_end_of_a_replaced_field_is_cut_exactly():
    pod_spec = "\n      tolerations:\n      - key: node-role\n        value: |\n          x\n      containers: []\n"
    text = contract_daemonset(pod_spec, '{"tolerations":[{"key":"node-role","value":"x\\n"}]}', GPU_INPUTS)
    output, _ = postrender(text)
    assert "      containers: []\n      nodeSelector:\n        pool: gpu\n" in output
    assert yaml.safe_load(output)["spec"]["template"]["spec"]["tolerations"] == [
        {"key": "node-role", "value": "x\n"},
        {"key": "node-type", "value": "gpu"},
    ]


def test_indentless_lists_stay_indentless():
    text = contract_daemonset(
        "\n      tolerations:\n      - key: node-role\n", '{"tolerations":[{"key":"node-role"}]}', GPU_INPUTS
    )
    assert "      tolerations:\n      - key: node-role\n      - key: node-type\n        value: gpu\n" in postrender(text)[0]


def test_a_field_the_base_does_not_have_is_removed():
    text = contract_daemonset("\n      containers: []\n      tolerations:\n      - key: stray\n      hostPID: true\n")
    assert postrender(text)[0] == contract_daemonset("\n      containers: []\n      hostPID: true\n")


def test_a_flow_style_pod_spec_is_replaced_in_flow_style_keeping_the_text_around_it():
    text = contract_daemonset(
        " {containers: [], tolerations: [{key: node-role}], hostPID: true}  # pod\n",
        '{"tolerations":[{"key":"node-role"}]}',
        GPU_INPUTS,
    )
    output, _ = postrender(text)
    assert output == contract_daemonset(
        " {containers: [], tolerations: [{key: node-role}, {key: node-type, value: gpu}], hostPID: true, "
        "nodeSelector: {pool: gpu}}  # pod\n",
        '{"tolerations":[{"key":"node-role"}]}',
        GPU_INPUTS,
    )
    assert postrender(output)[0] == output


@settings(max_examples=60, deadline=None)
@given(all_inputs)
def test_any_inputs_give_the_merge_result_and_a_second_run_changes_nothing(inputs):
    from metax_operator.chart.merge import merge_scheduling

    base_text = yaml.safe_dump(inputs.base, default_flow_style=False) if inputs.base else ""
    pod_spec = "\n      containers: []\n" + "".join("      " + line + "\n" for line in base_text.splitlines())
    recorded = {"global": inputs.global_pts, "component": inputs.component_pts, "tolerations": inputs.deprecated_tolerations}
    text = (
        contract_daemonset(pod_spec)
        .replace("gpu.metax-tech.com/component: maca", f"gpu.metax-tech.com/component: {inputs.component}")
        .replace("scheduling-base: '{}'", f"scheduling-base: {json.dumps(json.dumps(inputs.base))}")
        .replace("scheduling-inputs: '{}'", f"scheduling-inputs: {json.dumps(json.dumps(recorded))}")
    )
    output, _ = postrender(text)
    pod = yaml.safe_load(output)["spec"]["template"]["spec"]
    assert {k: v for k, v in pod.items() if k != "containers"} == merge_scheduling(inputs)[0]
    assert postrender(output)[0] == output


# --- errors -----------------------------------------------------------------------------


def test_malformed_podtemplatespec_fails_naming_document_source_and_field(helm_home, tmp_path):
    values = {"maca": {"podTemplateSpec": {"spec": {"containers": [{"name": "x"}]}}}}
    rendered = helm_template(HELM3, helm_home, FIXTURE_CHART, write_values(tmp_path, values)).stdout
    result = run_executable(rendered)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith(
        "error: DaemonSet/metax-maca (metax-fixture/templates/daemonsets.yaml): "
        "maca.podTemplateSpec.spec.containers: is not supported"
    )


def test_a_bad_global_input_is_reported_once_not_per_daemonset():
    doc = (
        "---\n# Source: chart/templates/{name}.yaml\napiVersion: apps/v1\nkind: DaemonSet\nmetadata:\n"
        "  name: {name}\n  annotations:\n    gpu.metax-tech.com/component: {key}\n"
        "    gpu.metax-tech.com/scheduling-base: '{{}}'\n"
        '    gpu.metax-tech.com/scheduling-inputs: \'{{"global":{{"spec":{{"hostPID":true}}}}}}\'\n'
        "spec: {{template: {{spec: {{}}}}}}\n"
    )
    stream = doc.format(name="metax-maca", key="maca") + doc.format(name="metax-driver", key="driver")
    result = run_executable(stream)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: DaemonSet/metax-maca (chart/templates/metax-maca.yaml): podTemplateSpec.spec.hostPID: is not "
        "supported: only nodeSelector, affinity and tolerations are managed (seed table 3.15); remove it, or set "
        "it in the chart's values for that component if it has one"
    ]


@pytest.mark.parametrize(
    "document, expected",
    [
        (
            "kind: DaemonSet\nmetadata:\n  name: metax-maca\n  annotations:\n"
            "    gpu.metax-tech.com/scheduling-inputs: [unclosed\n",
            "DaemonSet/metax-maca (templates/m.yaml): is not valid YAML",
        ),
        (
            "kind: DaemonSet\nmetadata:\n  name: metax-maca\n  annotations:\n    gpu.metax-tech.com/component: maca\n"
            "    gpu.metax-tech.com/scheduling-base: '{}'\n    gpu.metax-tech.com/scheduling-inputs: '{\"global\": nul'\n"
            "spec: {template: {spec: {}}}\n",
            'DaemonSet/metax-maca (templates/m.yaml): metadata.annotations["gpu.metax-tech.com/scheduling-inputs"]: '
            "is not valid JSON",
        ),
        (
            "kind: DaemonSet\nmetadata:\n  name: metax-maca\n  annotations:\n    gpu.metax-tech.com/component: maca\n"
            "    gpu.metax-tech.com/scheduling-base: '{}'\n    gpu.metax-tech.com/scheduling-inputs: '{}'\n",
            "DaemonSet/metax-maca (templates/m.yaml): spec.template.spec: is missing",
        ),
    ],
)
def test_malformed_input_fails_naming_the_document(document, expected):
    result = run_executable("---\n# Source: templates/m.yaml\n" + document)
    assert result.returncode == 1
    assert result.stderr.startswith("error: " + expected), result.stderr


def test_a_document_without_source_and_with_flow_metadata_is_still_named():
    result = run_executable(
        "kind: DaemonSet\nmetadata: {name: metax-x, annotations: {gpu.metax-tech.com/scheduling-inputs: '{}'}}\n"
    )
    assert result.returncode == 1
    assert result.stderr.startswith('error: DaemonSet/metax-x: metadata.annotations["gpu.metax-tech.com/component"]: is missing')


ANNOTATED = "kind: DaemonSet\nmetadata:\n  name: metax-maca\n  annotations:\n    gpu.metax-tech.com/scheduling-inputs: '{}'\n"


@pytest.mark.parametrize(
    "nesting",
    ["  deep: " + "[" * 50_000 + "]" * 50_000 + "\n", "  deep:\n" + "".join("  " * i + "- \n" for i in range(1, 600))],
    ids=["flow", "block"],
)
def test_an_over_deep_document_is_refused_with_a_message_not_a_crash(nesting):
    """Regression: PyYAML's C composer recursed once per level and died with SIGSEGV (no message,
    Helm only saw the plugin vanish) on a 50,000-deep nesting inside an annotated document."""
    result = run_executable("---\n# Source: templates/m.yaml\n" + ANNOTATED + "spec:\n" + nesting)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: DaemonSet/metax-maca (templates/m.yaml): is nested more than 1000 levels deep; "
        "fix the template or values that produced it"
    ]


def test_a_repeated_key_in_a_daemonset_is_refused_with_its_line():
    """YAML forbids duplicate keys; a parser that keeps the last one silently drops the first."""
    result = run_executable(
        "---\n# Source: templates/m.yaml\n"
        + ANNOTATED
        + "spec:\n  template:\n    spec:\n      nodeSelector: {a: b}\n      nodeSelector: {c: d}\n"
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: DaemonSet/metax-maca (templates/m.yaml): line 11: key 'nodeSelector' is repeated (first at "
        "line 10); remove one of them: YAML forbids duplicate keys and Helm keeps only the last"
    ]


def test_input_that_is_not_utf8_is_refused():
    result = subprocess.run([EXECUTABLE], input=b"\xff\xfe", capture_output=True)
    assert result.returncode == 1 and result.stderr.startswith(b"error: stdin: is not UTF-8 text")


def test_error_document_mode_exits_zero_with_one_document_carrying_the_message():
    result = run_executable(
        "kind: DaemonSet\nmetadata: {name: x, annotations: {gpu.metax-tech.com/scheduling-inputs: '{}'}}\n", "--error-document"
    )
    assert result.returncode == 0
    (doc,) = yaml.safe_load_all(result.stdout)
    assert "gpu.metax-tech.com/component" in doc["metadata"]["annotations"][HELM4_FILENAME]
    assert result.stdout == error_document(result.stderr.removeprefix("error: ").rstrip("\n"))


# --- end to end with the real binaries --------------------------------------------------

# What the real chart requires before it renders at all (seed table 3.1, 3.4).
CHART_REQUIRED = {"registry": "cr.example.com/metax", "driver": {"payload": {"version": "2.32.0.6"}}}


@pytest.mark.parametrize(
    "chart, required", [pytest.param(FIXTURE_CHART, {}, id="fixture-chart"), pytest.param(REPO, CHART_REQUIRED, id="chart")]
)
@pytest.mark.parametrize("helm, post_renderer", [(HELM3, str(EXECUTABLE)), (HELM4, "metax-postrender")], ids=["helm3", "helm4"])
def test_seed_example_end_to_end(helm_home, tmp_path, chart, required, helm, post_renderer):
    result = helm_template(
        helm,
        helm_home,
        chart,
        write_values(tmp_path, {**SEED_VALUES, **required}),
        "--post-renderer",
        post_renderer,
        "--post-renderer-args",
        "--namespace=gpu",
    )
    assert result.returncode == 0, result.stderr
    found = daemonsets(result.stdout)
    for name, role, added in (("metax-maca", "maca", "gpu"), ("metax-driver", "driver", "general")):
        base = json.loads(found[name]["metadata"]["annotations"][SCHEDULING_BASE_ANNOTATION]).get("tolerations", [])
        tolerations = found[name]["spec"]["template"]["spec"]["tolerations"]
        assert tolerations == base + [toleration("node-type", added)]
        if chart == FIXTURE_CHART:  # the seed's own default templates
            assert pairs(tolerations) == [("node-role", role), ("node-type", added)]
    # Helm 4 files each document under its template again: the filename annotation was kept.
    assert "generated-by-postrender" not in result.stdout and HELM4_FILENAME not in result.stdout


def test_helm3_shows_the_error_and_fails(helm_home, tmp_path):
    values = write_values(tmp_path, {"driver": {"podTemplateSpec": {"spec": {"hostNetwork": True}}}})
    result = helm_template(HELM3, helm_home, FIXTURE_CHART, values, "--post-renderer", str(EXECUTABLE))
    assert result.returncode != 0
    assert (
        "DaemonSet/metax-driver (metax-fixture/templates/daemonsets.yaml): "
        "driver.podTemplateSpec.spec.hostNetwork: is not supported"
    ) in result.stderr


def test_helm4_shows_the_error_and_fails(helm_home, tmp_path):
    values = write_values(tmp_path, {"driver": {"podTemplateSpec": {"spec": {"hostNetwork": True}}}})
    result = helm_template(HELM4, helm_home, FIXTURE_CHART, values, "--post-renderer", "metax-postrender")
    assert result.returncode != 0
    assert (
        "DaemonSet/metax-driver (metax-fixture/templates/daemonsets.yaml): "
        "driver.podTemplateSpec.spec.hostNetwork: is not supported"
    ) in result.stderr
    assert result.stdout == ""
