"""Runs the helm-unittest suites under tests/helm-unittest/ (one pytest test per suite file) and checks that
every template of the chart has its suite.

helm-unittest (built by scripts/setup.d/10-helm-unittest) renders with the Helm engine compiled
into it (Helm 3's library) and runs standalone, so it needs neither helm binary; the same
templates are rendered by the real Helm 3.18 and 4.1 binaries in tests/templates/test_chart_render.py.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.helm import BIN, CHART

UNIT = CHART / "tests" / "helm-unittest"
SUITES = sorted(UNIT.rglob("*_test.yaml"))
# Templates owned elsewhere, with their own tests: validation helpers, hook Jobs, helm test pods.
NOT_COVERED_HERE = ("templates/_", "templates/hooks/", "templates/tests/")


def suite_id(path) -> str:
    return str(path.relative_to(UNIT))


@pytest.mark.parametrize("suite", SUITES, ids=suite_id)
def test_helm_unittest_suite_passes(suite):
    binary = BIN / "helm-unittest"
    if not binary.exists():
        pytest.fail(f"{binary} is missing: run 'make test'", pytrace=False)
    result = subprocess.run(
        [binary, "--strict", "--color=false", "--file", str(suite.relative_to(CHART)), "."],
        cwd=CHART,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 passed" not in result.stdout.split("Tests:")[1].splitlines()[0], result.stdout


def test_every_template_has_a_suite():
    templates = [p.relative_to(CHART).as_posix() for p in (CHART / "templates").rglob("*") if p.is_file()]
    templates = [t for t in templates if not t.startswith(NOT_COVERED_HERE)]
    expected = {t.removeprefix("templates/").removesuffix(".yaml").removesuffix(".txt").lower() + "_test.yaml" for t in templates}
    assert expected - {suite_id(s) for s in SUITES} == set()
