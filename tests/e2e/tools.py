"""Small helpers the e2e tests share: the real kubectl and other commands, and polling."""
from __future__ import annotations

import os
import subprocess

from tests.controlplane import wait_for as eventually  # noqa: F401 (re-exported: poll until truthy)
from tests.helm import BIN


def kubectl(cp, *args: str, env: dict | None = None, check: bool = True) -> str:
    """The real kubectl against control plane `cp`; its stdout, or an AssertionError with stderr."""
    result = subprocess.run([str(BIN / "kubectl"), "--kubeconfig", str(cp.kubeconfig), *args],
                            capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=60)
    if check and result.returncode:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
    return result.stdout


def run(*command: str) -> str:
    """Run a command; its stdout, or an AssertionError carrying its stderr."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    if result.returncode:
        raise AssertionError(f"{' '.join(command)} failed: {result.stderr or result.stdout}")
    return result.stdout
