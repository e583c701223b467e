"""The runner's loop: a pass when a watch announces a change (one pass for a burst), the interval
only as the latest, a failure's backoff kept whatever changes, and `stop` ending any wait. The
informer's change signal against the real API server. A refused write logged as one line."""

from __future__ import annotations

import json
import logging
import threading

import pytest

from metax_operator import jsonlog
from metax_operator.runtime import kube
from metax_operator.runtime import run as runner_mod
from metax_operator.runtime.informer import Informer
from tests.runtime.test_health import FakeElector
from tests.runtime.test_kube import DRIVER, INVALID, refused_patch
from tests.waiting import consistently, eventually

HOUR = 3600.0  # an interval no test waits for: every pass here is woken


class GatedRunner:
    """A runner whose passes are counted and, while `gate` is clear, block until it is set."""

    def __init__(self, fail: bool | Exception = False):
        self.passes, self.fail = 0, fail
        self.writes: list[int] = []  # what the next passes return (then 0: nothing to write)
        self.wake, self.gate = threading.Event(), threading.Event()
        self.gate.set()

    def run_pass(self) -> int:
        self.passes += 1
        self.gate.wait()
        if isinstance(self.fail, Exception):
            raise self.fail
        if self.fail:
            raise RuntimeError("the API refused")
        return self.writes.pop(0) if self.writes else 0


@pytest.fixture
def running():
    """Start the real loop over a runner; stop it (and check it stops) afterwards."""
    started = []

    def start(runner: GatedRunner) -> threading.Thread:
        stop = threading.Event()
        thread = threading.Thread(target=runner_mod.loop, args=(runner, FakeElector(), HOUR, stop), daemon=True)
        thread.start()
        started.append((stop, thread, runner))
        return thread

    yield start
    for stop, thread, runner in started:
        runner.gate.set()
        stop.set()
        thread.join(10)
        assert not thread.is_alive(), "the loop did not end when stopped during a one-hour wait"


def test_a_change_starts_a_pass_long_before_the_interval(running):
    runner = GatedRunner()
    running(runner)
    eventually(lambda: runner.passes == 1, 10, "the first pass")
    runner.wake.set()
    eventually(lambda: runner.passes == 2, 10, "a pass woken by the change (the interval is an hour)")


def test_a_pass_that_wrote_is_followed_by_one_more_and_then_the_loop_waits(running):
    runner = GatedRunner()
    runner.writes = [3]  # the first pass starts a step: the next one may act at once
    running(runner)
    eventually(lambda: runner.passes == 2, 10, "the pass after the one that wrote")
    done = threading.Event()
    threading.Timer(2 * runner_mod.COALESCE + 1, done.set).start()
    consistently(lambda: runner.passes == 2, done.is_set, 10, "no pass after one that wrote nothing")


def test_a_burst_of_changes_during_a_pass_makes_one_more_pass(running):
    runner = GatedRunner()
    runner.gate.clear()
    running(runner)
    eventually(lambda: runner.passes == 1, 10, "the first pass, held open")
    for _ in range(1000):  # a 1,000-pod wave turning Ready while the pass runs
        runner.wake.set()
    runner.gate.set()
    eventually(lambda: runner.passes == 2, 10, "the pass for the burst")
    done = threading.Event()
    threading.Timer(2 * runner_mod.COALESCE + 1, done.set).start()
    consistently(lambda: runner.passes == 2, done.is_set, 10, "one pass for the whole burst")


def test_after_a_failed_pass_a_change_does_not_cut_the_backoff_short(running):
    runner = GatedRunner(fail=True)
    running(runner)
    eventually(lambda: runner.passes == 1, 10, "the first (failing) pass")
    runner.wake.set()
    done = threading.Event()
    threading.Timer(2 * runner_mod.COALESCE + 1, done.set).start()
    consistently(lambda: runner.passes == 1, done.is_set, 10, "no pass during the backoff")


def test_a_refused_write_is_logged_as_one_line_with_the_request_and_the_servers_message(running, caplog):
    err = refused_patch()
    caplog.set_level(logging.ERROR, logger="metax_operator.runtime.run")
    runner = GatedRunner(fail=err)
    running(runner)
    eventually(
        lambda: any(getattr(r, "fields", {}).get("action") == "pass-failed" for r in caplog.records), 10, "the pass-failed line"
    )
    record = next(r for r in caplog.records if getattr(r, "fields", {}).get("action") == "pass-failed")
    assert record.fields["error"] == f"PATCH {DRIVER}: 422 Unprocessable Entity: {INVALID}"
    line = jsonlog.JsonFormatter().format(record)
    assert "\n" not in line and "HTTP response" not in line and json.loads(line)["failures"] == 1


@pytest.fixture
def informer(control_plane):
    api = kube.Client.connect(str(control_plane.kubeconfig))
    core = api.resource("v1", "ConfigMap")
    namespace = "informer-changes"
    api.call("POST", "/api/v1/namespaces", body={"metadata": {"name": namespace}})
    changes = []
    cache = Informer(
        api, core.path(namespace=namespace), name="configmaps", project=lambda cm: (cm.get("data") or {}).get("watched")
    )
    cache.on_change = lambda: changes.append(dict(cache.snapshot()))
    cache.start()
    assert cache.wait_synced(30)
    yield api, core.path(namespace=namespace), changes
    cache.stop()
    api.call("DELETE", f"/api/v1/namespaces/{namespace}")


def test_the_informer_signals_what_its_projection_sees_and_nothing_else(informer):
    api, path, changes = informer
    api.call("POST", path, body={"metadata": {"name": "a"}, "data": {"watched": "1"}})
    eventually(lambda: changes and changes[-1] == {"informer-changes/a": "1"}, 30, "the added object")
    seen = len(changes)
    api.call("PATCH", f"{path}/a", body={"data": {"other": "x"}}, content_type="application/merge-patch+json")
    api.call("PATCH", f"{path}/a", body={"data": {"watched": "2"}}, content_type="application/merge-patch+json")
    eventually(lambda: changes[-1] == {"informer-changes/a": "2"}, 30, "the projected change")
    assert len(changes) == seen + 1, "an update the projection does not see signalled a change"
    api.call("DELETE", f"{path}/a")
    eventually(lambda: changes[-1] == {}, 30, "the deletion")


def test_interval_only_ignores_changes():
    runner = GatedRunner()
    stop = threading.Event()
    thread = threading.Thread(
        target=runner_mod.loop, args=(runner, FakeElector(), HOUR, stop), kwargs={"on_change": False}, daemon=True
    )
    thread.start()
    try:
        eventually(lambda: runner.passes == 1, 10, "the first pass")
        runner.wake.set()
        done = threading.Event()
        threading.Timer(2 * runner_mod.COALESCE + 1, done.set).start()
        consistently(lambda: runner.passes == 1, done.is_set, 10, "no pass before the interval")
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()


@pytest.mark.parametrize("on_change", [True, False])
def test_the_first_pass_comes_as_soon_as_the_election_takes_the_lease(on_change, caplog):
    """The loop starts before the election thread has asked for the lease: it finds itself no
    leader and waits; taking the lease ends that wait, so a start does not cost an interval."""
    from kubernetes import client

    from metax_operator.runtime.leader import Elector, LeaseLock
    from tests.runtime.test_leader import Leases

    lock = LeaseLock("lease", "ns", "me", client.ApiClient())
    lock.api = Leases()
    elector = Elector(lock, lease_duration=15, renew_deadline=10, retry_period=2)
    runner, stop = GatedRunner(), threading.Event()
    caplog.set_level(logging.INFO, logger="metax_operator.runtime.run")
    thread = threading.Thread(target=runner_mod.loop, args=(runner, elector, HOUR, stop), kwargs={"on_change": on_change})
    thread.start()
    try:
        waiting = lambda: any(getattr(r, "fields", {}).get("action") == "wait-lease" for r in caplog.records)  # noqa: E731
        eventually(waiting, 10, "the loop waiting for the lease, which nobody has asked for yet")
        elector.start()
        eventually(lambda: runner.passes == 1, 10, "the first pass, once the lease is taken (the interval is an hour)")
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
