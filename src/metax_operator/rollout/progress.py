"""The Progressing phase: a change of course (the rollout turned off, the template reverted or
replaced, the steps edited), else the step in flight through its states: StepUpgradeInit,
StepUpgrade (waves towards the step's target, retries, the step's failure and `fallback`),
StepPaused (the admin's confirmation, or `pauseDuration`, and the health gate), StepReady, then
the next step or Completed.
"""

from __future__ import annotations

from metax_operator.chart.upgrade_policy import Fallback
from metax_operator.conditions import FALSE, TRUE, EventType, parse_time, rfc3339
from metax_operator.rollout import health_gate
from metax_operator.rollout.context import Next, PassContext
from metax_operator.rollout.observation import RevisionView
from metax_operator.rollout.rollback import Rollback
from metax_operator.rollout.status import (
    COMPLETED,
    DISABLING,
    IDLING,
    STEP_INIT,
    STEP_PAUSED,
    STEP_READY,
    STEP_UPGRADE,
    TERMINATING,
    ConditionType,
    PauseReason,
    Reason,
    WaveKind,
)
from metax_operator.rollout.waves import Waves


class Progress:
    """The Progressing phase's handlers of one pass."""

    def __init__(self, ctx: PassContext, waves: Waves, rollback: Rollback):
        self.ctx, self.waves, self.rollback = ctx, waves, rollback

    def progress(self) -> Next:
        """A change of course, else the step's state: init, upgrade, paused, ready, then the next
        step."""
        ctx, step, resume, policy = self.ctx, self.ctx.step, self.ctx.resume, self.ctx.policy
        current = ctx.observed.current_revision
        if not policy.enable_rollout:
            message = "enableRollout was set to false during the rollout: rolling back"
            return self.rollback.begin(DISABLING, Reason.ROLLOUT_DISABLED, message)
        if current == step.last_pod_spec_revision:
            message = f"the driver template was set back to revision {current}: rolling back"
            return self.rollback.begin(TERMINATING, Reason.TEMPLATE_REVERTED, message)
        if current != step.upgrading_pod_spec_revision:
            replaced = step.upgrading_pod_spec_revision
            ctx.event(
                EventType.NORMAL, Reason.NEW_REVISION, f"driver revision {current} replaces {replaced}: restarting at step 0"
            )
            step.upgrading_pod_spec_revision = current
            self.rollback.take_over_wave(WaveKind.UPGRADE)
            resume.retry_queue, resume.timed_out_nodes = [], []
            ctx.clear_runner_pause()
            ctx.enter_step(ctx.resume_index())
            return Next.PROGRESS
        if resume.steps_key != policy.steps_key:
            index = ctx.resume_index()
            ctx.event(EventType.NORMAL, Reason.STEPS_EDITED, f"upgradeSteps changed: continuing at step {index}")
            ctx.clear_runner_pause()
            resume.retry_queue = []
            ctx.enter_step(index)
            return Next.PROGRESS
        view = ctx.view(current)
        index = min(step.current_step_index, len(policy.steps) - 1)
        target = policy.targets(view.total)[index]
        step.current_upgrade_replicas, step.current_upgrade_ready_replicas = target, len(view.ready_at_revision)
        step.total_upgrade_replicas, step.total_upgrade_ready_replicas = view.total, len(view.ready_at_revision)
        ctx.record_failed(view)
        if problem := policy.last_step_problem(view.total):
            ctx.condition(ConditionType.FAILED, TRUE, Reason.INVALID_POLICY, problem)
            return ctx.finish(f'holding: {problem}; set the last step\'s replicas to "100%"')
        if any(c.reason == Reason.INVALID_POLICY and c.status == TRUE for c in ctx.status.conditions):
            ctx.condition(ConditionType.FAILED, FALSE, Reason.POLICY_VALID, "the upgrade policy reaches every node again")
        state = step.current_step_state
        if state == STEP_INIT:
            ctx.step_state(STEP_UPGRADE)
            return Next.PROGRESS
        if state == STEP_UPGRADE:
            return self.upgrade(view, index, target)
        if state == STEP_PAUSED:
            return self.paused(view)
        if index + 1 < len(policy.steps):  # StepReady
            ctx.enter_step(index + 1)
            return Next.PROGRESS
        return self.complete()

    def upgrade(self, view: RevisionView, index: int, target: int) -> Next:
        """StepUpgrade: wait for the wave in flight, retry failed pods, fail the step, call it
        ready, or start the next wave towards `target`."""
        ctx, waves, policy, resume = self.ctx, self.waves, self.ctx.policy, self.ctx.resume
        allowed = policy.tolerations(view.total)[index]
        busy = waves.busy(view)
        ctx.record_failed(view)  # with the nodes the wave found stuck
        if busy:
            return Next.DONE
        queue = [n for n in resume.retry_queue if n in view.failed]
        if queue:
            if ctx.admin_pause:
                return ctx.finish(ctx.admin_paused)
            budget = ctx.budget(view, index)
            if budget.room <= 0:
                return waves.wait_for_room(f"step {index}", budget)
            wave, resume.retry_queue = budget.take(queue, node=str)  # failed nodes: within the cap alone
            waves.start(WaveKind.RETRY, wave, [view.live[n] for n in wave if n in view.live])
            return ctx.finish(f"step {index}: retry {ctx.step.current_failure_retry}: recreating {len(wave)} failed pods")
        resume.retry_queue = []
        if len(view.failed) > allowed:
            return self.failed_step(view, index, allowed, "toleration")
        # Failed nodes count as done: at the revision, stuck without a pod, or timed out before the swap.
        done = view.at_revision + sum(1 for n in view.failed if n not in view.live or view.live[n].revision != view.revision)
        if done >= target and not view.coming:
            unavailable = policy.max_unavailable.of(view.total)
            if index == len(policy.steps) - 1 and len(view.failed) > unavailable:
                return self.failed_step(view, index, unavailable, "maxUnavailable")
            return self.step_ready(index, done)
        if ctx.admin_pause:
            return ctx.finish(ctx.admin_paused)
        remaining = target - done - len(view.coming)
        if remaining <= 0:
            return ctx.finish(f"step {index}: waiting for {len(view.coming)} pods to be created")
        pods = waves.takeable(view.others)
        if not pods:
            return waves.none_takeable(f"step {index}", view.others)
        budget = ctx.budget(view, index)
        wave, _ = budget.take(pods, remaining)
        if not wave:
            return waves.wait_for_room(f"step {index}", budget)
        waves.start(WaveKind.UPGRADE, [p.node for p in wave], wave)
        return ctx.finish(f"step {index}: upgrading {len(wave)} nodes ({done} of {target} done)")

    def step_ready(self, index: int, done: int) -> Next:
        """The step reached its target: pause for the admin, or for the step's `pauseDuration`."""
        ctx = self.ctx
        ctx.resume.step_ready_time, ctx.resume.promotion_due = rfc3339(ctx.now), None
        pause_ms = ctx.policy.steps[index].pause_ms
        if pause_ms is None:
            ctx.runner_pause(PauseReason.STEP)
            message = f"step {index} is ready ({done} upgraded): waiting for pause: false"
        else:
            ctx.step.recheck_time = rfc3339(ctx.now + pause_ms / 1000)
            message = f"step {index} is ready ({done} upgraded): continuing after {pause_ms} ms"
        ctx.event(EventType.NORMAL, Reason.STEP_READY, message)
        ctx.step_state(STEP_PAUSED, message)
        return Next.PROGRESS

    def failed_step(self, view: RevisionView, index: int, allowed: int, limit: str) -> Next:
        """More failed pods than `limit` allows: retry them, or after the last retry the fallback."""
        ctx, policy = self.ctx, self.ctx.policy
        retry = ctx.step.current_failure_retry
        failed = len(view.failed)
        if retry < policy.max_failure_threshold:
            ctx.step.current_failure_retry = retry + 1
            ctx.resume.retry_queue = sorted(view.failed)
            ctx.event(
                EventType.WARNING,
                Reason.STEP_RETRY,
                f"step {index}: {failed} failed pods exceed {limit} {allowed}: "
                f"retry {retry + 1} of {policy.max_failure_threshold}",
            )
            return Next.PROGRESS
        message = f"step {index}: {failed} failed pods exceed {limit} {allowed} after {retry} retries"
        return self.fallback(view, Reason.STEP_FAILED, message)

    def fallback(self, view: RevisionView, reason: Reason, why: str) -> Next:
        """The step failed (`why`): roll back, or the runner's pause until the admin has fixed the
        nodes, as `fallback` says."""
        ctx, fallback = self.ctx, self.ctx.policy.fallback
        message = f"{why}: fallback {fallback}"
        ctx.condition(ConditionType.FAILED, TRUE, reason, message)
        ctx.event(EventType.WARNING, reason, message)
        if fallback == Fallback.ROLLBACK:
            return self.rollback.begin(TERMINATING, Reason.FALLBACK_ROLLBACK, message)
        ctx.condition(ConditionType.PROGRESSING, TRUE, Reason.FAILED, message)
        ctx.runner_pause(PauseReason.FAILURE)
        ctx.resume.retry_queue = sorted(view.failed)  # recreated once the admin resumes
        ctx.step_state(STEP_PAUSED, message + ": fix the failed nodes, then set pause: false")
        return Next.PROGRESS

    def paused(self, view: RevisionView) -> Next:
        """StepPaused: the runner's pause until the admin releases it, or the admin's own pause,
        or the step's `pauseDuration` until its recheck time; the health gate throughout."""
        ctx, resume = self.ctx, self.ctx.resume
        index = ctx.step.current_step_index
        if resume.paused_by_runner:
            releasing = resume.pause_confirmed and not ctx.admin_pause  # the admin's `pause: false`
            if resume.pause_reason == PauseReason.STEP and (held := self.health_gate(view, index, releasing)):
                return held
            if not resume.pause_confirmed:
                if not ctx.admin_pause:
                    ctx.decision.set_pause = True
                    return Next.DONE
                resume.pause_confirmed = True
            if ctx.admin_pause:
                return Next.DONE
            return self.resumed(index)
        recheck = parse_time(ctx.step.recheck_time)
        if ctx.admin_pause:
            return ctx.finish(f"step {index}: {ctx.admin_paused}")
        over = recheck is None or ctx.now >= recheck
        if held := self.health_gate(view, index, over):
            return held
        if not over:
            ctx.wakes.append(recheck)
            return Next.DONE
        ctx.step_state(STEP_READY)
        return Next.PROGRESS

    def health_gate(self, view: RevisionView, index: int, promoting: bool) -> Next | None:
        """The health gate (`rollout.health_gate`) at step `index`'s pause, `promoting` once the
        pause is over: None lets the pause go on as it would (or the step promote); else what
        the pass does instead: wait for a snapshot, or fail the step.

        While paused, a snapshot taken since the step was ready and at most `RECHECK_S` old is
        compared (a newer one is asked for, the pause going on meanwhile). To promote, only one
        taken since the gate first saw the step due (`resume.promotionDue`): a node that went
        wrong in the last moments of a pause is seen before the next step begins."""
        ctx, gate = self.ctx, self.ctx.policy.health_gate
        if gate is None:
            return None
        if promoting and ctx.resume.promotion_due is None:
            ctx.resume.promotion_due = rfc3339(ctx.now)
        health = ctx.observed.health
        if promoting:
            stale = health is None or health.taken < (parse_time(ctx.resume.promotion_due) or 0.0)
        else:
            since_ready = parse_time(ctx.resume.step_ready_time) or 0.0
            stale = health is None or health.taken < since_ready or ctx.now - health.taken > health_gate.RECHECK_S
        if stale:
            ctx.decision.observe_health = True
            ctx.wakes.append(ctx.now)
            if promoting:
                return ctx.finish(f"step {index}: comparing the upgraded nodes' health with the others' before promoting")
            return None
        others = [p.node for p in view.others]
        since = parse_time(ctx.resume.step_start_time) or 0.0
        upgraded = view.ready_at_revision | view.pending  # a node NotReady makes its pods unready too
        comparisons = health_gate.compare(health, upgraded, others, since, gate)
        ctx.decision.health_compared = comparisons
        if any(c.regressed for c in comparisons):
            why = f"step {index}: the upgraded nodes are less healthy than the others: {health_gate.verdict(comparisons)}"
            return self.fallback(view, Reason.UNHEALTHY_STEP, why)
        if promoting:
            compared = health_gate.verdict(comparisons) if comparisons else "nothing to compare (a group is empty)"
            ctx.event(EventType.NORMAL, Reason.HEALTH_GATE_PASSED, f"step {index}: {compared}")
        else:
            ctx.wakes.append(health.taken + health_gate.RECHECK_S)
        return None

    def resumed(self, index: int) -> Next:
        """The admin released the runner's pause: after a failure the step upgrades again with
        its retries reset, after a ready step the rollout goes on."""
        ctx = self.ctx
        reason = ctx.resume.pause_reason
        ctx.clear_runner_pause()
        message = f"step {index}: resumed by the admin"
        ctx.event(EventType.NORMAL, Reason.RESUMED, message)
        if reason == PauseReason.FAILURE:
            ctx.step.current_failure_retry = 0
            ctx.condition(ConditionType.FAILED, FALSE, Reason.RESUMED, message)
            ctx.condition(ConditionType.PROGRESSING, TRUE, Reason.RESUMED, message)
            ctx.step_state(STEP_UPGRADE)
            return Next.PROGRESS
        ctx.step_state(STEP_READY)
        return Next.PROGRESS

    def complete(self) -> Next:
        ctx = self.ctx
        revision = ctx.step.upgrading_pod_spec_revision
        message = f"every driver pod is at revision {revision}"
        ctx.resume.stable_revision = revision
        ctx.record_stable_spec()
        ctx.status.phase = IDLING
        ctx.condition(ConditionType.PROGRESSING, FALSE, Reason.COMPLETED, message)
        ctx.condition(ConditionType.SUCCEED, TRUE, Reason.COMPLETED, message)
        ctx.event(EventType.NORMAL, Reason.COMPLETED, message)
        ctx.step_state(COMPLETED, message)
        return Next.DONE
