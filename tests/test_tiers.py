"""The test tiers (tests/tiers.py): a test that uses a cluster fixture is e2e, whatever its module
says; `make test`'s run fails a test that starts a cluster binary, `make e2e`'s runs one that
starts a binary their setup has not built yet, and so does `make matrix`'s."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from tests import controlplane, tiers

INI = "[pytest]\nmarkers =\n    e2e\n    long_build\n    matrix\n"
CONFTEST = "from tests.conftest import control_plane, faults, pytest_collection_modifyitems, pytest_configure\n"


def stub(folder: Path, name: str) -> Path:
    """A program that does nothing, named like a binary a tier may refuse."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_a_test_is_e2e_by_the_cluster_fixtures_it_uses_or_its_marker(pytester):
    pytester.makeini(INI)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        textwrap.dedent(
            """
            import pytest

            def test_unit():
                pass

            def test_on_the_control_plane(control_plane):
                pass

            def test_through_a_fixture_that_uses_it(faults):
                pass

            @pytest.mark.long_build
            def test_of_argo_cd():
                pass

            @pytest.mark.matrix
            def test_of_the_version_matrix():
                pass
            """
        )
    )
    fast = pytester.runpytest("--collect-only", "-q", "-m", "not e2e")
    assert [line for line in fast.outlines if "::" in line] == [
        "test_a_test_is_e2e_by_the_cluster_fixtures_it_uses_or_its_marker.py::test_unit"
    ]
    e2e = pytester.runpytest("--collect-only", "-q", "-m", "e2e")
    assert [line.split("::")[1] for line in e2e.outlines if "::" in line] == [
        "test_on_the_control_plane",
        "test_through_a_fixture_that_uses_it",
        "test_of_argo_cd",
        "test_of_the_version_matrix",
    ]


def test_make_test_fails_a_test_that_starts_a_cluster_binary_saying_to_mark_it(pytester, monkeypatch, tmp_path):
    monkeypatch.setattr(controlplane, "CACHE", tmp_path / "cache")
    apiserver = stub(tmp_path / "cache" / "controlplane" / controlplane.K8S_VERSION, "kube-apiserver")
    helm, stand_in = stub(tmp_path / "cache" / "bin", "helm3"), stub(tmp_path / "test", "kwok")
    pytester.makeini(INI)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        textwrap.dedent(
            f"""
            import subprocess

            def test_starts_an_api_server():
                subprocess.run([{str(apiserver)!r}], check=True)

            def test_runs_helm_and_a_stand_in_of_kwok():
                subprocess.run([{str(helm)!r}], check=True)
                subprocess.run([{str(stand_in)!r}], check=True)

            def test_runs_containerd():
                subprocess.run(["containerd", "--version"], check=True)
            """
        )
    )
    monkeypatch.setenv(tiers.TIER, "test")
    result = pytester.runpytest("-q")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines_random(
        [
            "this test starts kube-apiserver, which `make test` does not set up: give it a cluster fixture or mark it e2e",
            "this test starts containerd, which `make test` does not set up: give it a cluster fixture or mark it e2e",
            "FAILED *::test_starts_an_api_server*",
            "FAILED *::test_runs_containerd*",
        ]
    )
    monkeypatch.delenv(tiers.TIER)
    assert subprocess.run([apiserver]).returncode == 0  # outside a tier's run, anything runs


def test_each_e2e_run_refuses_the_binaries_another_run_builds(monkeypatch, tmp_path):
    monkeypatch.setattr(controlplane, "CACHE", tmp_path)
    default = stub(tmp_path / "controlplane" / controlplane.K8S_VERSION, "kube-apiserver")
    matrix = stub(tmp_path / "controlplane" / controlplane.matrix()[0].version, "kube-apiserver")
    long_builds = [stub(tmp_path / "bin", "cosign"), stub(tmp_path / "argocd" / "v3.2.6", "argocd")]
    refused = {"e2e": [*long_builds, matrix], "long_build": [matrix], "matrix": long_builds}
    for tier, programs in refused.items():
        monkeypatch.setenv(tiers.TIER, tier)
        assert subprocess.run([default]).returncode == 0
        for program in [*long_builds, matrix]:
            if program in programs:
                marker = "matrix" if program == matrix else "long_build"
                with pytest.raises(pytest.fail.Exception, match=f"^this test starts {program}, .*: mark it {marker}$"):
                    subprocess.run([program])
            else:
                assert subprocess.run([program]).returncode == 0, (tier, program)
    monkeypatch.setenv(tiers.TIER, "test")
    with pytest.raises(pytest.fail.Exception, match="mark it e2e$"):
        subprocess.run([default])
