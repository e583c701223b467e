"""One pass of the rollout: its inputs, the status it is writing, the actions it collected, and the
bookkeeping verbs every part of the engine uses (`PassContext`). The parts hold the context; none
inherits from another: the waves' rules (`waves.Waves`), the phases without a step in flight and
the rollbacks (`rollback.Rollback`), the steps (`progress.Progress`), joined by `engine`.

A part's handler does its part of the pass and returns what runs next (`Next`): another handler,
or `Next.DONE` to end the pass.
"""

from __future__ import annotations

import copy
from enum import Enum

from metax_operator.chart.upgrade_policy import OnTimeout, Policy
from metax_operator.conditions import Condition, Event, EventType, rfc3339, transition_time
from metax_operator.rollout.budget import Budget, in_flight, out_of_service
from metax_operator.rollout.decision import Decision, PodRef, WorkCheck
from metax_operator.rollout.observation import Cluster, Pod, RevisionView
from metax_operator.rollout.status import PROGRESSING, STEP_INIT, ConditionType, NodeList, PauseReason, Reason, UpgradeStatus


class Next(Enum):
    """What a handler asks to run next."""

    IDLE = "idle"  # `Rollback.idle`: no rollout in flight
    PROGRESS = "progress"  # `Progress.progress`: the step in flight
    ROLL_BACK = "roll back"  # `Rollback.roll_back`: back to the stable revision
    DONE = "done"  # the pass is done


class PassContext:
    """One pass's state, read and changed by the parts' handlers:

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
        self.node_pods = observed.node_pods
        self.views: dict[tuple[str, tuple[str, ...]], RevisionView] = {}  # by revision and wave: see `classify`
        self.before = status or UpgradeStatus()
        self.status = copy.deepcopy(self.before)
        self.step, self.resume = self.status.step, self.status.resume
        self.resume.out_of_service = NodeList()  # listed again by the pass whose wave they hold (`Waves.wait_for_room`)
        work_check = WorkCheck(gpu=not policy.allow_gpu_workloads, wait_selector=policy.wait_selector)
        self.decision = Decision(status=self.status, cordon_first=policy.cordon, work_check=work_check)
        self.wakes: list[float] = []
        self.admin_pause = policy.pause
        if self.resume.release_pause:
            if policy.pause:
                self.decision.set_pause, self.admin_pause = False, False
            else:
                self.resume.release_pause = False

    @property
    def admin_paused(self) -> str:
        """What a pass held by the admin's pause says (the policy's place: the driver's, a pool's)."""
        return f"paused by the admin ({self.policy.field}.pause: true)"

    @property
    def timeout(self) -> float:
        """The readiness timeout, seconds."""
        return self.policy.readiness_timeout_ms / 1000

    def say(self, message: str) -> None:
        self.status.message = self.step.message = message

    def finish(self, message: str) -> Next:
        """Say `message` and end the pass."""
        self.say(message)
        return Next.DONE

    def condition(self, kind: ConditionType, status: str, reason: Reason, message: str) -> None:
        """Set the condition `kind`; its lastTransitionTime moves only when its status changes."""
        condition = next((c for c in self.status.conditions if c.type == kind), None)
        if condition is None:
            self.status.conditions.append(Condition(kind, status, reason, message, rfc3339(self.now)))
            return
        condition.last_transition_time = transition_time(
            condition.status, condition.last_transition_time, status, rfc3339(self.now)
        )
        condition.status, condition.reason, condition.message = status, reason, message

    def event(self, kind: EventType, reason: Reason, message: str) -> None:
        self.decision.events.append(Event(kind, reason, message))

    def step_state(self, state: str, message: str = "") -> None:
        self.step.current_step_state = state
        self.say(message or f"step {self.step.current_step_index}: {state}")

    def enter_step(self, index: int) -> None:
        self.step.current_step_index, self.step.current_failure_retry, self.step.recheck_time = index, 0, None
        self.resume.step_start_time, self.resume.step_ready_time, self.resume.promotion_due = rfc3339(self.now), None, None
        step = self.policy.steps[index]
        after = "wait for the admin" if step.pause_ms is None else f"pause {step.pause_ms} ms"
        self.event(EventType.NORMAL, Reason.STEP_STARTED, f"step {index}: replicas {step.replicas}, then {after}")
        self.step_state(STEP_INIT, f"step {index} started")

    def runner_pause(self, reason: PauseReason) -> None:
        self.resume.paused_by_runner, self.resume.pause_reason = True, reason
        self.resume.pause_confirmed, self.resume.release_pause = self.admin_pause, False
        if not self.admin_pause:
            self.decision.set_pause = True

    def clear_runner_pause(self) -> None:
        """Forget the runner's pause; if the spec still holds it (the rollout moved on without the
        admin's answer: a rollback, a new revision, edited steps), set it back to false."""
        if self.resume.paused_by_runner and self.admin_pause:
            self.resume.release_pause, self.decision.set_pause, self.admin_pause = True, False, False
        self.resume.paused_by_runner, self.resume.pause_reason, self.resume.pause_confirmed = False, "", False

    def record_stable_spec(self) -> None:
        """Record the template and `spec.driver` observed now as those of the stable revision
        (`lastAppliedSpec`, `lastCoDriverSpec`: what a rollback writes back to the CR).

        Called only when the current revision is the stable one and the observation is caught up,
        so both belong to it. The pass that completes a rollout records them too: the next version
        may arrive before any idle pass, and its rollout must not inherit the spec of the rollout
        before (a rollback would then restore an older driver version than its revision's).
        """
        self.status.last_applied_spec, self.status.last_co_driver_spec = self.observed.template, self.observed.driver_spec

    def record_failed(self, view: RevisionView) -> None:
        """List the failed nodes in status; a node newly listed whose driver pod says why it cannot
        start (`Pod.failure`: the payload contract) or whose validation failed gets a Warning Event
        with that line."""
        said = {*self.before.resume.failed.names, *self.resume.failed.names}  # by an earlier pass, or this one
        self.resume.failed = NodeList.of(view.failed)
        for node in self.resume.failed.names:
            pod = view.live.get(node)
            if node in said or pod is None:
                continue
            if pod.failure:
                self.event(EventType.WARNING, Reason.DRIVER_FAILED, f"node {node}: {pod.failure}")
            elif node in view.reasons:
                self.event(EventType.WARNING, Reason.VALIDATION_FAILED, f"node {node}: validation failed: {view.reasons[node]}")

    def delete(self, pods: list[Pod]) -> None:
        self.decision.delete.extend(PodRef(p.name, p.uid, p.node) for p in pods)

    def classify(self, revision: str, wave: tuple[str, ...]) -> RevisionView:
        """The nodes sorted relative to `revision` and `wave`: a view depends on nothing else that
        changes within a pass, so it is built once per pass for each and handed out as a copy
        (handlers change the copy they hold; the next handler starts from the observation)."""
        key = (revision, wave)
        if key not in self.views:
            self.views[key] = RevisionView(
                self.observed, self.node_pods, revision, set(wave), self.timeout, self.now, self.policy.validation
            )
        return self.views[key].copy()

    def view(self, revision: str) -> RevisionView:
        """The view of `revision` and the wave in flight, with the pods that time out woken for and
        (`onTimeout: fail`) the nodes whose wait or drain timed out counted failed."""
        view = self.classify(revision, tuple(self.resume.wave))
        if view.deadline is not None:
            self.wakes.append(view.deadline)  # a pending pod turns failed then
        if self.status.phase == PROGRESSING and self.policy.on_timeout == OnTimeout.FAIL:
            timed_out = {n for n in self.resume.timed_out_nodes if n in view.live and view.live[n].revision != revision}
            view.failed.update(timed_out)  # failed before the swap: not taken again unless retried
            view.others = [p for p in view.others if p.node not in timed_out]
        return view

    def resume_index(self) -> int:
        """The first step whose target is at least the pods already at the current revision.

        Also records the step list it was computed for (`resume.stepsKey`).
        """
        self.resume.steps_key = self.policy.steps_key
        view = self.view(self.observed.current_revision)
        targets = self.policy.targets(view.total)
        return next((i for i, t in enumerate(targets) if t >= view.at_revision), max(len(targets) - 1, 0))

    def budget(self, view: RevisionView, index: int | None = None) -> Budget:
        """What a wave of step `index` (the current step's by default) may take now: its cap less
        the nodes in flight, the wave's nodes with no pod yet (`view.coming`) and those still
        validating among them, and no more nodes still serving than the nodes out of service
        leave (`budget.out_of_service`)."""
        step = self.step.current_step_index if index is None else index
        swapping = in_flight(self.node_pods, view.coming | view.validating, self.now, self.timeout)
        out = out_of_service(self.observed, self.node_pods, swapping | view.failed)
        return Budget.for_step(self.policy, view.total, step, swapping, out, frozenset(view.failed))
