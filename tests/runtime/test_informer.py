"""The watch-fed cache (`runtime.informer.Informer`) against a fake API server on loopback
(tests/fakeapi.py): the real client lists in pages, follows the watch, relists when the watch's
version is gone (410, as an ERROR event in the stream and as the answer to the WATCH itself), and
outlives 5xx answers (retried; a LIST that keeps failing leaves the cache "failing" until the API
answers again). The real API server cannot be told to answer these; its own watch is exercised
by every e2e test of the runner."""

from __future__ import annotations

import logging

import pytest

from metax_operator.runtime import kube
from metax_operator.runtime.informer import Informer
from tests.fakeapi import FakeApi
from tests.waiting import eventually

PODS = "/api/v1/namespaces/ns/pods"


def pod(name: str, app: str = "driver") -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "ns", "labels": {"app": app}}}


@pytest.fixture
def api():
    with FakeApi() as fake:
        yield fake


def start(api: FakeApi, **kwargs) -> Informer:
    informer = Informer(
        api.client(), PODS, project=lambda o: o["metadata"]["resourceVersion"], label_selector="app=driver", **kwargs
    ).start()
    assert informer.wait_synced(10)
    eventually(lambda: api.watching(PODS), 10, "the informer's watch")
    return informer


def test_lists_in_pages_then_follows_the_watch(api, monkeypatch):
    monkeypatch.setattr(kube, "PAGE_SIZE", 2)
    monkeypatch.setattr("metax_operator.runtime.informer.PAGE_SIZE", 2)
    for i in range(5):
        api.put(f"{PODS}/p{i}", pod(f"p{i}"))
    api.put(f"{PODS}/other", pod("other", app="web"))
    informer = start(api)
    try:
        assert sorted(informer.snapshot()) == [f"ns/p{i}" for i in range(5)]
        assert informer.stats.list_requests == 3  # 2 + 2 + 1
        api.put(f"{PODS}/p5", pod("p5"))
        del api.objects[f"{PODS}/p0"]
        api.push(PODS, "DELETED", pod("p0"))
        api.push(PODS, "BOOKMARK", {"metadata": {"resourceVersion": "999"}})
        eventually(
            lambda: "ns/p5" in informer.snapshot() and "ns/p0" not in informer.snapshot(),
            10,
            "the watched addition and deletion in the cache",
        )
        eventually(lambda: informer.resource_version == "999", 10, "the bookmark's version kept")
        assert informer.state == "synced" and informer.stats.relists == 0
    finally:
        informer.stop()


def test_a_watch_whose_version_is_gone_relists(api):
    api.put(f"{PODS}/p0", pod("p0"))
    informer = start(api)
    try:
        api.put(f"{PODS}/p1", pod("p1"))  # a change the watch delivers
        eventually(lambda: "ns/p1" in informer.snapshot(), 10, "p1 in the cache")
        api.objects.pop(f"{PODS}/p0")  # a deletion the watch never delivers (compacted away)...
        api.push(PODS, "ERROR", {"kind": "Status", "code": 410, "message": "too old resource version"})
        eventually(lambda: informer.stats.relists == 1, 10, "a relist after the 410")
        assert sorted(informer.snapshot()) == ["ns/p1"]  # ...which the relist repairs
        eventually(lambda: api.watching(PODS), 10, "the watch reopened")
        assert informer.state == "synced"
    finally:
        informer.stop()


def test_a_watch_refused_with_410_relists(api):
    informer = start(api)
    try:
        api.fail("GET", PODS, 410, watch=True)
        api.put(f"{PODS}/p0", pod("p0"))  # the cache misses it: it is between two watches
        api.close_watches()  # the server ends the watch (timeoutSeconds); the next one gets 410
        eventually(lambda: informer.stats.relists == 1 and "ns/p0" in informer.snapshot(), 10, "a relist after the refused watch")
    finally:
        informer.stop()


def test_a_5xx_on_the_list_is_retried(api):
    api.put(f"{PODS}/p0", pod("p0"))
    api.fail("GET", PODS, 503, times=2)  # fewer failures than the client's attempts
    informer = start(api)
    try:
        assert list(informer.snapshot()) == ["ns/p0"] and informer.state == "synced"
        assert [r.query.get("watch") for r in api.sent("GET", PODS)][:3] == [None, None, None]
    finally:
        informer.stop()


def test_a_list_that_keeps_failing_leaves_the_cache_failing_until_the_api_answers(api):
    api.put(f"{PODS}/p0", pod("p0"))
    api.fail("GET", PODS, 500, times=4)  # more than one LIST's attempts: the first LIST fails
    informer = Informer(api.client(attempts=2), PODS, label_selector="app=driver").start()
    try:
        eventually(lambda: informer.state == "failing", 10, "the informer failing")
        assert not informer.synced and informer.snapshot() == {}
        assert informer.wait_synced(20)  # the thread retries after its backoff
        assert list(informer.snapshot()) == ["ns/p0"] and informer.state == "synced"
    finally:
        informer.stop()


def test_each_watch_failure_after_a_successful_list_waits_the_first_backoff_again(api, caplog):
    """Separate failures, each followed by a LIST that succeeds, are not one failure growing: the
    wait before the relist starts again from the shortest (at most 1 s), so a cache that fails
    once an hour is not left "failing" (the rollout taking no node) for up to 30 s."""
    caplog.set_level(logging.WARNING, logger="metax_operator.runtime.informer")
    api.put(f"{PODS}/p0", pod("p0"))
    informer = start(api)
    try:
        for round_ in range(1, 5):
            api.fail("GET", PODS, 500, watch=True)  # the next watch request fails once...
            api.close_watches()  # ...when the server ends the open one
            eventually(lambda round_=round_: len(retries(caplog)) == round_, 10, f"failure {round_} logged")
            eventually(lambda: informer.state == "synced" and api.watching(PODS), 10, "the cache listed and watching again")
        assert max(retries(caplog)) <= 1.0, retries(caplog)
    finally:
        informer.stop()


def retries(caplog) -> list[float]:
    """The waits the informer logged before retrying, in order."""
    return [r.fields["retry_in"] for r in caplog.records if getattr(r, "fields", {}).get("action") == "informer-error"]
