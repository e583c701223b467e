"""The test tiers and the guard that keeps them apart (docs/control-plane.md, "Test tiers").

- `make test` runs every test not marked `e2e`: it sets up no cluster, real node, registry,
  tools image or Checkov, and takes minutes.
- `make e2e` runs the tests marked `e2e` but `matrix`: those that use a fixture of
  CLUSTER_FIXTURES (directly or through another fixture: marked here), and the modules that
  start a cluster themselves or run Checkov (their `pytestmark`). Among them, `long_build` marks
  the tests that use a tool of the long cold builds (setup profile `long-builds`: Argo CD, Flux,
  cosign): `make e2e` builds those while the other e2e tests run, then runs these.
- `make matrix` runs the tests marked `matrix`: those that need a Kubernetes version of the
  matrix besides the default (setup profile `matrix`: six more Kubernetes builds, half an
  hour or more cold on 2 cores, which is why CI's `make e2e` leaves them out).

The guard: each run sets METAX_TEST_TIER, and a test that starts a program its run did not set
up fails, saying how to mark it: `make test` refuses every program of the e2e setup (`mark it
e2e`); `make e2e`'s first run the long builds' and the matrix's binaries; its `long_build` run
the matrix's; `make matrix` the long builds'. It sees every process the tests start (a
`subprocess.Popen` audit hook), whichever helper starts it; a stand-in program of the same name
elsewhere (a test's fake kwok) runs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests import controlplane

TIER = "METAX_TEST_TIER"
CLUSTER_FIXTURES = frozenset({"control_plane", "tools_cluster", "tools_image"})
# Debian's programs of the real node, of the registry's pushes and the tools image, Argo CD's cache.
HOST_TOOLS = frozenset({"containerd", "runc", "nsenter", "unshare", "skopeo", "umoci", "redis-server"})


def mark(items: list[pytest.Item]) -> None:
    """Mark `e2e` every test that uses a cluster fixture or is marked `long_build` or `matrix`."""
    for item in items:
        if CLUSTER_FIXTURES.intersection(item.fixturenames) or any(map(item.get_closest_marker, ("long_build", "matrix"))):
            item.add_marker(pytest.mark.e2e)


def matrix_build(program: Path) -> bool:
    """A binary of a Kubernetes version of the matrix (not the default version's)."""
    cache = controlplane.CACHE
    return program.parent.parent == cache / "controlplane" and program.parent.name != controlplane.K8S_VERSION


def long_build(program: Path) -> bool:
    """A binary of the long builds: Argo CD's, Flux's, cosign."""
    cache = controlplane.CACHE
    return (
        program.is_relative_to(cache / "argocd") or program.is_relative_to(cache / "flux") or program == cache / "bin" / "cosign"
    )


def cluster(program: Path) -> bool:
    """A program of `make e2e`'s setup (or `make demo`'s): the control plane, the real node, the
    registry, the tools image's build, Checkov, the long builds and the matrix."""
    cache = controlplane.CACHE
    return (
        long_build(program)
        or program.is_relative_to(cache / "controlplane")
        or program.is_relative_to(controlplane.BIN_DIR)
        or program == cache / "bin" / "registry"
        or program.is_relative_to(cache / "checkov")
        or program == controlplane.REPO / "scripts" / "image"
        or program.name in HOST_TOOLS
    )


def refusal(tier: str, program: str) -> str | None:
    """Why a test of `tier` may not start `program`, in one line; None when it may."""
    if tier == "test" and cluster(Path(program)):
        name = Path(program).name
        return f"this test starts {name}, which `make test` does not set up: give it a cluster fixture or mark it e2e"
    if tier in ("e2e", "matrix") and long_build(Path(program)):
        return f"this test starts {program}, which `make e2e` builds while the other e2e tests run: mark it long_build"
    if tier in ("e2e", "long_build") and matrix_build(Path(program)):
        return f"this test starts {program}, a Kubernetes version `make matrix` builds: mark it matrix"
    return None


def _audit(event: str, args: tuple) -> None:
    if event != "subprocess.Popen" or not os.environ.get(TIER):
        return
    why = refusal(os.environ[TIER], os.fsdecode(args[0]))  # the program Popen executes
    if why:
        pytest.fail(why, pytrace=False)


_installed = False


def install_guard() -> None:
    """Watch the processes this interpreter starts (once: an audit hook cannot be removed)."""
    global _installed
    if not _installed:
        sys.addaudithook(_audit)
        _installed = True
