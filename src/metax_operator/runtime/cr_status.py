"""What the runner writes on the `cluster-operator` CR about itself: its status, once per pass
(`write`: the conditions, `observedGeneration` and the rollout's `upgradeStatus` in one PUT of
the status subresource carrying the resourceVersion the pass read), and Events about it
(`emit_event`). Every write is preceded by the lease check (`check_lease`): a runner that lost
the lease stops before its next write.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kubernetes.client.exceptions import ApiException

from metax_operator.conditions import (
    FALSE,
    HEALTHY,
    TRUE,
    Condition,
    CrCondition,
    CrReason,
    Event,
    EventType,
    transition_time,
)
from metax_operator.contract import CR_API_VERSION, CR_KIND, CR_NAME, RUNNER_FIELD_MANAGER
from metax_operator.errors import UserError
from metax_operator.jsonlog import event
from metax_operator.runtime.api_failures import api_problem
from metax_operator.runtime.kube import Client

log = logging.getLogger(__name__)

#: Events about the cluster-scoped CR must live here (API server rule for cluster-scoped objects).
EVENT_NAMESPACE = "default"


class LostLeadership(Exception):
    """The lease was lost in the middle of a pass: stop writing at once."""


def check_lease(guard: Callable[[], bool]) -> None:
    """Raise LostLeadership unless `guard` says the lease is still held: called before every write."""
    if not guard():
        raise LostLeadership("the lease was lost: stopping before the next write")


def pass_condition(failure: BaseException | None) -> Condition:
    """RunnerHealthy for how a pass ended: False with the failure in one line and its fix (a
    permission the runner lacks shows in `kubectl describe`, not only in the runner's log)."""
    if failure is None:
        return Condition(CrCondition.RUNNER_HEALTHY, TRUE, CrReason.PASS_SUCCEEDED, "the runner's last pass succeeded")
    retry = "the runner retries with backoff"
    if isinstance(failure, ApiException) and failure.status in (401, 403):
        problem = api_problem(failure)
        fix = "give the runner's ServiceAccount that permission back: helm upgrade renders its RBAC (templates/runner/rbac.yaml)"
        return Condition(
            CrCondition.RUNNER_HEALTHY, FALSE, CrReason.FORBIDDEN, f"{problem.field}: {problem.problem}; {fix}; {retry}"
        )
    if isinstance(failure, UserError):
        reason, text = CrReason.PASS_FAILED, str(failure)
    elif (problem := api_problem(failure)) is not None:
        reason, text = CrReason.API_ERROR, str(problem)
    else:
        reason, text = CrReason.PASS_FAILED, f"{type(failure).__name__}: {failure}"
    return Condition(CrCondition.RUNNER_HEALTHY, FALSE, reason, f"{' '.join(text.split())}; {retry}")


def merge_conditions(
    existing: list[dict], wanted: list[Condition], generation: int | None, now: str
) -> tuple[list[dict], list[Condition]]:
    """`existing` with the `wanted` conditions set (others kept), and the ones that changed.

    `lastTransitionTime` moves only when a condition's status changes (metav1.Condition rules).
    """
    result = [dict(c) for c in existing]
    changed = []
    for want in wanted:
        old = next((c for c in result if c.get("type") == want.type), None)
        new = {
            "type": want.type,
            "status": want.status,
            "reason": want.reason,
            "message": want.message[:32768],
            "observedGeneration": generation,
            "lastTransitionTime": transition_time(old.get("status"), old.get("lastTransitionTime"), want.status, now)
            if old
            else now,
        }
        if old is None:
            result.append(new)
        else:
            result[result.index(old)] = new
        if old is None or (old.get("status"), old.get("reason"), old.get("message")) != (
            want.status,
            want.reason,
            new["message"],
        ):
            changed.append(want)
    return result, changed


def transition_events(changed: list[Condition], first: set[str]) -> list[Event]:
    """Events for condition changes: Warning when a condition goes bad, Normal when it recovers.

    A condition set for the first time (`first`) and healthy is not worth an event.
    """
    events = []
    for c in changed:
        healthy = HEALTHY.get(c.type) == c.status
        if healthy and c.type in first:
            continue
        events.append(Event(EventType.NORMAL if healthy else EventType.WARNING, c.reason, f"{c.type}={c.status}: {c.message}"))
    return events


@dataclass
class StatusWrite:
    """What `write_status` did: the CR as it now stands (None after a conflict), the writes (0 or
    1) and the events of the conditions that changed."""

    cr: dict | None
    writes: int = 0
    events: list[Event] = field(default_factory=list)


def write_status(
    api: Client,
    cr: dict,
    conditions: list[Condition],
    guard: Callable[[], bool],
    now: str,
    applied: bool = True,
    rollout: dict | None = None,
) -> StatusWrite:
    """The CR's status as one pass leaves it: `conditions` set (`merge_conditions`),
    `observedGeneration` when `applied` (the pass's outcome is the whole of it for the CR's
    generation, not a condition alone), the rollouts' fields when given (`upgradeStatus`, the
    driver pools' `pools`: `rollout.target`); written as one
    PUT of the status subresource carrying the resourceVersion the pass read, and only when it
    differs from the status read."""
    status = cr.get("status") or {}
    generation = cr["metadata"].get("generation")
    existing = status.get("conditions") or []
    merged, changed = merge_conditions(existing, conditions, generation, now)
    wanted = dict(status)
    if merged != existing:
        wanted["conditions"] = merged
    if applied:
        wanted["observedGeneration"] = generation
    wanted.update(rollout or {})
    if wanted == status:
        return StatusWrite(cr)
    check_lease(guard)
    body = {**json.loads(json.dumps(cr)), "status": wanted}
    path = api.resource(CR_API_VERSION, CR_KIND).path(CR_NAME, subresource="status")
    try:
        written = api.call("PUT", path, body=body)
    except ApiException as err:
        if err.status != 409:
            raise
        # The CR changed since it was read: this status was planned from the spec of generation
        # `generation`, which may no longer be the CR's. Writing it under the new generation would
        # claim a spec this pass never applied, and the rollout's decision is stale too: the next
        # pass decides again (and acts on nothing before).
        event(log, "status-conflict", msg="the CR changed since it was read: its status waits for the next pass")
        return StatusWrite(None)
    if changed:
        event(log, "set-conditions", changed=[f"{c.type}={c.status}({c.reason})" for c in changed])
    first = {c.type for c in conditions} - {c["type"] for c in existing}
    return StatusWrite(written, 1, transition_events(changed, first))


def write(
    api: Client,
    cr: dict,
    conditions: list[Condition],
    events: list[Event],
    guard: Callable[[], bool],
    now: str,
    identity: str = "",
    applied: bool = True,
    rollout: dict | None = None,
) -> StatusWrite:
    """The pass's status (`write_status`), then `events` and those of the conditions it changed;
    the writes counted in what it returns."""
    written = write_status(api, cr, conditions, guard, now, applied=applied, rollout=rollout)
    for item in [*events, *written.events]:
        check_lease(guard)
        written.writes += emit_event(api, cr, item, now, identity)
    return written


def emit_event(api: Client, cr: dict, item: Event, now: str, identity: str = "", component: str = RUNNER_FIELD_MANAGER) -> bool:
    """A core/v1 Event about the CR (what `kubectl describe clusteroperator` shows) from `component`
    (the runner, or the bootstrap hook). The API server keeps events of cluster-scoped objects in
    namespace `default`. Best effort, as client-go's recorder: a failed event is logged, never
    fails the pass."""
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{CR_NAME}.", "namespace": EVENT_NAMESPACE},
        "involvedObject": {"apiVersion": CR_API_VERSION, "kind": CR_KIND, "name": CR_NAME, "uid": cr["metadata"].get("uid")},
        "type": str(item.type),
        "reason": str(item.reason),
        "message": item.message[:1024],
        "source": {"component": component},
        "reportingComponent": component,
        "reportingInstance": identity or component,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        api.call("POST", api.resource("v1", "Event").path(namespace=EVENT_NAMESPACE), body=body)
    except Exception as err:  # noqa: BLE001 - events are best effort
        event(
            log,
            "event-failed",
            logging.WARNING,
            type=str(item.type),
            reason=str(item.reason),
            msg=item.message,
            error=f"{type(err).__name__}: {getattr(err, 'reason', err)}",
        )
        return False
    event(log, "event", type=str(item.type), reason=str(item.reason), msg=item.message)
    return True
