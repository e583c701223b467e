"""The watch-fed cache (`runtime.informer.Informer`) against a fake API server on loopback
(tests/fakeapi.py): the real client lists in pages, follows the watch, relists when the watch's
version is gone (410, as an ERROR event in the stream and as the answer to the WATCH itself), and
outlives 5xx answers (retried; a LIST that keeps failing leaves the cache "failing" until the API
answers again). The real API server cannot be told to answer these; its own watch is exercised
by every e2e test of the runner."""

from __future__ import annotations

import logging
import time

import pytest

from metax_operator.runtime.informer import Informer
from metax_operator.runtime.kube import plain
from tests.fakeapi import FakeApi
from tests.waiting import consistently, eventually

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


def test_a_steady_stream_is_read_in_bursts_after_the_gather(api):
    """With `gather`, the events after one the thread waited for stay in the socket's buffer that
    long, then are read together; none is lost."""
    informer = start(api, gather=1.0)
    try:
        api.put(f"{PODS}/p0", pod("p0"))
        eventually(lambda: "ns/p0" in informer.snapshot(), 10, "the first event", interval=0.01)
        sent = time.monotonic()
        for i in range(1, 4):
            api.put(f"{PODS}/p{i}", pod(f"p{i}"))
        eventually(lambda: len(informer.snapshot()) == 4, 10, "the burst")
        assert time.monotonic() - sent >= 0.5, "the burst was read before the gather was over"
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


def test_a_metadata_only_cache_lists_and_watches_the_objects_metadata(api):
    api.put(f"{PODS}/p0", {**pod("p0"), "spec": {"nodeName": "n0"}, "status": {"phase": "Running"}})
    informer = Informer(api.client(), PODS, project=lambda o: (o.get("kind"), sorted(o)), metadata_only=True).start()
    try:
        assert informer.wait_synced(10)
        assert informer.get("ns/p0") == ("PartialObjectMetadata", ["apiVersion", "kind", "metadata"])
        api.put(f"{PODS}/p1", pod("p1"))
        eventually(lambda: informer.get("ns/p1"), 10, "the watched pod")
        assert informer.get("ns/p1")[0] == "PartialObjectMetadata"
    finally:
        informer.stop()


def test_an_index_follows_the_store_through_events_and_relists(api):
    for name, app in (("p0", "driver"), ("p1", "driver")):
        api.put(f"{PODS}/{name}", {**pod(name, app), "spec": {"nodeName": "n0"}})
    node_of = lambda o: (o.get("spec") or {}).get("nodeName")  # noqa: E731
    informer = Informer(api.client(), PODS, project=lambda o: node_of(o) or "", index=lambda node: [node] if node else [])
    informer.start()
    try:
        assert informer.wait_synced(10)
        assert informer.indexed("n0") == {"ns/p0", "ns/p1"} and informer.indexed("n1") == set()
        api.put(f"{PODS}/p1", {**pod("p1"), "spec": {"nodeName": "n1"}})
        api.put(f"{PODS}/p2", {**pod("p2"), "spec": {"nodeName": "n1"}})
        eventually(lambda: informer.indexed("n1") == {"ns/p1", "ns/p2"}, 10, "p1 moved and p2 added")
        assert informer.indexed("n0") == {"ns/p0"}
        api.delete(f"{PODS}/p0")
        eventually(lambda: informer.indexed("n0") == set(), 10, "p0 gone")
        api.objects.pop(f"{PODS}/p2")  # gone while the watch is away: the relist repairs the index
        api.expire_watches()
        eventually(lambda: informer.stats.relists == 1, 10, "the relist")
        assert informer.indexed("n1") == {"ns/p1"}
    finally:
        informer.stop()


def test_stores_plain_objects_and_a_projection_keeping_the_parsed_view_fails_loudly(api, monkeypatch):
    """By default the store holds each object as plain Python, equal to the server's; a projection
    that keeps simdjson's view instead of plain values breaks the next parse, and the cache says it
    is failing rather than serving views of a reused buffer."""
    monkeypatch.setattr("metax_operator.runtime.informer.PAGE_SIZE", 1)
    for i in range(2):
        api.put(f"{PODS}/p{i}", pod(f"p{i}"))
    whole = Informer(api.client(), PODS).start()
    keeping = Informer(api.client(), PODS, project=lambda o: o["metadata"], name="keeping").start()
    try:
        assert whole.wait_synced(10)
        stored = whole.snapshot()["ns/p1"]
        assert type(stored) is dict and stored == api.objects[f"{PODS}/p1"]
        eventually(lambda: keeping.state == "failing", 10, "the cache keeping views failing")
        assert not keeping.synced
    finally:
        whole.stop()
        keeping.stop()


def test_one_list_page_is_decoded_at_a_time_in_the_process(api):
    """Two caches listing at once: while one stores a page, the other's page waits, so the
    runner's memory holds one page's objects, not one per cache."""
    import threading

    api.put(f"{PODS}/p0", pod("p0"))
    api.put("/api/v1/namespaces/ns/configmaps/c0", {"metadata": {"name": "c0", "namespace": "ns"}})
    storing, go, stored = threading.Event(), threading.Event(), []

    def slow(obj):
        storing.set()
        go.wait(10)
        return plain(obj)

    first = Informer(api.client(), PODS, project=slow).start()
    try:
        assert storing.wait(10)  # the first cache is storing its page
        second = Informer(api.client(), "/api/v1/namespaces/ns/configmaps", project=lambda o: stored.append(plain(o))).start()
        done = threading.Event()
        threading.Timer(1.0, done.set).start()
        consistently(lambda: not stored and not second.synced, done.is_set, 5, "the second cache's page waiting")
        go.set()
        assert second.wait_synced(10) and first.wait_synced(10) and len(stored) == 1
        second.stop()
    finally:
        go.set()
        first.stop()
