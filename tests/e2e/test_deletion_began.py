"""When the real API server says a pod's deletion began (runtime.rollout_projections.deletion_began)."""

from __future__ import annotations

import time

from kubernetes import client

from metax_operator.conditions import parse_time
from metax_operator.runtime.rollout_projections import deletion_began

GRACE = 30
FINALIZER = "metax-tech.com/test-hold"  # keeps the pod Terminating
NODE = "no-such-node"  # bound (an unbound pod is deleted at once, without a grace period), and no kwok or kubelet there


def test_a_pod_deleted_with_a_grace_period_began_its_deletion_when_it_was_asked(control_plane):
    core = client.CoreV1Api(control_plane.api())
    name = f"deletion-began-{int(time.time() * 1000) % 100000}"
    body = {
        "metadata": {"name": name, "finalizers": [FINALIZER]},
        "spec": {
            "nodeName": NODE,
            "containers": [{"name": "c", "image": "registry.example/c:1"}],
            "terminationGracePeriodSeconds": GRACE,
        },
    }
    core.create_namespaced_pod("default", body)
    try:
        before = time.time()
        core.delete_namespaced_pod(name, "default", grace_period_seconds=GRACE)
        after = time.time()
        meta = control_plane.api().sanitize_for_serialization(core.read_namespaced_pod(name, "default").metadata)
        stamped = parse_time(meta["deletionTimestamp"])
        assert stamped >= before + GRACE - 1  # the API server's stamp: the request plus the grace period
        assert before - 1 <= deletion_began(meta) <= after  # RFC 3339 seconds: up to 1 s truncated
    finally:
        core.patch_namespaced_pod(name, "default", {"metadata": {"finalizers": None}})
