"""What the runner reports on the `cluster-operator` CR, in one shape each: a `Condition` (of the
CR's `status.conditions`, or of the rollout's `status.upgradeStatus.condition`), an `Event` (a
core/v1 Event about the CR), and the time format both carry.

The CR's own condition types (`CrCondition`) and their reasons (`CrReason`) are named here once,
as the rollout's are in `rollout.status`; the words a user reads in `kubectl describe` come from
these and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from enum import StrEnum

#: A condition's `status` values (metav1.Condition).
TRUE, FALSE = "True", "False"


class EventType(StrEnum):
    """An Event's `type`."""

    NORMAL = "Normal"
    WARNING = "Warning"


@dataclass(frozen=True)
class Event:
    """An Event the runner (or a hook) emits on the CR."""

    type: EventType
    reason: str
    message: str


class CrCondition(StrEnum):
    """The types of the CR's `status.conditions`, each set by every runner pass."""

    SPEC_VALID = "SpecValid"  # the spec passes the values' validation
    CONFIG_VALID = "ConfigMapsValid"  # driver-config and metax-vfio-config parse
    RECONCILED = "Reconciled"  # every DaemonSet matches the CR
    HELM_UPGRADE = "HelmUpgradeRequired"  # a CR change only `helm upgrade` can make
    WORKLOADS_VALID = "WorkloadsValid"  # the GPU workloads fit the nodes' modes and MXMACA versions
    RUNNER_HEALTHY = "RunnerHealthy"  # how the runner's last pass ended
    SPEC_HELD = "SpecHeld"  # an edit made during a driver rollout waits for it to end
    POOLS_DISJOINT = "DriverPoolsDisjoint"  # no GPU node is selected by two driver pools


#: Each CR condition's status when all is well.
HEALTHY = {
    CrCondition.SPEC_VALID: TRUE,
    CrCondition.CONFIG_VALID: TRUE,
    CrCondition.RECONCILED: TRUE,
    CrCondition.HELM_UPGRADE: FALSE,
    CrCondition.WORKLOADS_VALID: TRUE,
    CrCondition.RUNNER_HEALTHY: TRUE,
    CrCondition.SPEC_HELD: FALSE,
    CrCondition.POOLS_DISJOINT: TRUE,
}


class CrReason(StrEnum):
    """The reasons of the CR's conditions, of the Events that say they changed, and of the other
    Events about the CR (but the rollout's: `rollout.status.Reason`)."""

    VALID = "Valid"  # SpecValid, ConfigMapsValid, WorkloadsValid: the input passes its checks
    INVALID_SPEC = "InvalidSpec"  # SpecValid, Reconciled: the spec fails validation
    INVALID_CONFIGMAP = "InvalidConfigMap"  # ConfigMapsValid: an admin's edit does not parse
    APPLIED = "Applied"  # Reconciled; and the Event of each DaemonSet or ConfigMap the runner wrote
    BROKEN_DAEMONSET = "BrokenDaemonSet"  # Reconciled: the chart's annotations on a DaemonSet are broken
    HELM_OWNED_CHANGE = "HelmOwnedChange"  # HelmUpgradeRequired
    IN_SYNC = "InSync"  # HelmUpgradeRequired: nothing needs helm upgrade
    PASS_SUCCEEDED = "PassSucceeded"  # RunnerHealthy
    FORBIDDEN = "Forbidden"  # RunnerHealthy: the runner lacks a permission
    API_ERROR = "APIError"  # RunnerHealthy: the API server refused or failed a request
    PASS_FAILED = "PassFailed"  # RunnerHealthy: anything else
    NOTHING_HELD = "NothingHeld"  # SpecHeld: the runner acts on the CR's spec
    EDIT_DURING_ROLLOUT = "EditDuringRollout"  # SpecHeld: an edit waits for the rollout to end
    VALUES_OVERRODE_EDIT = "ValuesOverrodeEdit"  # Event: helm's values replaced an admin's edit (bootstrap hook)
    WORKLOAD_MISCONFIGURED = "WorkloadMisconfigured"  # WorkloadsValid: a workload does not fit its node
    DISJOINT = "Disjoint"  # DriverPoolsDisjoint: each GPU node is in one pool at most
    POOLS_OVERLAP = "PoolsOverlap"  # DriverPoolsDisjoint: nodes two pools select keep the driver they have


#: RunnerHealthy's reasons when False.
PASS_FAILURES = (CrReason.FORBIDDEN, CrReason.API_ERROR, CrReason.PASS_FAILED)


def transition_time(old_status: str | None, old_time: str | None, status: str, now: str) -> str:
    """A condition's `lastTransitionTime` when it is set to `status`: kept while its status stays
    (and was recorded), `now` when the status changes (metav1.Condition's rule, for the CR's
    conditions and those of `upgradeStatus` alike)."""
    return old_time if old_status == status and old_time else now


@dataclass
class Condition:
    """A condition: of the CR (`status.conditions`, set by the runner's reconcile) or of the
    rollout (`status.upgradeStatus.condition`). Its JSON keys are the field names in camelCase
    (`rollout.status` reads and writes the rollout's)."""

    type: str = ""  # a `CrCondition`, or a `rollout.status.ConditionType`
    status: str = ""  # TRUE, FALSE
    reason: str = ""
    message: str = ""
    last_transition_time: str = ""  # changes only when `status` does


def rfc3339(t: float) -> str:
    """`t` (seconds since the epoch) as Kubernetes writes times: UTC, milliseconds when any."""
    ms = round(t * 1000)
    text = datetime.fromtimestamp(ms // 1000, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{text}.{ms % 1000:03d}Z" if ms % 1000 else f"{text}Z"


def parse_time(text: str | None) -> float | None:
    """An RFC 3339 time as seconds since the epoch (None for none)."""
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
