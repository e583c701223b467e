"""How many nodes at once: the one place that decides how many driver pods a wave may take.

A step's cap is `maxParallel`: an int, or max(1, ceil(p% x the step's share of the targets));
0 means no cap (`step_caps`). A new wave takes at most the cap less the nodes in flight, whatever
wave started them (`in_flight`: a pod being deleted with no Ready successor, a young pod not Ready
yet, a wave node whose pod is gone and not back, each within the readiness timeout from its own
deletion or creation; a node past it is failed and holds no slot), and at most what the step
still needs (`Budget.take`). The upgrade wave, the retry wave (whose rest stays queued), the
rollback wave and an admin's retry label all take through `Budget`; the number of waves a step
needs and when it should be done by (`step_deadline`, a metric the alerts read) come from the
same caps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from metax_operator.chart.upgrade_policy import Policy
from metax_operator.conditions import parse_time
from metax_operator.rollout.observation import NodePods, starting
from metax_operator.rollout.status import PROGRESSING, UpgradeStatus

T = TypeVar("T")


def step_caps(policy: Policy, nodes: int) -> list[int]:
    """Each step's batch cap on `nodes` eligible pods: `maxParallel` int, or max(1, ceil(p% x
    the step's share of the targets)); an int 0 is no cap (every node)."""
    caps, previous = [], 0
    for target in policy.targets(nodes):
        limit = policy.max_parallel
        if not limit.percent:
            caps.append(limit.value if limit.value else max(nodes, 1))
        else:
            caps.append(max(1, limit.of(target - previous)))
        previous = target
    return caps


def step_waves(policy: Policy, nodes: int) -> list[int]:
    """Each step's number of waves on `nodes` eligible pods with no failure: its share of the
    targets in batches of its cap."""
    targets = policy.targets(nodes)
    return [-(-(t - p) // cap) for t, p, cap in zip(targets, [0, *targets], step_caps(policy, nodes), strict=False)]


def in_flight(pods: NodePods, coming: Iterable[str], now: float, timeout: float) -> frozenset[str]:
    """The nodes whose driver is being swapped now: a pod being deleted with no Ready successor,
    a live pod starting (`observation.starting`), or a wave node with no pod yet (`coming`, those
    the caller has not found stuck), each within the readiness timeout."""
    swapping = {n for n, since in pods.deleting.items() if now - since < timeout and not (n in pods.live and pods.live[n].ready)}
    swapping.update(node for node, pod in pods.live.items() if starting(pod, now, timeout))
    swapping.update(coming)
    return frozenset(swapping)


@dataclass(frozen=True)
class Budget:
    """What a wave may take in this pass: `cap` nodes at once less those `in_flight`."""

    cap: int
    in_flight: frozenset[str]

    @classmethod
    def for_step(cls, policy: Policy, nodes: int, index: int, in_flight: frozenset[str]) -> Budget:
        """The budget of step `index` (the last step's beyond the list) on `nodes` eligible pods."""
        caps = step_caps(policy, nodes)
        return cls(caps[min(index, len(caps) - 1)] if caps else max(nodes, 1), in_flight)

    @property
    def room(self) -> int:
        return max(self.cap - len(self.in_flight), 0)

    def take(self, candidates: Sequence[T], want: int | None = None) -> tuple[list[T], list[T]]:
        """The wave (the first candidates the room allows, at most `want` of them) and the rest."""
        count = self.room if want is None else min(self.room, max(want, 0))
        return list(candidates[:count]), list(candidates[count:])

    def with_deleted(self, nodes: Iterable[str]) -> Budget:
        """This budget once `nodes` (deleted in this pass) are in flight too."""
        return Budget(self.cap, self.in_flight | frozenset(nodes))


def wave_bound(policy: Policy) -> float | None:
    """The longest one wave may take under `policy`, seconds, before the runner acts on its own
    (the wait for matching pods, the drain, the readiness timeout, each bounded); None when the
    wait for matching pods has no timeout."""
    if policy.wait_selector and not policy.wait_timeout_ms:
        return None
    wait_ms = policy.wait_timeout_ms if policy.wait_selector else 0
    drain_ms = policy.drain_timeout_ms if policy.drain else 0
    return (wait_ms + drain_ms + policy.readiness_timeout_ms) / 1000


def step_deadline(status: UpgradeStatus, policy: Policy | None) -> float | None:
    """When the current step should be done by (seconds since the epoch): its start, plus one
    `wave_bound` per wave its nodes need at the step's cap and per retry the policy allows
    (`maxFailureThreshold`), plus its timed pause. None while no bound applies: no rollout in
    progress, the policy unknown or invalid, a pause (the admin's, or the runner's waiting for
    the admin), or a wait for matching pods without a timeout."""
    step, resume = status.step, status.resume
    start = parse_time(resume.step_start_time)
    if policy is None or not policy.steps or status.phase != PROGRESSING or start is None:
        return None
    if policy.pause or resume.paused_by_runner or (wave := wave_bound(policy)) is None:
        return None
    index = min(step.current_step_index, len(policy.steps) - 1)
    waves = max(1, step_waves(policy, step.total_upgrade_replicas)[index]) + policy.max_failure_threshold
    return start + waves * wave + (policy.steps[index].pause_ms or 0) / 1000
