"""`status.upgradeStatus`, typed: seed 000 table 3.16 plus `resume`, the bookkeeping a restarted
runner needs (docs/rollout.md documents every field).

Each field declares its JSON key once (`_key`); `to_json` writes the keys in declaration order and
leaves out the fields that are None (`currentStepState` before the first rollout, the times not
set yet), `from_json` reads any subset of them (a status written by an older version, or edited),
a missing or null key giving the field's default. Node lists are written as the first
`LISTED_NODES` names and a count, under two keys (`NodeList`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, get_args, get_origin, get_type_hints

from metax_operator.conditions import Condition

# The rollout's vocabulary, named once. Phases and step states are the seed's (OpenKruise
# Rollout's) names, written to `phase` and `status.currentStepState`.
IDLING, PROGRESSING, TERMINATING, DISABLED, DISABLING = ("Idling", "Progressing", "Terminating", "Disabled", "Disabling")
STEP_INIT, STEP_UPGRADE, STEP_PAUSED, STEP_READY, COMPLETED = (
    "StepUpgradeInit",
    "StepUpgrade",
    "StepPaused",
    "StepReady",
    "Completed",
)
# At most this many node names are listed in status (held back, failed); the count is always given.
LISTED_NODES = 20


class ConditionType(StrEnum):
    """The `type` of each entry of `upgradeStatus.condition` (seed table 3.16); each is set once a
    rollout starts and kept afterwards, its `reason` saying why it last changed."""

    PROGRESSING = "Progressing"  # True while a rollout is in flight, also paused after a failed step
    SUCCEED = "Succeed"  # True once every driver pod reached the rollout's revision
    FAILED = "Failed"  # True after a step failed beyond its retries, or while the policy cannot finish
    TERMINATING = "Terminating"  # True while a rollback is in flight


class WaveKind(StrEnum):
    """`resume.waveKind`: why the pods of the wave in flight were deleted."""

    UPGRADE = "upgrade"  # old-revision pods, for the step's target
    RETRY = "retry"  # failed pods of the step, deleted again (`maxFailureThreshold`)
    ROLLBACK = "rollback"  # pods of the abandoned revision, back to `lastPodSpecRevision`


class PauseReason(StrEnum):
    """`resume.pauseReason`: why the runner set `spec.driver.upgradePolicy.pause` itself."""

    STEP = "step"  # a step without `pauseDuration` is ready: the admin's `pause: false` continues
    FAILURE = "failure"  # a step failed after its retries (`fallback: pause`): fix, then resume


class Reason(StrEnum):
    """The reasons of the rollout's conditions and of the Events it emits."""

    ROLLOUT_STARTED = "RolloutStarted"  # a new driver revision starts rolling out
    NEW_REVISION = "NewRevision"  # a newer revision replaces the one rolling out (or a rollback)
    STEPS_EDITED = "StepsEdited"  # `upgradeSteps` changed during the rollout
    STEP_STARTED = STEP_INIT  # a step begins (the event's reason is the step state's name)
    STEP_READY = "StepReady"  # a step reached its target
    STEP_RETRY = "StepRetry"  # a step's failed pods are deleted again
    STEP_FAILED = "StepFailed"  # a step failed beyond its retries
    FAILED = "Failed"  # Progressing's reason after a failed step paused the rollout
    RESUMED = "Resumed"  # the admin released the runner's pause
    COMPLETED = "Completed"  # every driver pod is at the revision
    INVALID_POLICY = "InvalidPolicy"  # the last step cannot reach every node
    POLICY_VALID = "PolicyValid"  # it can again
    ROLLOUT_DISABLED = "RolloutDisabled"  # `enableRollout: false` during a rollout: rolled back
    TEMPLATE_REVERTED = "TemplateReverted"  # the template was set back: rolled back
    FALLBACK_ROLLBACK = "FallbackRollback"  # a failed step with `fallback: rollback`
    ROLLED_BACK = "RolledBack"  # every driver pod is back at `lastPodSpecRevision`
    REPLACED = "Replaced"  # without a staged rollout, every pod was replaced at once
    NODES_HELD_BACK = "NodesHeldBack"  # nodes with GPU work (or a timed-out wait or drain) kept out
    WAIT_TIMEOUT = "WaitTimeout"  # a node's pods matching `waitForCompletion.podSelector` did not end
    DRAIN_TIMEOUT = "DrainTimeout"  # a node's GPU pods were not evicted in time
    NODE_RETRIED = "NodeRetried"  # an admin's retry label: a failed node's driver pod deleted again
    NOTHING_TO_RETRY = "NothingToRetry"  # the retry label on a node whose driver is not failed
    DRIVER_FAILED = "DriverFailed"  # a node's new driver pod cannot start, and says why (payload contract)
    VALIDATION_FAILED = "ValidationFailed"  # a swapped node's validation failed or timed out
    UNHEALTHY_STEP = "UnhealthyStep"  # the health gate: the upgraded nodes regressed against the others
    HEALTH_GATE_PASSED = "HealthGatePassed"  # the health gate let a step promote
    PODS_BEHIND = "PodsBehind"  # pods created at another revision since the fleet settled: rolled back
    SAME_DRIVER = "SameDriver"  # a new revision changes only where driver pods may run: no pod replaced


#: A pass's message while the admin's `spec.driver.upgradePolicy.pause` holds the rollout.


def _key(name: str, default: Any = None, *, factory: Any = None, count: str = "") -> Any:
    """A field written under the JSON key `name` (and, for a `NodeList`, its count under `count`)."""
    meta = {"json": name, "count": count}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class NodeList:
    """Nodes as status lists them: the first `LISTED_NODES` names, sorted, and how many in all."""

    names: list[str] = field(default_factory=list)
    count: int = 0

    @classmethod
    def of(cls, nodes) -> NodeList:
        nodes = sorted(nodes)
        return cls(nodes[:LISTED_NODES], len(nodes))


@dataclass
class StepStatus:
    """`status.upgradeStatus.status`: the step in progress."""

    last_pod_spec_revision: str = _key("lastPodSpecRevision", "")  # the rollback target
    upgrading_pod_spec_revision: str = _key("upgradingPodSpecRevision", "")
    current_step_index: int = _key("currentStepIndex", 0)
    current_upgrade_replicas: int = _key("currentUpgradeReplicas", 0)  # the step's target
    current_upgrade_ready_replicas: int = _key("currentUpgradeReadyReplicas", 0)
    current_failure_retry: int = _key("currentFailureRetry", 0)
    total_upgrade_replicas: int = _key("totalUpgradeReplicas", 0)
    total_upgrade_ready_replicas: int = _key("totalUpgradeReadyReplicas", 0)
    message: str = _key("message", "")
    last_update_time: str | None = _key("lastUpdateTime")
    # Absent until a rollout starts (the CRD's enum has no empty value).
    current_step_state: str | None = _key("currentStepState")
    recheck_time: str | None = _key("recheckTime")  # when a timed pause ends


@dataclass
class Resume:
    """`status.upgradeStatus.resume`: what a restarted runner needs beyond the seed's fields."""

    stable_revision: str = _key("stableRevision", "")
    steps_key: str = _key("stepsKey", "")  # the step list the step index refers to
    wave: list[str] = _key("wave", factory=list)
    wave_kind: str = _key("waveKind", "")  # a `WaveKind`, "" between waves
    wave_uids: list[str] = _key("waveUids", factory=list)  # the pods a retry wave deletes
    retry_queue: list[str] = _key("retryQueue", factory=list)
    paused_by_runner: bool = _key("pausedByRunner", False)
    pause_reason: str = _key("pauseReason", "")  # a `PauseReason`, "" without the runner's pause
    pause_confirmed: bool = _key("pauseConfirmed", False)  # the runner saw its own pause land
    release_pause: bool = _key("releasePause", False)  # set pause back to false: the rollout moved on
    held: NodeList = _key("heldNodes", factory=NodeList, count="heldNodeCount")
    failed: NodeList = _key("failedNodes", factory=NodeList, count="failedNodeCount")
    abandoned_revision: str = _key("abandonedRevision", "")
    skipped: NodeList = _key("skippedNodes", factory=NodeList, count="skippedNodeCount")
    cordoned: NodeList = _key("cordonedNodes", factory=NodeList, count="cordonedNodeCount")
    drain_start: dict[str, str] = _key("drainStart", factory=dict)  # node -> when its drain began
    # Wave nodes whose driver pod was deleted after the wave began (their work ended first, or the
    # deletion was repeated), node -> when: a node's readiness timeout runs from its own deletion.
    deleted_at: dict[str, str] = _key("deletedAt", factory=dict)
    timed_out_nodes: list[str] = _key("timedOutNodes", factory=list)
    need_reboot: NodeList = _key("needRebootNodes", factory=NodeList, count="needRebootNodeCount")
    # The nodes out of service for reasons of their own that keep the next wave waiting (`budget`).
    out_of_service: NodeList = _key("outOfServiceNodes", factory=NodeList, count="outOfServiceNodeCount")
    step_start_time: str | None = _key("stepStartTime")
    wave_start_time: str | None = _key("waveStartTime")
    step_ready_time: str | None = _key("stepReadyTime")
    # When the health gate first saw the step due to promote (its timed pause over, or the admin's
    # `pause: false`): only a snapshot of the nodes' health taken since then lets it promote.
    promotion_due: str | None = _key("promotionDue")
    # When the pods last settled at `stableRevision` (the first idle pass after a rollout, a
    # rollback or a replacement ended): a pod created since at another revision is behind.
    settled_at: str | None = _key("settledAt")
    # The revision a rollback's restore was planned for, until the template is back at it
    # (`engine._restore_again`: a restore that did not land is not a new revision).
    restoring: str | None = _key("restoring")
    # The CR's spec the rollout acts on, less pause and enableRollout (`freeze.record`): an edit of
    # anything else waits until the rollout ends (an API server without the policy stores it).
    spec: str | None = _key("spec")


@dataclass
class UpgradeStatus:
    """`status.upgradeStatus`."""

    last_applied_spec: str = _key("lastAppliedSpec", "")  # the pod template when the pods last settled
    last_co_driver_spec: str = _key("lastCoDriverSpec", "")  # the CR's spec.driver then
    upgrading: bool = _key("upgrading", False)
    conditions: list[Condition] = _key("condition", factory=list)
    phase: str = _key("phase", IDLING)
    message: str = _key("message", "")
    step: StepStatus = _key("status", factory=StepStatus)
    resume: Resume = _key("resume", factory=Resume)

    @classmethod
    def from_json(cls, raw: dict | None) -> UpgradeStatus:
        return _from_json(cls, raw)

    def to_json(self) -> dict:
        return _to_json(self)


def _json_key(f: dataclasses.Field) -> str:
    """A field's JSON key: the one `_key` declared, else its name in camelCase (`Condition`)."""
    head, *rest = f.name.split("_")
    return f.metadata.get("json") or head + "".join(part.title() for part in rest)


def _to_json(obj) -> dict:
    out: dict = {}
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), _json_key(f)
        if value is None:
            continue
        if isinstance(value, NodeList):
            out[key], out[f.metadata["count"]] = list(value.names), value.count
        elif dataclasses.is_dataclass(value):
            out[key] = _to_json(value)
        elif isinstance(value, list):
            out[key] = [_to_json(v) if dataclasses.is_dataclass(v) else v for v in value]
        elif isinstance(value, dict):
            out[key] = dict(value)
        else:
            out[key] = value
    return out


@functools.cache
def _hints(cls) -> dict:
    """The field types of a status dataclass (`get_type_hints` evaluates the annotations' text)."""
    return get_type_hints(cls)


def _from_json(cls, raw: Any):
    raw = raw if isinstance(raw, dict) else {}
    hints = _hints(cls)
    values: dict = {}
    for f in dataclasses.fields(cls):
        kind, value = hints[f.name], raw.get(_json_key(f))
        if kind is NodeList:
            values[f.name] = NodeList(list(value or ()), raw.get(f.metadata["count"]) or 0)
        elif value is None:
            continue
        elif dataclasses.is_dataclass(kind):
            values[f.name] = _from_json(kind, value)
        elif get_origin(kind) is list:
            item = get_args(kind)[0]
            values[f.name] = [_from_json(item, v) if dataclasses.is_dataclass(item) else v for v in value]
        elif get_origin(kind) is dict:
            values[f.name] = dict(value)
        else:
            values[f.name] = value
    return cls(**values)
