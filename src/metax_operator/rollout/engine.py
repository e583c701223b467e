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
to run next, or None when the pass is done (`_settle` bounds the chain).

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
from operator import attrgetter
from typing import NamedTuple, Optional

from metax_operator.chart.upgrade_policy import Policy
from metax_operator.rollout import restore
from metax_operator.rollout.restore import Restore
from metax_operator.rollout.status import (
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
    NodeList,
    UpgradeStatus,
    parse_time,
    rfc3339,
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
    deleting: float | None = None  # deletionTimestamp, when being deleted


@dataclass(frozen=True)
class Observed:
    """One pass's view of the cluster."""

    current_revision: str  # hash of the DaemonSet's newest ControllerRevision
    caught_up: bool  # DaemonSet status.observedGeneration == metadata.generation
    nodes: frozenset[str]  # nodes that should run the driver (the DaemonSet's node selector)
    pods: tuple[Pod, ...]  # the DaemonSet's pods
    gpu_busy_nodes: frozenset[str] = frozenset()  # nodes running pods that request metax-tech.com/*
    wait_busy_nodes: frozenset[str] = frozenset()  # nodes running pods that match waitForCompletion.podSelector
    skipped: frozenset[str] = frozenset()  # nodes labelled to keep their driver (not in `nodes`)
    cordoned: frozenset[str] = frozenset()  # nodes the runner cordoned (its label on the node)
    need_reboot: frozenset[str] = frozenset()  # nodes that reported NodeNeedReboot and have not rebooted since
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
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Decision:
    """Everything the runner does after one pass, in this order (`runtime.rollout_execute`)."""

    status: UpgradeStatus  # the new status.upgradeStatus: write it before acting
    set_pause: bool | None = None  # set spec.driver.upgradePolicy.pause to this (it holds the other value)
    status_once_paused: UpgradeStatus | None = None  # write this once `set_pause: true` landed (pauseConfirmed)
    restore: Restore | None = None  # roll the driver back (spec.driver, then the template)
    cordon: list[str] = field(default_factory=list)  # wave nodes whose work must end first: cordon now
    evict: list[str] = field(default_factory=list)  # nodes whose GPU pods to evict (drain), once cordoned
    delete: list[PodRef] = field(default_factory=list)
    cordon_first: bool = True  # cordon each pod's node before deleting its pod (upgradePolicy.cordon)
    uncordon: list[str] = field(default_factory=list)  # nodes the runner cordoned whose driver is back
    events: list[Event] = field(default_factory=list)
    wake_at: float | None = None  # run again by then even if nothing changes (pauses, timeouts)


class Unsettled(RuntimeError):
    """The pass's transitions did not settle within their bound: a defect of the engine."""


# A handler of the pass: does its part, then names the next handler, or None when the pass is done.
Handler = Callable[[], Optional["Handler"]]


def decide(observed: Observed, policy: Policy, status: UpgradeStatus | None, now: float) -> Decision:
    """The actions and new `status.upgradeStatus` for one pass."""
    return _Pass(observed, policy, status, now).run()


class _NodePods:
    """Each eligible node's live driver pod (the newest not being deleted) and since when a pod of
    it is being deleted: what every `_View` of one pass starts from, worked out once."""

    def __init__(self, observed: Observed):
        self.live: dict[str, Pod] = {}
        self.deleting: dict[str, float] = {}
        for pod in observed.pods:
            if pod.node not in observed.nodes:
                continue
            if pod.deleting is not None:
                self.deleting[pod.node] = min(pod.deleting, self.deleting.get(pod.node, pod.deleting))
            elif pod.node not in self.live or pod.created > self.live[pod.node].created:
                self.live[pod.node] = pod


class _View:
    """The eligible nodes sorted by what their driver pod is doing, relative to `revision`."""

    def __init__(self, observed: Observed, pods: _NodePods, revision: str, wave: set[str], timeout: float, now: float):
        self.revision = revision
        self.live = pods.live
        deleting = pods.deleting
        self.at_rev_ready: set[str] = set()
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
                self.at_rev_ready.add(node)
            elif pod.phase == "Failed" or pod.restart_count >= RESTART_LIMIT or now - pod.created >= timeout:
                self.failed.add(node)
            else:
                self.pending.add(node)
                end = pod.created + timeout
                self.deadline = end if self.deadline is None else min(self.deadline, end)
        self.at_rev = len(self.at_rev_ready) + len(self.pending) + sum(1 for n in self.failed if n in self.live)
        self.n = len(self.live) + len(self.coming) + sum(1 for n in self.failed if n not in self.live)

    def copy(self) -> _View:
        """A copy whose sets and lists a handler may change without changing this view."""
        view = copy.copy(self)
        view.at_rev_ready, view.failed, view.pending = set(self.at_rev_ready), set(self.failed), set(self.pending)
        view.coming, view.others = set(self.coming), list(self.others)
        return view


class _Pass:
    def __init__(self, observed: Observed, policy: Policy, status: UpgradeStatus | None, now: float):
        self.obs, self.pol, self.now = observed, policy, now
        self.node_pods = _NodePods(observed)
        self.views: dict[tuple[str, tuple[str, ...]], _View] = {}  # by revision and wave: see `_view`
        self.before = status or UpgradeStatus()
        self.st = copy.deepcopy(self.before)
        self.sub, self.rs = self.st.step, self.st.resume
        self.out = Decision(status=self.st, cordon_first=policy.cordon)
        self.wakes: list[float] = []
        self.pause = policy.pause  # the admin's pause: the spec's, unless it is the runner's being released
        if self.rs.release_pause:
            if policy.pause:
                self.out.set_pause, self.pause = False, False
            else:
                self.rs.release_pause = False

    # -- driver ---------------------------------------------------------------------------
    def run(self) -> Decision:
        if not self.obs.caught_up:
            self._say("waiting for the DaemonSet controller to observe the latest template")
        else:
            self._settle(
                {PROGRESSING: self._progress, TERMINATING: self._roll_back, DISABLING: self._roll_back}.get(
                    self.st.phase, self._idle
                )
            )
        self.st.upgrading = self.st.phase in (PROGRESSING, TERMINATING, DISABLING)
        self.rs.skipped = NodeList.of(self.obs.skipped)
        self.rs.cordoned = NodeList.of(self.obs.cordoned)
        self.rs.need_reboot = NodeList.of(self.obs.need_reboot)
        self.out.uncordon = sorted(self._driver_back())
        if _without_update_time(self.st) != _without_update_time(self.before):
            self.sub.last_update_time = rfc3339(self.now)
        if self.out.set_pause == self.pol.pause:
            self.out.set_pause = None  # the spec holds it already
        if self.out.set_pause is True and self.rs.paused_by_runner and not self.rs.pause_confirmed:
            # Once the runner's own pause has landed, the status says so: otherwise an admin's
            # `pause: false` a moment later would look like that pause not applied yet, and the
            # next pass would pause again.
            self.out.status_once_paused = dataclasses.replace(self.st, resume=dataclasses.replace(self.rs, pause_confirmed=True))
        self.out.wake_at = min(self.wakes) if self.wakes else None
        return self.out

    def _settle(self, handler: Handler) -> None:
        """Run `handler` and the handlers it names until one ends the pass.

        A pass goes through a few phase changes and at most four states per step (init, upgrade,
        paused, ready), so a chain longer than that bound is a defect, not a long rollout.
        """
        bound = 10 + 4 * len(self.pol.steps)
        trail = []
        for _ in range(bound):
            trail.append(handler.__name__)
            next_handler = handler()
            if next_handler is None:
                return
            handler = next_handler
        raise Unsettled(
            f"the rollout's transitions did not settle within {bound} steps "
            f"(phase {self.st.phase}, step {self.sub.current_step_index} {self.sub.current_step_state or '-'}; "
            f"handlers {' -> '.join(trail[-6:])})"
        )

    # -- Idling / Disabled: nothing in flight ---------------------------------------------
    def _idle(self) -> Handler | None:
        cur, stable = self.obs.current_revision, self.rs.stable_revision
        if not stable:  # the first pass ever: the pods' most common older revision, if any
            older = Counter(
                p.revision for p in self.obs.pods if p.node in self.obs.nodes and p.deleting is None and p.revision != cur
            )
            stable = self.rs.stable_revision = older.most_common(1)[0][0] if older else cur
        self.st.phase = IDLING if self.pol.enable_rollout else DISABLED
        if cur == stable:
            self._record_stable_spec()
            return self._stop(
                f"all driver pods are at revision {cur}"
                if self.st.phase == IDLING
                else "staged rollout is disabled; a new driver revision replaces every pod at once"
            )
        if self.pol.enable_rollout:
            return self._start(reason="RolloutStarted", message=f"driver revision {cur} rolls out in {len(self.pol.steps)} steps")
        return self._replace_all(cur)

    def _replace_all(self, cur: str) -> Handler | None:
        """enableRollout false and nothing in flight: delete every old pod at once."""
        view = self._classify(cur, ())
        if not view.others and not view.coming:
            self.rs.stable_revision = cur
            self._event("Normal", "Replaced", f"every driver pod is at revision {cur}")
            return self._idle
        if self.pause:
            return self._stop("paused by the admin (spec.driver.upgradePolicy.pause: true)")
        pods = [p for p in self._takeable(view.others) if not self._to_prepare(p.node)]  # no waves: no wait, no drain
        self._delete(pods)
        return self._stop(f"replacing {len(view.others)} driver pods with revision {cur} at once")

    def _start(self, reason: str, message: str) -> Handler:
        self.sub.last_pod_spec_revision = self.rs.stable_revision
        self.sub.upgrading_pod_spec_revision = self.obs.current_revision
        self.st.phase = PROGRESSING
        self.rs.wave, self.rs.wave_kind, self.rs.retry_queue = [], "", []
        self.rs.abandoned_revision, self.rs.timed_out_nodes = "", []
        self._clear_runner_pause()
        for kind in ("Succeed", "Failed", "Terminating"):
            self._condition(kind, "False", reason, message)
        self._condition("Progressing", "True", reason, message)
        self._event("Normal", reason, message)
        self._enter_step(self._resume_index())
        return self._progress

    # -- Progressing -------------------------------------------------------------------------
    def _progress(self) -> Handler | None:
        cur, sub = self.obs.current_revision, self.sub
        if not self.pol.enable_rollout:
            return self._begin_rollback(
                DISABLING, "RolloutDisabled", "enableRollout was set to false during the rollout: rolling back"
            )
        if cur == sub.last_pod_spec_revision:
            return self._begin_rollback(
                TERMINATING, "TemplateReverted", f"the driver template was set back to revision {cur}: rolling back"
            )
        if cur != sub.upgrading_pod_spec_revision:
            self._event(
                "Normal", "NewRevision", f"driver revision {cur} replaces {sub.upgrading_pod_spec_revision}: restarting at step 0"
            )
            sub.upgrading_pod_spec_revision = cur
            self.rs.wave, self.rs.retry_queue, self.rs.timed_out_nodes = [], [], []
            self._clear_runner_pause()
            self._enter_step(self._resume_index())
            return self._progress
        if self.rs.steps_key != self.pol.steps_key:
            index = self._resume_index()
            self._event("Normal", "StepsEdited", f"upgradeSteps changed: continuing at step {index}")
            self._clear_runner_pause()
            self.rs.retry_queue = []
            self._enter_step(index)
            return self._progress
        view = self._view(cur)
        index = min(sub.current_step_index, len(self.pol.steps) - 1)
        target = self.pol.targets(view.n)[index]
        sub.current_upgrade_replicas, sub.current_upgrade_ready_replicas = target, len(view.at_rev_ready)
        sub.total_upgrade_replicas, sub.total_upgrade_ready_replicas = view.n, len(view.at_rev_ready)
        self.rs.failed = NodeList.of(view.failed)
        if problem := self.pol.last_step_problem(view.n):
            self._condition("Failed", "True", "InvalidPolicy", problem)
            return self._stop(f'holding: {problem}; set the last step\'s replicas to "100%"')
        if any(c.reason == "InvalidPolicy" and c.status == "True" for c in self.st.conditions):
            self._condition("Failed", "False", "PolicyValid", "the upgrade policy reaches every node again")
        state = sub.current_step_state
        if state == STEP_INIT:
            self._step_state(STEP_UPGRADE)
            return self._progress
        if state == STEP_UPGRADE:
            return self._upgrade(view, index, target)
        if state == STEP_PAUSED:
            return self._paused()
        if index + 1 < len(self.pol.steps):  # StepReady
            self._enter_step(index + 1)
            return self._progress
        return self._complete()

    def _upgrade(self, view: _View, index: int, target: int) -> Handler | None:
        cap = self.pol.caps(view.n)[index]
        allowed = self.pol.tolerations(view.n)[index]
        if self._wave_busy(view):
            return None
        queue = [n for n in self.rs.retry_queue if n in view.failed]
        if queue:
            if self.pause:
                return self._stop("paused by the admin (spec.driver.upgradePolicy.pause: true)")
            wave = queue[:cap]
            self.rs.retry_queue = queue[cap:]
            self._start_wave("retry", wave, [view.live[n] for n in wave if n in view.live])
            return self._stop(f"step {index}: retry {self.sub.current_failure_retry}: recreating {len(wave)} failed pods")
        self.rs.retry_queue = []
        if len(view.failed) > allowed:
            return self._failed_step(view, index, allowed, "toleration")
        # Failed nodes count as done: at the revision, stuck without a pod, or timed out before the swap.
        done = view.at_rev + sum(1 for n in view.failed if n not in view.live or view.live[n].revision != view.revision)
        if done >= target and not view.coming:
            unavailable = self.pol.max_unavailable.of(view.n)
            if index == len(self.pol.steps) - 1 and len(view.failed) > unavailable:
                return self._failed_step(view, index, unavailable, "maxUnavailable")
            self.rs.step_ready_time = rfc3339(self.now)
            pause_ms = self.pol.steps[index].pause_ms
            if pause_ms is None:
                self._runner_pause("step")
                message = f"step {index} is ready ({done} upgraded): waiting for pause: false"
            else:
                self.sub.recheck_time = rfc3339(self.now + pause_ms / 1000)
                message = f"step {index} is ready ({done} upgraded): continuing after {pause_ms} ms"
            self._event("Normal", "StepReady", message)
            self._step_state(STEP_PAUSED, message)
            return self._progress
        if self.pause:
            return self._stop("paused by the admin (spec.driver.upgradePolicy.pause: true)")
        remaining = target - done - len(view.coming)
        if remaining <= 0:
            return self._stop(f"step {index}: waiting for {len(view.coming)} pods to be created")
        pods = self._takeable(view.others)
        if not pods:
            return self._stop(f"step {index}: every remaining node is held back")
        wave = pods[: min(cap, remaining)]
        self._start_wave("upgrade", [p.node for p in wave], wave)
        return self._stop(f"step {index}: upgrading {len(wave)} nodes ({done} of {target} done)")

    def _failed_step(self, view: _View, index: int, allowed: int, limit: str) -> Handler | None:
        retry = self.sub.current_failure_retry
        failed = len(view.failed)
        if retry < self.pol.max_failure_threshold:
            self.sub.current_failure_retry = retry + 1
            self.rs.retry_queue = sorted(view.failed)
            self._event(
                "Warning",
                "StepRetry",
                f"step {index}: {failed} failed pods exceed {limit} {allowed}: "
                f"retry {retry + 1} of {self.pol.max_failure_threshold}",
            )
            return self._progress
        message = (
            f"step {index}: {failed} failed pods exceed {limit} {allowed} after {retry} retries: fallback {self.pol.fallback}"
        )
        self._condition("Failed", "True", "StepFailed", message)
        self._event("Warning", "StepFailed", message)
        if self.pol.fallback == "rollback":
            return self._begin_rollback(TERMINATING, "FallbackRollback", message)
        self._condition("Progressing", "True", "Failed", message)
        self._runner_pause("failure")
        self._step_state(STEP_PAUSED, message + ": fix the failed nodes, then set pause: false")
        return self._progress

    def _paused(self) -> Handler | None:
        index = self.sub.current_step_index
        if self.rs.paused_by_runner:
            if not self.rs.pause_confirmed:
                if not self.pause:
                    self.out.set_pause = True
                    return None
                self.rs.pause_confirmed = True
            if self.pause:
                return None
            reason = self.rs.pause_reason
            self._clear_runner_pause()
            self._event("Normal", "Resumed", f"step {index}: resumed by the admin")
            if reason == "failure":
                self.sub.current_failure_retry = 0
                self._condition("Failed", "False", "Resumed", f"step {index}: resumed by the admin")
                self._condition("Progressing", "True", "Resumed", f"step {index}: resumed by the admin")
                self._step_state(STEP_UPGRADE)
                return self._progress
            self._step_state(STEP_READY)
            return self._progress
        recheck = parse_time(self.sub.recheck_time)
        if self.pause:
            return self._stop(f"step {index}: paused by the admin (spec.driver.upgradePolicy.pause: true)")
        if recheck is not None and self.now < recheck:
            self.wakes.append(recheck)
            return None
        self._step_state(STEP_READY)
        return self._progress

    def _complete(self) -> Handler | None:
        revision = self.sub.upgrading_pod_spec_revision
        message = f"every driver pod is at revision {revision}"
        self.rs.stable_revision = revision
        self._record_stable_spec()
        self.st.phase = IDLING
        self._condition("Progressing", "False", "Completed", message)
        self._condition("Succeed", "True", "Completed", message)
        self._event("Normal", "Completed", message)
        self._step_state(COMPLETED, message)
        return None

    # -- Terminating / Disabling: back to lastPodSpecRevision --------------------------------
    def _begin_rollback(self, phase: str, reason: str, message: str) -> Handler:
        self.st.phase = phase
        self.rs.wave, self.rs.retry_queue, self.rs.timed_out_nodes = [], [], []
        self.rs.abandoned_revision = self.sub.upgrading_pod_spec_revision
        self._clear_runner_pause()
        self._condition("Terminating", "True", reason, message)
        self._event("Warning", reason, message)
        self._say(message)
        return self._roll_back

    def _roll_back(self) -> Handler | None:
        cur, last = self.obs.current_revision, self.sub.last_pod_spec_revision
        if cur not in (last, self.rs.abandoned_revision):
            self.rs.stable_revision = last
            if self.st.phase == TERMINATING and self.pol.enable_rollout:
                return self._start("NewRevision", f"driver revision {cur} rolls out, replacing the rollback")
            self.st.phase = DISABLED
            return self._idle
        if cur != last:
            self.out.restore = restore.plan(
                last, self.obs.revisions.get(last), self.obs.daemonset, self.obs.cr_spec, self.st.last_co_driver_spec
            )
            return self._stop(f"restoring the driver template to revision {last}")
        view = self._view(last)
        self.sub.total_upgrade_replicas, self.sub.total_upgrade_ready_replicas = view.n, len(view.at_rev_ready)
        if self._wave_busy(view):
            return None
        if not view.others and not view.coming:
            self.rs.stable_revision, self.rs.wave, self.rs.wave_kind = last, [], ""
            message = f"rolled back: every driver pod is at revision {last}"
            self._condition("Terminating", "False", "RolledBack", message)
            self._condition("Progressing", "False", "RolledBack", message)
            self._event("Normal", "RolledBack", message)
            self.st.phase = DISABLED if self.st.phase == DISABLING else IDLING
            self._say(message)
            return self._idle
        if self.pause:
            return self._stop("rollback paused by the admin (spec.driver.upgradePolicy.pause: true)")
        pods = self._takeable(view.others)
        if not pods:
            return self._stop("rollback: every remaining node is held back")
        index = min(self.sub.current_step_index, len(self.pol.steps) - 1)
        cap = self.pol.caps(view.n)[index] if self.pol.steps else view.n
        wave = pods[:cap]
        self._start_wave("rollback", [p.node for p in wave], wave)
        return self._stop(f"rolling back {len(wave)} nodes to revision {last} ({len(view.others)} left)")

    # -- waves --------------------------------------------------------------------------------
    def _classify(self, revision: str, wave: tuple[str, ...]) -> _View:
        """The nodes sorted relative to `revision` and `wave`: a view depends on nothing else that
        changes within a pass, so it is built once per pass for each and handed out as a copy
        (handlers change the copy they hold; the next handler starts from the observation)."""
        key = (revision, wave)
        if key not in self.views:
            self.views[key] = _View(self.obs, self.node_pods, revision, set(wave), self._timeout(), self.now)
        return self.views[key].copy()

    def _view(self, revision: str) -> _View:
        view = self._classify(revision, tuple(self.rs.wave))
        if view.deadline is not None:
            self.wakes.append(view.deadline)  # a pending pod turns failed then
        if self.st.phase == PROGRESSING and self.pol.on_timeout == "fail":
            timed_out = {n for n in self.rs.timed_out_nodes if n in view.live and view.live[n].revision != revision}
            view.failed.update(timed_out)  # failed before the swap: not taken again unless retried
            view.others = [p for p in view.others if p.node not in timed_out]
        return view

    def _wave_busy(self, view: _View) -> bool:
        """True while the current wave is still coming back; repeats deletions a crash lost.

        A wave node is back when its pod is at the wave's revision and Ready or failed (failed
        nodes hold no slot), or when it is stuck. A pod the wave meant to delete (another
        revision, or a uid in `waveUids` for a retry) that is still there is deleted again, after
        the same checks as a first deletion: GPU work holds it back, work to wait for or drain
        must end first (`_prepare`).
        """
        start = parse_time(self.rs.wave_start_time)
        wave = [n for n in self.rs.wave if n in self.obs.nodes]
        if not wave or start is None:
            return False
        doomed = set(self.rs.wave_uids)
        busy, lost = [], []
        for node in wave:
            pod = view.live.get(node)
            if node in view.at_rev_ready:
                continue
            if pod is not None and (pod.revision != view.revision or pod.uid in doomed):
                lost.append(pod)
            elif node in view.failed and (pod is not None or self.rs.wave_kind != "retry"):
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
        ready = self._prepare([p for p in lost if p not in held], view, start, busy)
        if not busy:
            return False
        if ready and not self.pause:
            self._delete(ready)
        self.wakes.append(deadline)
        preparing = len(lost) - len(held) - len(ready)
        notes = [f"{len(held)} held back by GPU workloads"] * bool(held) + [
            f"{preparing} cordoned, waiting for their work to end"
        ] * bool(preparing)
        self._say(
            f"waiting for {len(busy)} of {len(wave)} pods of the {self.rs.wave_kind} wave to be Ready"
            + (f" ({'; '.join(notes)})" if notes else "")
        )
        return True

    def _start_wave(self, kind: str, nodes: list[str], pods: list[Pod]) -> None:
        """Start a wave: delete the pods of its free nodes now; the others are cordoned and
        deleted by `_wave_busy` once their work has ended (`_prepare`)."""
        rs = self.rs
        rs.wave, rs.wave_kind, rs.wave_start_time, rs.drain_start = sorted(nodes), kind, rfc3339(self.now), {}
        rs.wave_uids = sorted(p.uid for p in pods) if kind == "retry" else []
        rs.timed_out_nodes = [n for n in rs.timed_out_nodes if n not in nodes]
        prepare = self._nodes_to_prepare()
        self._delete([p for p in pods if p.node not in prepare])
        self.out.cordon.extend(p.node for p in pods if p.node in prepare)
        self.wakes.append(self.now + self._timeout())

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
            if pod.node in self.rs.timed_out_nodes:  # failed before the swap (a held node left the wave)
                view.failed.add(pod.node)
                busy.remove(pod.node)
                continue
            if stage == "wait":
                deadline = start + self.pol.wait_timeout_ms / 1000 if self.pol.wait_timeout_ms else None
            else:
                began = self.rs.drain_start.setdefault(pod.node, rfc3339(self.now))
                deadline = parse_time(began) + self.pol.drain_timeout_ms / 1000
            if deadline is not None and self.now >= deadline:
                self._timed_out(pod.node, stage, view)
                busy.remove(pod.node)
                continue
            if deadline is not None:
                self.wakes.append(deadline)
            if pod.node not in self.obs.cordoned:
                self.out.cordon.append(pod.node)  # again, should the cordon have been lost
            if stage == "drain" and not self.pause:
                self.out.evict.append(pod.node)
        return free

    def _timed_out(self, node: str, stage: str, view: _View) -> None:
        """`node`'s wait or drain ran out: hold it back (out of the wave, uncordoned, its driver
        kept) or count it failed (`onTimeout`)."""
        self.rs.drain_start.pop(node, None)
        if node not in self.rs.timed_out_nodes:
            self.rs.timed_out_nodes = sorted([*self.rs.timed_out_nodes, node])
            what = "waiting for its pods matching waitForCompletion.podSelector" if stage == "wait" else "draining its GPU pods"
            then = "held back" if self.pol.on_timeout == "hold" else "counted failed"
            self._event(
                "Warning",
                "WaitTimeout" if stage == "wait" else "DrainTimeout",
                f"node {node}: {what} timed out; {then} (onTimeout: {self.pol.on_timeout})",
            )
        if self.pol.on_timeout == "hold":
            self.rs.wave = [n for n in self.rs.wave if n != node]
        else:
            view.failed.add(node)

    def _takeable(self, pods: list[Pod]) -> list[Pod]:
        """Pods that may be deleted now (or once their node's work ends): nodes without work to
        wait for first, then not-ready first, then by node; lists the held-back nodes."""
        prepare = self._nodes_to_prepare()
        held_nodes = {n for n in self.obs.gpu_busy_nodes if self._held(n)} | (set(self.rs.timed_out_nodes) & prepare)
        held = [p.node for p in pods if p.node in held_nodes] if held_nodes else []
        self.rs.held = NodeList.of(held)
        if held and len(held) != self.before.resume.held.count:
            self._event(
                "Warning",
                "NodesHeldBack",
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
        return {n for n in self.obs.wait_busy_nodes | self.obs.gpu_busy_nodes if self._to_prepare(n)}

    def _held(self, node: str) -> bool:
        """Whether `node` is not taken at all: it runs GPU work that is neither allowed nor drained."""
        return node in self.obs.gpu_busy_nodes and not self.pol.allow_gpu_workloads and not self.pol.drain

    def _to_prepare(self, node: str) -> str:
        """What must end on `node` before its driver pod is deleted: "wait" (pods matching
        waitForCompletion.podSelector), "drain" (GPU pods, evicted) or "" (nothing)."""
        if self.pol.wait_selector and node in self.obs.wait_busy_nodes:
            return "wait"
        if self.pol.drain and not self.pol.allow_gpu_workloads and node in self.obs.gpu_busy_nodes:
            return "drain"
        return ""

    def _delete(self, pods: list[Pod]) -> None:
        self.out.delete.extend(PodRef(p.name, p.uid, p.node) for p in pods)

    def _driver_back(self) -> set[str]:
        """The nodes the runner cordoned that it may uncordon now.

        A node stays cordoned while its driver is being swapped: a pod of it is to be deleted in
        this pass, or is being deleted, or its live pod is not Ready (coming up, or failed: a
        node whose new driver fails stays cordoned until an admin looks at it), or it is in the
        wave with a pod the wave has yet to replace (another revision, or a uid a retry
        deletes), its work still to end (wait, drain). A node with no driver pod at all that no
        wave waits for has nothing coming.
        """
        if not self.obs.cordoned:
            return set()
        deleting = {ref.node for ref in self.out.delete}
        live: dict[str, Pod] = {}
        for pod in self.obs.pods:
            if pod.deleting is not None:
                deleting.add(pod.node)
            elif pod.node not in live or pod.created > live[pod.node].created:
                live[pod.node] = pod
        # A node whose wait or drain timed out keeps its driver: its swap is given up.
        wave = set(self.rs.wave) - set(self.rs.timed_out_nodes)
        doomed = set(self.rs.wave_uids)
        back = set()
        for node in self.obs.cordoned - deleting:
            pod = live.get(node)
            if pod is None:
                if node not in wave:
                    back.add(node)
            elif pod.ready and (node not in wave or (pod.revision == self.obs.current_revision and pod.uid not in doomed)):
                back.add(node)
        return back

    # -- small helpers --------------------------------------------------------------------------
    def _resume_index(self) -> int:
        """The first step whose target is at least the pods already at the current revision.

        Also records the step list it was computed for (`resume.stepsKey`).
        """
        self.rs.steps_key = self.pol.steps_key
        view = self._view(self.obs.current_revision)
        targets = self.pol.targets(view.n)
        return next((i for i, t in enumerate(targets) if t >= view.at_rev), max(len(targets) - 1, 0))

    def _enter_step(self, index: int) -> None:
        self.sub.current_step_index, self.sub.current_failure_retry, self.sub.recheck_time = index, 0, None
        self.rs.step_start_time, self.rs.step_ready_time = rfc3339(self.now), None
        step = self.pol.steps[index]
        after = "wait for the admin" if step.pause_ms is None else f"pause {step.pause_ms} ms"
        self._event("Normal", STEP_INIT, f"step {index}: replicas {step.replicas}, then {after}")
        self._step_state(STEP_INIT, f"step {index} started")

    def _step_state(self, state: str, message: str = "") -> None:
        self.sub.current_step_state = state
        self._say(message or f"step {self.sub.current_step_index}: {state}")

    def _runner_pause(self, reason: str) -> None:
        self.rs.paused_by_runner, self.rs.pause_reason = True, reason
        self.rs.pause_confirmed, self.rs.release_pause = self.pause, False
        if not self.pause:
            self.out.set_pause = True

    def _clear_runner_pause(self) -> None:
        """Forget the runner's pause; if the spec still holds it (the rollout moved on without the
        admin's answer: a rollback, a new revision, edited steps), set it back to false."""
        if self.rs.paused_by_runner and self.pause:
            self.rs.release_pause, self.out.set_pause, self.pause = True, False, False
        self.rs.paused_by_runner, self.rs.pause_reason, self.rs.pause_confirmed = False, "", False

    def _record_stable_spec(self) -> None:
        """Record the template and `spec.driver` observed now as those of the stable revision
        (`lastAppliedSpec`, `lastCoDriverSpec`: what a rollback writes back to the CR).

        Called only when the current revision is the stable one and the observation is caught up,
        so both belong to it. The pass that completes a rollout records them too: the next version
        may arrive before any idle pass, and its rollout must not inherit the spec of the rollout
        before (a rollback would then restore an older driver version than its revision's).
        """
        self.st.last_applied_spec, self.st.last_co_driver_spec = self.obs.template, self.obs.driver_spec

    def _timeout(self) -> float:
        return self.pol.readiness_timeout_ms / 1000

    def _say(self, message: str) -> None:
        self.st.message = self.sub.message = message

    def _stop(self, message: str) -> None:
        """Say `message` and end the pass (a handler's `return self._stop(...)`)."""
        self._say(message)

    def _condition(self, kind: str, status: str, reason: str, message: str) -> None:
        cond = next((c for c in self.st.conditions if c.type == kind), None)
        if cond is None:
            self.st.conditions.append(Condition(kind, status, reason, message, rfc3339(self.now)))
            return
        if cond.status != status:
            cond.last_transition_time = rfc3339(self.now)
        cond.status, cond.reason, cond.message = status, reason, message

    def _event(self, type_: str, reason: str, message: str) -> None:
        self.out.events.append(Event(type_, reason, message))


def _without_update_time(status: UpgradeStatus) -> UpgradeStatus:
    return dataclasses.replace(status, step=dataclasses.replace(status.step, last_update_time=None))
