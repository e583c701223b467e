"""Render the chart with the real helm binaries (after Apache Airflow's chart tests).

    from tests.helm import helm_bin, render_chart   # helm_bin: fixture over both Helm versions

    def test_x(helm_bin):
        objects = render_chart({"registry": "r.example/metax"}, helm=helm_bin,
                               show_only=["templates/driver/daemonset.yaml"])

`render_chart` writes the values to a temporary file, runs `helm template` (Helm 3.18 or 4.1 as
installed by `make test`'s setup), parses the output with PyYAML's C loader and returns the objects;
`HelmError` carries helm's stderr when the render fails. `validate_objects` checks objects
against the Kubernetes API schemas (kubernetes-validate, strict: unknown fields fail).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Iterable

import kubernetes_validate
import pytest
import yaml

from metax_operator.chart import schema

CHART = Path(__file__).resolve().parent.parent
_META = yaml.safe_load((CHART / "Chart.yaml").read_text())
#: The release version (docs/release.md): the chart's version and appVersion, the default image tag.
CHART_VERSION, APP_VERSION = _META["version"], _META["appVersion"]
BIN = Path(os.environ.get("METAX_CACHE", Path.home() / ".cache" / "metax-operator")) / "bin"
HELM_VERSIONS = ("helm3", "helm4")
KUBERNETES_VERSION = "1.34"
RELEASE, NAMESPACE = "metax", "metax-operator"
# The upgrade-crds hook's CRD arguments as the chart passes them: the portable CRD and the whole one.
UPGRADE_CRDS_ARGS = ("--crd", str(CHART / schema.CRD_FILE), "--full-crd", str(CHART / schema.FULL_CRD_FILE))
# Kinds that are not in the Kubernetes API schemas (CRD-defined); they are left unvalidated.
CUSTOM_API_GROUPS = ("monitoring.coreos.com/", "gpu.metax-tech.com/")


class HelmError(Exception):
    """A helm command failed; the message is helm's stderr (then stdout, where lint reports)."""


def helm_path(helm: str) -> Path:
    path = BIN / helm
    if not path.exists():
        pytest.fail(f"{path} is missing: run 'make test'", pytrace=False)
    return path


def run_helm(helm: str, *args: str) -> str:
    """Run `helm ARGS` (helm = "helm3" or "helm4"); return stdout or raise HelmError(stderr)."""
    result = subprocess.run([helm_path(helm), *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise HelmError("\n".join(filter(None, (result.stderr.strip(), result.stdout.strip()))))
    return result.stdout


def template_args(values: dict | None, args: Iterable[str], tmp: str) -> list[str]:
    """The values and extra arguments as helm flags (values go to a file in `tmp`)."""
    flags = []
    if values is not None:
        path = Path(tmp) / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        flags += ["--values", str(path)]
    return flags + list(args)


def render_chart(
    values: dict | None = None,
    *,
    helm: str = "helm3",
    show_only: Iterable[str] = (),
    args: Iterable[str] = (),
    chart: Path = CHART,
) -> list[dict]:
    """The objects `helm template` renders for `values` (plus raw helm `args` such as
    `--set k=v`, `--set-file`, `-f FILE`), optionally only from the `show_only` templates."""
    with tempfile.TemporaryDirectory() as tmp:
        command = ["template", RELEASE, str(chart), "--namespace", NAMESPACE, *template_args(values, args, tmp)]
        for template in show_only:
            command += ["--show-only", template]
        output = run_helm(helm, *command)
    return [doc for doc in yaml.load_all(output, Loader=yaml.CSafeLoader) if doc]


def lint_chart(values: dict | None = None, *, helm: str = "helm3", args: Iterable[str] = (), chart: Path = CHART) -> str:
    """`helm lint --strict` output; raises HelmError when the chart fails."""
    with tempfile.TemporaryDirectory() as tmp:
        return run_helm(helm, "lint", "--strict", str(chart), "--namespace", NAMESPACE, *template_args(values, args, tmp))


def validate_objects(objects: Iterable[dict]) -> None:
    """Validate every object against the Kubernetes API schemas (strict: unknown fields fail)."""
    for obj in objects:
        if obj["apiVersion"].startswith(CUSTOM_API_GROUPS):
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            name = f"{obj['kind']}/{obj['metadata']['name']}"
            raise AssertionError(f"{name} is not a valid object: {error.message} at {list(error.path)}") from None


def overlay(base: dict, changes: dict) -> dict:
    """`changes` over a copy of `base` the way Helm merges values (maps key by key, anything
    else replaced, None deletes): for unit tests that build values without running Helm."""
    out = dict(base)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            out[key] = overlay(base[key], value)
        else:
            out[key] = value
    return out


def find(objects: Iterable[dict], kind: str, name: str) -> dict:
    """The one object of `kind` named `name`."""
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


@pytest.fixture(params=HELM_VERSIONS)
def helm_bin(request) -> str:
    """Each test using it runs under Helm 3.18 and Helm 4.1."""
    helm_path(request.param)
    return request.param
