"""The alert rules (`chart.alerts`, generated into alerts/metax-operator-rules.yaml) under the real
`promtool` (Debian's prometheus package, installed by scripts/setup.d/15-prometheus): the file
checks, its unit tests (alerts_test.yaml) pass, every alert has a case that fires and one that
does not, and each case is sharp: an alert made to fire always, or never, fails its cases. Then
what the rules read (metrics the runner exports), where their runbooks point (a section of
docs/alerts.md), and the chart's PrometheusRule (the same groups)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from metax_operator.chart import alerts
from metax_operator.runtime.metrics import Metrics, names
from tests.helm import CHART, find, helm_bin, render_chart  # noqa: F401 - helm_bin is a fixture
from tests.templates.test_chart_render import SEED_INSTALL

RULES = CHART / alerts.RULES_FILE
CASES = Path(__file__).with_name("alerts_test.yaml")
DOCS = CHART / "docs" / "alerts.md"
METRIC_NAME = re.compile(r"\bmetax_operator_[a-z_]+\b")


def promtool(*args: str) -> subprocess.CompletedProcess:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: run 'make test' (it installs Debian's prometheus package)", pytrace=False)
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=120)


def rule_names(groups: list[dict]) -> list[str]:
    return [rule["alert"] for group in groups for rule in group["rules"]]


ALERT_NAMES = rule_names(yaml.safe_load(RULES.read_text())["groups"])


def test_the_rules_file_passes_promtool_check():
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERT_NAMES)} rules found" in result.stdout


def test_the_promtool_unit_tests_pass():
    result = promtool("test", "rules", str(CASES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_case_that_fires_and_one_that_does_not():
    cases = [case for test in yaml.safe_load(CASES.read_text())["tests"] for case in test["alert_rule_test"]]
    firing = {c["alertname"] for c in cases if c["exp_alerts"]}
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert len(ALERT_NAMES) == len(set(ALERT_NAMES)) == 10
    assert firing == quiet == set(ALERT_NAMES)


def _with_expr(tmp_path: Path, alert: str, expr: str) -> Path:
    """A copy of the unit tests over the rules file with `alert`'s expression replaced."""
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if rule["alert"] == alert:
                rule["expr"] = expr
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(doc))
    cases = yaml.safe_load(CASES.read_text())
    cases["rule_files"] = ["rules.yaml"]
    (tmp_path / "cases.yaml").write_text(yaml.safe_dump(cases))
    return tmp_path / "cases.yaml"


@pytest.mark.parametrize("alert", ALERT_NAMES)
def test_each_alerts_cases_fail_when_it_fires_always_or_never(tmp_path, alert):
    for expr, broken in (("vector(1)", "a case that must stay quiet"), ("vector(1) == 0", "a case that must fire")):
        result = promtool("test", "rules", str(_with_expr(tmp_path, alert, expr)))
        assert result.returncode != 0, f"{alert} with expr {expr!r} still passes: no {broken}"
        assert f"alertname: {alert}" in result.stderr + result.stdout


def test_the_rules_read_only_metrics_the_runner_exports():
    exported = names(Metrics())
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            named = set(METRIC_NAME.findall(rule["expr"]))
            if group["name"] == alerts.EXPORTER_GROUP:
                assert not named and 'up{job="metax-data-exporter"}' in rule["expr"]
                continue
            assert named, f"{rule['alert']} reads no runner metric"
            assert named <= exported, f"{rule['alert']} reads {named - exported}, which the runner does not export"


def _doc_anchors() -> set[str]:
    """GitHub's anchors of the headings of docs/alerts.md (lower case, punctuation dropped)."""
    headings = re.findall(r"^#+ (.+)$", DOCS.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}


def test_every_alert_links_its_own_section_of_the_docs():
    anchors = _doc_anchors()
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            base, anchor = rule["annotations"]["runbook_url"].split("#")
            assert base == alerts.RUNBOOK_BASE and base.endswith("/docs/alerts.md")
            assert anchor == rule["alert"].lower() and anchor in anchors, f"docs/alerts.md has no section {rule['alert']}"
            section = DOCS.read_text().split(f"## {rule['alert']}\n", 1)[1].split("\n## ", 1)[0]
            for part in ("**What it means**", "**What to check**", "**The fix**"):
                assert part in section, f"the section {rule['alert']} lacks {part}"


# -- the chart's PrometheusRule -----------------------------------------------------------------

ON = SEED_INSTALL + ("--set", "runner.prometheusRule.enabled=true")
EXPORTER = ("--set", "gpuLabel.deploy=true", "--set", "exporter.deploy=true", "--set", "exporter.serviceMonitor.enabled=true")


def prometheus_rule(objects) -> dict:
    return find(objects, "PrometheusRule", "metax-operator-runner")


def test_the_prometheus_rule_holds_the_rules_files_groups(helm_bin):
    spec = prometheus_rule(render_chart(helm=helm_bin, args=ON + EXPORTER))["spec"]
    assert spec["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    without = prometheus_rule(render_chart(helm=helm_bin, args=ON))["spec"]["groups"]
    assert [g["name"] for g in without] == [alerts.RUNNER_GROUP]


def test_labels_runbook_base_and_additional_rules_pass_promtool(helm_bin, tmp_path):
    values = {
        "runner": {
            "prometheusRule": {
                "labels": {"release": "kube-prometheus-stack"},
                "annotations": {"owner": "gpu-infra"},
                "additionalRuleLabels": {"team": "gpu", "severity": "page"},
                "runbookBaseURL": "https://docs.example.com/metax/alerts",
                "additionalRules": [{"alert": "GpuHot", "expr": "max(metax_gpu_temperature) > 90", "for": "5m"}],
            }
        }
    }
    rule = prometheus_rule(render_chart(values, helm=helm_bin, args=ON))
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["metadata"]["annotations"] == {"owner": "gpu-infra"}
    groups = rule["spec"]["groups"]
    assert [g["name"] for g in groups] == [alerts.RUNNER_GROUP, "metax-operator-additional"]
    for item in groups[0]["rules"]:
        assert item["labels"]["team"] == "gpu"
        assert item["labels"]["severity"] in ("warning", "critical")  # the alert's own severity stays
        assert item["annotations"]["runbook_url"] == f"https://docs.example.com/metax/alerts#{item['alert'].lower()}"
    assert groups[1]["rules"] == [{"alert": "GpuHot", "expr": "max(metax_gpu_temperature) > 90", "for": "5m"}]
    (tmp_path / "rendered.yaml").write_text(yaml.safe_dump({"groups": groups}))
    result = promtool("check", "rules", str(tmp_path / "rendered.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_prometheus_rule_is_off_by_default_and_in_cronjob_mode(helm_bin):
    kinds = {o["kind"] for o in render_chart(helm=helm_bin, args=SEED_INSTALL)}
    assert "PrometheusRule" not in kinds
    cron = render_chart(helm=helm_bin, args=ON + ("--set", "runner.mode=cronjob"))
    assert "PrometheusRule" not in {o["kind"] for o in cron}
