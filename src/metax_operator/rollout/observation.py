"""What one pass of the rollout observed (`Cluster`, its driver `Pod`s), and the rules that read
it the same way for every part of the engine: which pod is each node's, when a pod has failed,
which nodes GPU work holds back or must be waited for, where a swapped node's validation stands,
whose driver is back, and the nodes sorted relative to a revision (`RevisionView`).

The validation of a swapped node (`driver.upgradePolicy.validation`): after a wave node's new
driver pod is Ready, the runner runs a validation pod on the node (still cordoned;
`runtime.validation_pod`) and records its outcome on the driver pod (`Pod.verdict`). Until then
the node holds its slot of the wave, stays cordoned and is not counted upgraded; a failed or
timed-out validation makes it a failed node of the step, as a driver pod that is never Ready
(retries and `fallback` apply; a retry's new pod is validated anew). The record outlives the
wave: a node whose validation failed stays failed, and cordoned, after the next wave has begun.
Only wave nodes are validated: a Ready pod the runner did not swap (a new node, a node upgraded
before validation was enabled) counts as it always did.

`runtime.rollout_observe` builds a `Cluster` from the runner's watch caches; the tests build them
by hand. Times are seconds since the epoch (UTC), as every clock of the runner.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from metax_operator.chart.upgrade_policy import Policy, Validation
from metax_operator.contract import VALIDATION_FAILED_PREFIX, VALIDATION_PASSED
from metax_operator.rollout.health_gate import HealthSnapshot
from metax_operator.rollout.status import Resume

# A new-revision pod that is not Ready and has restarted this often is failed (CrashLoopBackOff).
RESTART_LIMIT = 3


@dataclass(frozen=True)
class Check:
    """A driver pod's validation pod, as the runner observed it."""

    name: str
    created: float
    done: bool = False  # it ended (Succeeded, or Failed)
    passed: bool = False  # it Succeeded
    reason: str = ""  # why it failed: its failed container's message, or the pod's reason


@dataclass(frozen=True)
class Pod:
    """A driver pod as the runner observed it."""

    name: str
    uid: str
    node: str
    revision: str  # its `controller-revision-hash` label
    ready: bool = False
    phase: str = "Pending"
    restart_count: int = 0
    created: float = 0.0
    deleting: float | None = None  # when its deletion was asked (deletionTimestamp less the grace period)
    # Why it will never be Ready, when a container said so (the payload contract's exit): failed at once.
    failure: str = ""
    verdict: str = ""  # its node's validation as the runner recorded it (`validation`), "" none yet
    check: Check | None = None  # its validation pod, if any


@dataclass(frozen=True)
class Cluster:
    """The cluster as one pass observed it, in the rollout's terms (`rollout_observe` builds it
    from the watch caches; the pass's own `reconcile.Observed` holds the objects themselves)."""

    current_revision: str  # hash of the DaemonSet's newest ControllerRevision
    caught_up: bool  # DaemonSet status.observedGeneration == metadata.generation
    nodes: frozenset[str]  # nodes that should run the driver (the DaemonSet's node selector)
    pods: tuple[Pod, ...]  # the DaemonSet's pods
    gpu_busy_nodes: frozenset[str] = frozenset()  # nodes running pods that request metax-tech.com/*
    wait_busy_nodes: frozenset[str] = frozenset()  # nodes running pods that match waitForCompletion.podSelector
    skipped: frozenset[str] = frozenset()  # nodes labelled to keep their driver (not in `nodes`)
    cordoned: frozenset[str] = frozenset()  # nodes the runner cordoned (its label on the node)
    unschedulable: frozenset[str] = frozenset()  # nodes cordoned by anyone (spec.unschedulable)
    need_reboot: frozenset[str] = frozenset()  # nodes that reported NodeNeedReboot and have not rebooted since
    retry: frozenset[str] = frozenset()  # nodes an admin labelled to retry their failed driver
    template: str = ""  # the DaemonSet's pod template, serialized: recorded as lastAppliedSpec
    driver_spec: str = ""  # the spec.driver the runner acts on, serialized: recorded as lastCoDriverSpec
    # What a rollback restores from (`restore.plan`):
    revisions: Mapping[str, dict] = field(default_factory=dict)  # hash -> the DaemonSet's ControllerRevision data
    daemonset: Mapping = field(default_factory=dict)  # the driver DaemonSet as read
    cr_spec: Mapping = field(default_factory=dict)  # the spec the runner acts on (`freeze.in_force`)
    # The CR's spec.driver as stored, which differs from `cr_spec`'s while a rollback's write of it
    # has not landed (or an edit is held): what tells the rollback its restore is done.
    stored_driver: Mapping = field(default_factory=dict)
    health: HealthSnapshot | None = None  # the latest snapshot of the nodes' health, if the health gate asked for one
    # The DaemonSet's revisions that run the same driver as the current one, the current one
    # included: their templates differ from its only in where pods may run (`rollout_observe.same_driver`).
    # Their pods are read as at the current revision.
    same_driver: frozenset[str] = frozenset()
    # GPU nodes out of service in any driver DaemonSet's rollout (driver pools): being swapped,
    # moved between pools, not Ready or cordoned. Those of the other rollouts count in this
    # rollout's budget; its own count by its own rules (`budget.out_of_service`).
    elsewhere: frozenset[str] = frozenset()

    @functools.cached_property
    def node_pods(self) -> NodePods:
        """The eligible nodes' driver pods (`NodePods`), worked out once for every reader."""
        return NodePods(self)


class Stage(StrEnum):
    """What must end on a wave's node before its driver pod is deleted (never persisted)."""

    WAIT = "wait"  # its pods matching `waitForCompletion.podSelector`
    DRAIN = "drain"  # its GPU pods, evicted


def failed(pod: Pod, now: float, timeout: float) -> bool:
    """A pod not Ready that will not be: in phase Failed, restarting again and again, a container
    of it saying why it cannot start (`Pod.failure`), or not Ready within the readiness timeout."""
    if pod.ready:
        return False
    return pod.phase == "Failed" or bool(pod.failure) or pod.restart_count >= RESTART_LIMIT or now - pod.created >= timeout


def starting(pod: Pod, now: float, timeout: float) -> bool:
    """A pod coming up: not Ready yet and not failed. Its driver may be flashing GPU firmware, so
    no rule deletes it for a newer template until it is Ready or has failed."""
    return not pod.ready and not failed(pod, now, timeout)


class ValidationOutcome(StrEnum):
    """Where a Ready wave pod's validation stands."""

    PASSED = "passed"  # upgraded (or nothing to validate)
    VALIDATING = "validating"  # its validation pod is to be created, or runs
    FAILED = "failed"


def validation_outcome(pod: Pod, in_wave: bool, validation: Validation | None, now: float) -> tuple[ValidationOutcome, str]:
    """The validation's outcome for a Ready driver `pod` and, when it failed, why.

    A recorded failure stands whatever the policy says now: the node is not given back to
    service until an admin retries it (or a new revision replaces its pod). A validation pod
    counts whether or not its node is still in the wave (a rollback may have taken the wave over
    before the outcome was recorded).
    """
    if pod.verdict and pod.verdict != VALIDATION_PASSED:
        return ValidationOutcome.FAILED, pod.verdict.removeprefix(VALIDATION_FAILED_PREFIX)
    if validation is None or pod.verdict == VALIDATION_PASSED:
        return ValidationOutcome.PASSED, ""
    check = pod.check
    if check is None:  # a pod outside the waves was not swapped by the runner: nothing to validate
        return ValidationOutcome.VALIDATING if in_wave else ValidationOutcome.PASSED, ""
    if check.done and check.passed:
        return ValidationOutcome.PASSED, ""
    if check.done:
        return ValidationOutcome.FAILED, check.reason or "its validation pod failed"
    if now - check.created >= validation.timeout_s:
        return ValidationOutcome.FAILED, f"its validation did not end within {validation.timeout_s} s (timeoutSeconds)"
    return ValidationOutcome.VALIDATING, ""


def verdict(result: ValidationOutcome, reason: str) -> str:
    """What the runner records on the driver pod for an ended validation."""
    return VALIDATION_PASSED if result is ValidationOutcome.PASSED else VALIDATION_FAILED_PREFIX + reason


def validation_deadline(pod: Pod, validation: Validation | None) -> float | None:
    """When a running validation times out (None: none running)."""
    if validation is None or pod.check is None or pod.check.done:
        return None
    return pod.check.created + validation.timeout_s


def held(observed: Cluster, policy: Policy, node: str) -> bool:
    """Whether `node` is not taken at all: it runs GPU work that is neither allowed, nor drained,
    nor waited for (`waitForCompletion` takes a node whose pods match it, GPU work or not, into a
    wave and cordons it while they run)."""
    if node not in observed.gpu_busy_nodes or policy.allow_gpu_workloads or policy.drain:
        return False
    return not (policy.wait_selector and node in observed.wait_busy_nodes)


def to_prepare(observed: Cluster, policy: Policy, node: str) -> Stage | None:
    """What must end on `node` before its driver pod is deleted: its pods to wait for, its GPU
    pods to drain, or nothing (None)."""
    if policy.wait_selector and node in observed.wait_busy_nodes:
        return Stage.WAIT
    if policy.drain and not policy.allow_gpu_workloads and node in observed.gpu_busy_nodes:
        return Stage.DRAIN
    return None


class NodePods:
    """Each eligible node's live driver pod (the newest not being deleted) and since when a pod of
    it is being deleted: what every `RevisionView` of one pass starts from, worked out once."""

    def __init__(self, observed: Cluster):
        self.live: dict[str, Pod] = {}
        self.deleting: dict[str, float] = {}
        for pod in observed.pods:
            if pod.node not in observed.nodes:
                continue
            if pod.deleting is not None:
                self.deleting[pod.node] = min(pod.deleting, self.deleting.get(pod.node, pod.deleting))
            elif pod.node not in self.live or pod.created > self.live[pod.node].created:
                self.live[pod.node] = pod
        # The eligible nodes whose driver pod is not Ready, or that have none.
        self.not_ready = frozenset(node for node, pod in self.live.items() if not pod.ready) | (observed.nodes - self.live.keys())


def driver_back(observed: Cluster, resume: Resume, deleting: set[str], validation: Validation | None, now: float) -> set[str]:
    """The nodes the runner cordoned that it may uncordon now, `deleting` holding the nodes whose
    driver pod is to be deleted in this pass.

    A node stays cordoned while its driver is being swapped: a pod of it is to be deleted in
    this pass, or is being deleted, or its live pod is not Ready (coming up, or failed: a
    node whose new driver fails stays cordoned until an admin looks at it), or it is in the
    wave with a pod the wave has yet to replace (another revision, or a uid a retry
    deletes), its work still to end (wait, drain). A node with no driver pod at all that no
    wave waits for has nothing coming. Unlike `NodePods` it reads the pods of every node,
    not only the eligible ones: a node the runner cordoned may have left the eligible set.
    """
    if not observed.cordoned:
        return set()
    deleting = set(deleting)
    live: dict[str, Pod] = {}
    for pod in observed.pods:
        if pod.deleting is not None:
            deleting.add(pod.node)
        elif pod.node not in live or pod.created > live[pod.node].created:
            live[pod.node] = pod
    # A node whose wait or drain timed out keeps its driver: its swap is given up. A node that
    # left the DaemonSet mid-wave (relabelled) gets no driver back: nothing is coming.
    wave = (set(resume.wave) & observed.nodes) - set(resume.timed_out_nodes)
    doomed = set(resume.wave_uids)
    back = set()
    for node in observed.cordoned - deleting:
        pod = live.get(node)
        if pod is None:
            if node not in wave:
                back.add(node)
        elif pod.ready and (node not in wave or (pod.revision == observed.current_revision and pod.uid not in doomed)):
            if validation_outcome(pod, node in wave, validation, now)[0] is ValidationOutcome.PASSED:
                back.add(node)
    return back


class RevisionView:
    """The eligible nodes sorted by what their driver pod is doing, relative to `revision` and the
    nodes of the wave in flight (`wave`: a wave node without a live pod is coming), a Ready pod
    counted by its node's `validation` too."""

    def __init__(
        self,
        observed: Cluster,
        pods: NodePods,
        revision: str,
        wave: set[str],
        timeout: float,
        now: float,
        validation: Validation | None,
    ):
        self.revision = revision
        self.live = pods.live
        deleting = pods.deleting
        self.ready_at_revision: set[str] = set()
        self.failed: set[str] = set()  # at the revision and failed, or stuck without a pod
        self.pending: set[str] = set()  # at the revision, neither Ready (and validated) nor failed yet
        self.validating: set[str] = set()  # of `pending`: Ready, their validation not ended
        self.reasons: dict[str, str] = {}  # failed nodes whose validation failed -> why
        self.coming: set[str] = set()  # no live pod yet; the DaemonSet will create one
        self.others: list[Pod] = []  # live pods at another revision
        self.deadline: float | None = None  # the next time a pending pod times out
        for node in observed.nodes:
            pod = self.live.get(node)
            if pod is None:
                if node in deleting and now - deleting[node] >= timeout:
                    self.failed.add(node)  # stuck Terminating
                elif node in deleting or node in wave:
                    self.coming.add(node)
            elif pod.revision != revision:
                self.others.append(pod)
            elif pod.ready:
                self._validated(node, pod, node in wave, validation, now)
            elif failed(pod, now, timeout):
                self.failed.add(node)
            else:
                self.pending.add(node)
                end = pod.created + timeout
                self.deadline = end if self.deadline is None else min(self.deadline, end)
        self.at_revision = len(self.ready_at_revision) + len(self.pending) + sum(1 for n in self.failed if n in self.live)
        self.total = len(self.live) + len(self.coming) + sum(1 for n in self.failed if n not in self.live)

    def _validated(self, node: str, pod: Pod, in_wave: bool, validation: Validation | None, now: float) -> None:
        """Sort a Ready pod at the revision by its validation."""
        result, reason = validation_outcome(pod, in_wave, validation, now)
        if result is ValidationOutcome.PASSED:
            self.ready_at_revision.add(node)
        elif result is ValidationOutcome.FAILED:
            self.failed.add(node)
            self.reasons[node] = reason
        else:
            self.pending.add(node)
            self.validating.add(node)
            end = validation_deadline(pod, validation)
            if end is not None:
                self.deadline = end if self.deadline is None else min(self.deadline, end)

    def copy(self) -> RevisionView:
        """A copy whose sets and lists a handler may change without changing this view."""
        view = copy.copy(self)
        view.ready_at_revision, view.failed, view.pending = set(self.ready_at_revision), set(self.failed), set(self.pending)
        view.coming, view.others = set(self.coming), list(self.others)
        view.validating, view.reasons = set(self.validating), dict(self.reasons)
        return view
