"""The rules of a wave: the pods deleted together, and the nodes' work that must end first.

A wave's nodes are recorded in `resume.wave`; a node with pods to wait for
(`waitForCompletion.podSelector`) or GPU pods to drain is cordoned first and its driver pod
deleted by a later pass once that work has ended (its stage, `observation.to_prepare`), or it
times out (`onTimeout`). GPU work that is neither allowed, drained nor waited for holds its node
out of every wave. A node's readiness timeout runs from the deletion of its own driver pod: the
wave's start, or later for a node whose work ended first (`resume.deletedAt`).
"""

from __future__ import annotations

from operator import attrgetter

from metax_operator.chart.upgrade_policy import OnTimeout
from metax_operator.conditions import EventType, parse_time, rfc3339
from metax_operator.contract import RETRY_LABEL
from metax_operator.rollout.budget import Budget
from metax_operator.rollout.context import Next, PassContext
from metax_operator.rollout.decision import PodRef, Verdict
from metax_operator.rollout.observation import (
    Pod,
    RevisionView,
    Stage,
    ValidationOutcome,
    driver_back,
    held,
    starting,
    to_prepare,
    validation_outcome,
    verdict,
)
from metax_operator.rollout.status import LISTED_NODES, NodeList, Reason, WaveKind


class Waves:
    """The wave rules of one pass, on its context."""

    def __init__(self, ctx: PassContext):
        self.ctx = ctx

    def start(self, kind: WaveKind, nodes: list[str], pods: list[Pod]) -> None:
        """Start a wave: delete the pods of its free nodes now; the others are cordoned and
        deleted by `busy` once their work has ended (`prepare`)."""
        ctx, resume = self.ctx, self.ctx.resume
        resume.wave, resume.wave_kind, resume.wave_start_time = sorted(nodes), kind, rfc3339(ctx.now)
        resume.drain_start, resume.deleted_at = {}, {}
        resume.wave_uids = sorted(p.uid for p in pods) if kind == WaveKind.RETRY else []
        resume.timed_out_nodes = [n for n in resume.timed_out_nodes if n not in nodes]
        prepare = self.nodes_to_prepare()
        ctx.delete([p for p in pods if p.node not in prepare])
        ctx.decision.cordon.extend(p.node for p in pods if p.node in prepare)
        ctx.wakes.append(ctx.now + ctx.timeout)

    def busy(self, view: RevisionView) -> bool:
        """True while the current wave is still coming back; repeats deletions a crash lost.

        A wave node is back when its pod is at the wave's revision and Ready or failed (failed
        nodes hold no slot), or when it is stuck: no pod back within the readiness timeout of its
        deletion. A pod the wave meant to delete (another revision, or a uid in `waveUids` for a
        retry) that is still there is deleted again, after the same checks as a first deletion:
        work to wait for or drain must end first (`prepare`); a node labelled skip since, or that
        runs GPU work since (its cordon was refused, the runner crashed), leaves the wave (it is
        uncordoned once nothing of it is being swapped) rather than stalling the wave.
        """
        ctx, resume = self.ctx, self.ctx.resume
        start = parse_time(resume.wave_start_time)
        wave = [n for n in resume.wave if n in ctx.observed.nodes]
        if not wave or start is None:
            return False
        self.validate(view, wave)
        doomed = set(resume.wave_uids)
        busy, lost = [], []
        for node in wave:
            pod = view.live.get(node)
            if node in view.ready_at_revision:
                continue
            if pod is not None and (pod.revision != view.revision or pod.uid in doomed):
                lost.append(pod)
            elif node in view.failed and (pod is not None or resume.wave_kind != WaveKind.RETRY):
                continue  # failed; but a retried stuck node gets the timeout again
            busy.append(node)
        undeleted = {p.node for p in lost}  # the runner's deletion never happened: not the node's fault

        def deadline(node: str) -> float:
            return (parse_time(resume.deleted_at.get(node)) or start) + ctx.timeout

        waiting = [n for n in busy if n not in view.pending and n not in undeleted]
        stuck = [n for n in waiting if ctx.now >= deadline(n)]  # deleted, never came back: failed, not in flight
        view.failed.update(stuck)
        view.coming.difference_update(stuck)
        busy = [n for n in busy if n not in stuck]
        out = {p.node for p in lost if p.node in ctx.observed.skipped or self.held(p.node)}
        if out:  # not swapped yet, and labelled skip or running GPU work since: out of the wave
            resume.wave = [n for n in resume.wave if n not in out]
            busy = [n for n in busy if n not in out]
            lost = [p for p in lost if p.node not in out]
        ready = self.prepare(lost, view, start, busy)
        if not busy:
            return False
        if ready and not ctx.admin_pause:
            ctx.delete(ready)
            resume.deleted_at.update((p.node, rfc3339(ctx.now)) for p in ready)
        ctx.wakes.extend(deadline(n) for n in busy if n not in view.pending)
        self.say_busy(len(busy), len(wave) - len(out), len(lost) - len(ready))
        return True

    def validate(self, view: RevisionView, wave: list[str]) -> None:
        """Run a validation pod for each Ready pod of the wave at the view's revision that has none
        (`observation.validation_outcome`)."""
        ctx = self.ctx
        for node in wave:
            pod = view.live.get(node)
            if node in view.validating and pod is not None and pod.check is None:
                ctx.decision.validate.append(PodRef(pod.name, pod.uid, node))

    def record_validations(self) -> None:
        """Record each validation that ended (or timed out) on its driver pod, whatever the phase."""
        ctx, validation = self.ctx, self.ctx.policy.validation
        if validation is None:
            return
        for node, pod in ctx.node_pods.live.items():
            if pod.check is None or pod.verdict or not pod.ready:
                continue
            result, reason = validation_outcome(pod, True, validation, ctx.now)
            if result is not ValidationOutcome.VALIDATING:
                ctx.decision.verdicts.append(Verdict(PodRef(pod.name, pod.uid, node), verdict(result, reason)))

    def say_busy(self, busy: int, wave: int, preparing: int) -> None:
        notes = [f"{preparing} cordoned, waiting for their work to end"] * bool(preparing)
        self.ctx.say(
            f"waiting for {busy} of {wave} pods of the {self.ctx.resume.wave_kind} wave to be Ready"
            + (f" ({'; '.join(notes)})" if notes else "")
        )

    def prepare(self, pods: list[Pod], view: RevisionView, start: float, busy: list[str]) -> list[Pod]:
        """Of the wave's pods still to delete, those whose node is free of the work that must end
        first. For the others: keep them cordoned, evict their GPU pods (drain, once no pod to
        wait for is left), and apply `onTimeout` to those whose wait or drain ran out (taken out
        of `busy`)."""
        ctx, policy = self.ctx, self.ctx.policy
        free = []
        for pod in pods:
            stage = self.to_prepare(pod.node)
            if not stage:
                free.append(pod)
                continue
            if pod.node in ctx.resume.timed_out_nodes:  # failed before the swap (a held node left the wave)
                view.failed.add(pod.node)
                busy.remove(pod.node)
                continue
            if stage == Stage.WAIT:
                deadline = start + policy.wait_timeout_ms / 1000 if policy.wait_timeout_ms else None
            else:
                began = ctx.resume.drain_start.setdefault(pod.node, rfc3339(ctx.now))
                deadline = parse_time(began) + policy.drain_timeout_ms / 1000
            if deadline is not None and ctx.now >= deadline:
                self.timed_out(pod.node, stage, view)
                busy.remove(pod.node)
                continue
            if deadline is not None:
                ctx.wakes.append(deadline)
            if pod.node not in ctx.observed.cordoned:
                ctx.decision.cordon.append(pod.node)  # again, should the cordon have been lost
            if stage == Stage.DRAIN and not ctx.admin_pause:
                ctx.decision.evict.append(pod.node)
        return free

    def timed_out(self, node: str, stage: Stage, view: RevisionView) -> None:
        """`node`'s wait or drain ran out: hold it back (out of the wave, uncordoned, its driver
        kept) or count it failed (`onTimeout`)."""
        ctx, resume, on_timeout = self.ctx, self.ctx.resume, self.ctx.policy.on_timeout
        resume.drain_start.pop(node, None)
        if node not in resume.timed_out_nodes:
            resume.timed_out_nodes = sorted([*resume.timed_out_nodes, node])
            waited = stage == Stage.WAIT
            what = "waiting for its pods matching waitForCompletion.podSelector" if waited else "draining its GPU pods"
            then = "held back" if on_timeout == OnTimeout.HOLD else "counted failed"
            ctx.event(
                EventType.WARNING,
                Reason.WAIT_TIMEOUT if waited else Reason.DRAIN_TIMEOUT,
                f"node {node}: {what} timed out; {then} (onTimeout: {on_timeout})",
            )
        if on_timeout == OnTimeout.HOLD:
            resume.wave = [n for n in resume.wave if n != node]
        else:
            view.failed.add(node)

    def takeable(self, pods: list[Pod]) -> list[Pod]:
        """Pods that may be deleted now (or once their node's work ends): nodes without work to
        wait for first, then not-Ready first, then by node; lists the held-back nodes. A pod
        still starting is not taken (`observation.starting`): it is replaced once Ready or failed;
        nor one of a node labelled skip."""
        ctx = self.ctx
        prepare = self.nodes_to_prepare()
        held_nodes = {n for n in ctx.observed.gpu_busy_nodes if self.held(n)} | (set(ctx.resume.timed_out_nodes) & prepare)
        held_back = [p.node for p in pods if p.node in held_nodes] if held_nodes else []
        ctx.resume.held = NodeList.of(held_back)
        if held_back and len(held_back) != ctx.before.resume.held.count:
            ctx.event(
                EventType.WARNING,
                Reason.NODES_HELD_BACK,
                f"{len(held_back)} nodes run GPU workloads (or their wait or drain "
                f"timed out) and are held back: {', '.join(sorted(held_back)[:LISTED_NODES])}",
            )
        skipped = ctx.observed.skipped  # a wave node labelled skip is observed until it leaves the wave
        free = [p for p in pods if p.node not in held_nodes | skipped and not starting(p, ctx.now, ctx.timeout)]
        ordered = sorted(free, key=attrgetter("ready", "node"))
        if not prepare:
            return ordered
        return [p for p in ordered if p.node not in prepare] + [p for p in ordered if p.node in prepare]

    def none_takeable(self, what: str, pods: list[Pod]) -> Next:
        """End a pass that found no pod to take among `pods`: say why (held back, or starting)."""
        ctx = self.ctx
        coming_up = sum(1 for p in pods if starting(p, ctx.now, ctx.timeout))
        if coming_up:
            return ctx.finish(
                f"{what}: waiting for {coming_up} driver pods of an older template that are still starting "
                "(their driver may be flashing firmware): they are replaced once Ready or failed"
            )
        return ctx.finish(f"{what}: every remaining node is held back")

    def nodes_to_prepare(self) -> set[str]:
        """The nodes with work to end before their driver pod is deleted (`to_prepare`). Only
        nodes running GPU work or pods to wait for can have any: looking them up in those
        (usually small) sets keeps a 100,000-pod wave from costing a call per pod."""
        observed = self.ctx.observed
        return {n for n in observed.wait_busy_nodes | observed.gpu_busy_nodes if self.to_prepare(n)}

    def held(self, node: str) -> bool:
        return held(self.ctx.observed, self.ctx.policy, node)

    def to_prepare(self, node: str) -> Stage | None:
        return to_prepare(self.ctx.observed, self.ctx.policy, node)

    def wait_for_room(self, what: str, budget: Budget) -> Next:
        """End a pass whose wave `budget` leaves empty, saying what it waits for: the swaps in
        flight, or with room in the cap, nodes out of service to return."""
        if budget.room <= 0:
            return self.ctx.finish(f"{what}: waiting for the driver pods being swapped to be Ready before the next wave")
        out = sorted(budget.out_of_service)
        self.ctx.resume.out_of_service = NodeList.of(out)
        return self.ctx.finish(
            f"{what}: waiting for GPU nodes to return to service: {len(out)} out of service "
            f"({', '.join(out[:LISTED_NODES])}: cordoned, not Ready or without a driver pod) and "
            f"{len(budget.in_flight)} being swapped leave no room within maxParallel ({budget.cap}) "
            f"plus maxUnavailable ({budget.allowance})"
        )

    def retry_labelled(self) -> None:
        """The nodes an admin labelled for a retry (`Cluster.retry`) whose driver pod at the current
        revision failed: that pod is deleted again, whatever the phase and also while paused (a
        failed node runs no driver, so its retry takes nothing down), as far as the step's budget
        leaves room beside the swaps in flight and this pass's deletions; the others wait for
        room. A labelled node whose driver is Ready has nothing to retry: an Event says so."""
        ctx, observed = self.ctx, self.ctx.observed
        view = ctx.view(observed.current_revision)
        deleting = {ref.node for ref in ctx.decision.delete}
        failed = [view.live[n] for n in sorted(observed.retry) if n in view.failed and n in view.live and n not in deleting]
        retried, _ = ctx.budget(view).with_deleted(deleting).take(failed)
        for pod in retried:
            ctx.delete([pod])
            ctx.event(
                EventType.NORMAL,
                Reason.NODE_RETRIED,
                f"node {pod.node}: its failed driver pod {pod.name} is deleted again (label {RETRY_LABEL}=true)",
            )
        for node in sorted((observed.retry & observed.nodes) - view.failed):
            if node in view.live and view.live[node].ready:  # mid-swap (a retry just done): no word
                ctx.event(EventType.WARNING, Reason.NOTHING_TO_RETRY, f"node {node}: its driver is Ready, nothing to retry")

    def driver_back(self) -> set[str]:
        """The nodes the runner cordoned that it may uncordon now (`observation.driver_back`)."""
        ctx = self.ctx
        deleting = {ref.node for ref in ctx.decision.delete}
        return driver_back(ctx.observed, ctx.resume, deleting, ctx.policy.validation, ctx.now)
