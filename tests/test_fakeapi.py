"""The fake API server of tests/fakeapi.py does what the real one does where the runner's tests
rely on it: `metadata.generation`, strategic merge and server-side apply of a pod template, the
Eviction subresource with PodDisruptionBudgets, the graceful deletion of a bound pod, and the
interceptors a test answers requests with. Each through the real client, as the runner sends it.
"""

from __future__ import annotations

import copy

import pytest
from kubernetes.client.exceptions import ApiException

from metax_operator.runtime.informer import Informer
from tests.fakeapi import FakeApi
from tests.waiting import eventually

NS = "ns"
DS = f"/apis/apps/v1/namespaces/{NS}/daemonsets/d"
CR = "/apis/gpu.metax-tech.com/v1/clusteroperators/cluster-operator"
PODS = f"/api/v1/namespaces/{NS}/pods"
T0 = 1_800_000_000.0


POD_SPEC = {
    "nodeSelector": {"a": "1", "b": "2"},
    "tolerations": [{"key": "x", "operator": "Exists"}],
    "initContainers": [{"name": "payload", "image": "p:1"}, {"name": "fw", "image": "f:1"}],
    "containers": [{"name": "c", "image": "c:1", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]}],
}


def daemonset(pod_spec: dict = POD_SPEC) -> dict:
    """DaemonSet `d` whose pod template's spec is `pod_spec`."""
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "d", "namespace": NS},
        "spec": {"template": {"spec": copy.deepcopy(pod_spec)}},
    }


def pod(name: str, node: str = "n0", labels: dict | None = None) -> dict:
    return {"metadata": {"name": name, "namespace": NS, "labels": labels or {}}, "spec": {"nodeName": node}}


@pytest.fixture
def api():
    with FakeApi(clock=lambda: T0) as fake:
        yield fake


def test_generation_is_one_at_creation_and_rises_only_when_more_than_metadata_or_status_changes(api):
    client = api.client()
    client.apply(daemonset(), field_manager="t")
    assert api.get(DS)["metadata"]["generation"] == 1
    client.patch("apps/v1", "DaemonSet", "d", {"metadata": {"labels": {"l": "v"}}}, namespace=NS)
    ds = client.get("apps/v1", "DaemonSet", "d", NS)
    ds["status"] = {"observedGeneration": 1}
    client.call("PUT", DS + "/status", body=ds)
    assert api.get(DS)["metadata"]["generation"] == 1
    client.patch("apps/v1", "DaemonSet", "d", {"spec": {"minReadySeconds": 5}}, namespace=NS)
    assert api.get(DS)["metadata"]["generation"] == 2
    ds = client.get("apps/v1", "DaemonSet", "d", NS)
    ds["metadata"]["generation"] = 40  # a client cannot set it
    ds["spec"]["minReadySeconds"] = 6
    client.call("PUT", DS, body=ds)
    assert api.get(DS)["metadata"]["generation"] == 3


def test_a_custom_resource_s_generation_follows_its_spec_not_its_status(api):
    api.put(CR, {"metadata": {"name": "cluster-operator", "generation": 4}, "spec": {"driver": {"pause": False}}})
    client = api.client()
    patch = [{"op": "replace", "path": "/spec/driver/pause", "value": True}]
    client.patch("gpu.metax-tech.com/v1", "ClusterOperator", "cluster-operator", patch, patch_type="json")
    cr = api.get(CR)
    assert cr["metadata"]["generation"] == 5
    client.call("PUT", CR + "/status", body={**cr, "status": {"observedGeneration": 5}})
    assert api.get(CR)["metadata"]["generation"] == 5


def test_an_apply_merges_named_items_by_name_and_replaces_atomic_fields(api):
    api.put(DS, daemonset())
    change = daemonset(
        {
            "nodeSelector": {"a": "9"},
            "tolerations": [{"key": "y", "operator": "Exists"}],
            "initContainers": [{"name": "payload", "image": "p:2"}],
            "containers": [{"name": "c", "env": [{"name": "B", "value": "3"}]}],
        }
    )
    api.client().apply(change, field_manager="t", force=True)
    pod_spec = api.get(DS)["spec"]["template"]["spec"]
    assert pod_spec["initContainers"] == [{"name": "payload", "image": "p:2"}, {"name": "fw", "image": "f:1"}]
    assert pod_spec["containers"] == [
        {"name": "c", "image": "c:1", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "3"}]}
    ]
    assert pod_spec["nodeSelector"] == {"a": "9"}  # atomic under apply
    assert pod_spec["tolerations"] == [{"key": "y", "operator": "Exists"}]  # a list without a merge key


def test_an_apply_creates_what_does_not_exist(api):
    api.client().apply(daemonset(), field_manager="t")
    assert api.get(DS)["spec"] == daemonset()["spec"]


def test_a_strategic_merge_patch_merges_maps_and_named_items_and_obeys_its_directives(api):
    api.put(DS, daemonset())
    client = api.client()
    patch = {
        "spec": {
            "template": {"spec": {"nodeSelector": {"a": "9", "b": None}, "initContainers": [{"name": "fw", "$patch": "delete"}]}}
        }
    }
    client.patch("apps/v1", "DaemonSet", "d", patch, namespace=NS, patch_type="strategic")
    pod_spec = api.get(DS)["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"] == {"a": "9"}
    assert pod_spec["initContainers"] == [{"name": "payload", "image": "p:1"}]
    undo = {"spec": {"template": {"$patch": "replace", "spec": {"containers": [{"name": "c", "image": "c:0"}]}}}}
    client.patch("apps/v1", "DaemonSet", "d", undo, namespace=NS, patch_type="strategic")
    assert api.get(DS)["spec"]["template"] == {"spec": {"containers": [{"name": "c", "image": "c:0"}]}}


def test_a_merge_patch_still_replaces_lists(api):
    api.put(DS, daemonset())
    patch = {"spec": {"template": {"spec": {"initContainers": [{"name": "payload", "image": "p:2"}]}}}}
    api.client().patch("apps/v1", "DaemonSet", "d", patch, namespace=NS)
    assert api.get(DS)["spec"]["template"]["spec"]["initContainers"] == [{"name": "payload", "image": "p:2"}]


def evict(api: FakeApi, name: str) -> None:
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": NS}}
    api.client(attempts=1).call("POST", f"{PODS}/{name}/eviction", body=body)


def test_an_eviction_deletes_the_pod_while_its_disruption_budgets_allow(api):
    pdb = "/apis/policy/v1/namespaces/ns/poddisruptionbudgets/train"
    api.put(
        pdb,
        {
            "metadata": {"name": "train"},
            "spec": {"selector": {"matchLabels": {"app": "train"}}},
            "status": {"disruptionsAllowed": 1},
        },
    )
    for name in ("a", "b"):
        api.put(f"{PODS}/{name}", pod(name, labels={"app": "train"}))
    api.put(f"{PODS}/other", pod("other", labels={"app": "web"}))
    evict(api, "a")
    assert api.get(f"{PODS}/a")["metadata"]["deletionTimestamp"]  # deleted gracefully, as any deletion
    assert api.get(pdb)["status"]["disruptionsAllowed"] == 0
    with pytest.raises(ApiException) as refused:
        evict(api, "b")
    assert refused.value.status == 429 and "disruption budget" in refused.value.body
    assert "deletionTimestamp" not in api.get(f"{PODS}/b")["metadata"]
    evict(api, "other")  # no budget selects it
    with pytest.raises(ApiException) as gone:
        evict(api, "nobody")
    assert gone.value.status == 404


def test_a_bound_pod_is_deleted_gracefully_and_gone_once_the_kubelet_removes_it(api):
    api.put(f"{PODS}/p", pod("p"))
    api.put(f"{PODS}/unbound", {"metadata": {"name": "unbound", "namespace": NS}, "spec": {}})
    client = api.client()
    assert client.delete("v1", "Pod", "p", NS, uid="uid-p")
    marked = api.get(f"{PODS}/p")["metadata"]
    assert (marked["deletionTimestamp"], marked["deletionGracePeriodSeconds"]) == ("2027-01-15T08:00:30Z", 30)
    assert client.delete("v1", "Pod", "p", NS)  # again: still marked, once
    assert api.get(f"{PODS}/p")["metadata"]["deletionTimestamp"] == marked["deletionTimestamp"]
    api.delete(f"{PODS}/p")  # the kubelet, once the containers stopped
    assert api.get(f"{PODS}/p") is None
    assert client.delete("v1", "Pod", "unbound", NS) and api.get(f"{PODS}/unbound") is None  # nothing to stop


def test_without_a_clock_a_deletion_removes_the_pod_at_once():
    with FakeApi() as api:
        api.put(f"{PODS}/p", pod("p"))
        assert api.client().delete("v1", "Pod", "p", NS)
        assert api.get(f"{PODS}/p") is None


def test_an_interceptor_sees_each_request_first_and_may_answer_it(api):
    api.put(f"{PODS}/p", pod("p"))
    seen = []

    def refuse_deletions(request):
        seen.append((request.method, request.path))
        return (403, {"kind": "Status", "code": 403, "message": "no"}) if request.method == "DELETE" else None

    api.interceptors.append(refuse_deletions)
    client = api.client(attempts=1)
    assert client.get("v1", "Pod", "p", NS) is not None
    with pytest.raises(ApiException) as refused:
        client.delete("v1", "Pod", "p", NS)
    assert refused.value.status == 403 and api.get(f"{PODS}/p") is not None
    assert seen[-2:] == [("GET", f"{PODS}/p"), ("DELETE", f"{PODS}/p")]


def test_the_faults_and_interceptors_leave_an_exempt_client_alone(api):
    api.put(f"{PODS}/p", pod("p"))
    api.exempt.add("kubectl")
    api.fail("GET", f"{PODS}/p", 500, times=10)
    api.interceptors.append(lambda request: (403, {"kind": "Status", "code": 403}) if request.method == "DELETE" else None)
    kubectl = api.client(attempts=1, user_agent="kubectl")
    assert kubectl.get("v1", "Pod", "p", NS) is not None
    assert kubectl.delete("v1", "Pod", "p", NS)
    with pytest.raises(ApiException):
        api.client(attempts=1).get("v1", "Pod", "p", NS)


def test_an_informer_between_a_410_and_its_next_watch_is_not_delivered(api):
    api.put(f"{PODS}/p", pod("p"))
    informer = Informer(api.client(attempts=1), PODS, name="pods").start()
    try:
        eventually(lambda: api.delivered([informer]), 10, "the informer to follow its watch", interval=0.01)
        api.fail("GET", PODS, 500, times=10_000)  # its relist fails: no watch follows
        api.expire_watches()  # the watch ends after its ERROR
        eventually(lambda: not api.watching(PODS), 10, "the expired watch to end", interval=0.01)
        assert not api.delivered([informer])
        api.clear_faults()
        eventually(lambda: api.delivered([informer]), 30, "the informer to watch again", interval=0.05)
    finally:
        informer.stop()


@pytest.mark.parametrize("by", ["someone else", "a DELETE request"])
def test_a_deletion_reaches_the_watches_at_its_own_resource_version(api, by):
    """As the API server's, a DELETED event carries the version of the deletion, not the object's
    last one: a cache that has seen it has seen the deletion, and `delivered` waits for it."""
    path = "/api/v1/namespaces/ns/configmaps/c"
    api.put(path, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": NS}})
    informer = Informer(api.client(attempts=1), "/api/v1/namespaces/ns/configmaps", name="configmaps").start()
    try:
        eventually(lambda: api.delivered([informer]) and "ns/c" in informer.snapshot(), 10, "the informer to hold c")
        last = api.get(path)["metadata"]["resourceVersion"]
        if by == "someone else":
            api.delete(path)
        else:
            assert api.client(attempts=1).delete("v1", "ConfigMap", "c", NS)
        eventually(lambda: api.delivered([informer]), 10, "the deletion delivered", interval=0.01)
        assert "ns/c" not in informer.snapshot()
        assert informer.resource_version == str(api.version) != last
    finally:
        informer.stop()
