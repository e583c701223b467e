"""What cordoning costs a rollout, and the per-wave overhead over the ideal schedule, on the real
control plane with 500 kwok GPU nodes.

One cluster (bench_rollout_cluster's: the driver DaemonSet under OnDelete, pods Ready
`READY_LATENCY` s after creation, the CR with its 4-step policy) and, for each rollout of a new
driver template, a fresh `metax-operator run` (1 s interval) serving its metrics: `cordon: false`,
`cordon: true` (the default), `cordon: false` again, all with passes woken by the watches, then
`cordon: true` at the fixed pace (`--interval-only`). For each: wall time, waves, seconds per wave
and over the ideal schedule (the engine's simulator with passes 50 ms apart), the runner's API
requests by HTTP method during the rollout (its `metax_operator_api_requests_total`), so the
difference is what the cordon and the uncordon add, and the load average. `python -m tests.bench cordon`
(env METAX_BENCH_CORDON_NODES to change the size).
"""

from __future__ import annotations

import os
import statistics
import time
import urllib.request
from pathlib import Path

from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from metax_operator.chart import upgrade_policy as policy_mod
from metax_operator.rollout.simulate import Config, simulate
from tests.bench.bench_pass_latency import PodTimes
from tests.bench.bench_rollout_cluster import (
    INTERVAL,
    NS,
    POLICY,
    READY_LATENCY,
    cluster_session,
    passes,
    rolled_out,
    start_runner,
)
from tests.controlplane import free_port, stop_pid
from tests.e2e.tools import CR

METHODS = ("GET", "PATCH", "DELETE", "PUT", "POST")


def requests(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {
        s.labels["method"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "metax_operator_api_requests_total"
    }


def rollout(api, times: PodTimes, log: Path, port: int, image: str, cordon: bool, deadline: float) -> dict:
    """Patch the policy's `cordon`, then the template to `image`; the figures once it completed."""
    client.CustomObjectsApi(api).patch_cluster_custom_object(*CR, {"spec": {"driver": {"upgradePolicy": {"cordon": cordon}}}})
    time.sleep(3)  # a few passes: the runner reads the policy
    before, lines = requests(port), len(passes(log))
    client.AppsV1Api(api).patch_namespaced_daemon_set(
        "metax-driver", NS, {"spec": {"template": {"spec": {"containers": [{"name": "driver-manager", "image": image}]}}}}
    )
    t0 = time.monotonic()
    while not rolled_out(log, lines):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the rollout to {image} did not complete in time")
        time.sleep(0.5)
    wall, after = time.monotonic() - t0, requests(port)
    seen: set[str] = set()
    waves = []
    for entry in passes(log)[lines:]:
        new = [name for name in entry["deleted"] if name not in seen]
        seen.update(new)
        if new:
            waves.append(new)
    gaps, swaps = times.between(waves, image)
    return {
        "wall": wall,
        "waves": len(waves),
        "pods": len(seen),
        "gap": statistics.median(gaps),
        "swap": statistics.median(swaps),
        "requests": {m: after.get(m, 0) - before.get(m, 0) for m in METHODS},
    }


def main() -> None:
    nodes = int(os.environ.get("METAX_BENCH_CORDON_NODES", "500"))
    budget = 400 + nodes * 1.2
    with cluster_session(nodes, budget, "bench-cordon-") as session:
        if session is None:
            return
        cp, api, tmp, started, runners = session
        cp.pods_ready_after([f"gpu-node-{i:04d}" for i in range(nodes)], READY_LATENCY)
        deadline = started + budget
        ideal = simulate(policy_mod.validate(POLICY), nodes, ready_latency=READY_LATENCY, interval=0.05).end_time
        ideal_swap = Config(nodes).terminate_latency + READY_LATENCY  # the simulator's swap of one pod
        times = PodTimes(api)
        results = {}
        # Off, on, off: the first rollout of a fresh cluster is not favoured either way; then on
        # at the fixed pace.
        runs = [
            ("cordon: false", False, True),
            ("cordon: true", True, True),
            ("cordon: false", False, True),
            ("cordon: true, --interval-only", True, False),
        ]
        for version, (name, cordon, woken) in enumerate(runs, start=2):
            log, port = tmp / f"runner-{version}.log", free_port()
            runner = start_runner(
                cp,
                log,
                runners,
                "--interval",
                str(INTERVAL),
                "--health-port",
                str(port),
                "--health-host",
                "127.0.0.1",
                *([] if woken else ["--interval-only"]),
            )
            try:
                r = rollout(api, times, log, port, f"registry.example/driver:{version}", cordon, deadline)
            finally:
                stop_pid(runner.pid, runner)
                runners.remove(runner)
            r["load"] = os.getloadavg()[0]
            results.setdefault(name, []).append(r)
        print(
            f"{nodes} nodes, 4 steps (10/30/60/100%, maxParallel 50%), pods Ready {READY_LATENCY:g} s after "
            f"creation, --interval {INTERVAL:g}; ideal schedule {ideal:.1f} s (no pass interval); runner "
            f"requests during each rollout:"
        )
        mean = {}
        for name, rs in results.items():
            r = mean[name] = {key: statistics.mean(x[key] for x in rs) for key in ("wall", "waves", "gap", "swap", "load")}
            r["pods"], r["requests"] = rs[0]["pods"], {m: statistics.mean(x["requests"][m] for x in rs) for m in METHODS}
            calls = ", ".join(f"{m} {r['requests'][m]:.0f}" for m in METHODS if r["requests"][m])
            print(
                f"  {name}{f' (mean of {len(rs)})' if len(rs) > 1 else ''}: {r['wall']:.1f} s, {r['waves']:g} waves "
                f"({r['wall'] / r['waves']:.2f} s per wave, {(r['wall'] - ideal) / r['waves']:+.2f} s per wave over "
                f"the ideal; target <= 0.25); median gap from a wave's last pod Ready to the next wave's first "
                f"deletion {r['gap']:.2f} s (the runner), median wave swap from first deletion to last pod Ready "
                f"{r['swap']:.2f} s (the cluster; {ideal_swap:g} s in the ideal: Terminating, then Ready); {r['pods']} pods; "
                f"{calls}; "
                f"load average {r['load']:.1f}",
                flush=True,
            )
        times.stop()
        on, off = mean["cordon: true"], mean["cordon: false"]
        added = {m: on["requests"][m] - off["requests"][m] for m in ("GET", "PATCH")}
        print(
            f"  cordoning adds {added['PATCH']:.0f} PATCH (writes: {added['PATCH'] / nodes:.2f} per node, "
            f"{added['PATCH'] / on['waves']:.1f} per wave) and {added['GET']:.0f} GET "
            f"({added['GET'] / nodes:.2f} per node); "
            f"{on['wall'] / on['waves'] - off['wall'] / off['waves']:+.2f} s per wave",
            flush=True,
        )


if __name__ == "__main__":
    main()
