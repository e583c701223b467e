"""The control plane's setup step in a bad environment says in one line what is wrong and what to
do, naming the command that runs it again. (A port in use and missing binaries are in
test_control_plane.py.)"""

from __future__ import annotations

import os
import subprocess

from tests.controlplane import REPO

SETUP = REPO / "scripts" / "setup.d" / "20-control-plane"


def run_setup(env: dict) -> subprocess.CompletedProcess:
    """The step as `make demo` runs it."""
    return subprocess.run([str(SETUP)], env={**env, "METAX_SETUP": "make demo"}, capture_output=True, text=True, timeout=120)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("==> ")]


def test_missing_go_says_to_install_it(tmp_path):
    result = run_setup({**os.environ, "PATH": "/usr/bin:/bin", "METAX_CACHE": str(tmp_path)})
    assert result.returncode == 1
    assert error_lines(result.stderr) == [
        "error: the Go toolchain is not on PATH: install Go 1.24 or newer "
        "(Debian package golang or the official tarball), then run 'make demo' again"
    ]


def test_failed_build_names_the_cause_and_the_log(tmp_path):
    # No module cache and no proxy: the build fails at its first module, quickly.
    env = {**os.environ, "METAX_CACHE": str(tmp_path), "GOMODCACHE": str(tmp_path / "mod"), "GOPROXY": "off"}
    result = run_setup(env)
    assert result.returncode == 1
    [line] = error_lines(result.stderr)
    log = tmp_path / "controlplane" / "build-v1.34.4.log"
    assert line == (
        f"error: building the control plane failed (module lookup disabled by GOPROXY=off): "
        f"see {log}, fix the cause, then run 'make demo' again"
    )
    assert log.exists()
    assert not (tmp_path / "controlplane" / "v1.34.4").exists()  # nothing half-built is taken for done
