"""The chart's helpers called wrongly fail the render, naming the helper and what is missing,
under the real Helm 3.18 and Helm 4.1: a probe template is added to a copy of the chart."""

from __future__ import annotations

import shutil

import pytest

from tests.helm import CHART, HelmError, helm_bin, overlay, render_chart  # noqa: F401

VALUES = {"registry": "r.example/metax", "driver": {"payload": {"version": "2.32.0.6"}}}


def render_probe(tmp_path, helm: str, body: str, values: dict | None = None) -> list[dict]:
    """The chart with templates/probe.yaml holding `body`, rendered with VALUES over `values`."""
    chart = tmp_path / "chart"
    top = {"Chart.yaml", "values.yaml", "values.schema.json", "crds", "files", "templates"}
    shutil.copytree(CHART, chart, ignore=lambda d, names: [n for n in names if d == str(CHART) and n not in top])
    (chart / "templates" / "probe.yaml").write_text(body)
    return render_chart(overlay(VALUES, values or {}), helm=helm, chart=chart, show_only=["templates/probe.yaml"])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ('include "metax-operator.image" (dict "root" $)', 'image: missing argument "image"'),
        ('include "metax-operator.metadata" (dict "root" $ "key" "driver")', 'metadata: missing argument "name"'),
        ('include "metax-operator.commonEnv" $', 'commonEnv: missing argument "root"'),
        ('include "metax-operator.runnerPod" "runner"', "runnerPod takes (dict root ... name ... command)"),
        ('include "metax-operator.valuesEnv" (dict "values" .Values "group" "nope")', 'valuesEnv: no environment group "nope"'),
        ('include "metax-operator.hooks.job" (dict "root" $ "hook" "x" "phases" "test")', 'hooks.job: missing argument "weight"'),
    ],
)
def test_a_helper_called_without_its_arguments_fails_naming_them(helm_bin, tmp_path, call, message):
    with pytest.raises(HelmError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        render_probe(tmp_path, helm_bin, f"probe: {{{{ {call} | quote }}}}\n")


def test_values_env_renders_each_value_as_the_runner_does(helm_bin, tmp_path):
    """Text as the runner writes it from the CR (chart/daemonset.py): a list joined with commas, a
    boolean and a number as their text. The probe also shows the failures above are the missing
    arguments, not the probe."""
    groups = {"driver": "driver", "gpuDevice": "gpuDevice", "maca": "maca", "log": "runner"}
    body = "kind: Probe\nmetadata: {name: probe}\n" + "".join(
        f'{group}: {{{{ include "metax-operator.valuesEnv" (dict "values" .Values.{values} "group" "{group}")'
        " | fromYamlArray | toJson }}\n"
        for group, values in groups.items()
    )
    chart_values = {
        "maca": {"payload": {"images": ["a:1", "b:2"]}},
        "gpuDevice": {"healthyInterval": 0},
        "driver": {"fwEnableVirt": True},
    }
    [probe] = render_probe(tmp_path, helm_bin, body, chart_values)
    assert probe["driver"] == [
        {"name": "DEPLOY_POLICY", "value": "PreferCloud"},
        {"name": "FW_UPGRADE_POLICY", "value": "Never"},
        {"name": "FW_ENABLE_VIRT", "value": "true"},
    ]
    assert probe["gpuDevice"] == [{"name": "HEALTHY_INTERVAL", "value": "0"}]
    assert probe["maca"] == [{"name": "PAYLOAD_IMAGES", "value": "a:1,b:2"}]
    assert [e["name"] for e in probe["log"]] == ["LOG_LEVEL", "LOG_FORMAT"]
