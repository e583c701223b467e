"""Scale probe of the local control plane: start it with 1,000 and then 5,000 simulated GPU
nodes, roll a DaemonSet onto all of them until every pod is Ready, and print the time each
phase took and the memory (RSS) of each process. Each probe is bounded (`LIMIT_S`) and stops
its control plane whatever happens.

`python -m tests.bench controlplane` (part of `make bench`); `BENCH_CONTROLPLANE_NODES=1000`
probes only the sizes listed.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from kubernetes import client

from tests.controlplane import GPU_LABEL, ControlPlane, ControlPlaneError

SIZES = [int(n) for n in os.environ.get("BENCH_CONTROLPLANE_NODES", "1000,5000").split(",")]
LIMIT_S = 900  # per probe: start, DaemonSet ready


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def probe(nodes: int, workdir: Path) -> None:
    started = time.monotonic()
    try:
        cp = ControlPlane.start(workdir, gpu_nodes=nodes, plain_nodes=0, timeout=LIMIT_S)
    except ControlPlaneError as error:
        print(f"{nodes:>5} nodes: the control plane did not start: {error}")
        return
    try:
        up = time.monotonic() - started
        apps = client.AppsV1Api(cp.api())
        labels = {"app": "probe"}
        apps.create_namespaced_daemon_set(
            "default",
            {
                "apiVersion": "apps/v1",
                "kind": "DaemonSet",
                "metadata": {"name": "probe"},
                "spec": {
                    "selector": {"matchLabels": labels},
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": {
                            "nodeSelector": {GPU_LABEL: "true"},
                            "containers": [{"name": "driver", "image": "registry.invalid/metax/driver:1"}],
                        },
                    },
                },
            },
        )
        rolled = time.monotonic()
        ready, deadline = 0, started + LIMIT_S
        while ready < nodes and time.monotonic() < deadline:
            time.sleep(1)
            ready = apps.read_namespaced_daemon_set_status("probe", "default").status.number_ready or 0
        rollout = time.monotonic() - rolled
        rss = cp.rss()
        outcome = "all Ready" if ready == nodes else f"only {ready} Ready when the {LIMIT_S} s limit hit"
        print(
            f"{nodes:>5} nodes: control plane up with nodes Ready in {up:.1f} s; DaemonSet of {nodes} pods "
            f"{outcome} in {rollout:.1f} s ({ready / rollout:.0f} pods/s)"
        )
        print(f"       memory: total {mib(sum(rss.values()))}; " + ", ".join(f"{k} {mib(v)}" for k, v in rss.items()))
    finally:
        cp.stop()


def main() -> None:
    print(f"control plane scale probe: {', '.join(map(str, SIZES))} nodes, {os.cpu_count()} CPUs")
    for nodes in SIZES:
        with tempfile.TemporaryDirectory(prefix="metax-bench-cp-") as tmp:
            probe(nodes, Path(tmp))


if __name__ == "__main__":
    main()
