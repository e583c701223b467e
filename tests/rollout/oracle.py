"""The product's OnDelete simulator (`metax_operator.rollout.simulate`) with what only the tests
need: pods that fail or hang, nodes whose validation fails, a runner that crashes between two actions, GPU work on nodes, nodes
joining and leaving, nodes out of service for a while (cordoned by an admin, or NotReady: their
driver pod not Ready), an admin who follows a script, and the counters the safety properties check
(deletions of upgraded Ready pods, pods in flight beyond the cap, serving nodes taken beyond the
availability bound, deletions while paused, retries, fallbacks)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from metax_operator.rollout import simulate
from metax_operator.rollout.budget import step_caps
from metax_operator.rollout.decision import Decision, PodRef
from metax_operator.rollout.observation import Cluster
from metax_operator.rollout.simulate import NEW, OLD, SimPod, StepRecord
from metax_operator.rollout.status import DISABLING, PROGRESSING, TERMINATING, UpgradeStatus

__all__ = ["NEW", "OLD", "Config", "Simulation"]


@dataclass
class Config(simulate.Config):
    fail_probability: float = 0.0  # a new-revision pod fails (phase Failed) instead of becoming Ready
    hang_probability: float = 0.0  # a new-revision pod never becomes Ready
    validation_fail_probability: float = 0.0  # a new-revision pod's validation fails (upgradePolicy.validation)
    crash_probability: float = 0.0  # the runner crashes before an action with this probability
    admin_resumes_failures: bool = True  # the admin also resumes after a fallback pause
    busy_nodes: dict[str, float] = field(default_factory=dict)  # node -> time its GPU work ends
    cordoned_nodes: dict[str, tuple[float, float]] = field(default_factory=dict)  # node -> an admin's cordon, from, until
    down_nodes: dict[str, tuple[float, float]] = field(default_factory=dict)  # node -> NotReady (pods not Ready), from, until


@dataclass
class Step(StepRecord):
    retries: list[int] = field(default_factory=list)  # the retry waves' sizes
    upgraded_at_ready: int = 0  # pods at the upgrading revision when the step became Ready
    failed_at_ready: int = 0
    fallback_retries: int | None = None  # retries counted when the step took the fallback


@dataclass
class Result(simulate.Result):
    rollback_waves: list[int] = field(default_factory=list)
    crashes: int = 0
    deleted_ready_upgraded: int = 0  # Ready (and validated) pods at the upgrading revision the runner deleted (must be 0)
    max_in_flight_over_cap: int = 0  # after a pass that deleted: pods in flight beyond its cap (must be <= 0)
    # in a pass that deleted: serving nodes it took beyond the cap plus maxUnavailable less the
    # nodes not serving before it (must be <= 0)
    max_taken_over_availability: int = 0
    deletions_while_paused: int = 0  # deletions carried out while pause was true (must be 0)


class Simulation(simulate.Simulation):
    def __init__(self, config: Config, policy, admin: list[tuple[float, Callable[[Simulation], None]]] | None = None):
        super().__init__(config, policy)
        self.crash_rng = random.Random(config.seed + 1)  # crashes do not change the pods' fates
        self.validation_rng = random.Random(config.seed + 2)  # nor do validations
        self.admin = sorted(admin or [], key=lambda a: a[0])
        self.in_flight: set[str] = set()  # nodes whose pod the runner deleted, replacement not back yet
        self.rollback_waves: list[int] = []
        self.crashes = self.deleted_ready_upgraded = self.over_cap = self.paused_deletions = self.over_availability = 0
        self.down_before: set[str] = set()  # the nodes not serving when the pass began
        self.serving_taken = 0  # nodes serving then whose driver the pass deleted
        self.crashed = self.deleted_now = False
        self.invalid: set[str] = set()  # the pods whose validation fails

    def run(self) -> Result:
        result = super().run()
        return Result(
            **vars(result),
            rollback_waves=self.rollback_waves,
            crashes=self.crashes,
            deleted_ready_upgraded=self.deleted_ready_upgraded,
            max_in_flight_over_cap=self.over_cap,
            max_taken_over_availability=self.over_availability,
            deletions_while_paused=self.paused_deletions,
        )

    # -- the cluster ------------------------------------------------------------------------
    def add_node(self, name: str, now: float) -> None:
        self.nodes.add(name)
        self._create(name, now)

    def remove_node(self, name: str) -> None:
        self.nodes.discard(name)
        for pod in self.by_node.pop(name, []):
            del self.pods[pod.uid]
        self.in_flight.discard(name)

    def _new_pod(self, pod: SimPod, now: float) -> None:
        super()._new_pod(pod, now)
        roll = self.rng.random()
        if pod.revision != OLD and roll < self.cfg.fail_probability:
            pod.ready_at, pod.failed_at = None, pod.ready_at
        elif pod.revision != OLD and roll < self.cfg.fail_probability + self.cfg.hang_probability:
            pod.ready_at = None

    def _validate(self, ref: PodRef, now: float) -> None:
        pod = self.pods.get(ref.uid)
        if pod is not None and pod.check is None and pod.revision != OLD:
            if self.validation_rng.random() < self.cfg.validation_fail_probability:
                self.invalid.add(pod.uid)
        super()._validate(ref, now)

    def _validation_passes(self, pod: SimPod) -> bool:
        return pod.uid not in self.invalid

    def _advance(self, now: float) -> None:
        super()._advance(now)
        timeout = self.policy.readiness_timeout_ms / 1000
        validating = self.policy.validation is not None
        for node in list(self.in_flight):
            live = self._live(node)
            if (
                live
                and live.revision == self.revision
                and (
                    (
                        live.ready_at is not None
                        and live.ready_at <= now
                        and (not validating or (live.checked_at is not None and live.checked_at <= now))
                    )
                    or (live.failed_at is not None and live.failed_at <= now)
                    or now - live.created >= timeout
                )
            ):  # the engine's failed pods hold no slot; a validating one does
                self.in_flight.discard(node)

    def _gpu_busy(self, now: float) -> frozenset[str]:
        return frozenset(n for n, until in self.cfg.busy_nodes.items() if until > now)

    def _within(self, spans: dict[str, tuple[float, float]], now: float) -> set[str]:
        return {n for n, (start, end) in spans.items() if start <= now < end and n in self.nodes}

    def observe(self, now: float) -> Cluster:
        observed = super().observe(now)
        down = self._within(self.cfg.down_nodes, now)
        pods = tuple(dataclasses.replace(p, ready=False) if p.node in down else p for p in observed.pods)
        return dataclasses.replace(observed, pods=pods, unschedulable=frozenset(self._within(self.cfg.cordoned_nodes, now)))

    def unavailable(self, now: float) -> set[str]:
        """The nodes an admin cordoned or that are NotReady now."""
        return self._within(self.cfg.cordoned_nodes, now) | self._within(self.cfg.down_nodes, now)

    def not_serving(self, now: float) -> set[str]:
        """What the availability bound counts as the pass begins: the nodes in flight, and those
        an admin cordoned whose driver pod is Ready (a node NotReady, or whose driver failed, may
        be a failed node of the engine's, which the bound leaves to the toleration)."""
        cordoned = self._within(self.cfg.cordoned_nodes, now) - self._within(self.cfg.down_nodes, now)
        ready = {n for n in cordoned if (p := self._live(n)) and p.ready_at is not None and p.ready_at <= now}
        return self.in_flight | ready

    def _changes(self, now: float) -> list[float]:
        spans = [t for span in (*self.cfg.cordoned_nodes.values(), *self.cfg.down_nodes.values()) for t in span]
        return [*super()._changes(now), *(t for t, _ in self.admin[:1]), *self.cfg.busy_nodes.values(), *spans]

    # -- the admin --------------------------------------------------------------------------
    def _before_pass(self, now: float) -> None:
        while self.admin and self.admin[0][0] <= now:
            self.admin.pop(0)[1](self)

    def _answers(self, status: UpgradeStatus) -> bool:
        return status.resume.pause_reason != "failure" or self.cfg.admin_resumes_failures

    # -- the runner ---------------------------------------------------------------------------
    def _pass(self, now: float) -> Decision:
        self.crashed = self.deleted_now = False
        self.down_before, self.serving_taken = self.not_serving(now), 0
        return super()._pass(now)

    def _before(self, kind: str, decision: Decision) -> bool:
        if self.cfg.crash_probability and self.crash_rng.random() < self.cfg.crash_probability:
            self.crashes += 1
            self.crashed = True  # the restarted runner runs its next pass one interval later
            return False
        if kind == "delete":
            self.paused_deletions += self.spec_pause or decision.status.resume.paused_by_runner
            self.deleted_now = True
        return True

    def _quiet(self, decision: Decision) -> bool:
        return not self.crashed and super()._quiet(decision)

    def _delete(self, ref: PodRef, now: float, decision: Decision) -> None:
        pod = self.pods.get(ref.uid)
        upgrading = decision.status.step.upgrading_pod_spec_revision if decision.status.phase == PROGRESSING else None
        if (
            pod is not None
            and pod.deleting is None
            and pod.revision == upgrading
            and pod.ready_at is not None
            and pod.ready_at <= now
            and pod.node not in self._within(self.cfg.down_nodes, now)  # Ready as the API says
            and pod.uid not in self.invalid  # a node whose validation failed is failed: retried so
        ):
            self.deleted_ready_upgraded += 1
        super()._delete(ref, now, decision)
        if pod is not None and pod.deleting == now:
            self.in_flight.add(pod.node)
            ready = pod.ready_at is not None and pod.ready_at <= now and pod.uid not in self.invalid
            self.serving_taken += ready and pod.node not in self.down_before | self.unavailable(now)

    # -- the timeline -------------------------------------------------------------------------
    def _record(self, status: UpgradeStatus, now: float) -> None:
        sub, rs = status.step, status.resume
        index = sub.current_step_index
        was_ready = index in self.steps and self.steps[index].ready is not None
        super()._record(status, now)
        rec = self.steps.get(index)
        if rec is not None and not was_ready and rec.ready == now:
            rec.upgraded_at_ready = sum(
                1 for n in self.nodes if (p := self._live(n)) and p.revision == sub.upgrading_pod_spec_revision
            )
            rec.failed_at_ready = rs.failed.count
        failure_pause = status.phase == PROGRESSING and rs.paused_by_runner and rs.pause_reason == "failure"
        rolled_back = status.phase == TERMINATING and rs.abandoned_revision
        if rec is not None and rec.fallback_retries is None and (failure_pause or rolled_back):
            rec.fallback_retries = sub.current_failure_retry
        cap = self._cap(status)
        if cap is not None and self.deleted_now:  # the cap of the pass that deleted (N may change later)
            self.over_cap = max(self.over_cap, len(self.in_flight) - cap)
            room = max(cap + self.policy.max_unavailable.of(len(self.nodes)) - len(self.down_before), 0)
            self.over_availability = max(self.over_availability, self.serving_taken - room)

    def _step_record(self, index: int, now: float) -> Step:
        return Step(**vars(super()._step_record(index, now)))

    def _wave(self, status: UpgradeStatus, kind: str, size: int) -> None:
        super()._wave(status, kind, size)
        index = status.step.current_step_index
        if kind == "rollback":
            self.rollback_waves.append(size)
        elif kind == "retry" and index in self.steps:
            self.steps[index].retries.append(size)

    def _cap(self, status: UpgradeStatus) -> int | None:
        if status.phase not in (PROGRESSING, TERMINATING, DISABLING) or not self.policy.steps:
            return None
        return step_caps(self.policy, len(self.nodes))[min(status.step.current_step_index, len(self.policy.steps) - 1)]
