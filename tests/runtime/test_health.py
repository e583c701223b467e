"""The runner's health endpoint without a cluster: the liveness and readiness rules on a fake
clock, the HTTP answers of the real server on loopback, and the real runner loop whose pass hangs.
Against a real API server (cut, frozen, watches killed): tests/e2e/test_runner_health.py."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from metax_operator.runtime import run as runner_mod
from metax_operator.runtime.health import Health, serve
from tests.fakeapi import FakeApi
from tests.runtime.cluster import Cluster
from tests.waiting import eventually


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeElector:
    """What Health and the loop read of `leader.Elector`."""

    def __init__(self, leader: bool = True):
        self.leader, self.electing = leader, True
        self.lock = SimpleNamespace(holder="me" if leader else "other", answered_at=None, name="lease", identity="me")

    def is_leader(self) -> bool:
        return self.leader

    def alive(self) -> bool:
        return self.electing

    def release(self) -> bool:
        return False


def health(clock, elector=None, caches=(), stall=30.0, api=15.0) -> Health:
    return Health(elector or FakeElector(), lambda: caches, stall_timeout=stall, api_timeout=api, clock=clock)


def cache(name: str, state: str):
    return SimpleNamespace(name=name, state=state)


# -- liveness ----------------------------------------------------------------------------------


def test_liveness_fails_once_an_iteration_has_run_for_the_stall_timeout():
    clock = Clock()
    h = health(clock, stall=30)
    clock.now += 29
    assert h.liveness()[0]
    clock.now += 1
    live, detail = h.liveness()
    assert not live and detail["iterationRunningSeconds"] == 30 and detail["stallTimeout"] == 30


def test_the_wait_between_iterations_backoff_included_does_not_count_as_running():
    clock = Clock()
    h = health(clock, stall=30)
    h.iteration_done(passed=False, wait=60)  # a failed pass, then 60 s of backoff
    clock.now += 60 + 29
    assert h.liveness()[0]
    clock.now += 1
    assert not h.liveness()[0]


def test_liveness_fails_when_the_election_thread_died():
    clock = Clock()
    elector = FakeElector()
    h = health(clock, elector)
    elector.electing = False
    live, detail = h.liveness()
    assert not live and detail["electionRunning"] is False


def test_a_finished_pass_is_reported_with_its_age():
    clock = Clock()
    h = health(clock)
    assert h.liveness()[1]["lastPassSeconds"] is None
    h.iteration_done(passed=True, wait=5)
    clock.now += 7
    assert h.liveness()[1]["lastPassSeconds"] == 7


# -- readiness ---------------------------------------------------------------------------------


def test_readiness_needs_a_recent_answer_of_the_api_server():
    clock = Clock()
    elector = FakeElector(leader=False)
    h = health(clock, elector, api=15)
    assert not h.readiness()[0]  # never answered
    elector.lock.answered_at = clock.now
    clock.now += 14
    ready, detail = h.readiness()
    assert ready and detail["lastApiAnswerSeconds"] == 14 and detail["leader"] is False
    clock.now += 1
    assert not h.readiness()[0]


@pytest.mark.parametrize("state", ["listing", "failing", "stopped"])
def test_readiness_needs_every_watch_cache_synced(state):
    clock = Clock()
    elector = FakeElector()
    elector.lock.answered_at = clock.now
    ready, detail = health(clock, elector, caches=[cache("driver-pods", "synced"), cache("gpu-workloads", state)]).readiness()
    assert not ready and detail["caches"] == {"driver-pods": "synced", "gpu-workloads": state}
    assert health(clock, elector, caches=[cache("driver-pods", "synced")]).readiness()[0]


def test_before_the_cr_exists_the_runner_s_readiness_waits_on_the_caches_it_started_only():
    """Helm's --wait holds the install until the runner is Ready, and the CR comes after it (the
    post-install bootstrap hook): the workload check's caches, which start with the first pass
    over a CR, must not hold readiness back before that."""
    with FakeApi() as api:
        runner = runner_mod.Runner(api.client(), "metax-operator", is_leader=lambda: True, identity="runner-0")
        try:
            runner.run_pass()
            eventually(lambda: all(c.state == "synced" for c in runner.caches()), 30, "the started caches to list")
            names = {c.name for c in runner.caches()}
            assert "driver-pods" in names and "hami-scheduler" not in names, names
            clock = Clock()
            elector = FakeElector()
            elector.lock.answered_at = clock.now
            assert Health(elector, runner.caches, stall_timeout=30, api_timeout=15, clock=clock).readiness()[0]
        finally:
            runner.close()


def test_the_driver_pools_node_watches_are_caches_readiness_waits_for():
    """A pool's nodes come from a watch of its selector: until it has listed, the runner moves no
    node (it would decide on a partial view), so readiness and the tests' cache checks wait for it."""
    cluster = Cluster(nodes=2, pools=[{"name": "rack-a", "nodeSelector": {"example.com/rack": "a"}}])
    try:
        cluster.run_pass()
        names = {c.name for c in cluster.runner.caches()}
        assert "pool-nodes example.com/rack=a" in names, names
    finally:
        cluster.close()


# -- the HTTP server -----------------------------------------------------------------------------


def get(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture
def server():
    servers = []

    def start(h: Health) -> int:
        servers.append(serve(h, "127.0.0.1", 0))
        return servers[-1].server_address[1]

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def test_the_server_answers_200_or_503_with_what_it_decided_from(server):
    clock = Clock()
    elector = FakeElector()
    h = health(clock, elector, stall=30)
    port = server(h)
    status, body = get(port, "/healthz")
    assert status == 200 and body["ok"] is True and body["leader"] is True and body["holder"] == "me"
    assert get(port, "/readyz")[0] == 503  # the API server never answered
    elector.lock.answered_at = clock.now
    assert get(port, "/readyz") == (200, {**h.readiness()[1], "ok": True})
    clock.now += 31
    status, body = get(port, "/healthz")
    assert status == 503 and body["ok"] is False and body["iterationRunningSeconds"] == 31


def test_an_unknown_path_is_404_naming_the_paths(server):
    status, body = get(server(health(Clock())), "/metrics")
    assert status == 404 and "/healthz or /readyz" in body["error"]


# -- the real loop -------------------------------------------------------------------------------


class HangingRunner:
    """A runner whose pass blocks until released, the way a pass stuck on a call would."""

    def __init__(self):
        self.release, self.passes, self.wake = threading.Event(), 0, threading.Event()

    def run_pass(self) -> int:
        self.passes += 1
        if self.passes == 3:
            self.release.wait()
        return 0


def test_a_hung_pass_fails_liveness_while_the_endpoint_still_answers_and_recovers_after(server):
    elector = FakeElector()
    hanging = HangingRunner()
    h = Health(elector, lambda: (), stall_timeout=1.0, api_timeout=15)
    port = server(h)
    stop = threading.Event()
    loop = threading.Thread(target=runner_mod.loop, args=(hanging, elector, 0.05, stop, h), daemon=True)
    loop.start()
    try:
        eventually(lambda: hanging.passes == 3, 10, "the third pass to start (and hang)")
        assert get(port, "/healthz")[0] == 200  # not yet for the stall timeout
        status, body = eventually(lambda: (r := get(port, "/healthz"))[0] == 503 and r, 10, "/healthz to fail")
        assert body["iterationRunningSeconds"] >= 1.0 and body["lastPassSeconds"] is not None
        hanging.release.set()
        eventually(lambda: get(port, "/healthz")[0] == 200, 10, "/healthz to recover once the pass returns")
    finally:
        hanging.release.set()
        stop.set()
        loop.join(5)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--health-port", "70000"], "argument --health-port: 70000 is not an integer from 0 to 65535"),
        (["--stall-timeout", "0"], "argument --stall-timeout: 0 is not a number from 1 to 86400"),
    ],
)
def test_bad_health_options_name_the_option(capsys, argv, fragment):
    from metax_operator import cli

    assert cli.main(["run", "--namespace", "ns", "--kubeconfig", "/nonexistent", *argv]) == 1
    assert fragment in capsys.readouterr().err
