"""A discrete-event simulator of the driver DaemonSet under OnDelete, driven by the rollout engine:
what `metax-operator rollout simulate` runs.

Pure Python, no cluster: N nodes, each with one driver pod; a deleted pod terminates, then the
DaemonSet controller creates its replacement at the current template revision, Ready after a
latency drawn from a seeded RNG; with `upgradePolicy.validation`, a validation pod the runner
creates ends `validation_latency` seconds later, and passes; with `upgradePolicy.healthGate`, the
snapshot of the nodes' health the engine asks for is read at the next pass, every node healthy.
The "runner" calls `engine.decide`
every loop interval and carries out the decision as `runtime.rollout_pass` does (the status, the
pause and the status once it landed, the restore, the deletions); the admin answers a runner's
pause `admin_delay` seconds after the status shows it. `run()` returns the timeline per step.

The tests drive the same simulator with failures, crashes and scripted admins by overriding its
hooks (`_new_pod`, `_gpu_busy`, `_before`, ...): tests/rollout/oracle.py.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from metax_operator.chart.upgrade_policy import Policy
from metax_operator.rollout import engine
from metax_operator.rollout.decision import Decision, PodRef
from metax_operator.rollout.health_gate import HealthSnapshot, NodeHealth
from metax_operator.rollout.observation import Check, Cluster, Pod
from metax_operator.rollout.status import (
    COMPLETED,
    DISABLED,
    IDLING,
    PROGRESSING,
    STEP_PAUSED,
    STEP_READY,
    PauseReason,
    UpgradeStatus,
    WaveKind,
)

OLD, NEW = "rev-old", "rev-new"


@dataclass
class SimPod:
    """A driver pod of the simulated fleet, with when it gets Ready, fails, is deleted and is gone."""

    name: str
    uid: str
    node: str
    revision: str
    created: float
    ready_at: float | None  # None: never Ready (hangs, or fails)
    failed_at: float | None = None
    deleting: float | None = None
    gone_at: float | None = None
    check: Check | None = None  # its validation pod, once the runner created it
    checked_at: float | None = None  # when that pod ends
    verdict: str = ""  # the validation's outcome as the runner recorded it


@dataclass
class Config:
    """The simulated fleet and its timings."""

    nodes: int
    interval: float = 5.0  # seconds between runner passes
    ready_latency: tuple[float, float] = (30.0, 30.0)  # new pods Ready after uniform(lo, hi) seconds
    terminate_latency: float = 1.0  # seconds a deleted pod stays Terminating
    validation_latency: float = 20.0  # seconds a validation pod runs (upgradePolicy.validation)
    admin_delay: float | None = 0.0  # the admin sets pause: false this long after a runner pause; None: never
    seed: int = 0
    max_time: float = 30 * 24 * 3600.0


@dataclass
class StepRecord:
    """What a step of the simulated rollout did: its target, its waves' sizes, its pause."""

    step: int
    target: int = 0
    deletions: list[int] = field(default_factory=list)  # the upgrade waves' sizes
    after: str | int = "manual"
    started: float = 0.0
    ready: float | None = None


@dataclass
class Result:
    """A simulated rollout: its steps, when it ended, and the last status."""

    steps: list[StepRecord]
    end_time: float
    passes: int
    status: UpgradeStatus
    pods: dict[str, str]  # node -> revision of its live pod
    actions_per_pass: list[int]  # API actions (pause, restore, deletions) each pass carried out

    def as_json(self) -> dict:
        """The `rollout simulate --output json` shape."""
        return {"steps": [{"step": s.step, "target": s.target, "deletions": s.deletions, "after": s.after} for s in self.steps]}


class Simulation:
    """The OnDelete DaemonSet, the kubelet and the admin around the real engine, on a clock."""

    def __init__(self, config: Config, policy: Policy):
        self.cfg, self.policy = config, policy
        self.rng = random.Random(config.seed)
        self.spec_pause = policy.pause
        self.revision = OLD
        self.nodes = {f"node-{i:05d}" for i in range(config.nodes)}
        self.pods: dict[str, SimPod] = {}
        self.by_node: dict[str, list[SimPod]] = {}
        self._serial = 0
        for node in sorted(self.nodes):
            self._create(node, 0.0, ready=True)
        self.status: UpgradeStatus | None = None
        self.unpause_at: float | None = None
        self.health: HealthSnapshot | None = None  # the runner's latest snapshot of the nodes' health
        self.health_asked = False

    # -- the cluster ------------------------------------------------------------------------
    def set_revision(self, revision: str) -> None:
        """The DaemonSet's template changes (a new driver version, or the runner's restore)."""
        self.revision = revision

    def _create(self, node: str, now: float, ready: bool = False) -> None:
        self._serial += 1
        uid = f"uid-{self._serial}"
        pod = SimPod(f"metax-driver-{self._serial}", uid, node, self.revision, now, now)
        if not ready:
            self._new_pod(pod, now)
        self.pods[uid] = pod
        self.by_node.setdefault(node, []).append(pod)

    def _new_pod(self, pod: SimPod, now: float) -> None:
        """The fate of a pod the DaemonSet controller just created: Ready after the latency."""
        lo, hi = self.cfg.ready_latency
        pod.ready_at = now + self.rng.uniform(lo, hi)

    def _advance(self, now: float) -> None:
        """Terminated pods go; the DaemonSet controller recreates them at the current revision."""
        for pod in sorted((p for p in self.pods.values() if p.gone_at is not None and p.gone_at <= now), key=lambda p: p.gone_at):
            del self.pods[pod.uid]
            self.by_node[pod.node].remove(pod)
            if pod.node in self.nodes:
                self._create(pod.node, pod.gone_at)

    def _live(self, node: str) -> SimPod | None:
        return next((p for p in self.by_node.get(node, ()) if p.deleting is None), None)

    def _gpu_busy(self, now: float) -> frozenset[str]:
        """Nodes running GPU work at `now`."""
        return frozenset()

    def observe(self, now: float) -> Cluster:
        pods = tuple(
            Pod(
                name=p.name,
                uid=p.uid,
                node=p.node,
                revision=p.revision,
                ready=p.ready_at is not None and p.ready_at <= now,
                phase="Failed" if p.failed_at is not None and p.failed_at <= now else "Running",
                created=p.created,
                deleting=p.deleting,
                verdict=p.verdict,
                check=self._check(p, now),
            )
            for p in self.pods.values()
        )
        return Cluster(
            current_revision=self.revision,
            caught_up=True,
            nodes=frozenset(self.nodes),
            pods=pods,
            gpu_busy_nodes=self._gpu_busy(now),
            health=self.health,
        )

    def _check(self, pod: SimPod, now: float) -> Check | None:
        """The pod's validation pod as observed at `now`: running, or ended."""
        if pod.check is None or pod.checked_at is None or pod.checked_at > now:
            return pod.check
        return dataclasses.replace(pod.check, done=True, passed=self._validation_passes(pod))

    def _health(self, now: float) -> HealthSnapshot:
        """The nodes' health as a snapshot at `now` reads it (every node healthy here)."""
        return HealthSnapshot(now, {node: NodeHealth() for node in self.nodes})

    def _validation_passes(self, pod: SimPod) -> bool:
        """Whether the validation of `pod`'s node passes (every one here)."""
        return True

    # -- the runner ---------------------------------------------------------------------------
    def run(self) -> Result:
        """Runner passes until the rollout is over and the pods settled (or nothing can change)."""
        now, self.passes = 0.0, 0
        self.steps: dict[int, StepRecord] = {}
        self.seen_waves: set[str] = set()
        self.actions_per_pass: list[int] = []
        started = False
        while now <= self.cfg.max_time:
            self._advance(now)
            self._before_pass(now)
            if self.unpause_at is not None and now >= self.unpause_at:
                self.spec_pause, self.unpause_at = False, None
            decision = self._pass(now)
            status = self.status or UpgradeStatus()
            if (
                status.resume.paused_by_runner
                and status.resume.pause_confirmed
                and self.spec_pause
                and self.unpause_at is None
                and self.cfg.admin_delay is not None
                and self._answers(status)
            ):
                self.unpause_at = now + self.cfg.admin_delay  # the admin saw the pause in status
            self._record(status, now)
            started = started or status.phase not in (IDLING, DISABLED)
            if started and not status.upgrading and not self._changing(now):
                break
            now = self._next_time(now, decision)
        return Result(
            steps=[self.steps[i] for i in sorted(self.steps)],
            end_time=now,
            passes=self.passes,
            status=self.status or UpgradeStatus(),
            pods={p.node: p.revision for p in self.pods.values() if p.deleting is None},
            actions_per_pass=self.actions_per_pass,
        )

    def _before_pass(self, now: float) -> None:
        """What happens in the cluster just before the pass at `now` (nothing here)."""

    def _answers(self, status: UpgradeStatus) -> bool:
        """Whether the admin answers the runner's pause that `status` shows."""
        return True

    def _pass(self, now: float) -> Decision:
        """One runner pass: decide, then carry out the decision's actions in the executor's order."""
        policy = dataclasses.replace(self.policy, pause=self.spec_pause)
        if self.health_asked:
            self.health = self._health(now)
        decision = engine.decide(self.observe(now), policy, self.status, now)
        self.health_asked = decision.observe_health
        self.passes += 1
        actions: list[tuple[str, Callable[[], None]]] = [("status", lambda: self._persist(decision.status))]
        if decision.set_pause is not None:
            actions.append(("pause", lambda: self._set_pause(decision.set_pause)))
        if decision.status_once_paused is not None:
            actions.append(("status", lambda: self._persist(decision.status_once_paused)))
        if decision.restore is not None:
            actions.append(("restore", lambda: self.set_revision(decision.restore.revision)))
        for ref in decision.delete:
            actions.append(("delete", lambda ref=ref: self._delete(ref, now, decision)))
        for ref in decision.validate:
            actions.append(("validate", lambda ref=ref: self._validate(ref, now)))
        for item in decision.verdicts:
            actions.append(("verdict", lambda item=item: self._verdict(item.pod, item.text)))
        self.actions_per_pass.append(sum(kind != "status" for kind, _ in actions))
        for kind, act in actions:
            if not self._before(kind, decision):
                break
            act()
        return decision

    def _before(self, kind: str, decision: Decision) -> bool:
        """Whether the runner gets to do the next action (`kind`) of `decision`."""
        return True

    def _record(self, status: UpgradeStatus, now: float) -> None:
        """The timeline, from the persisted status (what survives a crash)."""
        sub, rs = status.step, status.resume
        index = sub.current_step_index
        completed = sub.current_step_state == COMPLETED and sub.upgrading_pod_spec_revision == self.revision
        if (status.phase == PROGRESSING or completed) and self.policy.steps:
            if index not in self.steps:
                self.steps[index] = self._step_record(index, now)
            rec = self.steps[index]
            if rec.ready is None:  # the target as the step met it (N may change later)
                rec.target = sub.current_upgrade_replicas
            if (
                sub.current_step_state in (STEP_PAUSED, STEP_READY, COMPLETED)
                and rec.ready is None
                and not (rs.paused_by_runner and rs.pause_reason == PauseReason.FAILURE)
            ):
                rec.ready = now
        wave_key = f"{rs.wave_start_time}/{rs.wave_kind}"
        if rs.wave and wave_key not in self.seen_waves:
            self.seen_waves.add(wave_key)
            self._wave(status, rs.wave_kind, len(rs.wave))

    def _step_record(self, index: int, now: float) -> StepRecord:
        """The record of step `index`, first seen at `now`."""
        ms = self.policy.steps[index].pause_ms
        return StepRecord(index, started=now, after="manual" if ms is None else ms)

    def _wave(self, status: UpgradeStatus, kind: str, size: int) -> None:
        """A wave the timeline has not seen yet (upgrade, retry or rollback)."""
        index = status.step.current_step_index
        if kind == WaveKind.UPGRADE and index in self.steps:
            self.steps[index].deletions.append(size)

    def _persist(self, status: UpgradeStatus) -> None:
        self.status = status

    def _set_pause(self, value: bool) -> None:
        self.spec_pause = value

    def _delete(self, ref: PodRef, now: float, decision: Decision) -> None:
        pod = self.pods.get(ref.uid)
        if pod is None or pod.name != ref.name or pod.deleting is not None:
            return  # the uid precondition: a repeated deletion is harmless
        pod.deleting, pod.gone_at = now, now + self.cfg.terminate_latency

    def _validate(self, ref: PodRef, now: float) -> None:
        pod = self.pods.get(ref.uid)
        if pod is not None and pod.check is None:
            pod.check, pod.checked_at = Check(f"{pod.name}-validation", now), now + self.cfg.validation_latency

    def _verdict(self, ref: PodRef, text: str) -> None:
        pod = self.pods.get(ref.uid)
        if pod is not None:
            pod.verdict = text

    def _changing(self, now: float) -> bool:
        """Whether pods are still terminating or coming up."""
        return any(
            p.gone_at is not None or any(t is not None and t > now for t in (p.ready_at, p.checked_at))
            for p in self.pods.values()
        )

    def _next_time(self, now: float, decision: Decision) -> float:
        """The next pass: one interval on, or the next time anything can change, on the loop's grid."""
        step = self.cfg.interval
        if not self._quiet(decision):
            return now + step
        times = [t for t in self._changes(now) if t > now]
        times += [t for t in (decision.wake_at, self.unpause_at) if t is not None]
        if not times:
            return self.cfg.max_time + step  # nothing can change any more
        return now + step * max(1, -(-(min(times) - now) // step))

    def _changes(self, now: float) -> list[float]:
        """The times after `now` at which the cluster changes on its own."""
        return [t for p in self.pods.values() for t in (p.gone_at, p.ready_at, p.failed_at, p.checked_at) if t is not None]

    def _quiet(self, decision: Decision) -> bool:
        return (
            not decision.delete
            and not decision.validate
            and not decision.verdicts
            and not decision.observe_health
            and decision.restore is None
            and decision.set_pause is None
        )


def simulate(policy: Policy, nodes: int, ready_latency: float = 30.0, interval: float = 5.0) -> Result:
    """The no-failure dry run of `rollout simulate`: every node moves to a new driver revision."""
    sim = Simulation(
        Config(nodes=nodes, interval=interval, ready_latency=(ready_latency, ready_latency)),
        dataclasses.replace(policy, enable_rollout=True, pause=False),
    )
    sim.set_revision(NEW)
    return sim.run()
