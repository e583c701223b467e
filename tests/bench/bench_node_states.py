"""The nodes' upgrade-state labels (`rollout.node_state`): how many node writes they add to a
rollout at 500 and 10,000 nodes, against the node writes the rollout makes anyway (a cordon and
an uncordon per node).

The rollout runs in the OnDelete simulator (`rollout.simulate`) with the runner's rules for the
labels: the cordon before a deletion sets `deleting` and the uncordon the node's state in the
same write (`runtime.rollout_nodes`); after each pass, each node whose state differs from its
label is written, at most `STATE_WRITES_PER_PASS` a pass, the wave's nodes first
(`runtime.rollout_pass`). The fleet starts labelled `done` at the old revision, as an installed
cluster is.
"""

from __future__ import annotations

import time
from collections import Counter

from metax_operator.chart.upgrade_policy import validate
from metax_operator.contract import STATE_LABEL
from metax_operator.rollout.decision import Decision
from metax_operator.rollout.node_state import NodeUpgradeState, states
from metax_operator.rollout.simulate import NEW, Config, Simulation
from metax_operator.runtime.rollout_nodes import STATE_WRITES_PER_PASS, write_order

# Seed 001 scenario 2's shape in percentages, so that one policy fits both sizes.
POLICY = {
    "enableRollout": True,
    "upgradeSteps": [
        {"replicas": "5%", "pauseDuration": {}},
        {"replicas": "30%", "pauseDuration": 300000},
        {"replicas": "60%", "pauseDuration": 300000},
        {"replicas": "100%", "pauseDuration": {}},
    ],
    "maxParallel": "10%",
}


class LabelledSimulation(Simulation):
    """The simulator, with the runner's state labels written after each pass."""

    def __init__(self, config: Config, policy) -> None:
        super().__init__(config, policy)
        self.labels = dict.fromkeys(self.nodes, NodeUpgradeState.DONE)
        self.writes: Counter[str] = Counter()  # by the state written
        self.most_in_a_pass = 0
        self.cordoned: set[str] = set()  # by the runner, for their swap: uncordoned once their driver is back

    def _pass(self, now: float) -> Decision:
        observed = self.observe(now)
        decision = super()._pass(now)
        wanted = states(observed, decision, self.policy, now)
        if decision.cordon_first:  # the deletion's cordon, one write with its label
            for ref in decision.delete:
                self.labels[ref.node] = NodeUpgradeState.DELETING
                self.cordoned.add(ref.node)
        back = {n for n in self.cordoned if wanted.get(n) == NodeUpgradeState.DONE}  # the simulator keeps no cordons
        self.labels.update((n, NodeUpgradeState.DONE) for n in back)  # the uncordon, one write with its label
        self.cordoned -= back
        changed = write_order({n: {STATE_LABEL: s} for n, s in wanted.items() if self.labels.get(n) != s})
        for node in changed[:STATE_WRITES_PER_PASS]:
            self.labels[node] = wanted[node]
            self.writes[wanted[node]] += 1
        self.most_in_a_pass = max(self.most_in_a_pass, min(len(changed), STATE_WRITES_PER_PASS))
        return decision


def measure(nodes: int) -> tuple[int, float]:
    sim = LabelledSimulation(Config(nodes=nodes, interval=5.0, ready_latency=(60.0, 60.0)), validate(POLICY))
    sim.set_revision(NEW)
    started = time.process_time()
    result = sim.run()
    now, settling = result.end_time, 0
    while Counter(sim.labels.values()) != {NodeUpgradeState.DONE: nodes} and settling < 100:
        now, settling = now + sim.cfg.interval, settling + 1  # the passes after the rollout write what the cap left
        sim._advance(now)
        sim._pass(now)
    cpu = time.process_time() - started
    total = sum(sim.writes.values())
    rollout_writes = 2 * nodes  # a cordon and an uncordon per node
    print(f"{nodes} nodes, {result.passes} passes, then {settling} to write the last labels ({cpu:.1f} s CPU):")
    by_state = ", ".join(f"{state} {count}" for state, count in sorted(sim.writes.items()))
    print(f"  state-label writes: {total} = {total / nodes:.2f} per node; by state: {by_state}")
    print(
        f"  the rollout's own node writes: {rollout_writes} (a cordon and an uncordon per node); with the labels "
        f"{rollout_writes + total}: x{(rollout_writes + total) / rollout_writes:.2f}"
    )
    print(f"  most label writes in one pass: {sim.most_in_a_pass} (the cap is {STATE_WRITES_PER_PASS})")
    final = Counter(sim.labels.values())
    assert final == {NodeUpgradeState.DONE: nodes}, f"the labels did not end done: {final}"
    return total, total / nodes


def main() -> None:
    small, per_small = measure(500)
    large, per_large = measure(10_000)
    print(
        f"10,000 against 500 nodes: x{large / small:.1f} the writes for x20 the nodes "
        f"({per_large:.2f} against {per_small:.2f} per node): linear"
    )


if __name__ == "__main__":
    main()
