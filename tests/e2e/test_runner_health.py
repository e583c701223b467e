"""The runner's health endpoint against the real control plane: a `metax-operator run` process, as
the chart's runner ServiceAccount, reaches the API server through a relay (tests/e2e/relay.py)
that the test cuts, freezes or whose connections it kills, and the test asks `/healthz` and
`/readyz` what the kubelet would. The chart is installed with Helm 3 without hooks and the CR
bootstrapped as in tests/e2e/test_runner.py, so the runner leads, passes and starts its watches.
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from kubernetes import client

from metax_operator.runtime.api_failures import Backoff
from tests.controlplane import free_port
from tests.e2e.relay import Relay
from tests.e2e.tools import (
    CR,
    METAX,
    bootstrap,
    install_chart,
    log_entries,
    release_values,
    service_account_kubeconfig,
    uninstall_chart,
)
from tests.waiting import consistently, eventually

NS = "runner-health"
RELEASE = "metax"
LEASE = ("--lease-duration", "4", "--renew-deadline", "3", "--retry-period", "1")  # /readyz: API answer within 4 s
# The objects a pass reads, the rollout's caches, then the workload check's.
CACHES = {
    "clusteroperator-cluster-operator",
    "daemonsets",
    "configmap-driver-config",
    "configmap-metax-vfio-config",
    "service-metax-data-exporter",
    "controllerrevisions",
    "driver-pods",
    "validation-pods",
    "gpu-workloads",
    "unschedulable-nodes",
    "nodes",
    "node-need-reboot",
    "node-rebooted",
    "nodes-mode",
    "nodes-qos-policy",
    "hami-scheduler",
}
# A pass the API server refuses fails within one call's retries: Backoff's sleeps at their longest
# (7.75 s), plus a second for the refused requests themselves.
REFUSED_PASS = sum(min(Backoff.cap, Backoff.base * 2**n) for n in range(Backoff.attempts - 1)) + 1


@pytest.fixture(scope="module")
def installed(control_plane, tmp_path_factory):
    """The runner ServiceAccount's kubeconfig, with the chart installed and the CR bootstrapped."""
    tmp = tmp_path_factory.mktemp("runner-health")
    api = control_plane.api()
    install_chart(
        control_plane, api, tmp, RELEASE, NS, {"registry": "cr.example.com/metax", "driver": {"payload": {"version": "2.32.0.6"}}}
    )
    bootstrap(control_plane, tmp, RELEASE, release_values(control_plane, RELEASE, NS))
    yield service_account_kubeconfig(control_plane, tmp, "metax-operator-runner", NS)
    uninstall_chart(control_plane, api, RELEASE, NS)


@pytest.fixture
def relay(control_plane):
    relay = Relay(urlparse(control_plane.server).port)
    yield relay
    relay.close()


class HealthRunner:
    """`metax-operator run` through `relay`, serving its health endpoint on a free loopback port."""

    def __init__(self, kubeconfig: Path, relay: Relay, tmp: Path, stall_timeout: int):
        config = yaml.safe_load(kubeconfig.read_text())
        for cluster in config["clusters"]:
            cluster["cluster"]["server"] = f"https://127.0.0.1:{relay.port}"
        path = tmp / "through-relay.kubeconfig"
        path.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.log = tmp / "runner.log"
        self.proc = subprocess.Popen(
            [
                METAX,
                "run",
                "--namespace",
                NS,
                "--kubeconfig",
                str(path),
                "--interval",
                "1",
                *LEASE,
                "--health-port",
                str(self.port),
                "--health-host",
                "127.0.0.1",
                "--stall-timeout",
                str(stall_timeout),
                "--log-level",
                "debug",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("w"),
        )

    def get(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())
        except OSError as err:  # not listening yet
            return 0, {"error": str(err)}

    def lines(self, action: str) -> list[dict]:
        return log_entries(self.log, action)

    def until(self, path: str, status: int, timeout: float, what: str, caches: bool = False) -> dict:
        """The body of `path` once it answers `status` (with `caches`: and lists the three caches)."""

        def answered():
            code, body = self.get(path)
            self.last = (code, body)
            return code == status and (not caches or set(body["caches"]) == CACHES) and body

        try:
            return eventually(answered, timeout, what)
        except AssertionError as timed_out:
            raise AssertionError(f"{timed_out}; /readyz last answered {self.last}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def start(installed, relay, tmp_path):
    runners = []

    def start(stall_timeout: int) -> HealthRunner:
        runners.append(HealthRunner(installed, relay, tmp_path, stall_timeout))
        return runners[-1]

    yield start
    for runner in runners:
        runner.stop()


def test_readiness_follows_the_api_server_and_the_watches_while_liveness_holds(relay, start):
    runner = start(stall_timeout=60)
    ready = runner.until("/readyz", 200, 60, "the runner to lead with its caches synced", caches=True)
    assert ready["leader"]
    eventually(lambda: runner.get("/readyz")[1]["lastPassSeconds"] is not None, 30, "a successful pass")

    # Its watches killed: the caches relist and the runner is Ready again.
    errors = len(runner.lines("informer-error"))
    relay.sever()
    eventually(lambda: len(runner.lines("informer-error")) >= errors + len(CACHES), 30, "every watch to notice it was cut")
    runner.until("/readyz", 200, 30, "the caches to relist")

    # The API server out of reach: not Ready, but alive (its passes fail, the loop goes on).
    relay.down()
    runner.until("/readyz", 503, 30, "/readyz to fail without the API server")
    eventually(
        lambda: (body := runner.get("/readyz")[1])["lastApiAnswerSeconds"] >= 4 and "failing" in body["caches"].values(),
        30,
        "both the lease and the caches to see it",
    )
    # Alive all along: it lost the lease, and its loop goes on as a follower's.
    consistently(
        lambda: (r := runner.get("/healthz"))[0] == 200 and r[1]["iterationRunningSeconds"] < REFUSED_PASS,
        lambda: runner.get("/readyz")[1]["lastApiAnswerSeconds"] >= 4 + 10,
        30,
        "/healthz to pass while the API server is out of reach for 10 s more",
    )
    assert runner.lines("lease-lost")

    relay.up()
    back = runner.until("/readyz", 200, 90, "/readyz to recover with the API server")
    assert all(state == "synced" for state in back["caches"].values())


def test_a_pass_hung_on_an_unanswering_api_server_fails_liveness_until_it_returns(control_plane, relay, start):
    """A steady pass sends no request (its reads come from the caches), so the pass that hangs is
    one with a write to make: a CR edit, which the runner's watch still delivers while the relay
    holds every request the runner sends."""
    runner = start(stall_timeout=10)
    runner.until("/readyz", 200, 60, "the runner to lead with its caches synced", caches=True)
    relay.freeze(requests_only=True)
    crs = client.CustomObjectsApi(control_plane.api())
    crs.patch_cluster_custom_object(*CR, {"spec": {"gpuLabel": {"log": {"level": "debug"}}}})
    try:
        stalled = runner.until("/healthz", 503, 40, "/healthz to fail while a pass hangs")
        assert stalled["iterationRunningSeconds"] >= 10 and stalled["electionRunning"]
        assert runner.get("/readyz")[0] == 503
    finally:
        relay.thaw()
        crs.patch_cluster_custom_object(*CR, {"spec": {"gpuLabel": {"log": {"level": "info"}}}})
    runner.until("/healthz", 200, 90, "/healthz to recover once the pass returns")
    runner.until("/readyz", 200, 90, "/readyz to recover")
