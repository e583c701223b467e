"""The runbook of a site without internet, seed 001 §3.1.3 steps 1 to 5 typed against the offline
package (docs/release.md): the package built from this working tree (`release.package`, with the
tools image `make image` built), unpacked into a site directory (step 1); its images file
`./metax-k8s-images.VERSION.run push DOMAIN/PROJECT` run into the local cluster's registry (step 3;
the one the real node's kubelet pulls from, behind a private CA: `SKOPEO_FLAGS="--dest-cert-dir
DIR"`), then `helm push ./k8s/metax-operator-VERSION.tgz oci://DOMAIN/PROJECT` (step 4, Helm 3,
`SSL_CERT_FILE`), and only then the runbook's install (step 5), `--set registry=DOMAIN/PROJECT
--set driver.payload.version=2.32.0.6` plus the values file of the user's path that puts the hooks
and the runner on the real node:

- under Helm 3, from the chart file of the package (`helm install ./k8s/metax-operator-VERSION.tgz`),
  then `helm test`, a staged rollout by `helm upgrade --set driver.payload.version=...` and
  `helm uninstall --wait`;
- under Helm 4, from the registry step 4 pushed the chart into (`helm install
  oci://DOMAIN/PROJECT/metax-operator`), then `helm test` and `helm uninstall --wait`.

DOMAIN/PROJECT is `127.0.0.1:PORT/site/metax`, a path the test harness never pushes into
(tests/e2e/userpath.py publishes under `metax/`; the test checks it is empty before the push):
every hook, the runner and the helm-test pod run the tools image from there, by the index digest
the package's archive carries, so the image came from the package.
"""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client

from release import package
from tests import registry
from tests.e2e.test_user_path import assert_nothing_of_ours_left
from tests.e2e.userpath import (
    GPU_NODES,
    NS,
    POLICY,
    PodWatch,
    assert_ran_as_tools_pod,
    driver_pods,
    ok,
    release_name,
    rollout_completed,
    runner_pod,
    runner_waves,
    terminated,
)
from tests.helm import BIN, CHART_VERSION, helm_path
from tests.realnode import NODE_NAME
from tests.waiting import eventually

pytestmark = pytest.mark.xdist_group("real-node")

TOP = f"{package.PACKAGE_PREFIX}{CHART_VERSION}"
CHART_TGZ = f"k8s/metax-operator-{CHART_VERSION}.tgz"
RUN = package.RUN_NAME.format(version=CHART_VERSION)
TOOLS_ARCHIVE = f"{registry.TOOLS_IMAGE}+{CHART_VERSION}.oci.tar"
SITE_PROJECT = "site/metax"  # PROJECT of the runbook's DOMAIN/PROJECT
INSTALL_HOOKS = ("preflight", "upgrade-crds", "bootstrap")
NEW_RELEASE = ("--create-namespace", "--generate-name")  # the runbook's install flags an upgrade has not


@dataclass(frozen=True)
class Site:
    """The unpacked package and what its push put into the site's registry."""

    dir: Path  # metax-operator-package.VERSION/, where the runbook's commands are typed
    registry: str  # DOMAIN/PROJECT
    image: str  # DOMAIN/PROJECT/ + the tools image's line of the package's images.txt
    digest: str  # the index digest of the package's tools image archive


def in_registry(cluster, target: str) -> dict[str, bool]:
    """Whether the site's registry holds the package's chart and tools image under `target`."""
    trust = str(registry.trust_dir(cluster.cp.ca))
    image = ["skopeo", "inspect", "--raw", "--cert-dir", trust, f"docker://{target}/{registry.TOOLS_IMAGE}:{CHART_VERSION}"]
    chart = cluster.helm("helm3", "show", "chart", f"oci://{target}/metax-operator", "--version", CHART_VERSION)
    return {
        "image": subprocess.run(image, capture_output=True, timeout=60).returncode == 0,
        "chart": chart.returncode == 0,
    }


@pytest.fixture(scope="module")
def site(tools_cluster, tmp_path_factory) -> Site:
    """The package of this tree unpacked at the site, its images pushed by its images file, its
    chart by Helm 3's `helm push` (seed 001 §3.1.3 steps 1, 3 and 4)."""
    tools_image = registry.build_tools_image()  # `make image`: a warm cache only checks its inputs
    layout = Path(tools_image["layout"])
    built = package.build(package.REPO, tmp_path_factory.mktemp("dist"), str(helm_path("helm4")), None, layout)
    at = tmp_path_factory.mktemp("site")
    subprocess.run(["tar", "-xzf", built], cwd=at, check=True)  # the runbook's step 1
    here = at / TOP
    with tarfile.open(fileobj=io.BytesIO(package.run_archives((here / RUN).read_bytes())[TOOLS_ARCHIVE])) as archive:
        (digest,) = [m["digest"] for m in json.load(archive.extractfile("index.json"))["manifests"]]
    (listed,) = [line for line in (here / "images.txt").read_text().splitlines() if line.startswith(f"{registry.TOOLS_IMAGE}:")]
    target = f"{tools_cluster.cp.registry}/{SITE_PROJECT}"

    assert in_registry(tools_cluster, target) == {"image": False, "chart": False}, "the site's registry path is not empty"
    env = {**tools_cluster.env(), "SKOPEO_FLAGS": f"--dest-cert-dir {registry.trust_dir(tools_cluster.cp.ca)}"}
    push = subprocess.run([f"./{RUN}", "push", target], cwd=here, capture_output=True, text=True, timeout=600, env=env)
    assert push.returncode == 0, f"./{RUN} push {target} failed:\n{push.stderr}"
    assert in_registry(tools_cluster, target) == {"image": True, "chart": False}
    push = subprocess.run(
        [BIN / "helm3", "push", f"./{CHART_TGZ}", f"oci://{target}"], cwd=here, capture_output=True, text=True, env=env
    )
    assert push.returncode == 0, f"helm push ./{CHART_TGZ} failed:\n{push.stderr}"
    assert in_registry(tools_cluster, target) == {"image": True, "chart": True}
    return Site(here, target, f"{target}/{listed}", digest)


def runbook(cluster, which: str, site: Site, values: Path, *command: str, payload: str = "2.32.0.6"):
    """The runbook's step 5 (`helm install CHART --create-namespace --generate-name`, or the
    upgrade `helm upgrade RELEASE CHART`) with its flags and the site's values file, typed in the
    unpacked package's directory."""
    return cluster.helm(
        which,
        *command,
        "-n",
        NS,
        "--wait",
        "--timeout",
        "5m",
        "--set",
        f"registry={site.registry}",
        "--set",
        f"driver.payload.version={payload}",
        "-f",
        str(values),
        cwd=site.dir,
    )


def assert_hooks_ran_the_package_s_image(pods: PodWatch, site: Site, hooks) -> None:
    for hook in hooks:
        eventually(lambda hook=hook: [p for p in pods.hook(hook) if terminated(p)], 30, f"the {hook} hook's pod seen ended")
        for pod in pods.hook(hook):
            assert_ran_as_tools_pod(pod, site)


def assert_runner_and_test_ran_the_package_s_image(cluster, api, which: str, release: str, site: Site) -> None:
    """The runner pod is Ready on the real node with the package's image; `helm test` passes with it."""
    runner = eventually(lambda: runner_pod(api), 60, "one running runner pod")
    status = runner.status.container_statuses[0]
    assert runner.spec.node_name == NODE_NAME
    assert (runner.spec.containers[0].image, status.image_id.rsplit("@", 1)[-1]) == (site.image, site.digest), status
    report = ok(cluster.helm(which, "test", release, "-n", NS, "--logs", "--timeout", "3m"))
    assert "test: the install is healthy" in report
    assert_ran_as_tools_pod(client.CoreV1Api(api).read_namespaced_pod("metax-operator-test", NS), site)


def uninstall(cluster, api, which: str, release: str, pods: PodWatch, site: Site) -> None:
    ok(cluster.helm(which, "uninstall", release, "-n", NS, "--wait", "--timeout", "3m"))
    assert_hooks_ran_the_package_s_image(pods, site, ["cleanup"])
    pods.stop()
    assert_nothing_of_ours_left(api)


def test_runbook_install_from_the_package_s_chart_file_under_helm3(tools_cluster, tools_api, clean_slate, site, tmp_path):
    cluster, api = tools_cluster, tools_api
    values = cluster.user_values(tmp_path, runner={"interval": 1}, driver={"upgradePolicy": POLICY})
    pods = PodWatch(api, NS)

    release = release_name(ok(runbook(cluster, "helm3", site, values, "install", f"./{CHART_TGZ}", *NEW_RELEASE)))
    assert_hooks_ran_the_package_s_image(pods, site, INSTALL_HOOKS)
    assert_runner_and_test_ran_the_package_s_image(cluster, api, "helm3", release, site)

    # A new driver payload, from the same chart file with the install's flags and values file
    # (docs/release.md: not --reuse-values): the runner rolls it out in the policy's stages.
    old = {p.metadata.labels["controller-revision-hash"] for p in driver_pods(api)}
    assert len(old) == 1 and len(driver_pods(api)) == GPU_NODES
    ok(runbook(cluster, "helm3", site, values, "upgrade", release, f"./{CHART_TGZ}", payload="2.33.0.1"))
    eventually(lambda: len(pods.hook("bootstrap")) == 2, 30, "the bootstrap hook run again by the upgrade")
    assert_hooks_ran_the_package_s_image(pods, site, ["bootstrap"])
    done = eventually(lambda: rollout_completed(api), 120, "the staged rollout Completed")
    step = done["status"]
    assert step["upgradingPodSpecRevision"] not in old and step["lastPodSpecRevision"] in old
    revisions = [p.metadata.labels["controller-revision-hash"] for p in driver_pods(api)]
    assert revisions == [step["upgradingPodSpecRevision"]] * GPU_NODES
    assert (waves := runner_waves(cluster)) == {0: [1], 1: [2, 1]}, waves

    uninstall(cluster, api, "helm3", release, pods, site)


def test_runbook_install_from_the_site_registry_under_helm4(tools_cluster, tools_api, clean_slate, site, tmp_path):
    cluster, api = tools_cluster, tools_api
    values = cluster.user_values(tmp_path)
    pods = PodWatch(api, NS)

    installed = runbook(cluster, "helm4", site, values, "install", f"oci://{site.registry}/metax-operator", *NEW_RELEASE)
    release = release_name(ok(installed))
    assert f"Pulled: {site.registry}/metax-operator:{CHART_VERSION}" in installed.stderr + installed.stdout
    assert_hooks_ran_the_package_s_image(pods, site, INSTALL_HOOKS)
    assert_runner_and_test_ran_the_package_s_image(cluster, api, "helm4", release, site)
    uninstall(cluster, api, "helm4", release, pods, site)
