"""kube.py without a cluster: retry policy and paths (the API calls themselves are in test_hooks_api.py)."""

from __future__ import annotations

import pytest
import urllib3
from kubernetes.client.exceptions import ApiException

from metax_operator import workloads
from metax_operator.runtime import api_failures, kube
from tests.fakeapi import FakeApi


def api_error(status: int, headers: dict | None = None) -> ApiException:
    err = ApiException(status=status, reason="test")
    err.headers = headers or {}
    return err


class Flaky:
    """Raises the given errors in turn, then returns 'ok'."""

    def __init__(self, *errors: BaseException):
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


@pytest.mark.parametrize(
    "err",
    [
        api_error(429),
        api_error(500),
        api_error(503),
        api_error(504),
        urllib3.exceptions.ReadTimeoutError(None, "/", "timed out"),
        urllib3.exceptions.ProtocolError("reset"),
    ],
)
def test_transient_failures_are_retried(err):
    sleeps: list[float] = []
    fn = Flaky(err, err)
    assert api_failures.with_backoff(fn, api_failures.Backoff(attempts=3), sleep=sleeps.append) == "ok"
    assert fn.calls == 3 and len(sleeps) == 2


@pytest.mark.parametrize("status", [400, 403, 404, 409, 422])
def test_client_errors_are_not_retried(status):
    fn = Flaky(api_error(status))
    with pytest.raises(ApiException):
        api_failures.with_backoff(fn, api_failures.Backoff(attempts=5), sleep=lambda s: None)
    assert fn.calls == 1


def test_backoff_is_bounded_and_gives_up():
    sleeps: list[float] = []
    fn = Flaky(*[api_error(503)] * 10)
    with pytest.raises(ApiException):
        api_failures.with_backoff(fn, api_failures.Backoff(attempts=4, base=1, cap=2), sleep=sleeps.append)
    assert fn.calls == 4
    assert len(sleeps) == 3 and all(0 <= s <= 2 for s in sleeps)


def test_retry_after_is_honoured_up_to_the_cap():
    sleeps: list[float] = []
    api_failures.with_backoff(
        Flaky(api_error(429, {"Retry-After": "3"}), api_error(429, {"Retry-After": "60"})),
        api_failures.Backoff(attempts=3, cap=10),
        sleep=sleeps.append,
    )
    assert sleeps == [3.0, 10.0]


def test_conflicts_rerun_the_callers_function():
    fn = Flaky(api_error(409), api_error(409))
    assert api_failures.retry_on_conflict(fn, attempts=3) == "ok"
    assert fn.calls == 3
    with pytest.raises(ApiException):
        api_failures.retry_on_conflict(Flaky(*[api_error(409)] * 3), attempts=3)
    with pytest.raises(ApiException):
        api_failures.retry_on_conflict(Flaky(api_error(422)))


def test_resource_paths():
    node = kube.Resource("v1", "Node", "nodes", False)
    cm = kube.Resource("v1", "ConfigMap", "configmaps", True)
    co = kube.Resource("gpu.metax-tech.com/v1", "ClusterOperator", "clusteroperators", False)
    assert node.path("n1") == "/api/v1/nodes/n1"
    assert cm.path("driver-config", "ns") == "/api/v1/namespaces/ns/configmaps/driver-config"
    assert (
        co.path("cluster-operator", subresource="status")
        == "/apis/gpu.metax-tech.com/v1/clusteroperators/cluster-operator/status"
    )
    assert co.path() == "/apis/gpu.metax-tech.com/v1/clusteroperators"
    assert cm.path(all_namespaces=True) == "/api/v1/configmaps"
    with pytest.raises(ValueError, match="namespace is required"):
        cm.path("x")


# -- a failure as one log line -------------------------------------------------------------------

DRIVER = "/apis/apps/v1/namespaces/metax-operator/daemonsets/metax-driver"
INVALID = 'DaemonSet.apps "metax-driver" is invalid: spec.template.spec.containers[0].image: Required value'


def refused_patch() -> ApiException:
    """The 422 the API server answers a patch of the driver DaemonSet, as the client raises it."""
    with FakeApi() as fake:
        fake.put(DRIVER, {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "metax-driver"}})
        fake.fail("PATCH", DRIVER, 422, message=INVALID)
        with pytest.raises(ApiException) as caught:
            fake.client().patch(
                "apps/v1", "DaemonSet", "metax-driver", {"metadata": {"labels": {"a": "b"}}}, namespace="metax-operator"
            )
    return caught.value


def test_a_refused_request_is_one_line_with_the_request_and_the_servers_message():
    err = refused_patch()
    assert "HTTP response headers" in str(err)  # what the client's own str() dumps
    assert api_failures.failure_line(err) == f"PATCH {DRIVER}: 422 Unprocessable Entity: {INVALID}"


def test_other_failures_are_one_line_too():
    assert api_failures.failure_line(ApiException(status=503, reason="Service Unavailable")) == "503 Service Unavailable"
    assert api_failures.failure_line(RuntimeError("two\nlines")) == "RuntimeError: two lines"


def test_pages_yields_a_list_a_page_at_a_time_and_list_joins_them(monkeypatch):
    monkeypatch.setattr(kube, "PAGE_SIZE", 2)
    with FakeApi() as fake:
        for name in ("a", "b", "c", "d", "e"):
            fake.put(f"/api/v1/nodes/{name}", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
        client = fake.client()
        pages = [[n["metadata"]["name"] for n in page] for page in client.pages("v1", "Node")]
        assert pages == [["a", "b"], ["c", "d"], ["e"]]
        assert [n["metadata"]["name"] for n in client.list("v1", "Node")] == ["a", "b", "c", "d", "e"]
        assert [r.query.get("limit") for r in fake.sent("GET", "/api/v1/nodes")] == ["2"] * 6


def test_list_projects_each_selected_object_of_every_page_and_leaves_out_none(monkeypatch):
    """`list` with a projection over simdjson's lazy view: the same pages and the selector sent,
    what the projection keeps (plain values), nothing for objects it maps to None."""
    monkeypatch.setattr(kube, "PAGE_SIZE", 2)
    pod = lambda name, node, gpu: {  # noqa: E731
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"limits": {"metax-tech.com/gpu": "1"}}}] * gpu},
    }
    with FakeApi() as fake:
        for name, node, gpu in (("a", "n0", 1), ("b", "n0", 0), ("c", "n0", 1), ("d", "n1", 1), ("e", "n0", 1)):
            fake.put(f"/api/v1/namespaces/ml/pods/{name}", pod(name, node, gpu))
        client = fake.client()
        found = client.list("v1", "Pod", field_selector="spec.nodeName=n0", all_namespaces=True, project=workloads.gpu_pod)
        assert found == [workloads.GpuPod("ml", name, "n0") for name in ("a", "c", "e")]
        sent = fake.sent("GET", "/api/v1/pods")
        assert [(r.query.get("limit"), r.query.get("fieldSelector")) for r in sent] == [("2", "spec.nodeName=n0")] * 2
