"""What paces a rollout: passes woken by the watches against passes on a fixed interval.

One cluster (bench_rollout_cluster's: the driver DaemonSet under OnDelete, pods Ready
`READY_LATENCY` s after creation) of `METAX_BENCH_LATENCY_NODES` (40) kwok GPU nodes and a policy
of many small waves (10/30/60/100%, 4 nodes at a time). For each runner interval (5 s, the
chart's default, and 1 s), two rollouts of a new driver template, one with `metax-operator run
--interval-only` (the fixed pace) and one without (woken by the watches), each by a fresh runner.
Printed for each: the gap from a wave's last new pod turning Ready to the next wave's first
deletion (median and max, as this process's pod watch sees them), and the rollout's wall time
against the ideal schedule (pod re-creation and Ready latency only: no pass interval).
`python -m tests.bench pass_latency`.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

from kubernetes import client, watch

from metax_operator.chart import upgrade_policy as policy_mod
from metax_operator.rollout.simulate import simulate
from tests.bench.bench_rollout_cluster import NS, READY_LATENCY, cluster_session, passes, rolled_out, start_runner
from tests.controlplane import stop_pid
from tests.e2e.tools import CR, ready

POLICY = {
    "enableRollout": True,
    "maxParallel": 4,
    "maxFailureThreshold": 0,
    "upgradeSteps": [
        {"replicas": "10%", "pauseDuration": 0},
        {"replicas": "30%", "pauseDuration": 0},
        {"replicas": "60%", "pauseDuration": 0},
        {"replicas": "100%", "pauseDuration": 0},
    ],
}


class PodTimes:
    """When each driver pod was seen deleted, and when each turned Ready (this process's clock)."""

    def __init__(self, api):
        self.deleted: dict[str, tuple[float, str]] = {}  # pod -> (time, node)
        self.ready: dict[str, tuple[float, str, str]] = {}  # pod -> (time, node, image)
        self._watch, self._stopped = watch.Watch(), threading.Event()
        core = client.CoreV1Api(api)
        self._thread = threading.Thread(target=self._follow, args=(core,), daemon=True)
        self._thread.start()

    def _follow(self, core) -> None:
        while not self._stopped.is_set():  # a watch the server ends is opened again
            try:
                for change in self._watch.stream(core.list_namespaced_pod, NS, timeout_seconds=300):
                    self._see(change)
            except Exception:  # noqa: BLE001 - the control plane stopping ends the watch; else reopened
                self._stopped.wait(0.5)

    def _see(self, change: dict) -> None:
        pod, now = change["object"], time.monotonic()
        name, node = pod.metadata.name, pod.spec.node_name
        if (change["type"] == "DELETED" or pod.metadata.deletion_timestamp) and name not in self.deleted:
            self.deleted[name] = (now, node)
        elif name not in self.ready and ready(pod):
            self.ready[name] = (now, node, pod.spec.containers[0].image)

    def between(self, waves: list[list[str]], image: str) -> tuple[list[float], list[float]]:
        """For `waves` (the pods each deleted): the gaps from a wave's last new pod (at `image`)
        turning Ready to the next wave's first deletion (what the runner adds), and each wave's
        swap, from its first deletion to its last new pod Ready (what the cluster takes)."""
        ready_on = {node: at for at, node, img in self.ready.values() if img == image}
        first_deleted = [min(self.deleted[pod][0] for pod in wave) for wave in waves]
        last_ready = [max(ready_on[self.deleted[pod][1]] for pod in wave) for wave in waves]
        gaps = [start - end for end, start in zip(last_ready, first_deleted[1:], strict=False)]
        return gaps, [end - start for start, end in zip(first_deleted, last_ready, strict=True)]

    def stop(self) -> None:
        self._stopped.set()
        self._watch.stop()


def rollout(
    cp, api, times: PodTimes, tmp: Path, runners: list, image: str, interval: float, woken: bool, deadline: float
) -> dict:
    """One rollout to `image` by a fresh runner; the gaps between waves and the wall time."""
    log = tmp / f"runner-{image.rsplit(':', 1)[1]}.log"
    runner = start_runner(cp, log, runners, "--interval", str(interval), *([] if woken else ["--interval-only"]))
    try:
        client.AppsV1Api(api).patch_namespaced_daemon_set(
            "metax-driver", NS, {"spec": {"template": {"spec": {"containers": [{"name": "driver-manager", "image": image}]}}}}
        )
        t0 = time.monotonic()

        while not rolled_out(log):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the rollout to {image} did not complete in time")
            time.sleep(0.2)
        wall = time.monotonic() - t0
    finally:
        stop_pid(runner.pid, runner)
        runners.remove(runner)
    waves = [entry["deleted"] for entry in passes(log) if entry.get("deleted")]
    gaps, _ = times.between(waves, image)
    return {"wall": wall, "waves": len(waves), "gaps": gaps}


def main() -> None:
    nodes = int(os.environ.get("METAX_BENCH_LATENCY_NODES", "40"))
    budget = 600 + nodes * 2
    with cluster_session(nodes, budget, "bench-latency-") as session:
        if session is None:
            return
        cp, api, tmp, started, runners = session
        client.CustomObjectsApi(api).patch_cluster_custom_object(*CR, {"spec": {"driver": {"upgradePolicy": POLICY}}})
        cp.pods_ready_after([f"gpu-node-{i:04d}" for i in range(nodes)], READY_LATENCY)
        times = PodTimes(api)
        # The ideal: passes 50 ms apart, so the schedule is the pods' re-creation and Ready latency.
        ideal = simulate(policy_mod.validate(POLICY), nodes, ready_latency=READY_LATENCY, interval=0.05).end_time
        print(
            f"{nodes} nodes, 4 steps (10/30/60/100%), 4 nodes at a time, pods Ready {READY_LATENCY:g} s after "
            f"creation; ideal schedule {ideal:.1f} s:"
        )
        version = 1
        try:
            for interval in (5.0, 1.0):
                for woken in (False, True):
                    version += 1
                    r = rollout(
                        cp, api, times, tmp, runners, f"registry.example/driver:{version}", interval, woken, started + budget
                    )
                    name = "woken by the watches" if woken else "fixed interval     "
                    print(
                        f"  --interval {interval:g}, {name}: gap Ready -> next deletion median "
                        f"{statistics.median(r['gaps']):.2f} s, max {max(r['gaps']):.2f} s over {len(r['gaps'])} "
                        f"gaps; wall {r['wall']:.1f} s for {r['waves']} waves ({r['wall'] / ideal:.2f}x ideal, "
                        f"{(r['wall'] - ideal) / r['waves']:+.2f} s per wave)",
                        flush=True,
                    )
        finally:
            times.stop()


if __name__ == "__main__":
    main()
