"""The phases with no step in flight, and the rollbacks.

Idling and Disabled (`idle`): nothing to do at the stable revision; a new revision starts a
staged rollout (`start`, then `progress.Progress`), or, without a staged rollout, replaces every
pod at once (`replace_all`). Terminating and Disabling (`roll_back`): the template and the CR's
spec.driver are restored to the stable revision's (`rollout.restore`), re-planned on every pass
until both have landed, then the pods of the abandoned revision are replaced in waves.
"""

from __future__ import annotations

import math
from collections import Counter

from metax_operator.conditions import FALSE, TRUE, EventType, parse_time, rfc3339
from metax_operator.rollout import restore
from metax_operator.rollout.context import Next, PassContext
from metax_operator.rollout.observation import Pod, starting
from metax_operator.rollout.restore import Restore
from metax_operator.rollout.status import (
    DISABLED,
    DISABLING,
    IDLING,
    PROGRESSING,
    TERMINATING,
    ConditionType,
    Reason,
    WaveKind,
)
from metax_operator.rollout.waves import Waves


class Rollback:
    """The idle and rollback handlers of one pass."""

    def __init__(self, ctx: PassContext, waves: Waves):
        self.ctx, self.waves = ctx, waves

    def idle(self) -> Next:
        ctx, observed, resume = self.ctx, self.ctx.observed, self.ctx.resume
        current, stable = observed.current_revision, resume.stable_revision
        if not stable:  # the first pass ever: the pods' most common older revision, if any
            older = Counter(
                p.revision for p in observed.pods if p.node in observed.nodes and p.deleting is None and p.revision != current
            )
            stable = resume.stable_revision = older.most_common(1)[0][0] if older else current
            resume.settled_at = rfc3339(ctx.now)  # the pods there now are the fleet's as found
        ctx.status.phase = IDLING if ctx.policy.enable_rollout else DISABLED
        behind = self.behind() if current == stable else []
        if behind and ctx.policy.enable_rollout:
            revision = Counter(p.revision for p in behind).most_common(1)[0][0]
            ctx.step.last_pod_spec_revision, ctx.step.upgrading_pod_spec_revision = current, revision
            message = (
                f"{len(behind)} driver pods were created at revision {revision} after the fleet settled at {current},"
                f" the template's: rolling them back"
            )
            return self.begin(TERMINATING, Reason.PODS_BEHIND, message)
        if current == stable and not behind:
            if ctx.before.upgrading or ctx.before.resume.stable_revision != stable or not resume.settled_at:
                resume.settled_at = rfc3339(ctx.now)
            ctx.record_stable_spec()
            return ctx.finish(
                f"all driver pods are at revision {current}"
                if ctx.status.phase == IDLING
                else "staged rollout is disabled; a new driver revision replaces every pod at once"
            )
        if ctx.policy.enable_rollout:
            return self.start(Reason.ROLLOUT_STARTED, f"driver revision {current} rolls out in {len(ctx.policy.steps)} steps")
        return self.replace_all(current)

    def behind(self) -> list[Pod]:
        """The live pods at another revision than the template's, the stable one, created after
        the fleet settled at it (in its second or later: creation times have seconds): the
        DaemonSet controller made them from a template the runner never settled at, set and set
        back in between (a `helm rollback` right after the upgrade while the runner was held or
        restarting, a replacement at once cut short). A pod older than that (a node skipped, or
        failed before its swap and tolerated) is not behind."""
        settled = parse_time(self.ctx.resume.settled_at)
        if settled is None:
            return []
        second = math.floor(settled)
        return [p for p in self.ctx.classify(self.ctx.observed.current_revision, ()).others if p.created >= second]

    def replace_all(self, current: str) -> Next:
        """enableRollout false and nothing in flight: delete every old pod at once, but those
        still starting (replaced once Ready or failed: their driver may be flashing firmware)."""
        ctx = self.ctx
        view = ctx.classify(current, ())
        if not view.others and not view.coming:
            ctx.resume.stable_revision = current
            ctx.event(EventType.NORMAL, Reason.REPLACED, f"every driver pod is at revision {current}")
            return Next.IDLE
        if ctx.admin_pause:
            return ctx.finish(ctx.admin_paused)
        pods = [p for p in self.waves.takeable(view.others) if not self.waves.to_prepare(p.node)]  # no waves: no wait, no drain
        ctx.delete(pods)
        coming_up = sum(1 for p in view.others if starting(p, ctx.now, ctx.timeout))
        note = f" ({coming_up} still starting, their driver may be flashing firmware: replaced once Ready or failed)"
        return ctx.finish(f"replacing {len(view.others)} driver pods with revision {current} at once" + note * bool(coming_up))

    def start(self, reason: Reason, message: str) -> Next:
        """A rollout of the current revision begins, from the stable one."""
        ctx, resume = self.ctx, self.ctx.resume
        ctx.step.last_pod_spec_revision = resume.stable_revision
        ctx.step.upgrading_pod_spec_revision = ctx.observed.current_revision
        ctx.status.phase = PROGRESSING
        if not self.take_over_wave(WaveKind.UPGRADE):
            resume.wave_kind = ""
        resume.retry_queue, resume.abandoned_revision, resume.timed_out_nodes = [], "", []
        ctx.clear_runner_pause()
        for kind in (ConditionType.SUCCEED, ConditionType.FAILED, ConditionType.TERMINATING):
            ctx.condition(kind, FALSE, reason, message)
        ctx.condition(ConditionType.PROGRESSING, TRUE, reason, message)
        ctx.event(EventType.NORMAL, reason, message)
        ctx.enter_step(ctx.resume_index())
        return Next.PROGRESS

    def take_over_wave(self, kind: WaveKind) -> bool:
        """A rollout or a rollback starts: the wave in flight is replaced by one of `kind` holding
        its nodes whose driver pod is gone and not re-created yet. The DaemonSet controller will
        give them a pod, which the new wave replaces if it is not of its revision: they are being
        swapped still, and forgotten they would hold no slot, so that the new wave could take
        `maxParallel` more nodes while they have no driver. Its start time and their deletion
        times are kept: the readiness timeout runs from their deletion. Whether there were any."""
        observed, resume = self.ctx.observed, self.ctx.resume
        with_pods = {p.node for p in observed.pods}
        gone = [n for n in resume.wave if n in observed.nodes and n not in with_pods]
        resume.wave = gone
        resume.deleted_at = {n: at for n, at in resume.deleted_at.items() if n in gone}
        if gone:
            resume.wave_kind, resume.wave_uids = kind, []
        return bool(gone)

    def begin(self, phase: str, reason: Reason, message: str) -> Next:
        """A rollback begins (`phase` Terminating or Disabling)."""
        ctx, resume = self.ctx, self.ctx.resume
        ctx.status.phase = phase
        self.take_over_wave(WaveKind.ROLLBACK)
        resume.retry_queue, resume.timed_out_nodes = [], []
        resume.abandoned_revision = ctx.step.upgrading_pod_spec_revision
        ctx.clear_runner_pause()
        ctx.condition(ConditionType.TERMINATING, TRUE, reason, message)
        ctx.event(EventType.WARNING, reason, message)
        ctx.say(message)
        return Next.ROLL_BACK

    def roll_back(self) -> Next:
        """Terminating or Disabling: the restore first, then waves of the abandoned pods."""
        ctx, resume = self.ctx, self.ctx.resume
        current, last = ctx.observed.current_revision, ctx.step.last_pod_spec_revision
        if current not in (last, resume.abandoned_revision):
            if resume.restoring == last:
                return self.restore_again(current, last)
            resume.stable_revision = last
            if ctx.status.phase == TERMINATING and ctx.policy.enable_rollout:
                return self.start(Reason.NEW_REVISION, f"driver revision {current} rolls out, replacing the rollback")
            ctx.status.phase = DISABLED
            return Next.IDLE
        if current != last:
            resume.restoring = last
            ctx.decision.restore = self.restore_plan(last)
            return ctx.finish(f"restoring the driver template to revision {last}")
        if resume.restoring == last and not (plan := self.restore_plan(last)).landed(ctx.observed.stored_driver):
            # The template is back, but the CR's spec.driver still names the abandoned driver (its
            # write failed, or the runner stopped before it): written again before any wave, or
            # the end of the rollback would bring the abandoned driver back.
            ctx.decision.restore = Restore(last, plan.driver_spec, None)
            return ctx.finish(f"restoring spec.driver to revision {last}'s again: the last write of it did not land")
        resume.restoring = None
        return self.rollback_wave(last)

    def rollback_wave(self, last: str) -> Next:
        """The waves of a rollback: the abandoned revision's pods, replaced without pauses."""
        ctx, waves = self.ctx, self.waves
        view = ctx.view(last)
        ctx.step.total_upgrade_replicas, ctx.step.total_upgrade_ready_replicas = view.total, len(view.ready_at_revision)
        if waves.busy(view):
            return Next.DONE
        if not view.others and not view.coming:
            return self.rolled_back(last)
        if ctx.admin_pause:
            return ctx.finish(f"rollback {ctx.admin_paused}")
        pods = waves.takeable(view.others)
        if not pods:
            return waves.none_takeable("rollback", view.others)
        budget = ctx.budget(view)
        wave, _ = budget.take(pods)
        if not wave:
            return waves.wait_for_room("rollback", budget)
        waves.start(WaveKind.ROLLBACK, [p.node for p in wave], wave)
        return ctx.finish(f"rolling back {len(wave)} nodes to revision {last} ({len(view.others)} left)")

    def restore_plan(self, last: str) -> Restore:
        observed = self.ctx.observed
        return restore.plan(
            last, observed.revisions.get(last), observed.daemonset, observed.cr_spec, self.ctx.status.last_co_driver_spec
        )

    def restore_again(self, current: str, last: str) -> Next:
        """The restore of `last` has not landed, and the template moved on to `current`, neither
        `last` nor the abandoned revision: the restore wrote spec.driver, then its template write
        failed (or the runner stopped between the two), and the reconcile mapped the restored
        spec onto the abandoned template. That is no new revision to roll out, nor one to
        replace every pod with: the restore is planned again. Without `last`'s ControllerRevision,
        `current` (the restored spec's template) is the nearest to it there is, and the rollback
        goes on to it, in waves. (A template still at the abandoned revision is no such case: the
        restore is planned again by the path of a first restore.)"""
        ctx = self.ctx
        if ctx.observed.revisions.get(last) is None:
            ctx.step.last_pod_spec_revision, ctx.resume.restoring = current, None
            return Next.ROLL_BACK
        ctx.decision.restore = self.restore_plan(last)
        return ctx.finish(f"restoring the driver template to revision {last} again: the last restore did not land")

    def rolled_back(self, last: str) -> Next:
        ctx, resume = self.ctx, self.ctx.resume
        resume.stable_revision, resume.wave, resume.wave_kind = last, [], ""
        message = f"rolled back: every driver pod is at revision {last}"
        ctx.condition(ConditionType.TERMINATING, FALSE, Reason.ROLLED_BACK, message)
        ctx.condition(ConditionType.PROGRESSING, FALSE, Reason.ROLLED_BACK, message)
        ctx.event(EventType.NORMAL, Reason.ROLLED_BACK, message)
        ctx.status.phase = DISABLED if ctx.status.phase == DISABLING else IDLING
        ctx.say(message)
        return Next.IDLE
