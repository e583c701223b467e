"""`metax-operator wait-for`: the init container that keeps the component order on a node.

A dependent component's pod (e.g. metax-driver) starts only when the pods of its prerequisites
(seed §3.2.3: gpuLabel, runtime) on the same node are Ready. The wait is a WATCH restricted to
the node and the prerequisite components (`fieldSelector=spec.nodeName=NODE`,
`labelSelector=app.kubernetes.io/component in (...)`), so 10,000 nodes starting at once cost one
list and one long-lived watch per waiting pod, served from the API server's watch cache, not a
poll. API errors are retried with bounded exponential backoff; the command only reads.
"""

from __future__ import annotations

import argparse
import logging
import time

from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from metax_operator import jsonlog, workloads
from metax_operator.cli import bounded
from metax_operator.contract import COMPONENT_LABEL, COMPONENTS
from metax_operator.errors import UserError
from metax_operator.runtime.api_failures import Backoff, failure_line, is_transient
from metax_operator.runtime.kube import Client, add_arguments

log = logging.getLogger("metax_operator.runtime.wait_for")

#: Server-side length of one watch request, seconds (then it is re-opened from the last version).
WATCH_SECONDS = 300
#: Consecutive failed API calls before giving up (the kubelet then restarts the init container).
MAX_FAILURES = 8


def selectors(node: str, components: list[str]) -> tuple[str, str]:
    """(fieldSelector, labelSelector) of the prerequisite pods on `node`."""
    return f"spec.nodeName={node}", f"{COMPONENT_LABEL} in ({','.join(sorted(components))})"


def pending(pods: dict[str, dict], components: list[str]) -> dict[str, str]:
    """The components not yet Ready on the node, each with why (pure: pods are API dicts by name).

    A component is Ready when at least one of its pods (not being deleted) has condition
    Ready=True.
    """
    why: dict[str, str] = {}
    for component in components:
        mine = [p for p in pods.values() if (p["metadata"].get("labels") or {}).get(COMPONENT_LABEL) == component]
        live = [p for p in mine if not p["metadata"].get("deletionTimestamp")]
        if any(workloads.ready(p) for p in live):
            continue
        if not live:
            why[component] = "no pod on this node yet" if not mine else f"pod {mine[0]['metadata']['name']} is terminating"
        else:
            pod = live[0]
            phase = (pod.get("status") or {}).get("phase") or "Pending"
            why[component] = f"pod {pod['metadata']['name']} is {phase}, not Ready"
    return why


WAIT_BACKOFF = Backoff(attempts=MAX_FAILURES, base=0.5, cap=30.0)


def wait_for(
    api: Client, namespace: str, node: str, components: list[str], timeout: float = 0, backoff: Backoff = WAIT_BACKOFF
) -> bool:
    """Block until every component's pod on `node` is Ready: True, or False after `timeout` (0 = none).

    Raises the last API error after MAX_FAILURES consecutive failures.
    """
    core = client.CoreV1Api(api.api_client)
    field_selector, label_selector = selectors(node, components)
    deadline = time.monotonic() + timeout if timeout else None
    failures = 0
    delays = iter(())
    pods: dict[str, dict] = {}
    version = None  # resourceVersion to watch from; None = (re)list first
    last_reported = None
    while True:
        try:
            if version is None:
                # resourceVersion "0": served from the API server's watch cache, never etcd; a
                # slightly old list is fine, the watch from its version brings every later change.
                listed = core.list_namespaced_pod(
                    namespace,
                    field_selector=field_selector,
                    label_selector=label_selector,
                    resource_version="0",
                    _request_timeout=(5, 30),
                )
                pods = {p.metadata.name: api.api_client.sanitize_for_serialization(p) for p in listed.items}
                version = listed.metadata.resource_version
            why = pending(pods, components)
            if not why:
                jsonlog.event(log, "prerequisites-ready", node=node, components=components)
                return True
            if why != last_reported:
                jsonlog.event(
                    log,
                    "waiting",
                    node=node,
                    namespace=namespace,
                    pending=why,
                    msg=f"waiting for {', '.join(sorted(why))} on node {node} to be Ready",
                )
                last_reported = why
            remaining = deadline - time.monotonic() if deadline else WATCH_SECONDS
            if remaining <= 0:
                jsonlog.event(log, "timeout", logging.ERROR, node=node, pending=why)
                return False
            stream = watch.Watch().stream(
                core.list_namespaced_pod,
                namespace,
                field_selector=field_selector,
                label_selector=label_selector,
                resource_version=version,
                allow_watch_bookmarks=True,
                timeout_seconds=max(1, int(min(remaining, WATCH_SECONDS))),
                _request_timeout=(5, WATCH_SECONDS + 30),
            )
            for change in stream:
                pod = change["raw_object"]
                version = pod["metadata"].get("resourceVersion") or version
                if change["type"] == "DELETED":
                    pods.pop(pod["metadata"]["name"], None)
                elif change["type"] in ("ADDED", "MODIFIED"):
                    pods[pod["metadata"]["name"]] = pod
                if not pending(pods, components):
                    break
            failures, delays = 0, iter(())
        except Exception as err:  # transient ones retried below, others raised
            if isinstance(err, ApiException) and err.status == 410:  # our version is too old: list again
                version = None
                continue
            if not is_transient(err):
                raise
            failures += 1
            if failures == 1:
                delays = backoff.delays()
            delay = next(delays, None)
            if delay is None:
                raise
            jsonlog.event(
                log,
                "api-retry",
                logging.WARNING,
                node=node,
                error=failure_line(err),
                retry_in=round(delay, 2),
                failures=failures,
            )
            time.sleep(delay)
            version = None


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "wait-for",
        help="wait until prerequisite components' pods on this node are Ready (init container)",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--namespace", required=True, help="namespace of the component pods")
    parser.add_argument("--node", required=True, help="this pod's node (downward API spec.nodeName)")
    parser.add_argument(
        "--component",
        action="append",
        required=True,
        metavar="KEY",
        help=f"a prerequisite's values key ({', '.join(COMPONENTS)}); repeat for several",
    )
    parser.add_argument(
        "--timeout",
        type=bounded(float, 0, 7 * 86400),
        default=0,
        help="give up (exit 1) after this many seconds; 0 (default) waits as long as it takes",
    )
    jsonlog.add_arguments(parser)
    add_arguments(parser)
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    jsonlog.setup(args.log_level, args.log_format)
    unknown = [c for c in args.component if c not in COMPONENTS]
    if unknown:
        raise UserError("--component", f"{', '.join(unknown)} is not a component", f"use values keys: {', '.join(COMPONENTS)}")
    if not args.node:
        raise UserError("--node", "is empty", "pass the pod's node name (downward API fieldRef spec.nodeName)")
    return 0 if wait_for(Client.from_args(args), args.namespace, args.node, args.component, args.timeout) else 1
