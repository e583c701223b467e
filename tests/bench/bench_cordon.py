"""What cordoning costs a rollout, on the real control plane with 500 kwok GPU nodes.

One cluster (bench_rollout_cluster's: the driver DaemonSet under OnDelete, pods Ready
`READY_LATENCY` s after creation, the CR with its 4-step policy) and one `metax-operator run`
(1 s interval) serving its metrics. Two rollouts of a new driver template: with `cordon: true`
(the default) and with `cordon: false`. For each: wall time, waves, seconds per wave, and the
runner's API requests by HTTP method during the rollout (its `metax_operator_api_requests_total`),
so the difference is what the cordon and the uncordon add. `python -m tests.bench cordon`
(env METAX_BENCH_CORDON_NODES to change the size).
"""
from __future__ import annotations

import os
import time
import urllib.request
from pathlib import Path

from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from tests.bench.bench_rollout_cluster import INTERVAL, NS, READY_LATENCY, cluster_session, passes, start_runner
from tests.controlplane import free_port
from tests.e2e.tools import CR

METHODS = ("GET", "PATCH", "DELETE", "PUT", "POST")


def requests(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {s.labels["method"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "metax_operator_api_requests_total"}


def rollout(api, log: Path, port: int, image: str, cordon: bool, deadline: float) -> dict:
    """Patch the policy's `cordon`, then the template to `image`; the figures once it completed."""
    client.CustomObjectsApi(api).patch_cluster_custom_object(
        *CR, {"spec": {"driver": {"upgradePolicy": {"cordon": cordon}}}})
    time.sleep(3)  # a few passes: the runner reads the policy
    done_before = sum(p.get("state") == "Completed" for p in passes(log))
    before, lines = requests(port), len(passes(log))
    client.AppsV1Api(api).patch_namespaced_daemon_set("metax-driver", NS, {"spec": {"template": {"spec": {
        "containers": [{"name": "driver-manager", "image": image}]}}}})
    t0 = time.monotonic()
    while sum(p.get("state") == "Completed" for p in passes(log)) <= done_before:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the rollout to {image} did not complete in time")
        time.sleep(0.5)
    wall, after = time.monotonic() - t0, requests(port)
    seen: set[str] = set()
    waves = 0
    for entry in passes(log)[lines:]:
        new = [name for name in entry["deleted"] if name not in seen]
        seen.update(new)
        waves += bool(new)
    return {"wall": wall, "waves": waves, "pods": len(seen),
            "requests": {m: after.get(m, 0) - before.get(m, 0) for m in METHODS}}


def main() -> None:
    nodes = int(os.environ.get("METAX_BENCH_CORDON_NODES", "500"))
    budget = 300 + nodes * 0.9
    with cluster_session(nodes, budget, "bench-cordon-") as session:
        if session is None:
            return
        cp, api, tmp, started, runners = session
        cp.pods_ready_after([f"gpu-node-{i:04d}" for i in range(nodes)], READY_LATENCY)
        log, port = tmp / "runner.log", free_port()
        start_runner(cp, log, runners, "--interval", str(INTERVAL), "--health-port", str(port),
                     "--health-host", "127.0.0.1")
        deadline = started + budget
        # Off, on, off: the first rollout of a fresh cluster is not favoured either way.
        first = rollout(api, log, port, "registry.example/driver:2", False, deadline)
        on = rollout(api, log, port, "registry.example/driver:3", True, deadline)
        second = rollout(api, log, port, "registry.example/driver:4", False, deadline)
        off = {"wall": (first["wall"] + second["wall"]) / 2, "waves": (first["waves"] + second["waves"]) / 2,
               "pods": first["pods"], "requests": {m: (first["requests"][m] + second["requests"][m]) / 2
                                                   for m in METHODS}}
        print(f"{nodes} nodes, 4 steps (10/30/60/100%, maxParallel 50%), pods Ready {READY_LATENCY:g} s after "
              f"creation, pass every {INTERVAL:g} s; runner requests during each rollout:")
        for name, r in (("cordon: true", on), ("cordon: false (mean of 2)", off)):
            calls = ", ".join(f"{m} {r['requests'][m]:.0f}" for m in METHODS if r["requests"][m])
            print(f"  {name}: {r['wall']:.1f} s, {r['waves']:g} waves ({r['wall'] / r['waves']:.2f} s per wave), "
                  f"{r['pods']} pods; {calls}")
        added = {m: on["requests"][m] - off["requests"][m] for m in ("GET", "PATCH")}
        print(f"  cordoning adds {added['PATCH']:.0f} PATCH (writes: {added['PATCH'] / nodes:.2f} per node, "
              f"{added['PATCH'] / on['waves']:.1f} per wave) and {added['GET']:.0f} GET "
              f"({added['GET'] / nodes:.2f} per node); "
              f"{on['wall'] / on['waves'] - off['wall'] / off['waves']:+.2f} s per wave", flush=True)

if __name__ == "__main__":
    main()
