"""The pre-delete cleanup hook on a large cluster: how long removing our label from every GPU node
takes, NODE_WORKERS patches in flight versus one at a time, on the local control plane (a real
kube-apiserver and etcd; kwok nodes). The figures size the hook's budget in docs/hooks.md.

`python -m tests.bench cleanup` (part of `make bench`); `BENCH_CLEANUP_NODES=1000` probes only the
sizes listed.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from metax_operator.hooks import cleanup
from metax_operator.runtime import kube
from tests.controlplane import GPU_LABEL, ControlPlane, ControlPlaneError

SIZES = [int(n) for n in os.environ.get("BENCH_CLEANUP_NODES", "1000,10000").split(",")]


def label_all(client: kube.Client, names: list[str]) -> None:
    """Put our label back on every node (a cleanup removed it)."""
    patch = {"metadata": {"labels": {GPU_LABEL: "true"}}}
    for name in names:
        client.patch("v1", "Node", name, patch)


def timed_cleanup(client: kube.Client, workers: int) -> tuple[float, float, int]:
    """(wall seconds, this process's CPU seconds, nodes cleaned) of one cleanup."""
    cleanup.NODE_WORKERS = workers
    started, cpu = time.perf_counter(), time.process_time()
    done = cleanup.cleanup(client, "metax-operator", delete_crd=False)
    return time.perf_counter() - started, time.process_time() - cpu, len(done)


def probe(nodes: int, workdir: Path) -> None:
    try:
        cp = ControlPlane.start(workdir, gpu_nodes=0, plain_nodes=0, timeout=120)
    except ControlPlaneError as error:
        print(f"{nodes:>6} nodes: the control plane did not start: {error}")
        return
    try:
        names = cp.add_nodes(nodes, gpu=True, wait=False)
        client = kube.Client.connect(str(cp.kubeconfig))
        parallel = cleanup.NODE_WORKERS
        seconds, cpu, cleaned = timed_cleanup(client, parallel)
        print(
            f"{nodes:>6} nodes: cleanup with {parallel} patches in flight: {seconds:.1f} s "
            f"({cleaned / seconds:.0f} nodes/s, {cleaned} nodes cleaned; the hook's own CPU "
            f"{1000 * cpu / cleaned:.1f} ms per node)",
            flush=True,
        )
        if nodes <= 1000:
            label_all(client, names)
            seconds, cpu, cleaned = timed_cleanup(client, 1)
            print(
                f"{nodes:>6} nodes: cleanup one patch at a time: {seconds:.1f} s ({cleaned / seconds:.0f} nodes/s; "
                f"CPU {1000 * cpu / cleaned:.1f} ms per node)",
                flush=True,
            )
        cleanup.NODE_WORKERS = parallel
    finally:
        cp.stop()


def main() -> None:
    for nodes in SIZES:
        with tempfile.TemporaryDirectory(prefix=f"bench-cleanup-{nodes}-") as tmp:
            probe(nodes, Path(tmp))


if __name__ == "__main__":
    main()
