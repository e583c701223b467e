"""One verdict per values file: every case of tests/data/bad_values.yaml goes through each path that
judges values, and the test fails when a path disagrees with the case (a bad case accepted, a good
one refused) or does not name the field:

- `helm template` of the chart under Helm 3.18 and Helm 4.1 (values.schema.json, then
  templates/_validations.tpl);
- `metax-operator validate` (Helm merges; the schema and validation.py; then the render);
- the pre-install hook's check: `validation.values_problems` on the values Helm merged, what
  `metax-operator preflight` runs on the hook values ConfigMap.

Cross-field rules print the same sentence from all of them; every component prerequisite is a case.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from metax_operator import cli
from metax_operator.chart import validation
from metax_operator.chart.schema import load_values_defaults
from metax_operator.chart.validate import merged_values
from metax_operator.chart.validation import dependency_problem
from metax_operator.contract import PREREQUISITES
from metax_operator.errors import UserError, UserErrors
from tests.helm import BIN, CHART, HELM_VERSIONS, HelmError, render_chart

DATA = Path(__file__).resolve().parents[1] / "data"
TABLE = yaml.safe_load((DATA / "bad_values.yaml").read_text())
BASE_SET = TABLE["base"]["set"]
SCHEMA_FAILURE = "values don't meet the specifications of the schema"
PATHS = (*HELM_VERSIONS, "validate", "preflight")
#: The chart's values.yaml: the hook ConfigMap holds the values the chart rendered with, the
#: product manual's spellings read as the chart's keys (seed_spellings), which needs them.
DEFAULTS = load_values_defaults(CHART)
_REPEAT = re.compile(r"<(.{1,2})\*(\d+)>")
#: How each Helm prints a pattern's words (schema.readable_patterns): Helm 3 (gojsonschema) with the
#: field, Helm 4 (santhosh-tekuri/jsonschema) after the field's pointer (the words name a map).
READABLE = {"helm3": '{field} does not match: "{says}', "helm4": "value must be '{says}"}
#: What Helm prints for a pattern or a `not` the schema left as it is: the regular expression itself.
RAW = re.compile(r"does not match pattern|Must not validate the schema|'not' failed", re.IGNORECASE)


def expand(node):
    """The table's `<x*N>` (x repeated N times) written out, in every string of `node`."""
    if isinstance(node, str):
        return _REPEAT.sub(lambda m: m.group(1) * int(m.group(2)), node)
    if isinstance(node, list):
        return [expand(item) for item in node]
    if isinstance(node, dict):
        return {expand(key): expand(value) for key, value in node.items()}
    return node


def _dependency_cases() -> list[dict]:
    """One case per prerequisite edge of seed §3.2.3."""
    cases = []
    for component, prerequisites in PREREQUISITES.items():
        for prerequisite in prerequisites:
            cases.append(
                {
                    "name": f"{component} without {prerequisite}",
                    "by": "rule",
                    "set": [f"{component}.deploy=true", f"{prerequisite}.deploy=false"],
                    "field": f"{component}.deploy",
                    "expect": str(dependency_problem(component, prerequisite)),
                }
            )
    return cases


CASES = [expand(case) for case in TABLE["cases"]] + _dependency_cases()
IDS = [case["name"] for case in CASES]


def case_args(case: dict, tmp_path: Path) -> list[str]:
    """The case as helm-style flags: -f FILE, --set ..., --set-string, --set-json, --set-file."""
    args = []
    if "valuesFile" in case:
        args += ["-f", str(DATA / case["valuesFile"])]
    files = {
        "values": lambda v: yaml.safe_dump(v).encode(),
        "valuesText": str.encode,
        "valuesLatin1": lambda v: v.encode("latin-1"),
    }
    for key, encode in files.items():
        if key in case:
            path = tmp_path / f"case-{key}.yaml"
            path.write_bytes(encode(case[key]))
            args += ["-f", str(path)]
    for key, flag in (("set", "--set"), ("setString", "--set-string"), ("setJson", "--set-json")):
        for value in ([] if case.get("bare") or key != "set" else BASE_SET) + case.get(key, []):
            args += [flag, value]
    for key, content in case.get("setFile", {}).items():
        path = tmp_path / f"{key}.file"
        path.write_text(content)
        args += ["--set-file", f"{key}={path}"]
    return args


def helm_verdict(helm: str, args: list[str]) -> str | None:
    try:
        render_chart(helm=helm, args=args)
    except HelmError as err:
        return str(err)
    return None


def preflight_verdict(args: list[str]) -> list[str] | None:
    """What the pre-install hook says about the values Helm merged (None when Helm cannot merge
    them: the install stops at Helm, before any hook)."""
    try:
        values = merged_values(CHART, args, str(BIN / "helm3"))
    except (UserError, UserErrors):
        return None
    return [str(e) for e in validation.values_problems(values, defaults=DEFAULTS)] or None


def expected_refusals(case: dict) -> dict[str, bool]:
    if case["by"] == "file":  # only validate reads the file itself; Helm (and so the hook) takes it its way
        helm_refuses = case["helm"] == "refuses"
        return {**dict.fromkeys(HELM_VERSIONS, helm_refuses), "validate": True, "preflight": False}
    return dict.fromkeys(PATHS, case["by"] != "accept")


def helm_field(field: str, helm: str) -> str:
    """How Helm's schema validator spells a field: Helm 3 (gojsonschema) `a.b.0.c`, Helm 4
    (santhosh-tekuri/jsonschema) `'/a/b/0/c'`."""
    dotted = re.sub(r"\[(\d+)\]", r".\1", field)
    return dotted if helm == "helm3" else "'/" + dotted.replace(".", "/") + "'"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_path_gives_the_case_its_verdict(case, tmp_path, capsys):
    args = case_args(case, tmp_path)
    said = {helm: helm_verdict(helm, args) for helm in HELM_VERSIONS}
    status = cli.main(["validate", "--helm", str(BIN / "helm3"), *args])
    errors = capsys.readouterr().err.splitlines()
    said["validate"] = errors if status else None
    said["preflight"] = preflight_verdict(args)
    refused = {path: said[path] is not None for path in PATHS}
    assert refused == expected_refusals(case), f"the paths disagree: {said}"
    if case["by"] == "accept":
        return
    if case["by"] == "file":
        assert any(case["expect"] in line for line in errors), errors
        return
    if case["by"] == "rule":
        for helm in HELM_VERSIONS:
            assert case["expect"] in said[helm].splitlines(), said[helm]
        assert f"error: {case['expect']}" in errors, errors
        assert case["expect"] in said["preflight"], said["preflight"]
        return
    for helm in HELM_VERSIONS:
        assert SCHEMA_FAILURE in said[helm]
        where = case.get("helmField", case["field"])
        if where is not None:
            assert helm_field(where, helm) in said[helm], said[helm]
        if "helmExpect" in case:
            assert case["helmExpect"] in said[helm], said[helm]
        if "helmSays" in case:
            assert READABLE[helm].format(field=helm_field(case["field"], helm), says=case["helmSays"]) in said[helm], said[helm]
        assert not RAW.search(said[helm]), f"{helm} shows the schema's regular expression: {said[helm]}"
    for lines in (errors, said["preflight"]):
        assert any(f"{case['field']}: " in line and case["expect"] in line for line in lines), lines


def test_the_table_covers_every_verdict():
    assert {case["by"] for case in CASES} == {"accept", "schema", "rule", "file"}


def test_validate_entry_point_prints_one_line_per_problem():
    """The installed `metax-operator` script, as a user runs it, Helm found through $HELM_BIN."""
    script = Path(sys.executable).with_name("metax-operator")
    result = subprocess.run(
        [script, "validate", "--set", "gpuLabel.deploy=false", "--set", "driver.deployPolicy=Never"],
        capture_output=True,
        text=True,
        env={"HELM_BIN": str(BIN / "helm4"), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines[0] == ("error: registry: is required; set it to DOMAIN/PROJECT, e.g. --set registry=cr.example.com/metax")
    assert len(lines) == 1 + 5  # registry, then the five components that need gpuLabel
    assert all(line.startswith("error: ") for line in lines)
