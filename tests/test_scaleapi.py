"""The scale benchmark's API server (tests/scaleapi.py) at a small scale, read and written through
the runner's own client and watch cache: a LIST in pages from one snapshot, a WATCH that resumes
from a version and tells a watch an object left its selection, metadata-only answers, merge, JSON
and strategic patches with their preconditions, and the kubelets and the driver's DaemonSet
controller it plays. What the benchmark measures is only as good as this server's answers."""

from __future__ import annotations

import itertools
import json

import pytest
from kubernetes.client.exceptions import ApiException

from metax_operator import contract
from metax_operator.runtime.informer import Informer
from metax_operator.runtime.kube import Client
from tests import scale_objects, scaleapi
from tests.fakeapi import PARTIAL, PARTIAL_LIST
from tests.runtime.test_reconcile import VALUES
from tests.waiting import eventually

NODES = 12
POLICY = {"enableRollout": True, "maxParallel": 1, "upgradeSteps": [{"replicas": "100%", "pauseDuration": 0}]}


@pytest.fixture(scope="module")
def release() -> dict:
    return scaleapi.release(VALUES, POLICY)


@pytest.fixture
def cluster(release):
    """A cluster of NODES nodes with 2 other pods each and a training pod on half, its kubelets
    reporting every 2 s; pods terminate and turn Ready in a fraction of a second."""
    cluster = scaleapi.Cluster(NODES, node_period=2.0, other_pods=2, busy_fraction=0.5, ready=0.2, terminate=0.1)
    cluster.populate(release)
    cluster.start()
    server = scaleapi.serve(cluster)
    cluster.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield cluster
    server.shutdown()
    server.server_close()


def client(cluster) -> Client:
    from kubernetes import client as k8s

    configuration = k8s.Configuration()
    configuration.host = cluster.url
    return Client(k8s.ApiClient(configuration))


def raw(api: Client, path: str, query: dict, accept: str) -> dict:
    answer = api.api_client.call_api(
        path,
        "GET",
        query_params=list(query.items()),
        header_params={"Accept": accept},
        _preload_content=False,
        _return_http_data_only=True,
    )
    return json.loads(answer.data)


def test_it_serves_the_release_on_realistic_nodes_and_pods(cluster):
    api = client(cluster)
    nodes = api.list("v1", "Node")
    assert len(nodes) == NODES
    assert all(17_000 < len(json.dumps(n)) < 24_000 for n in nodes)  # what kubelets write: about 20 KB
    assert {len(n["metadata"]["managedFields"]) for n in nodes} == {8}
    daemonsets = {ds["metadata"]["name"] for ds in api.list("apps/v1", "DaemonSet", scaleapi.NS)}
    assert contract.DRIVER_DAEMONSET in daemonsets
    cr = api.get(contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME)
    assert cr["spec"]["driver"]["upgradePolicy"] == POLICY
    pods = api.list("v1", "Pod", all_namespaces=True)
    busy = sum(1 for i in range(NODES) if cluster.busy(i))
    assert len(pods) == NODES * 3 + busy  # a driver pod and 2 others on each node, a training pod on the busy ones
    on_node = api.list("v1", "Pod", field_selector="spec.nodeName=gpu-node-00003", all_namespaces=True)
    assert {p["spec"]["nodeName"] for p in on_node} == {"gpu-node-00003"} and len(on_node) in (3, 4)


def test_a_list_is_paged_from_one_snapshot(cluster):
    api = client(cluster)
    first = api.call("GET", "/api/v1/nodes", query={"limit": 5})
    cluster_node = "/api/v1/nodes/gpu-node-00011"
    api.patch("v1", "Node", "gpu-node-00011", {"metadata": {"labels": {"extra": "x"}}})  # after the first page
    names, token, versions = [n["metadata"]["name"] for n in first["items"]], first["metadata"]["continue"], set()
    while token:
        page = api.call("GET", "/api/v1/nodes", query={"limit": 5, "continue": token})
        names += [n["metadata"]["name"] for n in page["items"]]
        versions.add(page["metadata"]["resourceVersion"])
        token = page["metadata"].get("continue")
    assert names == [scale_objects.node_name(i) for i in range(NODES)]
    assert versions == {first["metadata"]["resourceVersion"]}  # every page is of the first page's snapshot
    assert cluster.obj(cluster_node)["metadata"]["labels"]["extra"] == "x"


def test_the_runners_watch_cache_lists_then_follows_changes_and_selections(cluster):
    api = client(cluster)
    state = contract.STATE_LABEL
    everything = Informer(api, "/api/v1/nodes", project=lambda n: n["metadata"]["resourceVersion"], name="nodes").start()
    pending = Informer(api, "/api/v1/nodes", label_selector=f"{state}=pending", project=lambda n: 1, name="pending").start()
    try:
        assert everything.wait_synced(10) and pending.wait_synced(10)
        assert len(everything.snapshot()) == NODES and not pending.snapshot()
        eventually(lambda: everything.stats.events >= NODES, 10, "each node's status report (kubelets every 2 s)")
        api.patch("v1", "Node", "gpu-node-00001", {"metadata": {"labels": {state: "pending"}}})
        eventually(lambda: "gpu-node-00001" in pending.snapshot(), 10, "the node entering the selection")
        api.patch("v1", "Node", "gpu-node-00001", {"metadata": {"labels": {state: "done"}}})
        eventually(lambda: not pending.snapshot(), 10, "the node leaving the selection (DELETED)")
    finally:
        everything.stop()
        pending.stop()


def watch_lines(api: Client, query: dict, accept: str = "application/json", until=lambda line: True) -> list[dict]:
    """The events of a WATCH of the nodes, up to the first `until` holds for."""
    response = api.api_client.call_api(
        "/api/v1/nodes",
        "GET",
        query_params=list({"watch": "true", **query}.items()),
        header_params={"Accept": accept},
        _preload_content=False,
        _return_http_data_only=True,
        _request_timeout=(5, 10),
    )
    seen, buffer = [], b""
    try:
        for chunk in response.stream(amt=None, decode_content=False):
            *lines, buffer = (buffer + chunk).split(b"\n")
            for line in filter(None, lines):
                seen.append(json.loads(line))
                if until(seen[-1]):
                    return seen
    finally:
        response.release_conn()
    return seen


def test_a_watch_resumes_from_its_version_and_one_too_old_is_gone(cluster):
    api = client(cluster)
    version = api.call("GET", "/api/v1/nodes", query={"limit": 1})["metadata"]["resourceVersion"]
    api.patch("v1", "Node", "gpu-node-00002", {"metadata": {"labels": {"mark": "1"}}})
    marked = lambda e: e["object"]["metadata"].get("labels", {}).get("mark") == "1"  # noqa: E731
    replayed = watch_lines(api, {"resourceVersion": version}, until=marked)
    assert marked(replayed[-1]) and replayed[-1]["type"] == "MODIFIED"
    assert all(int(e["object"]["metadata"]["resourceVersion"]) > int(version) for e in replayed)
    cluster.history_floor = int(version) + 1  # that version was compacted away
    (gone,) = watch_lines(api, {"resourceVersion": version})
    assert gone["type"] == "ERROR" and gone["object"]["code"] == 410


def test_metadata_only_answers_as_the_api_server_gives_them(cluster):
    api = client(cluster)
    listed = raw(api, "/api/v1/nodes", {"limit": 5}, f"application/json;as={PARTIAL_LIST};g=meta.k8s.io;v=v1")
    assert (listed["kind"], listed["apiVersion"], len(listed["items"])) == (PARTIAL_LIST, "meta.k8s.io/v1", 5)
    item = listed["items"][0]
    assert item["kind"] == PARTIAL and set(item) == {"kind", "apiVersion", "metadata"}
    assert item["metadata"]["labels"][contract.STATE_LABEL] == "done"
    one = raw(api, "/api/v1/nodes/gpu-node-00000", {}, f"application/json;as={PARTIAL};g=meta.k8s.io;v=v1")
    assert one["kind"] == PARTIAL and "status" not in one
    api.patch("v1", "Node", "gpu-node-00004", {"spec": {"unschedulable": True}})
    (event,) = watch_lines(
        api,
        {"resourceVersion": listed["metadata"]["resourceVersion"], "fieldSelector": "spec.unschedulable=true"},
        f"application/json;as={PARTIAL};g=meta.k8s.io;v=v1",
    )
    assert event["object"]["kind"] == PARTIAL and event["object"]["metadata"]["name"] == "gpu-node-00004"
    with pytest.raises(ApiException) as refused:  # the list's form asked of a single object
        raw(api, "/api/v1/nodes/gpu-node-00000", {}, f"application/json;as={PARTIAL_LIST};g=meta.k8s.io;v=v1")
    assert refused.value.status == 406


def test_patches_keep_their_preconditions(cluster):
    api = client(cluster)
    node = api.get("v1", "Node", "gpu-node-00005")
    stale = node["metadata"]["resourceVersion"]
    api.patch("v1", "Node", "gpu-node-00005", {"metadata": {"labels": {"a": "1"}}})
    with pytest.raises(ApiException) as conflict:
        api.patch("v1", "Node", "gpu-node-00005", {"metadata": {"resourceVersion": stale}, "spec": {"unschedulable": True}})
    assert conflict.value.status == 409
    test = [{"op": "test", "path": "/metadata/labels/a", "value": "2"}, {"op": "remove", "path": "/metadata/labels/a"}]
    with pytest.raises(ApiException) as failed:
        api.patch("v1", "Node", "gpu-node-00005", test, patch_type="json")
    assert failed.value.status == 422
    driver = contract.DRIVER_DAEMONSET
    ds = api.get("apps/v1", "DaemonSet", driver, scaleapi.NS)
    (container, *_) = ds["spec"]["template"]["spec"]["containers"]
    patch = {"spec": {"template": {"spec": {"containers": [{"name": container["name"], "env": [{"name": "X", "value": "1"}]}]}}}}
    written = api.patch("apps/v1", "DaemonSet", driver, patch, namespace=scaleapi.NS, patch_type="strategic")
    merged = written["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in merged] == [c["name"] for c in ds["spec"]["template"]["spec"]["containers"]]
    assert merged[0]["env"] == [*container.get("env", []), {"name": "X", "value": "1"}]  # merged by name, kept in order
    assert merged[0]["image"] == container["image"]
    assert written["metadata"]["generation"] == ds["metadata"]["generation"] + 1


def test_the_driver_daemonset_controller_makes_revisions_and_replaces_deleted_pods(cluster):
    api = client(cluster)
    before = cluster.progress()
    api.patch(
        contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME, {"spec": {"driver": {"payload": {"version": "9.9"}}}}
    )  # the CR alone changes nothing: the runner writes the template
    patch = {"spec": {"template": {"metadata": {"annotations": {"new": "template"}}}}}
    api.patch("apps/v1", "DaemonSet", contract.DRIVER_DAEMONSET, patch, namespace=scaleapi.NS, patch_type="merge")
    eventually(lambda: cluster.progress()["revision"] != before["revision"], 10, "a new ControllerRevision")
    revisions = api.list("apps/v1", "ControllerRevision", scaleapi.NS)
    assert sorted(r["revision"] for r in revisions) == [1, 2]
    selector = f"{contract.COMPONENT_LABEL}=driver"
    pod = next(
        p for p in api.list("v1", "Pod", scaleapi.NS, label_selector=selector) if p["spec"]["nodeName"] == "gpu-node-00000"
    )
    assert api.delete("v1", "Pod", pod["metadata"]["name"], scaleapi.NS, uid=pod["metadata"]["uid"])
    assert "deletionTimestamp" in api.get("v1", "Pod", pod["metadata"]["name"], scaleapi.NS)["metadata"]

    def replaced():
        pods = [
            p for p in api.list("v1", "Pod", scaleapi.NS, label_selector=selector) if p["spec"]["nodeName"] == "gpu-node-00000"
        ]
        return len(pods) == 1 and pods[0]["metadata"]["name"] != pod["metadata"]["name"] and pods[0]

    new = eventually(lambda: (p := replaced()) and p["status"]["phase"] == "Running" and p, 10, "a new driver pod")
    assert new["metadata"]["labels"][contract.REVISION_LABEL] == cluster.progress()["revision"]
    ready = lambda: any(c["type"] == "Ready" and c["status"] == "True" for c in replaced()["status"]["conditions"])  # noqa: E731
    eventually(ready, 10, "the new pod Ready")


def test_a_pod_name_the_controller_gives_again_comes_with_a_new_uid(cluster):
    """A driver pod's name has five hex digits, so the controller gives a name again once its pod
    is gone; its uid, as on a real API server, is never given again (the runner tells the pods it
    deleted by uid)."""
    node = "gpu-node-00001"
    seen: dict[str, int] = {}
    for serial in itertools.count(10**6):  # two serials that give `node` the same name
        suffix = scale_objects.digest(node + str(serial), 5)
        if suffix in seen:
            break
        seen[suffix] = serial
    uids = []
    for first in (seen[suffix], serial):
        cluster.serial = itertools.count(first)
        cluster.create_driver_pod(node, ready=True)
        path = f"{scaleapi.PODS}/{contract.DRIVER_DAEMONSET}-{suffix}"
        with cluster.lock:
            uids.append(cluster.obj(path)["metadata"]["uid"])
            cluster.remove(path)
    assert uids[0] != uids[1]


def test_the_benchmarks_harness_measures_the_real_runner_to_its_first_decided_pass(tmp_path, release):
    """bench_scale's own path at a small scale: this server in its process, the runner with the
    chart's flags under scale_runner's hooks; its first pass decides with every cache listed, and
    no pass fails (hooks that no longer fit the runner would fail every pass, silently to the
    benchmark but for its timeout)."""
    from tests.bench import bench_scale

    (tmp_path / "release.json").write_text(json.dumps(release))
    scenario = bench_scale.Scenario("small", NODES, other_pods=2, busy_fraction=0.5)
    with bench_scale.Run(scenario, tmp_path / "release.json", bench_scale.runner_command(), tmp_path) as run:
        run.start_api()
        run.start_runner()
        first = run.startup()
        assert first["seconds"] > 0 and first["list_bytes"] > 0, first
        outcomes = {p["outcome"] for p in run.passes()}
    assert outcomes == {"ok"}, (tmp_path / "small.runner.log").read_text()[-2000:]
