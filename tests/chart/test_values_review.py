"""`metax-operator validate FILE...` on the files of a GitOps repository: values files, Argo CD
Applications and Flux HelmReleases (values_sources.py), each problem at its file, line and column
(found here by searching the file's text, not by parsing it), in the text, github and json outputs.
The installed `metax-operator` script runs with the real Helm, as a user's hook or CI job would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from metax_operator.chart import validate as validate_cmd
from metax_operator.chart import values_sources
from metax_operator.errors import UserError
from tests.helm import BIN, CHART, HELM_VERSIONS

SCRIPT = Path(sys.executable).with_name("metax-operator")
BAD_STEP = 'replicas: "150%"'
STEPS = 'upgradePolicy:\n{i}  enableRollout: true\n{i}  upgradeSteps:\n{i}    - replicas: 5\n{i}    - replicas: "150%"\n'

HELM_RELEASE = """\
apiVersion: v1
kind: Namespace
metadata:
  name: metax-operator
---
apiVersion: helm.toolkit.fluxcd.io/v2
kind: HelmRelease
metadata:
  name: metax
  namespace: metax-operator
spec:
  interval: 1h
  chart:
    spec:
      chart: metax-operator
      sourceRef: {kind: HelmRepository, name: metax}
  values:
    registry: cr.example.com/metax
    driver:
      payload:
        version: 2.32
      """ + STEPS.format(i="      ")

APPLICATION = """\
apiVersion: argoproj.io/v1alpha1
kind: Application
metadata:
  name: metax
  namespace: argocd
spec:
  sources:
    - repoURL: https://git.example.com/gitops.git
      ref: values
    - repoURL: https://git.example.com/charts.git
      path: charts/metax-operator/
      helm:
        parameters:
          - name: driver.payload.version
            value: "2.32.0.6"
            forceString: true
        values: |
          registry: cr.example.com/metax
          driver:
            deployPolicy: Sometimes
    - repoURL: oci://cr.example.com/charts/metax-operator
      helm:
        valuesObject:
          registry: cr.example.com/metax
          commonLabels:
            team.example.com/owner: "not a label value"
          driver: {payload: {version: "2.32.0.6"}}
"""


def validate(*args, cwd: Path, helm: str = "helm3") -> subprocess.CompletedProcess:
    return subprocess.run([SCRIPT, "validate", "--helm", BIN / helm, *map(str, args)], cwd=cwd, capture_output=True, text=True)


def at(text: str, needle: str, nth: int = 1) -> str:
    """`LINE:COLUMN` of the `nth` line of `text` holding `needle`, where the needle starts."""
    lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if needle in line]
    number, line = lines[nth - 1]
    return f"{number}:{line.index(needle) + 1}"


def write(directory: Path, name: str, text: str) -> str:
    (directory / name).write_text(text)
    return name


@pytest.mark.parametrize("helm", HELM_VERSIONS)
def test_a_bad_driver_version_and_step_list_in_a_helm_release_are_reported_at_their_lines(tmp_path, helm):
    name = write(tmp_path, "metax-release.yaml", HELM_RELEASE)
    result = validate(name, cwd=tmp_path, helm=helm)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"error: {name}:{at(HELM_RELEASE, 'version: 2.32')}: driver.payload.version: must be a string, not number "
        '2.32; use an image tag such as "2.32.0.6" (quote it in YAML)',
        f"error: {name}:{at(HELM_RELEASE, BAD_STEP)}: driver.upgradePolicy.upgradeSteps[1].replicas: "
        "'150%' is not valid; use an integer >= 1 or a percentage from 1% to 100% such as \"50%\"",
    ]


def test_falling_steps_a_cross_field_rule_are_reported_at_the_step(tmp_path):
    text = HELM_RELEASE.replace("version: 2.32", 'version: "2.32.0.6"').replace('"150%"', "2")
    name = write(tmp_path, "release.yaml", text)
    result = validate(name, cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith(
        f"error: {name}:{at(text, 'replicas: 2')}: "
        "driver.upgradePolicy.upgradeSteps[1].replicas: 2 is below the previous step's 5"
    )


def test_an_application_values_string_is_located_line_by_line_and_its_parameters_apply(tmp_path):
    name = write(tmp_path, "app.yaml", APPLICATION)
    result = validate(name, cwd=tmp_path)
    assert result.returncode == 1
    # sources[1]: the version comes from the parameters (forceString), so only deployPolicy is wrong;
    # sources[2]: the label value, on its key's line (a key holding dots and a slash)
    deploy_policy, label = result.stderr.splitlines()
    assert deploy_policy == (
        f"error: {name}:{at(APPLICATION, 'deployPolicy')}: driver.deployPolicy: 'Sometimes' "
        "is not one of PreferCloud, PreferHost, PreferNewer, Never; use one of them"
    )
    assert label.startswith(
        f"error: {name}:{at(APPLICATION, 'team.example.com/owner')}: "
        "commonLabels.team.example.com/owner: 'not a label value' is not valid"
    )


def test_parameters_win_over_the_values_as_argo_cd_passes_them(tmp_path):
    text = APPLICATION.replace("deployPolicy: Sometimes", "deployPolicy: Never").replace("forceString: true", "")
    name = write(tmp_path, "app.yaml", text)
    result = validate(name, cwd=tmp_path)
    # without forceString, `--set driver.payload.version=2.32.0.6` is a string all the same
    assert (
        f"{name}:{at(text, 'values: |')}: Application argocd/metax spec.sources[1].helm.values: values are valid"
        in result.stdout.splitlines()
    )
    # `--set driver.payload.version=32` is Helm's integer 32 (forceString would keep the string);
    # the problem is reported at the parameter that sets it
    text = text.replace('value: "2.32.0.6"', 'value: "32"')
    write(tmp_path, name, text)
    result = validate(name, cwd=tmp_path)
    assert (
        f"error: {name}:{at(text, 'name: driver.payload.version')}: driver.payload.version: must be a string, "
        "not integer 32" in result.stderr
    ), result.stderr


def test_values_beside_values_object_are_refused(tmp_path):
    text = APPLICATION.replace("        valuesObject:", "        values: 'registry: x'\n        valuesObject:")
    name = write(tmp_path, "app.yaml", text)
    result = validate(name, cwd=tmp_path)
    assert (
        f"error: {name}:{at(text, 'values: ' + chr(39))}: spec.sources[2].helm.values: is not read by Argo CD "
        "when valuesObject is set; move these values into valuesObject, or remove one of the two" in result.stderr.splitlines()
    )


def test_a_field_the_file_does_not_write_is_reported_where_its_values_start(tmp_path):
    text = HELM_RELEASE.replace("    registry: cr.example.com/metax\n", "")
    text = text.replace("version: 2.32", 'version: "2.32.0.6"').replace('"150%"', '"100%"')
    name = write(tmp_path, "release.yaml", text)
    result = validate(name, cwd=tmp_path)
    assert result.stderr.splitlines() == [
        f"error: {name}:{at(text, 'values:')}: registry: is required; set it to DOMAIN/PROJECT, "
        "e.g. --set registry=cr.example.com/metax"
    ]
    # what the file cannot show comes from -f files under it and --set flags over it
    base = write(tmp_path, "base.yaml", "registry: cr.example.com/metax\n")
    assert validate(name, "-f", base, cwd=tmp_path).returncode == 0
    result = validate(name, "-f", base, "--set", "driver.deployPolicy=Later", cwd=tmp_path)
    assert "driver.deployPolicy: 'Later' is not one of" in result.stderr


def test_a_values_file_and_the_valid_sources_are_listed(tmp_path):
    values = write(tmp_path, "values.yaml", 'registry: cr.example.com/metax\ndriver:\n  payload:\n    version: "1"\n')
    text = HELM_RELEASE.replace("version: 2.32", 'version: "2.32.0.6"').replace('"150%"', '"100%"')
    release = write(tmp_path, "release.yaml", text)
    result = validate(values, release, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"{values}:1:1: values file: values are valid",
        f"{release}:{at(text, 'values:')}: HelmRelease metax-operator/metax spec.values: values are valid",
    ]


def test_releases_of_other_charts_are_skipped_and_a_file_without_this_chart_is_refused(tmp_path):
    other = HELM_RELEASE.replace("chart: metax-operator", "chart: cert-manager")
    name = write(tmp_path, "other.yaml", other)
    result = validate(name, cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [f"{name}:6: HelmRelease metax-operator/metax (chart cert-manager): skipped"]
    assert json.loads(validate("--output", "json", name, cwd=tmp_path).stdout)["skipped"] == [
        {"file": name, "line": 6, "what": "HelmRelease metax-operator/metax", "chart": "cert-manager"}
    ]
    assert result.stderr.splitlines() == [
        f"error: {name}:1:1: file: holds no values of the metax-operator chart (neither a values file nor an Argo "
        "CD Application or Flux HelmRelease of chart metax-operator); give only the files that do (the pre-commit "
        "hook's `files:` pattern), or name the chart with --chart-name"
    ]
    # --chart-name: the same release checked as this chart's
    assert "driver.payload.version: must be a string" in validate(name, "--chart-name", "cert-manager", cwd=tmp_path).stderr


@pytest.mark.parametrize(
    "text, expect",
    [
        ("registry: a\nregistry: b\n", "error: {name}:2:1: key 'registry' is repeated (first at line 1); remove one of them"),
        ("a: 1\n---\nb: 2\n", "error: {name}:1:1: document: is not a Kubernetes object, and the file holds 2 YAML documents"),
        ("registry: [\n", "error: {name}:2:1: is not valid YAML"),
        ("- a\n", "error: {name}:1:1: values: must be a mapping of values"),
        (
            APPLICATION.replace("          driver:\n", "          registry: again\n          driver:\n"),
            "error: {name}:"
            + str(APPLICATION.splitlines().index("          driver:") + 1)
            + ":11: key 'registry' is repeated (first at line ",
        ),
    ],
)
def test_what_a_tool_would_take_silently_is_refused_at_its_line(tmp_path, text, expect):
    name = write(tmp_path, "file.yaml", text)
    result = validate(name, cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith(expect.format(name=name)), result.stderr
    assert "Traceback" not in result.stderr


def test_github_output_is_one_annotation_per_problem(tmp_path):
    name = write(tmp_path, "release, 100%: gpu.yaml", HELM_RELEASE)  # `,` `:` `%` escaped in the file property
    result = validate("--output", "github", name, cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr == ""
    line, column = at(HELM_RELEASE, "version: 2.32").split(":")
    assert result.stdout.splitlines()[0] == (
        f"::error file=release%2C 100%25%3A gpu.yaml,line={line},col={column},title=metax-operator validate::"
        'driver.payload.version: must be a string, not number 2.32; use an image tag such as "2.32.0.6" '
        "(quote it in YAML)"
    )
    assert result.stdout.splitlines()[1].startswith("::error ") and "'150%25' is not valid" in result.stdout


def test_json_output(tmp_path):
    name = write(tmp_path, "release.yaml", HELM_RELEASE)
    good = write(tmp_path, "good.yaml", 'registry: r.example/m\ndriver: {payload: {version: "1"}}\n')
    result = validate("--output", "json", name, good, cwd=tmp_path)
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["valid"] is False
    assert report["checked"] == [{"file": good, "line": 1, "column": 1, "what": "values file"}]
    line, column = map(int, at(HELM_RELEASE, "version: 2.32").split(":"))
    assert report["problems"][0] == {
        "file": name,
        "line": line,
        "column": column,
        "field": "driver.payload.version",
        "problem": "must be a string, not number 2.32",
        "fix": 'use an image tag such as "2.32.0.6" (quote it in YAML)',
        "message": f"{name}:{line}:{column}: driver.payload.version: must be a string, not number 2.32; "
        'use an image tag such as "2.32.0.6" (quote it in YAML)',
    }
    assert json.loads(validate("--output", "json", good, cwd=tmp_path).stdout)["valid"] is True


def test_without_files_the_flags_are_checked_together_as_before(tmp_path):
    good = write(tmp_path, "good.yaml", 'registry: r.example/m\ndriver: {payload: {version: "1"}}\n')
    result = validate("-f", good, cwd=tmp_path)
    assert (result.returncode, result.stdout) == (0, "values are valid\n")
    assert json.loads(validate("-f", good, "--output", "json", cwd=tmp_path).stdout)["checked"] == [
        {"file": None, "line": None, "column": None, "what": "the -f files and --set flags"}
    ]
    result = validate("-f", good, "--set", "driver.deployPolicy=Later", "--output", "json", cwd=tmp_path)
    assert result.returncode == 1
    assert json.loads(result.stdout)["problems"][0]["file"] is None


def test_the_chart_is_found_beside_the_package_or_named(tmp_path):
    good = write(tmp_path, "good.yaml", 'registry: r.example/m\ndriver: {payload: {version: "1"}}\n')
    result = validate(good, "--chart", tmp_path, cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr == (
        f"error: --chart: {tmp_path} is not a chart directory (no Chart.yaml); pass --chart "
        "with the metax-operator chart's directory\n"
    )


def test_a_field_path_is_found_through_keys_holding_dots():
    text = "a.b:\n  c: 1\na:\n  b.c: 2\nlist:\n  - x: 1\n  - x: {y.z: 3}\n"
    found = values_sources._Reader("f.yaml", text, "metax-operator").read()
    source = found.sources[0]
    assert str(source.locate(UserError("a.b.c", "p"))) == "f.yaml:2:3: a.b.c: p"
    assert str(source.locate(UserError("a.b.c.d", "p"))) == "f.yaml:2:3: a.b.c.d: p"  # the deepest written
    assert str(source.locate(UserError("list[1].x.y.z", "p"))) == "f.yaml:7:9: list[1].x.y.z: p"
    assert str(source.locate(UserError("list[5].x", "p"))) == "f.yaml:5:1: list[5].x: p"
    assert str(source.locate(UserError("other", "p"))) == "f.yaml:1:1: other: p"


def test_an_installed_package_finds_the_chart_it_was_installed_from(monkeypatch, tmp_path):
    """Outside a checkout, the chart is the directory pip installed the package from (PEP 610's
    direct_url.json), as in a pre-commit hook's environment; this venv's editable install records
    this repository."""
    monkeypatch.setattr(validate_cmd, "REPO_ROOT", tmp_path)
    assert validate_cmd.installed_chart() == CHART
    assert validate_cmd.chart_dir(None) == CHART


@pytest.mark.parametrize(
    "values, expect",
    [
        ('"registry: a\\nregistry: b\\n"\n', "key 'registry' is repeated"),
        ("'registry: ['\n", "is not valid YAML"),
        (">\n          registry: a\n          driver:\n            deployPolicy: Sometimes\n", "is not valid YAML"),
    ],
)
def test_the_problems_of_values_in_a_quoted_or_folded_string_are_at_the_string(tmp_path, values, expect):
    """A quoted string's or a folded block's lines are not the file's: its problems are at its key."""
    text = APPLICATION.replace(
        "values: |\n          registry: cr.example.com/metax\n          driver:\n            deployPolicy: Sometimes\n",
        f"values: {values}",
    )
    assert text != APPLICATION
    name = write(tmp_path, "app.yaml", text)
    result = validate(name, cwd=tmp_path)
    assert result.stderr.startswith(f"error: {name}:{at(text, 'values: ')}: {expect}"), result.stderr


def test_a_file_that_cannot_be_read_is_one_line_naming_it(tmp_path):
    (tmp_path / "latin1.yaml").write_bytes(b"registry: caf\xe9\n")
    result = validate("latin1.yaml", "missing.yaml", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: latin1.yaml: is not UTF-8 text (byte 13 is 0xe9); save it as UTF-8",
        "error: missing.yaml: cannot be read: No such file or directory; check the path",
    ]
