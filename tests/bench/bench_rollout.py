"""Rollout engine figures: cost of one decision at 10,000 and 100,000 nodes, API actions per
pass, and the simulated duration of the seed's 100-node policy scaled to 10,000 nodes against the
ideal schedule.

Targets: one decision <= 0.2 s CPU and <= 100 MB peak at 10,000 nodes, <= 0.5 s CPU and
<= 300 MB at 100,000; the simulated rollout within one loop interval per wave of the ideal (sum
of waves x pod-ready latency + timed pauses).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import resource
import statistics
import time
import tracemalloc

from metax_operator.chart.upgrade_policy import validate
from metax_operator.rollout import engine
from metax_operator.rollout.decision import Decision
from metax_operator.rollout.observation import Cluster, Pod
from metax_operator.rollout.simulate import NEW, Config, Simulation

NODES = 10_000
LATENCY = 60.0
INTERVAL = 5.0
# Seed 001 scenario 2 (100 nodes), its int steps scaled x100 to 10,000 nodes.
SCALED_SEED_POLICY = {
    "enableRollout": True,
    "upgradeSteps": [
        {"replicas": "5%", "pauseDuration": {}},
        {"replicas": 3000, "pauseDuration": 300000},
        {"replicas": 6000, "pauseDuration": 300000},
        {"replicas": "100%", "pauseDuration": {}},
    ],
    "maxParallel": "50%",
    "maxUnavailable": "10%",
    "maxFailureThreshold": 5,
    "fallback": "pause",
}


def one_decision(observed: Cluster, policy, status, now: float) -> tuple[float, float, Decision]:
    """(median CPU seconds, peak MiB) of `decide` on this input."""
    cpu = []
    for _ in range(5):
        started = time.process_time()
        decision = engine.decide(observed, policy, status, now)
        cpu.append(time.process_time() - started)
    tracemalloc.start()
    engine.decide(observed, policy, status, now)
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return statistics.median(cpu), peak, decision


def decision_costs(count: int, cpu_target: float, memory_target: float) -> None:
    """One decision over `count` nodes at three moments of a one-wave rollout, against the targets
    (seconds of CPU, MiB)."""
    policy = validate({"enableRollout": True, "maxParallel": 0, "upgradeSteps": [{"replicas": "100%"}]})
    nodes = [f"node-{i:06d}" for i in range(count)]
    old = tuple(Pod(f"metax-driver-{i}", f"uid-{i}", node, "old", True, "Running", 0, 0.0) for i, node in enumerate(nodes))
    observed = Cluster("new", True, frozenset(nodes), old)
    print(f"one decision at {count} nodes (median CPU of 5 runs; tracemalloc peak of the decision's allocations):")
    cpu, peak, start = one_decision(observed, policy, None, 1000.0)
    worst = [(cpu, peak)]
    print(f"  rollout start, one wave of {len(start.delete)} deletions (maxParallel 0): {cpu * 1000:6.1f} ms CPU {peak:6.1f} MiB")
    coming = tuple(
        Pod(f"metax-driver-{i}b", f"uid-{i}b", node, "new", i % 2 == 0, "Running", 0, 1001.0) for i, node in enumerate(nodes)
    )
    cpu, peak, _ = one_decision(Cluster("new", True, frozenset(nodes), coming), policy, start.status, 1010.0)
    worst.append((cpu, peak))
    print(f"  that wave in flight, {count // 2} pods not Ready yet:            {cpu * 1000:6.1f} ms CPU {peak:6.1f} MiB")
    ready = tuple(Pod(p.name, p.uid, p.node, "new", True, "Running", 0, p.created) for p in coming)
    cpu, peak, _ = one_decision(Cluster("new", True, frozenset(nodes), ready), policy, start.status, 1100.0)
    worst.append((cpu, peak))
    print(f"  every pod Ready: rollout completes:                     {cpu * 1000:6.1f} ms CPU {peak:6.1f} MiB")
    cpu, peak = max(c for c, _ in worst), max(m for _, m in worst)
    met = "met" if cpu <= cpu_target and peak <= memory_target else "NOT met"
    print(
        f"  target: <= {cpu_target * 1000:.0f} ms CPU and <= {memory_target:.0f} MiB: {met} (worst {cpu * 1000:.0f} ms, "
        f"{peak:.0f} MiB; this process's peak RSS so far, inputs included: "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; load average {os.getloadavg()[0]:.1f})"
    )
    if met != "met":
        profile(lambda: engine.decide(observed, policy, None, 1000.0), "the rollout start")


def profile(call, what: str, lines: int = 8) -> None:
    """Where `call` spends its time: cProfile's functions by own time."""
    profiler = cProfile.Profile()
    profiler.runcall(call)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(lines)
    table = out.getvalue()
    print(f"  where {what} spends its time (cProfile, by own time):")
    print("\n".join("    " + line for line in table[table.index("ncalls") :].rstrip().splitlines()))


def scaled_rollout() -> None:
    policy = validate(SCALED_SEED_POLICY)
    sim = Simulation(Config(nodes=NODES, interval=INTERVAL, ready_latency=(LATENCY, LATENCY)), policy)
    sim.set_revision(NEW)
    started = time.process_time()
    result = sim.run()
    cpu = time.process_time() - started
    waves = sum(len(s.deletions) for s in result.steps)
    pauses = sum(s.after / 1000 for s in result.steps[:-1] if s.after != "manual")
    ideal = waves * LATENCY + pauses
    # time spent waiting for the admin's answer to a manual pause is not the engine's
    admin_wait = sum(nxt.started - s.ready for s, nxt in zip(result.steps, result.steps[1:], strict=False) if s.after == "manual")
    measured = result.steps[-1].ready - admin_wait
    actions = [a for a in result.actions_per_pass if a]
    print(f"seed 001 scenario 2 scaled to {NODES} nodes (pod Ready after {LATENCY:.0f} s, pass every {INTERVAL:.0f} s):")
    for s in result.steps:
        print(f"  step {s.step}: target {s.target:5d}  deletions {s.deletions}  after {s.after}")
    print(
        f"  simulated rollout: {measured:.0f} s (admin waits excluded); ideal {ideal:.0f} s "
        f"= {waves} waves x {LATENCY:.0f} s + {pauses:.0f} s of timed pauses"
    )
    print(
        f"  over the ideal: {measured - ideal:.0f} s = {(measured - ideal) / waves:.1f} s per wave "
        f"(target <= {INTERVAL:.0f} s, one loop interval)"
    )
    print(
        f"  passes: {result.passes}; API actions per pass: max {max(result.actions_per_pass)} "
        f"(a whole wave of deletions), mean {statistics.mean(actions):.0f} over the {len(actions)} passes that act, "
        "plus one status write when the status changed"
    )
    print(f"  simulator + engine CPU for the whole rollout: {cpu:.1f} s ({cpu / result.passes * 1000:.0f} ms per pass)")


def main() -> None:
    decision_costs(NODES, 0.2, 100)
    decision_costs(100_000, 0.5, 300)
    scaled_rollout()


if __name__ == "__main__":
    main()
