"""The staged driver rollout's decision: a pure function, `decide(observed, policy, status, now)`.

It reads what one runner pass observed (`observation.Cluster`: the driver DaemonSet's revision,
its pods, the eligible nodes), the parsed `driver.upgradePolicy`, the persisted
`status.upgradeStatus` (`rollout.status`) and the time, and returns a `decision.Decision` holding
everything the runner then does: the new status (seed 000 table 3.16, plus `resume`, the
bookkeeping a restarted runner needs), the value to set `spec.driver.upgradePolicy.pause` to and
the status to write once it landed, the restore of an older revision (`rollout.restore`:
spec.driver, then the template), nodes to cordon, drain or uncordon, pods to delete, events, and
when to run again. It never calls Kubernetes and never reads the clock, so every rule is tested
without a cluster.

A pass dispatches on the phase to a handler; each handler does its part and names what runs
next (`context.Next`), until one says `Next.DONE` (`_settle` bounds the chain). The handlers live
by topic, each part holding the pass's context (`context.PassContext`): the waves' rules
(`waves`), how many nodes at once (`budget`), the idle phases and the rollbacks (`rollback`), the
steps (`progress`).

The runner writes `Decision.status` first (resourceVersion-checked) and then acts; every action
is safe to repeat, and every action the status promises is planned again by the next pass until
the cluster shows it done, so a crash between any two actions loses nothing.
"""

from __future__ import annotations

import dataclasses

from metax_operator.chart.upgrade_policy import Policy
from metax_operator.conditions import EventType, rfc3339
from metax_operator.rollout import freeze
from metax_operator.rollout.context import Next, PassContext
from metax_operator.rollout.decision import Decision
from metax_operator.rollout.observation import Cluster
from metax_operator.rollout.progress import Progress
from metax_operator.rollout.rollback import Rollback
from metax_operator.rollout.status import DISABLING, PROGRESSING, TERMINATING, NodeList, Reason, UpgradeStatus
from metax_operator.rollout.waves import Waves


class Unsettled(RuntimeError):
    """The pass's transitions did not settle within their bound: a defect of the engine."""


def decide(observed: Cluster, policy: Policy, status: UpgradeStatus | None, now: float) -> Decision:
    """The actions and new `status.upgradeStatus` for one pass."""
    ctx = PassContext(observed, policy, status, now)
    waves = Waves(ctx)
    rollback = Rollback(ctx, waves)
    progress = Progress(ctx, waves, rollback)
    if not observed.caught_up:
        ctx.say("waiting for the DaemonSet controller to observe the latest template")
    else:
        _same_driver(ctx)
        handlers = {Next.IDLE: rollback.idle, Next.PROGRESS: progress.progress, Next.ROLL_BACK: rollback.roll_back}
        first = {PROGRESSING: Next.PROGRESS, TERMINATING: Next.ROLL_BACK, DISABLING: Next.ROLL_BACK}
        _settle(ctx, handlers, first.get(ctx.status.phase, Next.IDLE))
    return _report(ctx, waves)


def _same_driver(ctx: PassContext) -> None:
    """The status's revisions that run the current revision's driver (`Cluster.same_driver`: a
    change of where the pods may run alone) are read as the current one: no pod is replaced for
    it, a rollout in flight goes on, and a template set back to the stable driver is set back."""
    current, same, step, resume = ctx.observed.current_revision, ctx.observed.same_driver, ctx.step, ctx.resume
    if resume.stable_revision in same and resume.stable_revision != current:
        if not ctx.before.upgrading:
            message = (
                f"driver revision {current} differs from {resume.stable_revision} only in where driver pods may run"
                " (nodeSelector, affinity, tolerations): no driver pod is replaced for it"
            )
            ctx.event(EventType.NORMAL, Reason.SAME_DRIVER, message)
        resume.stable_revision = current
    if step.last_pod_spec_revision in same:
        step.last_pod_spec_revision = current
    if step.upgrading_pod_spec_revision in same:
        step.upgrading_pod_spec_revision = current
    if resume.restoring in same:  # the restored template, with the CR's scheduling applied since
        resume.restoring = current


def _settle(ctx: PassContext, handlers: dict, first: Next) -> None:
    """Run the handler `first` names and the handlers each names until one says `Next.DONE`.

    A pass goes through a few phase changes and at most four states per step (init, upgrade,
    paused, ready), so a chain longer than that bound is a defect, not a long rollout.
    """
    bound = 10 + 4 * len(ctx.policy.steps)
    trail, step = [], first
    for _ in range(bound):
        trail.append(step.value)
        step = handlers[step]()
        if step is Next.DONE:
            return
    raise Unsettled(
        f"the rollout's transitions did not settle within {bound} steps "
        f"(phase {ctx.status.phase}, step {ctx.step.current_step_index} {ctx.step.current_step_state or '-'}; "
        f"handlers {' -> '.join(trail[-6:])})"
    )


def _report(ctx: PassContext, waves: Waves) -> Decision:
    """What every pass reports whatever its phase: the spec it acts on, an admin's retry labels,
    the validations that ended, the listed nodes, the nodes to uncordon, the update time, the
    pause to confirm, the wake-up."""
    status, resume, decision, observed = ctx.status, ctx.resume, ctx.decision, ctx.observed
    status.upgrading = status.phase in (PROGRESSING, TERMINATING, DISABLING)
    resume.spec = freeze.record(observed.cr_spec, decision.restore) if status.upgrading else None
    if observed.retry and observed.caught_up:
        waves.retry_labelled()
    waves.record_validations()
    resume.skipped = NodeList.of(observed.skipped)
    resume.cordoned = NodeList.of(observed.cordoned)
    resume.need_reboot = NodeList.of(observed.need_reboot)
    decision.uncordon = sorted(waves.driver_back())
    if _without_update_time(status) != _without_update_time(ctx.before):
        ctx.step.last_update_time = rfc3339(ctx.now)
    if decision.set_pause == ctx.policy.pause:
        decision.set_pause = None  # the spec holds it already
    if decision.set_pause is True and resume.paused_by_runner and not resume.pause_confirmed:
        # Once the runner's own pause has landed, the status says so: otherwise an admin's
        # `pause: false` a moment later would look like that pause not applied yet, and the
        # next pass would pause again.
        confirmed = dataclasses.replace(resume, pause_confirmed=True)
        decision.status_once_paused = dataclasses.replace(status, resume=confirmed)
    decision.wake_at = min(ctx.wakes) if ctx.wakes else None
    return decision


def _without_update_time(status: UpgradeStatus) -> UpgradeStatus:
    return dataclasses.replace(status, step=dataclasses.replace(status.step, last_update_time=None))
