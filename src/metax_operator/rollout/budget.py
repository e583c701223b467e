"""How many nodes at once: the one place that decides how many driver pods a wave may take.

A step's cap is `maxParallel`: an int, or max(1, ceil(p% x the step's share of the targets));
0 means no cap (`step_caps`). A new wave takes at most the cap less the nodes in flight, whatever
wave started them (`in_flight`: a pod being deleted with no Ready successor, a young pod not Ready
yet, a wave node whose pod is gone and not back, each within the readiness timeout from its own
deletion or creation; a node past it is failed and holds no slot), and at most what the step
still needs (`Budget.take`).

The same cap bounds the GPU nodes out of service: a wave takes a node still serving only while
the nodes in flight and those out of service for a reason of their own (`out_of_service`:
cordoned by someone else, or a driver pod not Ready that is neither starting nor failed, or none)
stay within the cap plus `maxUnavailable` (`Budget.availability`). An admin's maintenance or a
node gone NotReady thus slows the rollout instead of adding to it; a node already out of service
costs no availability, and is taken within the cap alone. Failed nodes are the steps'
`toleration` and `maxUnavailable` at the end, not counted here.

The upgrade wave, the retry wave (whose rest stays queued), the rollback wave and an admin's retry
label all take through `Budget`; the number of waves a step needs and when it should be done by
(`step_deadline`, a metric the alerts read) come from the same caps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TypeVar

from metax_operator.chart.upgrade_policy import Policy
from metax_operator.conditions import parse_time
from metax_operator.rollout.observation import Cluster, NodePods, starting
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


def out_of_service(observed: Cluster, pods: NodePods, counted: Iterable[str]) -> frozenset[str]:
    """The eligible nodes out of service for a reason of their own, but for those `counted`
    elsewhere (in flight, failed): cordoned by someone other than the runner, or whose driver pod
    is not Ready (its node NotReady, its driver down), or that have no driver pod; and the GPU
    nodes of the other driver DaemonSets' rollouts out of service (`Cluster.elsewhere`: being
    swapped or moved, not Ready, cordoned), since one budget holds for all. Its own nodes count
    by the rules before, also where the other rollouts see them out of service: a wave's node
    whose new pod is Ready serves again once the runner gives back its cordon in this pass."""
    cordoned = (observed.unschedulable - observed.cordoned) & observed.nodes
    return (cordoned | pods.not_ready | (observed.elsewhere - observed.nodes)).difference(counted)


@dataclass(frozen=True)
class Budget:
    """What a wave may take in this pass: `cap` nodes at once less those `in_flight`, and of the
    nodes still serving only as many as leave the nodes out of service (`in_flight` and
    `out_of_service`) within the cap plus `allowance` (`maxUnavailable`). A node out of service
    or `failed` serves nothing: taking it costs a place in the cap only."""

    cap: int
    in_flight: frozenset[str]
    out_of_service: frozenset[str] = frozenset()
    allowance: int = 0
    failed: frozenset[str] = frozenset()

    @classmethod
    def for_step(
        cls,
        policy: Policy,
        nodes: int,
        index: int,
        in_flight: frozenset[str],
        out: frozenset[str] = frozenset(),
        failed: frozenset[str] = frozenset(),
    ) -> Budget:
        """The budget of step `index` (the last step's beyond the list) on `nodes` eligible pods;
        `out` out of service (`out_of_service`, without the nodes in flight)."""
        caps = step_caps(policy, nodes)
        cap = caps[min(index, len(caps) - 1)] if caps else max(nodes, 1)
        return cls(cap, in_flight, out, policy.max_unavailable.of(nodes), failed)

    @property
    def room(self) -> int:
        """Nodes a wave may take within the cap."""
        return max(self.cap - len(self.in_flight), 0)

    @property
    def availability(self) -> int:
        """Nodes still serving a wave may take out of service."""
        return max(self.cap + self.allowance - len(self.in_flight) - len(self.out_of_service), 0)

    def take(
        self, candidates: Sequence[T], want: int | None = None, node: Callable[[T], str] = attrgetter("node")
    ) -> tuple[list[T], list[T]]:
        """The wave (the candidates, in order, that the room and the availability allow, at most
        `want` of them) and the rest, in order; `node` names a candidate's node (a pod's)."""
        count = self.room if want is None else min(self.room, max(want, 0))
        serving = self.availability
        wave: list[T] = []
        rest: list[T] = []
        for candidate in candidates:
            free = node(candidate) in self.out_of_service or node(candidate) in self.failed
            if len(wave) < count and (free or serving > 0):
                wave.append(candidate)
                serving -= not free
            else:
                rest.append(candidate)
        return wave, rest

    def with_deleted(self, nodes: Iterable[str]) -> Budget:
        """This budget once `nodes` (deleted in this pass) are in flight too."""
        flying = self.in_flight | frozenset(nodes)
        return Budget(self.cap, flying, self.out_of_service - flying, self.allowance, self.failed)


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
