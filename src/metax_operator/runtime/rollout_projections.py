"""What the rollout's caches keep of each object (`rollout_observe.Watches`): the projections the
informers apply to every object they list or receive, and the types they give."""

from __future__ import annotations

from dataclasses import dataclass

from metax_operator import workloads
from metax_operator.conditions import parse_time
from metax_operator.contract import PAYLOAD_CONTRACT_EXIT, REVISION_LABEL, VALIDATION_ANNOTATION
from metax_operator.rollout.observation import Pod
from metax_operator.runtime.kube import plain


@dataclass(frozen=True)
class Revision:
    """A ControllerRevision of a DaemonSet: its hash label, number and template patch."""

    name: str
    owner_uid: str
    hash: str
    number: int
    data: dict


@dataclass(frozen=True)
class DriverPod:
    """A driver pod as the cache keeps it: the engine's `Pod` and its DaemonSet's uid."""

    owner_uid: str
    pod: Pod


def pod_node(obj: dict) -> str:
    return (obj.get("spec") or {}).get("nodeName") or ""


def node_event(obj: dict) -> tuple[str, float]:
    """A Node event's node and the last time it happened."""
    when = (
        obj.get("lastTimestamp") or obj.get("eventTime") or obj.get("firstTimestamp") or obj["metadata"].get("creationTimestamp")
    )
    return (obj.get("involvedObject") or {}).get("name", ""), parse_time(when) or 0.0


def project_revision(obj: dict) -> Revision | None:
    meta = obj["metadata"]
    owner = next((o for o in meta.get("ownerReferences") or [] if o.get("kind") == "DaemonSet"), None)
    if owner is None:
        return None
    return Revision(
        meta["name"],
        owner["uid"],
        (meta.get("labels") or {}).get(REVISION_LABEL, ""),
        int(obj.get("revision") or 0),
        plain(obj.get("data")) or {},
    )


def project_driver_pod(obj: dict) -> DriverPod | None:
    meta, spec, status = obj["metadata"], obj.get("spec") or {}, obj.get("status") or {}
    owner = next((o["uid"] for o in meta.get("ownerReferences") or [] if o.get("kind") == "DaemonSet"), None)
    if owner is None:
        return None
    restarts = max((c.get("restartCount") or 0 for c in status.get("containerStatuses") or []), default=0)
    failure = next((message for c in status.get("initContainerStatuses") or [] if (message := contract_failure(c))), "")
    return DriverPod(
        owner,
        Pod(
            name=meta["name"],
            uid=meta["uid"],
            node=spec.get("nodeName") or "",
            revision=(meta.get("labels") or {}).get(REVISION_LABEL, ""),
            ready=workloads.ready(obj),
            phase=status.get("phase") or "Pending",
            restart_count=restarts,
            created=parse_time(meta.get("creationTimestamp")) or 0.0,
            deleting=deletion_began(meta),
            failure=failure,
            verdict=(meta.get("annotations") or {}).get(VALIDATION_ANNOTATION, ""),
        ),
    )


def contract_failure(container: dict) -> str:
    """The payload contract's one line when an init container (the copier, a payload container)
    ended with `PAYLOAD_CONTRACT_EXIT` (now, or the last time it ran before a restart), else ""."""
    for state in ("state", "lastState"):
        ended = (container.get(state) or {}).get("terminated") or {}
        if ended.get("exitCode") == PAYLOAD_CONTRACT_EXIT:
            line = " ".join(str(ended.get("message") or "").split())
            return line or f"init container {container.get('name')} ended with the payload contract's exit code"
    return ""


def deletion_began(meta: dict) -> float | None:
    """When the object's deletion was asked, None if it is not being deleted: the API server sets
    deletionTimestamp to that time plus the grace period, which it keeps in
    deletionGracePeriodSeconds (a pod deleted with the default 30 s is stamped 30 s ahead)."""
    at = parse_time(meta.get("deletionTimestamp"))
    return None if at is None else at - (meta.get("deletionGracePeriodSeconds") or 0)


def need_reboot(asked, rebooted) -> set[str]:
    """The nodes whose latest NodeNeedReboot event is newer than their latest Rebooted event."""
    last_boot: dict[str, float] = {}
    for node, when in rebooted:
        last_boot[node] = max(when, last_boot.get(node, 0.0))
    return {node for node, when in asked if node and when > last_boot.get(node, -1.0)}
