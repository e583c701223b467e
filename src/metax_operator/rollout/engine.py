"""The staged driver rollout's decision: a pure function, `decide(observed, policy, status, now)`.

It reads what one runner pass observed (the driver DaemonSet's revision, its pods, the eligible
nodes), the parsed `driver.upgradePolicy`, the persisted `status.upgradeStatus` (`rollout.status`)
and the time, and returns a `Decision` holding everything the runner then does: the new status
(seed 000 table 3.16, plus `resume`, the bookkeeping a restarted runner needs), the value to set
`spec.driver.upgradePolicy.pause` to and the status to write once it landed, the restore of an
older revision (`rollout.restore`: spec.driver, then the template), nodes to cordon, drain or
uncordon, pods to delete, events, and when to run again. It never calls Kubernetes and never
reads the clock, so every rule is tested without a cluster.

A pass dispatches on the phase to a handler; each handler does its part and returns the handler
to run next, or `DONE` when the pass is done (`_Pass._settle` bounds the chain). The pass is
built in four pieces, each on the one before: its state and bookkeeping (`_PassState`), the
waves' rules (`_Waves`), the handlers of the phases without a step in flight (`_IdleAndRollback`)
and the Progressing phase's (`_Pass`). The names of states, reasons and kinds are in
`rollout.status`.

The runner writes `Decision.status` first (resourceVersion-checked) and then acts; every action
is safe to repeat, so a crash between any two actions loses nothing: the next pass sees the
persisted status and the cluster and carries on.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from operator import attrgetter
from typing import NamedTuple, Union

from metax_operator.chart.upgrade_policy import Fallback, OnTimeout, Policy
from metax_operator.contract import RETRY_LABEL
from metax_operator.rollout import freeze, restore
from metax_operator.rollout.restore import Restore
from metax_operator.rollout.status import (
    ADMIN_PAUSED,
    COMPLETED,
    DISABLED,
    DISABLING,
    IDLING,
    LISTED_NODES,
    PROGRESSING,
    STEP_INIT,
    STEP_PAUSED,
    STEP_READY,
    STEP_UPGRADE,
    TERMINATING,
    Condition,
    ConditionType,
    NodeList,
    PauseReason,
    Reason,
    Resume,
    UpgradeStatus,
    WaveKind,
    parse_time,
    rfc3339,
    transition_time,
)

# A new-revision pod that is not Ready and has restarted this often is failed (CrashLoopBackOff).
RESTART_LIMIT = 3


@dataclass(frozen=True)
class Pod:
    """A driver pod as the runner observed it. Times are seconds since the epoch (UTC)."""

    name: str
    uid: str
    node: str
    revision: str  # its `controller-revision-hash` label
    ready: bool = False
    phase: str = "Pending"
    restart_count: int = 0
    created: float = 0.0
    deleting: float | None = None  # when its deletion was asked (deletionTimestamp less the grace period)


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
    need_reboot: frozenset[str] = frozenset()  # nodes that reported NodeNeedReboot and have not rebooted since
    retry: frozenset[str] = frozenset()  # nodes an admin labelled to retry their failed driver
    template: str = ""  # the DaemonSet's pod template, serialized: recorded as lastAppliedSpec
    driver_spec: str = ""  # the CR's spec.driver, serialized: recorded as lastCoDriverSpec
    # What a rollback restores from (`restore.plan`):
    revisions: Mapping[str, dict] = field(default_factory=dict)  # hash -> the DaemonSet's ControllerRevision data
    daemonset: Mapping = field(default_factory=dict)  # the driver DaemonSet as read
    cr_spec: Mapping = field(default_factory=dict)  # the CR's spec


class PodRef(NamedTuple):
    """A pod to delete; the runner cordons its node, then deletes with a uid precondition, so a
    repeat is harmless. A tuple, not a frozen dataclass: a 100,000-node wave makes 100,000 of
    them, and a frozen dataclass takes twice as long to build (81 ms against 43 ms for 100,000)."""

    name: str
    uid: str
    node: str


@dataclass(frozen=True)
class Event:
    """An Event the runner emits on the CR."""

    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Decision:
    """Everything the runner does after one pass, in this order (`runtime.rollout_pass`)."""

    status: UpgradeStatus  # the new status.upgradeStatus: write it before acting
    set_pause: bool | None = None  # set spec.driver.upgradePolicy.pause to this (it holds the other value)
    status_once_paused: UpgradeStatus | None = None  # write this once `set_pause: true` landed (pauseConfirmed)
    restore: Restore | None = None  # roll the driver back (spec.driver, then the template)
    cordon: list[str] = field(default_factory=list)  # wave nodes whose work must end first: cordon now
    evict: list[str] = field(default_factory=list)  # nodes whose GPU pods to evict (drain), once cordoned
    delete: list[PodRef] = field(default_factory=list)
    cordon_first: bool = True  # cordon each pod's node before deleting its pod (upgradePolicy.cordon)
    idle_first: bool = True  # look again for GPU pods on the node (cordoned) right before the deletion
    uncordon: list[str] = field(default_factory=list)  # nodes the runner cordoned whose driver is back
    events: list[Event] = field(default_factory=list)
    wake_at: float | None = None  # run again by then even if nothing changes (pauses, timeouts)


class Unsettled(RuntimeError):
    """The pass's transitions did not settle within their bound: a defect of the engine."""


# A handler of the pass: does its part, then names the next handler, or `DONE` to end the pass.
Handler = Callable[[], Union["Handler", "_Done"]]


class Stage(StrEnum):
    """What must end on a wave's node before its driver pod is deleted (never persisted)."""

    WAIT = "wait"  # its pods matching `waitForCompletion.podSelector`
    DRAIN = "drain"  # its GPU pods, evicted


def decide(observed: Cluster, policy: Policy, status: UpgradeStatus | None, now: float) -> Decision:
    """The actions and new `status.upgradeStatus` for one pass."""
    return _Pass(observed, policy, status, now).run()


def driver_back(observed: Cluster, resume: Resume, deleting: set[str]) -> set[str]:
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
            back.add(node)
    return back


class NodePods:
    """Each eligible node's live driver pod (the newest not being deleted) and since when a pod of
    it is being deleted: what every `_View` of one pass starts from, worked out once."""

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


def held(observed: Cluster, policy: Policy, node: str) -> bool:
    """Whether `node` is not taken at all: it runs GPU work that is neither allowed nor drained."""
    return node in observed.gpu_busy_nodes and not policy.allow_gpu_workloads and not policy.drain


def to_prepare(observed: Cluster, policy: Policy, node: str) -> Stage | None:
    """What must end on `node` before its driver pod is deleted: its pods to wait for, its GPU
    pods to drain, or nothing (None)."""
    if policy.wait_selector and node in observed.wait_busy_nodes:
        return Stage.WAIT
    if policy.drain and not policy.allow_gpu_workloads and node in observed.gpu_busy_nodes:
        return Stage.DRAIN
    return None


def failed(pod: Pod, now: float, timeout: float) -> bool:
    """A pod not Ready that will not be: in phase Failed, restarting again and again, or not
    Ready within the readiness timeout."""
    return pod.phase == "Failed" or pod.restart_count >= RESTART_LIMIT or now - pod.created >= timeout


class _View:
    """The eligible nodes sorted by what their driver pod is doing, relative to `revision`."""

    def __init__(self, observed: Cluster, pods: NodePods, revision: str, wave: set[str], timeout: float, now: float):
        self.revision = revision
        self.live = pods.live
        deleting = pods.deleting
        self.ready_at_revision: set[str] = set()
        self.failed: set[str] = set()  # at the revision and failed, or stuck without a pod
        self.pending: set[str] = set()  # at the revision, neither Ready nor failed yet
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
                self.ready_at_revision.add(node)
            elif failed(pod, now, timeout):
                self.failed.add(node)
            else:
                self.pending.add(node)
                end = pod.created + timeout
                self.deadline = end if self.deadline is None else min(self.deadline, end)
        self.at_revision = len(self.ready_at_revision) + len(self.pending) + sum(1 for n in self.failed if n in self.live)
        self.total = len(self.live) + len(self.coming) + sum(1 for n in self.failed if n not in self.live)

    def copy(self) -> _View:
        """A copy whose sets and lists a handler may change without changing this view."""
        view = copy.copy(self)
        view.ready_at_revision, view.failed, view.pending = set(self.ready_at_revision), set(self.failed), set(self.pending)
        view.coming, view.others = set(self.coming), list(self.others)
        return view


class _Done:
    """What a handler returns to end the pass (`DONE`), where it would otherwise name the next."""

    def __repr__(self) -> str:
        return "DONE"


DONE = _Done()


class _PassState:
    """One pass's state and the bookkeeping verbs every part of the pass uses.

    The state, read and changed by the handlers:
    - `observed`, `policy`, `now`: the pass's inputs (never changed);
    - `before`: the status as persisted, `status` the new one being written (a deep copy), with
      its parts `step` (`status.status`: the step in progress) and `resume` (the bookkeeping);
    - `decision`: the actions collected so far (`decision.status` is `status`);
    - `admin_pause`: whether the admin's `spec.driver.upgradePolicy.pause` holds the rollout (the
      spec's value, unless it is the runner's own pause being released in this pass);
    - `wakes`: the times by which the pass wants to run again.
    """

    def __init__(self, observed: Cluster, policy: Policy, status: UpgradeStatus | None, now: float):
        self.observed, self.policy, self.now = observed, policy, now
        self.node_pods = NodePods(observed)
        self.views: dict[tuple[str, tuple[str, ...]], _View] = {}  # by revision and wave: see `_classify`
        self.before = status or UpgradeStatus()
        self.status = copy.deepcopy(self.before)
        self.step, self.resume = self.status.step, self.status.resume
        self.decision = Decision(status=self.status, cordon_first=policy.cordon, idle_first=not policy.allow_gpu_workloads)
        self.wakes: list[float] = []
        self.admin_pause = policy.pause
        if self.resume.release_pause:
            if policy.pause:
                self.decision.set_pause, self.admin_pause = False, False
            else:
                self.resume.release_pause = False

    def _say(self, message: str) -> None:
        self.status.message = self.step.message = message

    def _finish(self, message: str) -> _Done:
        """Say `message` and end the pass."""
        self._say(message)
        return DONE

    def _condition(self, kind: ConditionType, status: str, reason: Reason, message: str) -> None:
        """Set the condition `kind`; its lastTransitionTime moves only when its status changes."""
        condition = next((c for c in self.status.conditions if c.type == kind), None)
        if condition is None:
            self.status.conditions.append(Condition(kind, status, reason, message, rfc3339(self.now)))
            return
        condition.last_transition_time = transition_time(
            condition.status, condition.last_transition_time, status, rfc3339(self.now)
        )
        condition.status, condition.reason, condition.message = status, reason, message

    def _event(self, type_: str, reason: Reason, message: str) -> None:
        self.decision.events.append(Event(type_, reason, message))

    def _step_state(self, state: str, message: str = "") -> None:
        self.step.current_step_state = state
        self._say(message or f"step {self.step.current_step_index}: {state}")

    def _enter_step(self, index: int) -> None:
        self.step.current_step_index, self.step.current_failure_retry, self.step.recheck_time = index, 0, None
        self.resume.step_start_time, self.resume.step_ready_time = rfc3339(self.now), None
        step = self.policy.steps[index]
        after = "wait for the admin" if step.pause_ms is None else f"pause {step.pause_ms} ms"
        self._event("Normal", Reason.STEP_STARTED, f"step {index}: replicas {step.replicas}, then {after}")
        self._step_state(STEP_INIT, f"step {index} started")

    def _runner_pause(self, reason: PauseReason) -> None:
        self.resume.paused_by_runner, self.resume.pause_reason = True, reason
        self.resume.pause_confirmed, self.resume.release_pause = self.admin_pause, False
        if not self.admin_pause:
            self.decision.set_pause = True

    def _clear_runner_pause(self) -> None:
        """Forget the runner's pause; if the spec still holds it (the rollout moved on without the
        admin's answer: a rollback, a new revision, edited steps), set it back to false."""
        if self.resume.paused_by_runner and self.admin_pause:
            self.resume.release_pause, self.decision.set_pause, self.admin_pause = True, False, False
        self.resume.paused_by_runner, self.resume.pause_reason, self.resume.pause_confirmed = False, "", False

    def _record_stable_spec(self) -> None:
        """Record the template and `spec.driver` observed now as those of the stable revision
        (`lastAppliedSpec`, `lastCoDriverSpec`: what a rollback writes back to the CR).

        Called only when the current revision is the stable one and the observation is caught up,
        so both belong to it. The pass that completes a rollout records them too: the next version
        may arrive before any idle pass, and its rollout must not inherit the spec of the rollout
        before (a rollback would then restore an older driver version than its revision's).
        """
        self.status.last_applied_spec, self.status.last_co_driver_spec = self.observed.template, self.observed.driver_spec

    def _timeout(self) -> float:
        return self.policy.readiness_timeout_ms / 1000

    def _classify(self, revision: str, wave: tuple[str, ...]) -> _View:
        """The nodes sorted relative to `revision` and `wave`: a view depends on nothing else that
        changes within a pass, so it is built once per pass for each and handed out as a copy
        (handlers change the copy they hold; the next handler starts from the observation)."""
        key = (revision, wave)
        if key not in self.views:
            self.views[key] = _View(self.observed, self.node_pods, revision, set(wave), self._timeout(), self.now)
        return self.views[key].copy()

    def _view(self, revision: str) -> _View:
        """The view of `revision` and the wave in flight, with the pods that time out woken for and
        (`onTimeout: fail`) the nodes whose wait or drain timed out counted failed."""
        view = self._classify(revision, tuple(self.resume.wave))
        if view.deadline is not None:
            self.wakes.append(view.deadline)  # a pending pod turns failed then
        if self.status.phase == PROGRESSING and self.policy.on_timeout == OnTimeout.FAIL:
            timed_out = {n for n in self.resume.timed_out_nodes if n in view.live and view.live[n].revision != revision}
            view.failed.update(timed_out)  # failed before the swap: not taken again unless retried
            view.others = [p for p in view.others if p.node not in timed_out]
        return view

    def _resume_index(self) -> int:
        """The first step whose target is at least the pods already at the current revision.

        Also records the step list it was computed for (`resume.stepsKey`).
        """
        self.resume.steps_key = self.policy.steps_key
        view = self._view(self.observed.current_revision)
        targets = self.policy.targets(view.total)
        return next((i for i, t in enumerate(targets) if t >= view.at_revision), max(len(targets) - 1, 0))


class _Waves(_PassState):
    """The rules of a wave: the pods deleted together, and the nodes' work that must end first.

    A wave's nodes are recorded in `resume.wave`; a node with pods to wait for
    (`waitForCompletion.podSelector`) or GPU pods to drain is cordoned first and its driver pod
    deleted by a later pass once that work has ended (its stage, `_to_prepare`), or it times out
    (`onTimeout`). GPU work that is neither allowed nor drained holds its node out of every wave.
    """

    def _room(self, cap: int) -> int:
        """How many nodes a new wave may take: `cap` less the nodes whose driver is being swapped
        now, whatever wave started it (a pod being deleted with no Ready successor, or a young
        pod not Ready yet: created within the readiness timeout and not failed; a node past the
        timeout is failed and, as in a wave, holds no slot). A rollback, a new revision or a
        retry that starts while an earlier wave is still coming back (its record replaced) so
        never adds to it beyond the cap."""
        pods, timeout = self.node_pods, self._timeout()
        swapping = {
            n for n, since in pods.deleting.items() if self.now - since < timeout and not (n in pods.live and pods.live[n].ready)
        }
        swapping.update(node for node, pod in pods.live.items() if not pod.ready and not failed(pod, self.now, timeout))
        return cap - len(swapping)

    def _wait_for_room(self, what: str) -> Handler:
        return self._finish(f"{what}: waiting for the driver pods being swapped to be Ready before the next wave")

    def _start_wave(self, kind: WaveKind, nodes: list[str], pods: list[Pod]) -> None:
        """Start a wave: delete the pods of its free nodes now; the others are cordoned and
        deleted by `_wave_busy` once their work has ended (`_prepare`)."""
        resume = self.resume
        resume.wave, resume.wave_kind, resume.wave_start_time, resume.drain_start = sorted(nodes), kind, rfc3339(self.now), {}
        resume.wave_uids = sorted(p.uid for p in pods) if kind == WaveKind.RETRY else []
        resume.timed_out_nodes = [n for n in resume.timed_out_nodes if n not in nodes]
        prepare = self._nodes_to_prepare()
        self._delete([p for p in pods if p.node not in prepare])
        self.decision.cordon.extend(p.node for p in pods if p.node in prepare)
        self.wakes.append(self.now + self._timeout())

    def _wave_busy(self, view: _View) -> bool:
        """True while the current wave is still coming back; repeats deletions a crash lost.

        A wave node is back when its pod is at the wave's revision and Ready or failed (failed
        nodes hold no slot), or when it is stuck. A pod the wave meant to delete (another
        revision, or a uid in `waveUids` for a retry) that is still there is deleted again, after
        the same checks as a first deletion: work to wait for or drain must end first
        (`_prepare`); a node that runs GPU work since (its cordon was refused, the runner
        crashed) leaves the wave and is held back as any busy node, rather than stalling the
        wave until its work ends.
        """
        start = parse_time(self.resume.wave_start_time)
        wave = [n for n in self.resume.wave if n in self.observed.nodes]
        if not wave or start is None:
            return False
        doomed = set(self.resume.wave_uids)
        busy, lost = [], []
        for node in wave:
            pod = view.live.get(node)
            if node in view.ready_at_revision:
                continue
            if pod is not None and (pod.revision != view.revision or pod.uid in doomed):
                lost.append(pod)
            elif node in view.failed and (pod is not None or self.resume.wave_kind != WaveKind.RETRY):
                continue  # failed; but a retried stuck node gets the timeout again
            busy.append(node)
        deadline = start + self._timeout()
        if busy and self.now >= deadline:  # deleted but never came back: failed, no longer in flight
            undeleted = {p.node for p in lost}  # the runner's deletion never happened: not the node's fault
            stuck = [n for n in busy if n not in view.pending and n not in undeleted]
            view.failed.update(stuck)
            view.coming.difference_update(stuck)
            busy = [n for n in busy if n in view.pending or n in undeleted]
        held = [p for p in lost if self._held(p.node)]
        if held:  # its deletion was lost, and it runs GPU work since: held back as any busy node
            out = {p.node for p in held}
            self.resume.wave = [n for n in self.resume.wave if n not in out]
            busy = [n for n in busy if n not in out]
            lost = [p for p in lost if p.node not in out]
        ready = self._prepare(lost, view, start, busy)
        if not busy:
            return False
        if ready and not self.admin_pause:
            self._delete(ready)
        self.wakes.append(deadline)
        self._say_wave_busy(len(busy), len(wave) - len(held), len(lost) - len(ready))
        return True

    def _say_wave_busy(self, busy: int, wave: int, preparing: int) -> None:
        notes = [f"{preparing} cordoned, waiting for their work to end"] * bool(preparing)
        self._say(
            f"waiting for {busy} of {wave} pods of the {self.resume.wave_kind} wave to be Ready"
            + (f" ({'; '.join(notes)})" if notes else "")
        )

    def _prepare(self, pods: list[Pod], view: _View, start: float, busy: list[str]) -> list[Pod]:
        """Of the wave's pods still to delete, those whose node is free of the work that must end
        first. For the others: keep them cordoned, evict their GPU pods (drain, once no pod to
        wait for is left), and apply `onTimeout` to those whose wait or drain ran out (taken out
        of `busy`)."""
        free = []
        for pod in pods:
            stage = self._to_prepare(pod.node)
            if not stage:
                free.append(pod)
                continue
            if pod.node in self.resume.timed_out_nodes:  # failed before the swap (a held node left the wave)
                view.failed.add(pod.node)
                busy.remove(pod.node)
                continue
            if stage == Stage.WAIT:
                deadline = start + self.policy.wait_timeout_ms / 1000 if self.policy.wait_timeout_ms else None
            else:
                began = self.resume.drain_start.setdefault(pod.node, rfc3339(self.now))
                deadline = parse_time(began) + self.policy.drain_timeout_ms / 1000
            if deadline is not None and self.now >= deadline:
                self._timed_out(pod.node, stage, view)
                busy.remove(pod.node)
                continue
            if deadline is not None:
                self.wakes.append(deadline)
            if pod.node not in self.observed.cordoned:
                self.decision.cordon.append(pod.node)  # again, should the cordon have been lost
            if stage == Stage.DRAIN and not self.admin_pause:
                self.decision.evict.append(pod.node)
        return free

    def _timed_out(self, node: str, stage: Stage, view: _View) -> None:
        """`node`'s wait or drain ran out: hold it back (out of the wave, uncordoned, its driver
        kept) or count it failed (`onTimeout`)."""
        self.resume.drain_start.pop(node, None)
        if node not in self.resume.timed_out_nodes:
            self.resume.timed_out_nodes = sorted([*self.resume.timed_out_nodes, node])
            waited = stage == Stage.WAIT
            what = "waiting for its pods matching waitForCompletion.podSelector" if waited else "draining its GPU pods"
            then = "held back" if self.policy.on_timeout == OnTimeout.HOLD else "counted failed"
            self._event(
                "Warning",
                Reason.WAIT_TIMEOUT if waited else Reason.DRAIN_TIMEOUT,
                f"node {node}: {what} timed out; {then} (onTimeout: {self.policy.on_timeout})",
            )
        if self.policy.on_timeout == OnTimeout.HOLD:
            self.resume.wave = [n for n in self.resume.wave if n != node]
        else:
            view.failed.add(node)

    def _takeable(self, pods: list[Pod]) -> list[Pod]:
        """Pods that may be deleted now (or once their node's work ends): nodes without work to
        wait for first, then not-ready first, then by node; lists the held-back nodes."""
        prepare = self._nodes_to_prepare()
        held_nodes = {n for n in self.observed.gpu_busy_nodes if self._held(n)} | (set(self.resume.timed_out_nodes) & prepare)
        held = [p.node for p in pods if p.node in held_nodes] if held_nodes else []
        self.resume.held = NodeList.of(held)
        if held and len(held) != self.before.resume.held.count:
            self._event(
                "Warning",
                Reason.NODES_HELD_BACK,
                f"{len(held)} nodes run GPU workloads (or their wait or drain "
                f"timed out) and are held back: {', '.join(sorted(held)[:LISTED_NODES])}",
            )
        ordered = sorted((p for p in pods if p.node not in held_nodes) if held_nodes else pods, key=attrgetter("ready", "node"))
        if not prepare:
            return ordered
        return [p for p in ordered if p.node not in prepare] + [p for p in ordered if p.node in prepare]

    def _nodes_to_prepare(self) -> set[str]:
        """The nodes with work to end before their driver pod is deleted (`_to_prepare`). Only
        nodes running GPU work or pods to wait for can have any: looking them up in those
        (usually small) sets keeps a 100,000-pod wave from costing a call per pod."""
        return {n for n in self.observed.wait_busy_nodes | self.observed.gpu_busy_nodes if self._to_prepare(n)}

    def _held(self, node: str) -> bool:
        return held(self.observed, self.policy, node)

    def _to_prepare(self, node: str) -> Stage | None:
        return to_prepare(self.observed, self.policy, node)

    def _step_cap(self, total: int) -> int:
        """The current step's batch cap (`Policy.caps`: maxParallel of the step's share, 0 no cap)."""
        if not self.policy.steps:
            return total
        return self.policy.caps(total)[min(self.step.current_step_index, len(self.policy.steps) - 1)]

    def _retry(self) -> None:
        """The nodes an admin labelled for a retry (`Cluster.retry`) whose driver pod at the current
        revision failed: that pod is deleted again, whatever the phase and also while paused (a
        failed node runs no driver, so its retry takes nothing down), as far as the step's cap
        (`maxParallel`) leaves room beside the swaps in flight and this pass's deletions; the others wait for
        room. A labelled node whose driver is Ready has nothing to retry: an Event says so."""
        view = self._view(self.observed.current_revision)
        deleting = {ref.node for ref in self.decision.delete}
        failed = [view.live[n] for n in sorted(self.observed.retry) if n in view.failed and n in view.live and n not in deleting]
        room = self._room(self._step_cap(view.total)) - len(deleting)
        for pod in failed[: max(room, 0)]:
            self._delete([pod])
            self._event(
                "Normal",
                Reason.NODE_RETRIED,
                f"node {pod.node}: its failed driver pod {pod.name} is deleted again (label {RETRY_LABEL}=true)",
            )
        for node in sorted((self.observed.retry & self.observed.nodes) - view.failed):
            if node in view.live and view.live[node].ready:  # mid-swap (a retry just done): no word
                self._event("Warning", Reason.NOTHING_TO_RETRY, f"node {node}: its driver is Ready, nothing to retry")

    def _delete(self, pods: list[Pod]) -> None:
        self.decision.delete.extend(PodRef(p.name, p.uid, p.node) for p in pods)

    def _driver_back(self) -> set[str]:
        """The nodes the runner cordoned that it may uncordon now (`driver_back`)."""
        return driver_back(self.observed, self.resume, {ref.node for ref in self.decision.delete})


class _IdleAndRollback(_Waves):
    """The handlers of the phases with no step in flight: Idling and Disabled (`_idle`, the
    all-at-once replacement without a staged rollout) and the rollbacks, Terminating and
    Disabling (`_roll_back`, back to `lastPodSpecRevision`). A rollout that starts goes on in
    `_Pass._progress`."""

    def _idle(self) -> Handler:
        current, stable = self.observed.current_revision, self.resume.stable_revision
        if not stable:  # the first pass ever: the pods' most common older revision, if any
            older = Counter(
                p.revision
                for p in self.observed.pods
                if p.node in self.observed.nodes and p.deleting is None and p.revision != current
            )
            stable = self.resume.stable_revision = older.most_common(1)[0][0] if older else current
        self.status.phase = IDLING if self.policy.enable_rollout else DISABLED
        if current == stable:
            self._record_stable_spec()
            return self._finish(
                f"all driver pods are at revision {current}"
                if self.status.phase == IDLING
                else "staged rollout is disabled; a new driver revision replaces every pod at once"
            )
        if self.policy.enable_rollout:
            return self._start(Reason.ROLLOUT_STARTED, f"driver revision {current} rolls out in {len(self.policy.steps)} steps")
        return self._replace_all(current)

    def _replace_all(self, current: str) -> Handler:
        """enableRollout false and nothing in flight: delete every old pod at once."""
        view = self._classify(current, ())
        if not view.others and not view.coming:
            self.resume.stable_revision = current
            self._event("Normal", Reason.REPLACED, f"every driver pod is at revision {current}")
            return self._idle
        if self.admin_pause:
            return self._finish(ADMIN_PAUSED)
        pods = [p for p in self._takeable(view.others) if not self._to_prepare(p.node)]  # no waves: no wait, no drain
        self._delete(pods)
        return self._finish(f"replacing {len(view.others)} driver pods with revision {current} at once")

    def _start(self, reason: Reason, message: str) -> Handler:
        """A rollout of the current revision begins, from the stable one."""
        self.step.last_pod_spec_revision = self.resume.stable_revision
        self.step.upgrading_pod_spec_revision = self.observed.current_revision
        self.status.phase = PROGRESSING
        if not self._take_over_wave(WaveKind.UPGRADE):
            self.resume.wave_kind = ""
        self.resume.retry_queue, self.resume.abandoned_revision, self.resume.timed_out_nodes = [], "", []
        self._clear_runner_pause()
        for kind in (ConditionType.SUCCEED, ConditionType.FAILED, ConditionType.TERMINATING):
            self._condition(kind, "False", reason, message)
        self._condition(ConditionType.PROGRESSING, "True", reason, message)
        self._event("Normal", reason, message)
        self._enter_step(self._resume_index())
        return self._progress

    def _take_over_wave(self, kind: WaveKind) -> bool:
        """A rollout or a rollback starts: the wave in flight is replaced by one of `kind` holding
        its nodes whose driver pod is gone and not re-created yet. The DaemonSet controller will
        give them a pod, which the new wave replaces if it is not of its revision: they are being
        swapped still, and forgotten they would hold no slot, so that the new wave could take
        `maxParallel` more nodes while they have no driver. Its start time is kept: the
        readiness timeout runs from their deletion. Whether there were any."""
        with_pods = {p.node for p in self.observed.pods}
        gone = [n for n in self.resume.wave if n in self.observed.nodes and n not in with_pods]
        self.resume.wave = gone
        if gone:
            self.resume.wave_kind, self.resume.wave_uids = kind, []
        return bool(gone)

    def _begin_rollback(self, phase: str, reason: Reason, message: str) -> Handler:
        self.status.phase = phase
        self._take_over_wave(WaveKind.ROLLBACK)
        self.resume.retry_queue, self.resume.timed_out_nodes = [], []
        self.resume.abandoned_revision = self.step.upgrading_pod_spec_revision
        self._clear_runner_pause()
        self._condition(ConditionType.TERMINATING, "True", reason, message)
        self._event("Warning", reason, message)
        self._say(message)
        return self._roll_back

    def _roll_back(self) -> Handler:
        current, last = self.observed.current_revision, self.step.last_pod_spec_revision
        if current not in (last, self.resume.abandoned_revision):
            if self.resume.restoring == last:
                return self._restore_again(current, last)
            self.resume.stable_revision = last
            if self.status.phase == TERMINATING and self.policy.enable_rollout:
                return self._start(Reason.NEW_REVISION, f"driver revision {current} rolls out, replacing the rollback")
            self.status.phase = DISABLED
            return self._idle
        if current != last:
            self.resume.restoring = last
            self.decision.restore = self._restore_plan(last)
            return self._finish(f"restoring the driver template to revision {last}")
        self.resume.restoring = None
        view = self._view(last)
        self.step.total_upgrade_replicas, self.step.total_upgrade_ready_replicas = view.total, len(view.ready_at_revision)
        if self._wave_busy(view):
            return DONE
        if not view.others and not view.coming:
            return self._rolled_back(last)
        if self.admin_pause:
            return self._finish(f"rollback {ADMIN_PAUSED}")
        pods = self._takeable(view.others)
        if not pods:
            return self._finish("rollback: every remaining node is held back")
        cap = self._step_cap(view.total)
        room = self._room(cap)
        if room <= 0:
            return self._wait_for_room("rollback")
        wave = pods[:room]
        self._start_wave(WaveKind.ROLLBACK, [p.node for p in wave], wave)
        return self._finish(f"rolling back {len(wave)} nodes to revision {last} ({len(view.others)} left)")

    def _restore_plan(self, last: str) -> Restore:
        return restore.plan(
            last,
            self.observed.revisions.get(last),
            self.observed.daemonset,
            self.observed.cr_spec,
            self.status.last_co_driver_spec,
        )

    def _restore_again(self, current: str, last: str) -> Handler:
        """The restore of `last` has not landed, and the template moved on to `current`, neither
        `last` nor the abandoned revision: the restore wrote spec.driver, then its template write
        failed (or the runner stopped between the two), and the reconcile mapped the restored
        spec onto the abandoned template. That is no new revision to roll out, nor one to
        replace every pod with: the restore is planned again. Without `last`'s ControllerRevision,
        `current` (the restored spec's template) is the nearest to it there is, and the rollback
        goes on to it, in waves. (A template still at the abandoned revision is no such case: the
        restore is planned again by the path of a first restore.)"""
        if self.observed.revisions.get(last) is None:
            self.step.last_pod_spec_revision, self.resume.restoring = current, None
            return self._roll_back
        self.decision.restore = self._restore_plan(last)
        return self._finish(f"restoring the driver template to revision {last} again: the last restore did not land")

    def _rolled_back(self, last: str) -> Handler:
        self.resume.stable_revision, self.resume.wave, self.resume.wave_kind = last, [], ""
        message = f"rolled back: every driver pod is at revision {last}"
        self._condition(ConditionType.TERMINATING, "False", Reason.ROLLED_BACK, message)
        self._condition(ConditionType.PROGRESSING, "False", Reason.ROLLED_BACK, message)
        self._event("Normal", Reason.ROLLED_BACK, message)
        self.status.phase = DISABLED if self.status.phase == DISABLING else IDLING
        self._say(message)
        return self._idle


class _Pass(_IdleAndRollback):
    """One pass of the engine: `run` dispatches on the phase to a handler, each handler does its
    part and returns the handler to run next, or `DONE` (`_settle` bounds the chain), then `run`
    fills in what every pass reports. The Progressing phase's handlers are here; the other
    phases' in `_IdleAndRollback`, the waves' rules in `_Waves`, the state in `_PassState`."""

    def run(self) -> Decision:
        if not self.observed.caught_up:
            self._say("waiting for the DaemonSet controller to observe the latest template")
        else:
            handlers = {PROGRESSING: self._progress, TERMINATING: self._roll_back, DISABLING: self._roll_back}
            self._settle(handlers.get(self.status.phase, self._idle))
        self.status.upgrading = self.status.phase in (PROGRESSING, TERMINATING, DISABLING)
        self.resume.spec = freeze.record(self.observed.cr_spec, self.decision.restore) if self.status.upgrading else None
        if self.observed.retry and self.observed.caught_up:
            self._retry()
        self.resume.skipped = NodeList.of(self.observed.skipped)
        self.resume.cordoned = NodeList.of(self.observed.cordoned)
        self.resume.need_reboot = NodeList.of(self.observed.need_reboot)
        self.decision.uncordon = sorted(self._driver_back())
        if _without_update_time(self.status) != _without_update_time(self.before):
            self.step.last_update_time = rfc3339(self.now)
        if self.decision.set_pause == self.policy.pause:
            self.decision.set_pause = None  # the spec holds it already
        if self.decision.set_pause is True and self.resume.paused_by_runner and not self.resume.pause_confirmed:
            # Once the runner's own pause has landed, the status says so: otherwise an admin's
            # `pause: false` a moment later would look like that pause not applied yet, and the
            # next pass would pause again.
            confirmed = dataclasses.replace(self.resume, pause_confirmed=True)
            self.decision.status_once_paused = dataclasses.replace(self.status, resume=confirmed)
        self.decision.wake_at = min(self.wakes) if self.wakes else None
        return self.decision

    def _settle(self, handler: Handler) -> None:
        """Run `handler` and the handlers it names until one returns `DONE`.

        A pass goes through a few phase changes and at most four states per step (init, upgrade,
        paused, ready), so a chain longer than that bound is a defect, not a long rollout.
        """
        bound = 10 + 4 * len(self.policy.steps)
        trail = []
        for _ in range(bound):
            trail.append(handler.__name__)
            next_handler = handler()
            if next_handler is DONE:
                return
            handler = next_handler
        raise Unsettled(
            f"the rollout's transitions did not settle within {bound} steps "
            f"(phase {self.status.phase}, step {self.step.current_step_index} {self.step.current_step_state or '-'}; "
            f"handlers {' -> '.join(trail[-6:])})"
        )

    def _progress(self) -> Handler:
        """Progressing: a change of course (rollout off, template reverted or replaced, steps
        edited), else the step's state: init, upgrade, paused, ready, then the next step."""
        current, step = self.observed.current_revision, self.step
        if not self.policy.enable_rollout:
            message = "enableRollout was set to false during the rollout: rolling back"
            return self._begin_rollback(DISABLING, Reason.ROLLOUT_DISABLED, message)
        if current == step.last_pod_spec_revision:
            message = f"the driver template was set back to revision {current}: rolling back"
            return self._begin_rollback(TERMINATING, Reason.TEMPLATE_REVERTED, message)
        if current != step.upgrading_pod_spec_revision:
            replaced = step.upgrading_pod_spec_revision
            self._event("Normal", Reason.NEW_REVISION, f"driver revision {current} replaces {replaced}: restarting at step 0")
            step.upgrading_pod_spec_revision = current
            self._take_over_wave(WaveKind.UPGRADE)
            self.resume.retry_queue, self.resume.timed_out_nodes = [], []
            self._clear_runner_pause()
            self._enter_step(self._resume_index())
            return self._progress
        if self.resume.steps_key != self.policy.steps_key:
            index = self._resume_index()
            self._event("Normal", Reason.STEPS_EDITED, f"upgradeSteps changed: continuing at step {index}")
            self._clear_runner_pause()
            self.resume.retry_queue = []
            self._enter_step(index)
            return self._progress
        view = self._view(current)
        index = min(step.current_step_index, len(self.policy.steps) - 1)
        target = self.policy.targets(view.total)[index]
        step.current_upgrade_replicas, step.current_upgrade_ready_replicas = target, len(view.ready_at_revision)
        step.total_upgrade_replicas, step.total_upgrade_ready_replicas = view.total, len(view.ready_at_revision)
        self.resume.failed = NodeList.of(view.failed)
        if problem := self.policy.last_step_problem(view.total):
            self._condition(ConditionType.FAILED, "True", Reason.INVALID_POLICY, problem)
            return self._finish(f'holding: {problem}; set the last step\'s replicas to "100%"')
        if any(c.reason == Reason.INVALID_POLICY and c.status == "True" for c in self.status.conditions):
            self._condition(ConditionType.FAILED, "False", Reason.POLICY_VALID, "the upgrade policy reaches every node again")
        state = step.current_step_state
        if state == STEP_INIT:
            self._step_state(STEP_UPGRADE)
            return self._progress
        if state == STEP_UPGRADE:
            return self._upgrade(view, index, target)
        if state == STEP_PAUSED:
            return self._paused()
        if index + 1 < len(self.policy.steps):  # StepReady
            self._enter_step(index + 1)
            return self._progress
        return self._complete()

    def _upgrade(self, view: _View, index: int, target: int) -> Handler:
        """StepUpgrade: wait for the wave in flight, retry failed pods, fail the step, call it
        ready, or start the next wave towards `target`."""
        cap = self.policy.caps(view.total)[index]
        allowed = self.policy.tolerations(view.total)[index]
        if self._wave_busy(view):
            return DONE
        queue = [n for n in self.resume.retry_queue if n in view.failed]
        if queue:
            if self.admin_pause:
                return self._finish(ADMIN_PAUSED)
            room = self._room(cap)
            if room <= 0:
                return self._wait_for_room(f"step {index}")
            wave = queue[:room]
            self.resume.retry_queue = queue[cap:]
            self._start_wave(WaveKind.RETRY, wave, [view.live[n] for n in wave if n in view.live])
            retry = self.step.current_failure_retry
            return self._finish(f"step {index}: retry {retry}: recreating {len(wave)} failed pods")
        self.resume.retry_queue = []
        if len(view.failed) > allowed:
            return self._failed_step(view, index, allowed, "toleration")
        # Failed nodes count as done: at the revision, stuck without a pod, or timed out before the swap.
        done = view.at_revision + sum(1 for n in view.failed if n not in view.live or view.live[n].revision != view.revision)
        if done >= target and not view.coming:
            unavailable = self.policy.max_unavailable.of(view.total)
            if index == len(self.policy.steps) - 1 and len(view.failed) > unavailable:
                return self._failed_step(view, index, unavailable, "maxUnavailable")
            return self._step_ready(index, done)
        if self.admin_pause:
            return self._finish(ADMIN_PAUSED)
        remaining = target - done - len(view.coming)
        if remaining <= 0:
            return self._finish(f"step {index}: waiting for {len(view.coming)} pods to be created")
        pods = self._takeable(view.others)
        if not pods:
            return self._finish(f"step {index}: every remaining node is held back")
        room = self._room(cap)
        if room <= 0:
            return self._wait_for_room(f"step {index}")
        wave = pods[: min(room, remaining)]
        self._start_wave(WaveKind.UPGRADE, [p.node for p in wave], wave)
        return self._finish(f"step {index}: upgrading {len(wave)} nodes ({done} of {target} done)")

    def _step_ready(self, index: int, done: int) -> Handler:
        """The step reached its target: pause for the admin, or for the step's `pauseDuration`."""
        self.resume.step_ready_time = rfc3339(self.now)
        pause_ms = self.policy.steps[index].pause_ms
        if pause_ms is None:
            self._runner_pause(PauseReason.STEP)
            message = f"step {index} is ready ({done} upgraded): waiting for pause: false"
        else:
            self.step.recheck_time = rfc3339(self.now + pause_ms / 1000)
            message = f"step {index} is ready ({done} upgraded): continuing after {pause_ms} ms"
        self._event("Normal", Reason.STEP_READY, message)
        self._step_state(STEP_PAUSED, message)
        return self._progress

    def _failed_step(self, view: _View, index: int, allowed: int, limit: str) -> Handler:
        """More failed pods than `limit` allows: retry them, or after the last retry the fallback
        (roll back, or the runner's pause until the admin has fixed the nodes)."""
        retry = self.step.current_failure_retry
        failed = len(view.failed)
        if retry < self.policy.max_failure_threshold:
            self.step.current_failure_retry = retry + 1
            self.resume.retry_queue = sorted(view.failed)
            self._event(
                "Warning",
                Reason.STEP_RETRY,
                f"step {index}: {failed} failed pods exceed {limit} {allowed}: "
                f"retry {retry + 1} of {self.policy.max_failure_threshold}",
            )
            return self._progress
        fallback = self.policy.fallback
        message = f"step {index}: {failed} failed pods exceed {limit} {allowed} after {retry} retries: fallback {fallback}"
        self._condition(ConditionType.FAILED, "True", Reason.STEP_FAILED, message)
        self._event("Warning", Reason.STEP_FAILED, message)
        if fallback == Fallback.ROLLBACK:
            return self._begin_rollback(TERMINATING, Reason.FALLBACK_ROLLBACK, message)
        self._condition(ConditionType.PROGRESSING, "True", Reason.FAILED, message)
        self._runner_pause(PauseReason.FAILURE)
        self.resume.retry_queue = sorted(view.failed)  # recreated once the admin resumes
        self._step_state(STEP_PAUSED, message + ": fix the failed nodes, then set pause: false")
        return self._progress

    def _paused(self) -> Handler:
        """StepPaused: the runner's pause until the admin releases it, or the admin's own pause,
        or the step's `pauseDuration` until its recheck time."""
        index = self.step.current_step_index
        if self.resume.paused_by_runner:
            if not self.resume.pause_confirmed:
                if not self.admin_pause:
                    self.decision.set_pause = True
                    return DONE
                self.resume.pause_confirmed = True
            if self.admin_pause:
                return DONE
            return self._resumed(index)
        recheck = parse_time(self.step.recheck_time)
        if self.admin_pause:
            return self._finish(f"step {index}: {ADMIN_PAUSED}")
        if recheck is not None and self.now < recheck:
            self.wakes.append(recheck)
            return DONE
        self._step_state(STEP_READY)
        return self._progress

    def _resumed(self, index: int) -> Handler:
        """The admin released the runner's pause: after a failure the step upgrades again with
        its retries reset, after a ready step the rollout goes on."""
        reason = self.resume.pause_reason
        self._clear_runner_pause()
        message = f"step {index}: resumed by the admin"
        self._event("Normal", Reason.RESUMED, message)
        if reason == PauseReason.FAILURE:
            self.step.current_failure_retry = 0
            self._condition(ConditionType.FAILED, "False", Reason.RESUMED, message)
            self._condition(ConditionType.PROGRESSING, "True", Reason.RESUMED, message)
            self._step_state(STEP_UPGRADE)
            return self._progress
        self._step_state(STEP_READY)
        return self._progress

    def _complete(self) -> Handler:
        revision = self.step.upgrading_pod_spec_revision
        message = f"every driver pod is at revision {revision}"
        self.resume.stable_revision = revision
        self._record_stable_spec()
        self.status.phase = IDLING
        self._condition(ConditionType.PROGRESSING, "False", Reason.COMPLETED, message)
        self._condition(ConditionType.SUCCEED, "True", Reason.COMPLETED, message)
        self._event("Normal", Reason.COMPLETED, message)
        self._step_state(COMPLETED, message)
        return DONE


def _without_update_time(status: UpgradeStatus) -> UpgradeStatus:
    return dataclasses.replace(status, step=dataclasses.replace(status.step, last_update_time=None))
