"""A discrete-event simulator of the driver DaemonSet under OnDelete, driven by the rollout engine.

Pure Python, no cluster: N nodes, each with one driver pod; a deleted pod terminates, then the
DaemonSet controller creates its replacement at the current template revision, which becomes
Ready after a latency drawn from a seeded RNG, fails with a probability, or hangs. The "runner"
calls `engine.decide` every loop interval, persists the status, then applies the actions one by
one; it can crash between any two of them (only the persisted status survives). The admin's
answer to a manual pause is scripted. `run()` returns the timeline per step.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Callable

from metax_operator.rollout import engine
from metax_operator.rollout.policy import Policy

OLD, NEW = "rev-old", "rev-new"


@dataclass
class SimPod:
    name: str
    uid: str
    node: str
    revision: str
    created: float
    ready_at: float | None  # None: never Ready (hangs, or fails)
    failed_at: float | None = None
    deleting: float | None = None
    gone_at: float | None = None


@dataclass
class Config:
    nodes: int
    interval: float = 5.0  # seconds between runner passes
    ready_latency: tuple[float, float] = (30.0, 30.0)  # new pods Ready after uniform(lo, hi) seconds
    fail_probability: float = 0.0  # a new-revision pod fails (phase Failed) instead of becoming Ready
    hang_probability: float = 0.0  # a new-revision pod never becomes Ready
    terminate_latency: float = 1.0  # seconds a deleted pod stays Terminating
    crash_probability: float = 0.0  # the runner crashes before an action with this probability
    admin_delay: float | None = 0.0  # the admin sets pause: false this long after a runner pause; None: never
    admin_resumes_failures: bool = True  # the admin also resumes after a fallback pause
    busy_nodes: dict[str, float] = field(default_factory=dict)  # node -> time its GPU work ends
    seed: int = 0
    max_time: float = 30 * 24 * 3600.0


@dataclass
class StepRecord:
    step: int
    target: int = 0
    deletions: list[int] = field(default_factory=list)
    retries: list[int] = field(default_factory=list)
    after: str | int = "manual"
    started: float = 0.0
    ready: float | None = None
    upgraded_at_ready: int = 0  # pods at the new revision when the step became Ready
    failed_at_ready: int = 0
    fallback_retries: int | None = None  # retries counted when the step took the fallback


@dataclass
class Result:
    steps: list[StepRecord]
    rollback_waves: list[int]
    end_time: float
    passes: int
    crashes: int
    status: dict
    pods: dict[str, str]  # node -> revision of its live pod
    deleted_ready_upgraded: int  # Ready pods at the upgrading revision the runner deleted (must be 0)
    max_in_flight_over_cap: int  # after a pass that deleted: pods in flight beyond its cap (must be <= 0)
    deletions_while_paused: int  # deletions applied while spec pause was true (must be 0)
    actions_per_pass: list[int]

    def as_json(self) -> dict:
        """The `rollout simulate --output json` shape."""
        return {"steps": [{"step": s.step, "target": s.target, "deletions": s.deletions, "after": s.after}
                          for s in self.steps]}


class Simulation:
    def __init__(self, config: Config, policy: Policy,
                 admin: list[tuple[float, Callable[["Simulation"], None]]] | None = None):
        self.cfg, self.policy = config, policy
        self.rng = random.Random(config.seed)
        self.crash_rng = random.Random(config.seed + 1)  # crashes do not change the pods' fates
        self.spec_pause = policy.pause
        self.enable_rollout = policy.enable_rollout
        self.revision = OLD
        self.admin = sorted(admin or [], key=lambda a: a[0])
        self.nodes = {f"node-{i:05d}" for i in range(config.nodes)}
        self.pods: dict[str, SimPod] = {}
        self.by_node: dict[str, list[SimPod]] = {}
        self._serial = 0
        for node in sorted(self.nodes):
            self._create(node, 0.0, ready=True)
        self.status: dict | None = None
        self.in_flight: set[str] = set()  # nodes whose pod the runner deleted, replacement not back yet
        self.unpause_at: float | None = None
        self.deleted_ready_upgraded = 0

    # -- the cluster ------------------------------------------------------------------------
    def set_revision(self, revision: str) -> None:
        """The DaemonSet's template changes (a new driver version, or the runner's restore)."""
        self.revision = revision

    def add_node(self, name: str, now: float) -> None:
        self.nodes.add(name)
        self._create(name, now)

    def remove_node(self, name: str) -> None:
        self.nodes.discard(name)
        for pod in self.by_node.pop(name, []):
            del self.pods[pod.uid]
        self.in_flight.discard(name)

    def _create(self, node: str, now: float, ready: bool = False) -> None:
        self._serial += 1
        uid = f"uid-{self._serial}"
        pod = SimPod(f"metax-driver-{self._serial}", uid, node, self.revision, now, now)
        if not ready:
            lo, hi = self.cfg.ready_latency
            latency = self.rng.uniform(lo, hi)
            roll = self.rng.random()
            if self.revision != OLD and roll < self.cfg.fail_probability:
                pod.ready_at, pod.failed_at = None, now + latency
            elif self.revision != OLD and roll < self.cfg.fail_probability + self.cfg.hang_probability:
                pod.ready_at = None
            else:
                pod.ready_at = now + latency
        self.pods[uid] = pod
        self.by_node.setdefault(node, []).append(pod)

    def _advance(self, now: float) -> None:
        """Terminated pods go; the DaemonSet controller recreates them at the current revision."""
        for pod in sorted((p for p in self.pods.values() if p.gone_at is not None and p.gone_at <= now),
                          key=lambda p: p.gone_at):
            del self.pods[pod.uid]
            self.by_node[pod.node].remove(pod)
            if pod.node in self.nodes:
                self._create(pod.node, pod.gone_at)
        timeout = self.policy.readiness_timeout_ms / 1000
        for node in list(self.in_flight):
            live = self._live(node)
            if live and live.revision == self.revision and (
                    (live.ready_at is not None and live.ready_at <= now)
                    or (live.failed_at is not None and live.failed_at <= now)
                    or now - live.created >= timeout):  # the engine's failed pods hold no slot
                self.in_flight.discard(node)

    def _live(self, node: str) -> SimPod | None:
        return next((p for p in self.by_node.get(node, ()) if p.deleting is None), None)

    def observe(self, now: float) -> engine.Observed:
        pods = tuple(
            engine.Pod(name=p.name, uid=p.uid, node=p.node, revision=p.revision,
                        ready=p.ready_at is not None and p.ready_at <= now,
                        phase="Failed" if p.failed_at is not None and p.failed_at <= now else "Running",
                        created=p.created, deleting=p.deleting)
            for p in self.pods.values())
        busy = frozenset(n for n, until in self.cfg.busy_nodes.items() if until > now)
        return engine.Observed(current_revision=self.revision, caught_up=True,
                                nodes=frozenset(self.nodes), pods=pods, gpu_busy_nodes=busy)

    # -- the runner ---------------------------------------------------------------------------
    def run(self) -> Result:
        """Runner passes until the rollout is over and the pods settled (or nothing can change)."""
        now, self.passes, self.crashes = 0.0, 0, 0
        self.steps: dict[int, StepRecord] = {}
        self.rollback_waves: list[int] = []
        self.seen_waves: set[str] = set()
        self.over_cap = self.paused_deletions = 0
        self.actions_per_pass: list[int] = []
        started = False
        while now <= self.cfg.max_time:
            self._advance(now)
            while self.admin and self.admin[0][0] <= now:
                self.admin.pop(0)[1](self)
            if self.unpause_at is not None and now >= self.unpause_at:
                self.spec_pause, self.unpause_at = False, None
            decision = self._pass(now)
            status = self.status or engine.empty_status()
            rs = status["resume"]
            if rs["pausedByRunner"] and rs["pauseConfirmed"] and self.spec_pause and self.unpause_at is None \
                    and self.cfg.admin_delay is not None \
                    and (rs["pauseReason"] != "failure" or self.cfg.admin_resumes_failures):
                self.unpause_at = now + self.cfg.admin_delay  # the admin saw the pause in status
            self._record(status, now)
            started = started or status["phase"] not in (engine.IDLING, engine.DISABLED)
            if started and not status["upgrading"] and not self._changing(now):
                break
            now = self._next_time(now, decision)
        return Result(steps=[self.steps[i] for i in sorted(self.steps)], rollback_waves=self.rollback_waves,
                      end_time=now, passes=self.passes, crashes=self.crashes, status=self.status or {},
                      pods={p.node: p.revision for p in self.pods.values() if p.deleting is None},
                      deleted_ready_upgraded=self.deleted_ready_upgraded, max_in_flight_over_cap=self.over_cap,
                      deletions_while_paused=self.paused_deletions, actions_per_pass=self.actions_per_pass)

    def _pass(self, now: float) -> engine.Decision:
        """One runner pass: decide, persist the status, then act; maybe crash between two actions."""
        policy = dataclasses.replace(self.policy, pause=self.spec_pause, enable_rollout=self.enable_rollout)
        decision = engine.decide(self.observe(now), policy, self.status, now)
        self.passes += 1
        actions: list[tuple[str, Callable[[], None]]] = [("status", lambda: self._persist(decision.status))]
        if decision.restore_revision:
            actions.append(("restore", lambda: self.set_revision(decision.restore_revision)))
        if decision.set_pause is not None:
            actions.append(("pause", lambda: self._set_pause(decision.set_pause)))
        upgrading = decision.status["status"]["upgradingPodSpecRevision"] \
            if decision.status["phase"] == engine.PROGRESSING else None
        runner_paused = decision.status["resume"]["pausedByRunner"]
        for ref in decision.delete:
            actions.append(("delete", lambda ref=ref: self._delete(ref, now, upgrading)))
        self.actions_per_pass.append(len(actions) - 1)
        self.crashed = self.deleted_now = False
        for kind, act in actions:
            if self.cfg.crash_probability and self.crash_rng.random() < self.cfg.crash_probability:
                self.crashes += 1
                self.crashed = True  # the restarted runner runs its next pass one interval later
                break
            self.paused_deletions += kind == "delete" and (self.spec_pause or runner_paused)
            self.deleted_now |= kind == "delete"
            act()
        return decision

    def _record(self, status: dict, now: float) -> None:
        """The timeline, from the persisted status (what survives a crash)."""
        sub, rs = status["status"], status["resume"]
        index = sub["currentStepIndex"]
        state = sub.get("currentStepState")
        completed = state == engine.COMPLETED and sub["upgradingPodSpecRevision"] == self.revision
        if (status["phase"] == engine.PROGRESSING or completed) and self.policy.steps:
            rec = self.steps.setdefault(index, StepRecord(index, started=now, after=_after(self.policy, index)))
            if rec.ready is None:  # the target as the step met it (N may change later)
                rec.target = sub["currentUpgradeReplicas"]
            if rs["pausedByRunner"] and rs["pauseReason"] == "failure":
                if rec.fallback_retries is None:
                    rec.fallback_retries = sub["currentFailureRetry"]
            elif state in (engine.STEP_PAUSED, engine.STEP_READY, engine.COMPLETED) and rec.ready is None:
                rec.ready = now
                rec.upgraded_at_ready = sum(1 for n in self.nodes if (p := self._live(n))
                                            and p.revision == sub["upgradingPodSpecRevision"])
                rec.failed_at_ready = rs["failedNodeCount"]
        if status["phase"] == engine.TERMINATING and index in self.steps \
                and self.steps[index].fallback_retries is None and rs["abandonedRevision"]:
            self.steps[index].fallback_retries = sub["currentFailureRetry"]
        wave_key = f"{rs.get('waveStartTime')}/{rs.get('waveKind')}"
        if rs.get("wave") and wave_key not in self.seen_waves:
            self.seen_waves.add(wave_key)
            kind, size = rs["waveKind"], len(rs["wave"])
            if kind == "rollback":
                self.rollback_waves.append(size)
            elif index in self.steps:
                (self.steps[index].retries if kind == "retry" else self.steps[index].deletions).append(size)
        cap = self._cap(status)
        if cap is not None and self.deleted_now:  # the cap of the pass that deleted (N may change later)
            self.over_cap = max(self.over_cap, len(self.in_flight) - cap)

    def _persist(self, status: dict) -> None:
        self.status = status

    def _set_pause(self, value: bool) -> None:
        self.spec_pause = value

    def _delete(self, ref: engine.PodRef, now: float, upgrading: str | None) -> None:
        pod = self.pods.get(ref.uid)
        if pod is None or pod.name != ref.name or pod.deleting is not None:
            return  # the uid precondition: a repeated deletion is harmless
        if pod.revision == upgrading and pod.ready_at is not None and pod.ready_at <= now:
            self.deleted_ready_upgraded += 1
        pod.deleting, pod.gone_at = now, now + self.cfg.terminate_latency
        self.in_flight.add(pod.node)

    def _cap(self, status: dict) -> int | None:
        if status["phase"] not in (engine.PROGRESSING, engine.TERMINATING, engine.DISABLING) \
                or not self.policy.steps:
            return None
        live = len(self.nodes)
        return self.policy.caps(live)[min(status["status"]["currentStepIndex"], len(self.policy.steps) - 1)]

    def _changing(self, now: float) -> bool:
        """Whether pods are still terminating or coming up."""
        return any(p.gone_at is not None or (p.ready_at is not None and p.ready_at > now)
                   for p in self.pods.values())

    def _next_time(self, now: float, decision: engine.Decision) -> float:
        """The next pass: one interval on, or the next time anything can change, on the loop's grid."""
        step = self.cfg.interval
        if self.crashed or not self._quiet(decision):
            return now + step
        times = [t for p in self.pods.values() for t in (p.gone_at, p.ready_at, p.failed_at)
                 if t is not None and t > now]
        times += [t for t in (decision.wake_at, self.unpause_at) if t is not None]
        times += [t for t, _ in self.admin[:1]]
        times += [t for t in self.cfg.busy_nodes.values() if t > now]
        if not times:
            return self.cfg.max_time + step  # nothing can change any more
        return now + step * max(1, -(-(min(times) - now) // step))

    def _quiet(self, decision: engine.Decision) -> bool:
        return not decision.delete and decision.restore_revision is None and decision.set_pause is None


def _after(policy: Policy, index: int) -> str | int:
    ms = policy.steps[index].pause_ms
    return "manual" if ms is None else ms


def simulate(policy: Policy, nodes: int, ready_latency: float = 30.0, interval: float = 5.0) -> Result:
    """The no-failure dry run of `rollout simulate`: every node moves to a new driver revision."""
    sim = Simulation(Config(nodes=nodes, interval=interval, ready_latency=(ready_latency, ready_latency)),
                     dataclasses.replace(policy, enable_rollout=True, pause=False))
    sim.set_revision(NEW)
    return sim.run()
