"""The health gate (`driver.upgradePolicy.healthGate`): a step promotes only while the nodes it
upgraded are as healthy as the nodes not upgraded yet, as Argo Rollouts' and Flagger's analysis
compares a canary with its baseline.

At the step's pause the runner takes a snapshot of every eligible node's health (`HealthSnapshot`, read
by `runtime.node_health` when the engine asks for one: `Decision.observe_health`) and the engine
compares two groups of it (`compare`): the upgraded nodes (driver pod at the rollout's revision,
Ready or not: a node that goes NotReady has its pods marked unready too) and the others (driver
pod at another revision). For each signal
(`HealthSignal`) the share of each group that shows it is worked out; the step regresses when the
upgraded nodes' share exceeds the others' by more than `maxRegression`'s percentage points.
Comparing with the nodes not upgraded yet, not with zero, keeps what is wrong across the fleet (a
rack down, a job failing everywhere) from failing a step it has nothing to do with. When either
group is empty (the last step's pause: every node is upgraded) there is nothing to compare and
the gate lets the step go on.

Failed nodes of the step (`RevisionView.failed`) are in neither group: the step's toleration
and retries already count them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from metax_operator.chart.upgrade_policy import HealthGate, HealthSignal

#: While a step is paused, the gate looks again this often (seconds).
RECHECK_S = 300.0


@dataclass(frozen=True)
class NodeHealth:
    """One node's signals as the snapshot read them."""

    ready: bool = True
    gpus_unavailable: bool = False  # allocatable metax-tech.com/* below capacity, or none at all
    last_restart: float = 0.0  # when a container of its driver or gpu-device pod last ended and restarted (0: never)
    last_failed_gpu_pod: float = 0.0  # when a pod requesting metax-tech.com/* last failed on it (0: never)

    def shows(self, signal: HealthSignal, since: float) -> bool:
        """Whether the node shows `signal`; restarts and failed pods count from `since` (when the
        step began)."""
        if signal is HealthSignal.NOT_READY:
            return not self.ready
        if signal is HealthSignal.GPUS_UNAVAILABLE:
            return self.gpus_unavailable
        last = self.last_restart if signal is HealthSignal.RESTARTS else self.last_failed_gpu_pod
        return last > 0 and last >= since


@dataclass(frozen=True)
class HealthSnapshot:
    """A snapshot of the eligible nodes' health, taken at `taken` (seconds since the epoch)."""

    taken: float
    nodes: Mapping[str, NodeHealth]


@dataclass(frozen=True)
class Comparison:
    """One signal in the two groups."""

    signal: HealthSignal
    upgraded: int  # upgraded nodes showing it
    upgraded_total: int
    others: int  # nodes not upgraded yet showing it
    others_total: int
    allowed: int  # percentage points

    @property
    def regression(self) -> float:
        """How many percentage points more of the upgraded nodes show the signal."""
        return 100 * self.upgraded / self.upgraded_total - 100 * self.others / self.others_total

    @property
    def regressed(self) -> bool:
        return self.regression > self.allowed

    def __str__(self) -> str:
        return (
            f"{self.signal.value}: {self.upgraded} of {self.upgraded_total} upgraded nodes "
            f"({_percent(self.upgraded, self.upgraded_total)}) against {self.others} of {self.others_total} others "
            f"({_percent(self.others, self.others_total)}), {self.regression:.1f} points more, {self.allowed} allowed"
        )


def compare(
    health: HealthSnapshot, upgraded: Collection[str], others: Collection[str], since: float, gate: HealthGate
) -> list[Comparison]:
    """Each signal compared between the `upgraded` nodes and the `others` (the nodes of either
    that the snapshot has: a node deleted since counts in neither); empty when a group is."""
    up = [health.nodes[n] for n in upgraded if n in health.nodes]
    rest = [health.nodes[n] for n in others if n in health.nodes]
    if not up or not rest:
        return []
    return [
        Comparison(
            signal,
            sum(1 for n in up if n.shows(signal, since)),
            len(up),
            sum(1 for n in rest if n.shows(signal, since)),
            len(rest),
            gate.allowed(signal),
        )
        for signal in HealthSignal
    ]


def verdict(comparisons: list[Comparison]) -> str:
    """The comparisons as one line: the regressions, or every signal when none regressed."""
    regressed = [c for c in comparisons if c.regressed]
    return "; ".join(str(c) for c in (regressed or comparisons))


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%"
