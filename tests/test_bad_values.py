"""Every bad input of tests/data/bad_values.yaml is refused, naming the field, by `helm template`
under Helm 3.18 and Helm 4.1 and by `metax-operator validate`: one test per case per tool.

Cross-field rules must print the same sentence from the template (templates/_validations.tpl)
and from Python (validation.py); every component prerequisite is checked too.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from metax_operator import cli
from metax_operator.validation import DEPENDENCIES, dependency_problem
from tests.helm import HELM_VERSIONS, HelmError, render_chart

TABLE = yaml.safe_load((Path(__file__).parent / "data" / "bad_values.yaml").read_text())
BASE_SET = TABLE["base"]["set"]
SCHEMA_FAILURE = "values don't meet the specifications of the schema"


def _dependency_cases() -> list[dict]:
    """One case per prerequisite edge of seed §3.2.3."""
    cases = []
    for component, prerequisites in DEPENDENCIES.items():
        for prerequisite in prerequisites:
            cases.append({"name": f"{component} without {prerequisite}", "by": "rule",
                          "set": [f"{component}.deploy=true", f"{prerequisite}.deploy=false"],
                          "field": f"{component}.deploy",
                          "expect": str(dependency_problem(component, prerequisite))})
    return cases


CASES = TABLE["cases"] + _dependency_cases()
IDS = [case["name"] for case in CASES]


def case_args(case: dict, tmp_path: Path) -> list[str]:
    """The case as helm-style flags: --set ..., -f FILE, --set-file KEY=FILE."""
    args = []
    for flag in ([] if case.get("bare") else BASE_SET) + case.get("set", []):
        args += ["--set", flag]
    if "values" in case:
        path = tmp_path / "case-values.yaml"
        path.write_text(yaml.safe_dump(case["values"]))
        args += ["-f", str(path)]
    for key, content in case.get("setFile", {}).items():
        path = tmp_path / f"{key}.file"
        path.write_text(content)
        args += ["--set-file", f"{key}={path}"]
    return args


def helm_field(field: str, helm: str) -> str:
    """How Helm's schema validator spells a field: Helm 3 (gojsonschema) `a.b.0.c`, Helm 4
    (santhosh-tekuri/jsonschema) `'/a/b/0/c'`."""
    dotted = re.sub(r"\[(\d+)\]", r".\1", field)
    return dotted if helm == "helm3" else "'/" + dotted.replace(".", "/") + "'"


@pytest.mark.helm
@pytest.mark.parametrize("helm", HELM_VERSIONS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_helm_template_refuses(case, helm, tmp_path):
    with pytest.raises(HelmError) as failure:
        render_chart(helm=helm, args=case_args(case, tmp_path))
    message = str(failure.value)
    if case["by"] == "rule":
        assert case["expect"] in message.splitlines(), message
        return
    assert SCHEMA_FAILURE in message
    where = case.get("helmField", case["field"])
    if where is not None:
        assert helm_field(where, helm) in message, message
    if "helmExpect" in case:
        assert case["helmExpect"] in message, message


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_validate_command_refuses(case, tmp_path, capsys):
    status = cli.main(["validate", *case_args(case, tmp_path)])
    errors = capsys.readouterr().err.splitlines()
    assert status == 1
    if case["by"] == "rule":
        assert f"error: {case['expect']}" in errors, errors
    else:
        assert any(line.startswith(f"error: {case['field']}: ") and case["expect"] in line
                   for line in errors), errors


@pytest.mark.helm
@pytest.mark.parametrize("helm", HELM_VERSIONS)
def test_base_values_render(helm, tmp_path):
    """The cases fail because of what they add, not because the base is broken."""
    assert render_chart(helm=helm, args=case_args({"set": []}, tmp_path))


def test_base_values_validate(capsys):
    assert cli.main(["validate", *sum((["--set", s] for s in BASE_SET), [])]) == 0
    assert capsys.readouterr().out.strip() == "values are valid"


def test_validate_entry_point_prints_one_line_per_problem(tmp_path):
    """The installed `metax-operator` script, as a user runs it."""
    script = Path(sys.executable).with_name("metax-operator")
    result = subprocess.run([script, "validate", "--set", "gpuLabel.deploy=false",
                             "--set", "driver.deployPolicy=Never"], capture_output=True, text=True)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines[0] == ("error: registry: is required; set it to DOMAIN/PROJECT, "
                        "e.g. --set registry=cr.example.com/metax")
    assert len(lines) == 1 + 5  # registry, then the five components that need gpuLabel
    assert all(line.startswith("error: ") for line in lines)
