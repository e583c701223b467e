"""The runner's probes on a real kubelet: the chart installed on the user's path
(tests/e2e/userpath.py) with the runner pod on the real node (tests/realnode.py), then the pod's
connections to the API server cut by an iptables rule in the pod's own network namespace (its
sandbox's, which outlives container restarts), for what the runner dials: the `kubernetes`
Service. Nothing else is touched: not the host's network namespace, not the node's, not the
kubelet's own traffic to the API server (its probes, status and events go on).

The rule sits in the pod's namespace, not the node's, because only there a refusal reaches the
runner as one: in the node's namespace the connections arrive translated by kube-proxy from the
Service's address to the API server's, and a REJECT's TCP reset is not translated back (the
runner never sees it), while an ICMP refusal is rate-limited (part of the connects time out).

- REJECT with a TCP reset (the API server refuses the runner): its passes fail at once,
  /readyz fails, the kubelet marks the pod not Ready and the Deployment unavailable, and
  liveness holds: no restart, a restart would not bring the API server back. Ready again once
  the API server is reachable.
- DROP (the API server stops answering) and a CR edit, which the runner's watch still receives
  (the drop is of what the pod sends): the pass that applies it hangs on its writes (a pass over
  an unchanged cluster sends nothing, its reads come from its caches), /healthz fails once the
  iteration has run for `runner.health.stallTimeout` seconds (set low through the chart's
  values) and the kubelet restarts the container. Ready again once the API server answers.
"""

from __future__ import annotations

import contextlib
import os

import pytest
from kubernetes import client

from tests.e2e.tools import CR, ready, run
from tests.e2e.userpath import NS, ok, runner_log, runner_pod, seed_install
from tests.waiting import eventually

pytestmark = pytest.mark.xdist_group("real-node")

STALL_TIMEOUT = 20  # runner.health.stallTimeout: above a refused pass (under 10 s of retries)
DEPLOYMENT = "metax-operator-runner"
REFUSED = ["REJECT", "--reject-with", "tcp-reset"]
UNANSWERED = ["DROP"]


@contextlib.contextmanager
def cut_off(cp, api, pod: client.V1Pod, target: list[str]):
    """For the block, the pod's packets to the `kubernetes` Service meet iptables `target` in the
    pod's network namespace; the rule is removed after it, whatever happens."""
    service = client.CoreV1Api(api).read_namespaced_service("kubernetes", "default").spec
    pids = cp.node.pod_pids(pod.metadata.uid)
    assert pids, f"no process of pod {pod.metadata.name} in the real node's cgroups"
    namespace = os.open(f"/proc/{min(pids)}/ns/net", os.O_RDONLY)  # held: the sandbox's namespace
    iptables = ["nsenter", f"--net=/proc/{os.getpid()}/fd/{namespace}", "--", "iptables", "-w"]
    rule = ["OUTPUT", "-d", service.cluster_ip, "-p", "tcp", "--dport", str(service.ports[0].port), "-j", *target]
    try:
        run(*iptables, "-I", *rule)
        try:
            yield
        finally:
            run(*iptables, "-D", *rule)
    finally:
        os.close(namespace)


def restarts(pod: client.V1Pod) -> int:
    return pod.status.container_statuses[0].restart_count


def kubelet_events(api, pod: str) -> list[str]:
    """`reason: message` of the kubelet's events about `pod` (what `kubectl describe pod` lists)."""
    events = client.CoreV1Api(api).list_namespaced_event(NS, field_selector=f"involvedObject.name={pod}").items
    return [f"{e.reason}: {e.message}" for e in events if e.source.component == "kubelet"]


def test_readiness_follows_the_api_server_and_liveness_restarts_a_hung_runner(tools_cluster, tools_api, clean_slate, tmp_path):
    cluster, api = tools_cluster, tools_api
    apps = client.AppsV1Api(api)
    values = cluster.user_values(tmp_path, runner={"interval": 1, "health": {"stallTimeout": STALL_TIMEOUT}})
    # --wait: the runner is Ready before the post-install bootstrap hook creates the CR.
    ok(seed_install(cluster, "helm3", values))
    pod = eventually(lambda: (p := runner_pod(api)) and ready(p) and p, 60, "the runner pod Ready")
    assert restarts(pod) == 0

    def current() -> client.V1Pod:
        return client.CoreV1Api(api).read_namespaced_pod(pod.metadata.name, NS)

    # The API server refuses the runner: not Ready, the Deployment unavailable; not restarted.
    with cut_off(cluster.cp, api, pod, REFUSED):
        eventually(
            lambda: not ready(current()) and not apps.read_namespaced_deployment(DEPLOYMENT, NS).status.ready_replicas,
            90,
            "the runner pod not Ready and its Deployment unavailable",
        )
        assert any(line.get("action") == "lease-lost" for line in runner_log(cluster))
    events = kubelet_events(api, pod.metadata.name)
    assert "Unhealthy: Readiness probe failed: HTTP probe failed with statuscode: 503" in events, events
    eventually(lambda: ready(current()), 90, "the runner pod Ready again with the API server back")
    assert restarts(current()) == 0, "an unreachable API server does not get the runner restarted"
    assert not [e for e in kubelet_events(api, pod.metadata.name) if "Liveness" in e]

    # The API server stops answering and the CR changes: the pass that applies the change hangs;
    # liveness gets the container restarted.
    crs = client.CustomObjectsApi(api)
    with cut_off(cluster.cp, api, pod, UNANSWERED):
        crs.patch_cluster_custom_object(*CR, {"spec": {"gpuLabel": {"log": {"level": "debug"}}}})
        restarted = eventually(
            lambda: restarts(p := current()) >= 1 and p, STALL_TIMEOUT + 120, "the kubelet to restart the hung runner"
        )
    events = kubelet_events(api, pod.metadata.name)
    assert "Unhealthy: Liveness probe failed: HTTP probe failed with statuscode: 503" in events, events
    assert "Killing: Container runner failed liveness probe, will be restarted" in events, events
    assert restarted.status.container_statuses[0].last_state.terminated is not None
    eventually(lambda: ready(current()), 120, "the restarted runner Ready with the API server back")
