"""The rollout's node cache (`runtime.node_cache`) on the real kube-apiserver, the default version
and the oldest the chart supports (etcd and the API server alone; the nodes are written as a
kubelet registers them): its two watches are metadata only (`PartialObjectMetadata`) and the second
one selects the unschedulable nodes by field selector, as the cache needs of every API server it
runs on. Also what tests/fakeapi.py copies of these answers: the list and the single-object forms,
and 406 for the one a request cannot have."""

from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException

from metax_operator.contract import CORDONED_LABEL, RETRY_LABEL, SKIP_LABEL, STATE_LABEL
from metax_operator.runtime.informer import Informer
from metax_operator.runtime.kube import Client
from metax_operator.runtime.node_cache import NodeCache
from tests import controlplane
from tests.fakeapi import PARTIAL, PARTIAL_LIST
from tests.waiting import eventually

pytestmark = pytest.mark.e2e

OLDEST = min((v.version for v in controlplane.matrix()), key=controlplane.minor)
#: The oldest version is built by `make matrix`, which runs its tests (`matrix`).
VERSIONS = [controlplane.K8S_VERSION, pytest.param(OLDEST, marks=pytest.mark.matrix, id=OLDEST)]
NODES = "/api/v1/nodes"


@pytest.fixture(scope="module", params=VERSIONS)
def api(request, tmp_path_factory) -> Client:
    try:
        cp = controlplane.ControlPlane.start(
            tmp_path_factory.mktemp(f"nodes-{request.param}"), api_only=True, kubernetes=request.param
        )
    except controlplane.ControlPlaneError as error:
        pytest.fail(f"Kubernetes {request.param}: {error}", pytrace=False)
    yield Client.connect(str(cp.kubeconfig))
    cp.stop()


def register(api: Client, name: str, labels: dict, unschedulable: bool = False) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {"unschedulable": unschedulable},
    }
    api.call("POST", NODES, body=body)


def raw_get(api: Client, path: str, accept: str) -> dict:
    return api.api_client.call_api(
        path, "GET", header_params={"Accept": accept}, response_type="object", _return_http_data_only=True
    )


def test_the_node_cache_follows_nodes_by_their_metadata_and_the_unschedulable_ones_by_field_selector(api):
    register(api, "n0", {SKIP_LABEL: "true", STATE_LABEL: "done"})
    register(api, "n1", {"kubernetes.io/hostname": "n1"})
    register(api, "n2", {CORDONED_LABEL: "true"}, unschedulable=True)
    cache = NodeCache(api, resync=1800)
    kinds = Informer(api, NODES, project=lambda o: o.get("kind"), metadata_only=True, name="kinds")
    for informer in (*cache.informers, kinds):
        informer.start()
    try:
        assert all(i.wait_synced(30) for i in (*cache.informers, kinds))
        assert set(kinds.snapshot().values()) == {PARTIAL}  # listed as metadata
        assert [cache.get(n).unschedulable for n in ("n0", "n1", "n2")] == [False, False, True]
        assert cache.get("n0").labels == frozenset({(SKIP_LABEL, "true"), (STATE_LABEL, "done")})
        assert cache.labelled(SKIP_LABEL).snapshot() == {"n0": "n0"} and cache.labelled(CORDONED_LABEL).snapshot() == {"n2": "n2"}

        api.patch("v1", "Node", "n1", {"spec": {"unschedulable": True}, "metadata": {"labels": {RETRY_LABEL: "true"}}})
        api.patch("v1", "Node", "n2", {"spec": {"unschedulable": False}, "metadata": {"labels": {CORDONED_LABEL: None}}})
        eventually(lambda: cache.get("n1").unschedulable and not cache.get("n2").unschedulable, 30, "the cordon and the uncordon")
        # The metadata watch brings the two patches in order, after or before the other watch.
        eventually(lambda: cache.labelled(RETRY_LABEL).snapshot() == {"n1": "n1"}, 30, "n1's retry label")
        eventually(lambda: cache.labelled(CORDONED_LABEL).snapshot() == {}, 30, "n2's label removed")
        assert cache.has_seen(api.get("v1", "Node", "n2")["metadata"]["resourceVersion"])
        assert kinds.stats.events >= 2 and set(kinds.snapshot().values()) == {PARTIAL}  # watched as metadata
    finally:
        for informer in (*cache.informers, kinds):
            informer.stop()


def test_metadata_comes_in_the_form_asked_and_a_form_a_request_cannot_have_is_refused(api):
    register(api, "m0", {"a": "b"})
    listed = raw_get(api, NODES, f"application/json;as={PARTIAL_LIST};g=meta.k8s.io;v=v1")
    assert listed["kind"] == PARTIAL_LIST and {i["kind"] for i in listed["items"]} == {PARTIAL}
    assert all(set(i) == {"kind", "apiVersion", "metadata"} for i in listed["items"])
    one = raw_get(api, f"{NODES}/m0", f"application/json;as={PARTIAL};g=meta.k8s.io;v=v1")
    assert one["kind"] == PARTIAL and one["metadata"]["labels"] == {"a": "b"}
    for path, wrong in ((NODES, PARTIAL), (f"{NODES}/m0", PARTIAL_LIST)):
        with pytest.raises(ApiException) as refused:
            raw_get(api, path, f"application/json;as={wrong};g=meta.k8s.io;v=v1")
        assert refused.value.status == 406, (path, wrong)
