"""The rollout's node cache (`runtime.node_cache`) against the fake API server: every node's
metadata and the unschedulable ones from two watches, read as one; the nodes by the rollout's
labels from an index; and, when the two watches disagree for a moment, a node read as
unschedulable, so that a cordon confirms it rather than take an admin's cordon for its own."""

from __future__ import annotations

import pytest

from metax_operator.contract import CORDONED_LABEL, RETRY_LABEL, SKIP_LABEL, STATE_LABEL
from metax_operator.runtime import cordon
from metax_operator.runtime.node_cache import NodeCache
from metax_operator.runtime.resource_version import compare_versions
from tests.fakeapi import FakeApi
from tests.waiting import eventually

NODES = "/api/v1/nodes"


def node(name: str, labels: dict | None = None, unschedulable: bool | None = None) -> dict:
    spec = {} if unschedulable is None else {"unschedulable": unschedulable}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": spec,
        "status": {"images": []},
    }


@pytest.fixture
def api():
    with FakeApi() as fake:
        yield fake


@pytest.fixture
def cache(api):
    """The node cache, started by `start` (after the test made its nodes)."""
    nodes = NodeCache(api.client(), resync=1800)
    informers = nodes.informers
    yield nodes
    for informer in informers:
        informer.stop()


def start(api: FakeApi, nodes: NodeCache) -> None:
    for informer in nodes.informers:
        informer.start()
    assert all(i.wait_synced(10) for i in nodes.informers)
    eventually(lambda: api.watching(NODES) == 2, 10, "both watches open")


def test_it_reads_labels_and_versions_from_metadata_and_unschedulable_from_its_own_watch(api, cache):
    api.put(f"{NODES}/n0", node("n0", {STATE_LABEL: "done", "other.io/x": "1"}))
    api.put(f"{NODES}/n1", node("n1", unschedulable=True))
    start(api, cache)
    n0, n1 = cache.get("n0"), cache.get("n1")
    assert n0 == cordon.NodeState(
        False, api.get(f"{NODES}/n0")["metadata"]["resourceVersion"], frozenset({(STATE_LABEL, "done")})
    )
    assert n1.unschedulable and cache.snapshot() == {"n0": n0, "n1": n1}
    assert {r.query.get("fieldSelector") for r in api.sent("GET", NODES)} == {None, "spec.unschedulable=true"}
    api.put(f"{NODES}/n0", node("n0", unschedulable=True))  # an admin's cordon
    api.put(f"{NODES}/n1", node("n1"))  # and uncordon
    eventually(lambda: cache.get("n0").unschedulable and not cache.get("n1").unschedulable, 10, "the cordon and uncordon")
    api.delete(f"{NODES}/n0")
    eventually(lambda: cache.get("n0") is None and list(cache.snapshot()) == ["n1"], 10, "the node gone")


def test_a_node_whose_cordon_only_its_metadata_watch_delivered_is_unschedulable(api, cache):
    """An admin cordons n0; the metadata watch delivers the write, the unschedulable watch has not
    yet: the cache says unschedulable (it cannot tell), so the runner's cordon reads the node and
    leaves the admin's cordon theirs, unlabelled."""
    api.put(f"{NODES}/n0", node("n0"))
    start(api, cache)
    assert not cache.get("n0").unschedulable
    cache.unschedulable = Frozen(cache.unschedulable)  # its watch delivers nothing from now on
    cordoned = api.put(f"{NODES}/n0", node("n0", unschedulable=True))
    eventually(lambda: cache.metadata.get("n0").resource_version == cordoned["metadata"]["resourceVersion"], 10, "n0's metadata")
    assert cache.get("n0").unschedulable and cache.snapshot()["n0"].unschedulable
    api.requests.clear()
    assert cordon.cordon(api.client(), "n0", cache).outcome == cordon.ALREADY
    assert [(r.method, r.path) for r in api.requests if r.path.startswith(NODES)] == [("GET", f"{NODES}/n0")]  # no write
    assert CORDONED_LABEL not in api.get(f"{NODES}/n0")["metadata"]["labels"]


def test_a_cordon_after_the_runners_own_label_write_carries_the_nodes_later_version(api, cache):
    """The runner wrote n0's state label (what `OwnWrites` remembers until both watches hold it);
    then the node changed (a kubelet's report). The unschedulable watch sees nothing of either
    (no cordon anywhere, no bookmark yet): the cordon must carry the version the metadata watch
    holds now, not the label write's, which would meet 409 at every pass while that watch is quiet."""
    api.put(f"{NODES}/n0", node("n0"))
    start(api, cache)
    cache.unschedulable = Frozen(cache.unschedulable)
    own = cordon.OwnWrites(cache)
    own.record("n0", cordon.set_labels(api.client(), "n0", {STATE_LABEL: "upgrading"}))
    assert own.get("n0") == own.written["n0"]  # the write, while no watch has delivered it
    reported = api.put(f"{NODES}/n0", {**api.get(f"{NODES}/n0"), "status": {"images": [{"names": ["x"]}]}})
    version = reported["metadata"]["resourceVersion"]
    eventually(lambda: cache.metadata.get("n0").resource_version == version, 10, "the report")
    assert cordon.cordon(api.client(), "n0", own).outcome == cordon.CORDONED
    assert api.get(f"{NODES}/n0")["spec"]["unschedulable"] is True


def test_the_rollouts_labels_are_an_index_of_the_metadata(api, cache):
    api.put(f"{NODES}/n0", node("n0", {SKIP_LABEL: "true"}))
    api.put(f"{NODES}/n1", node("n1", {CORDONED_LABEL: "true", RETRY_LABEL: "false"}, unschedulable=True))
    api.put(f"{NODES}/n2", node("n2"))
    start(api, cache)
    skipped, runners, retry = (cache.labelled(label) for label in (SKIP_LABEL, CORDONED_LABEL, RETRY_LABEL))
    assert (skipped.snapshot(), runners.snapshot(), retry.snapshot()) == ({"n0": "n0"}, {"n1": "n1"}, {})
    api.put(f"{NODES}/n2", node("n2", {RETRY_LABEL: "true", SKIP_LABEL: "true"}))
    api.put(f"{NODES}/n0", node("n0"))
    api.delete(f"{NODES}/n1")
    eventually(lambda: skipped.snapshot() == {"n2": "n2"} and retry.snapshot() == {"n2": "n2"}, 10, "n2 labelled, n0 not")
    eventually(lambda: runners.snapshot() == {}, 10, "n1 gone")
    api.expire_watches()  # a relist rebuilds the index from what it lists
    eventually(lambda: cache.metadata.stats.relists >= 1, 10, "the relist")
    assert (skipped.snapshot(), runners.snapshot(), retry.snapshot()) == ({"n2": "n2"}, {}, {"n2": "n2"})


def test_it_counts_a_node_added_relabelled_or_removed_as_a_change_and_a_status_report_not(api, cache):
    """What tells a rollout at rest that it must decide again (`NodeCache.changes`)."""
    api.put(f"{NODES}/n0", node("n0"))
    start(api, cache)
    before = cache.changes
    reported = api.put(f"{NODES}/n0", {**api.get(f"{NODES}/n0"), "status": {"images": [{"names": ["x"]}]}})
    eventually(lambda: cache.labels_seen(reported["metadata"]["resourceVersion"]), 10, "the report")
    assert cache.changes == before, "a status report counted as a change"
    api.put(f"{NODES}/n1", node("n1"))
    eventually(lambda: cache.changes == before + 1, 10, "n1 added")
    api.put(f"{NODES}/n1", node("n1", {SKIP_LABEL: "true"}))
    eventually(lambda: cache.changes == before + 2, 10, "n1 relabelled")
    api.delete(f"{NODES}/n0")
    eventually(lambda: cache.changes == before + 3, 10, "n0 removed")
    api.expire_watches()  # a relist that finds what the watch delivered counts nothing
    eventually(lambda: cache.metadata.stats.relists >= 1, 10, "the relist")
    assert cache.changes == before + 3


class Frozen:
    """An informer whose watch delivers nothing more: what it held, as of its version then."""

    def __init__(self, informer):
        self.store, self.resource_version = informer.snapshot(), informer.resource_version

    def has_seen(self, resource_version: str) -> bool:
        return compare_versions(self.resource_version, resource_version) >= 0

    def get(self, key: str):
        return self.store.get(key)

    def snapshot(self) -> dict:
        return dict(self.store)

    def versioned_snapshot(self) -> tuple[dict, str]:
        return dict(self.store), self.resource_version
