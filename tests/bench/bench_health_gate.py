"""What one snapshot of the health gate costs the runner (`runtime.node_health.read`): the three
paged LISTs at a step's pause, against the API server of the runner's benchmark at scale
(tests/scaleapi.py: nodes as kubelets write them, about 20 KB each; with `+pods`, 10 more
DaemonSet pods per node and GPU jobs on half of them). The read runs in a process of its own,
as the runner runs it (its imports and client made first): wall time, CPU, and the peak of its
RSS above what it held before the read. The API server's CPU for the same read is printed beside.
The runner reads one at a step's pause, every 5 minutes of it, and when the step is due to
promote. `BENCH_HEALTH` chooses the scenarios (`10k,10k+pods` by default; those of
`bench_scale`). `python -m tests.bench health_gate`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from tests import scaleapi
from tests.bench.bench_scale import POLICY, SCENARIOS, Run, proc
from tests.runtime.test_reconcile import VALUES

READ = """
import json, resource, sys, time
from pathlib import Path
from metax_operator.runtime import node_health
from metax_operator.runtime.kube import Client

def rss():
    status = dict(l.split(":", 1) for l in Path("/proc/self/status").read_text().splitlines() if ":" in l)
    return int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024

api = Client.connect(sys.argv[1])
api.server_version()
before, _ = rss()
wall, cpu = time.perf_counter(), time.process_time()
health = node_health.read(api, sys.argv[2], time.time())
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
_, peak = rss()
print(json.dumps({"nodes": len(health.nodes), "wall": wall, "cpu": cpu, "rss_before": before, "peak": peak}))
"""


def kubeconfig(path: Path, port: int) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "scale", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "runner", "user": {"token": "bench"}}],
                "contexts": [{"name": "scale", "context": {"cluster": "scale", "user": "runner"}}],
                "current-context": "scale",
            }
        )
    )
    return path


def main() -> None:
    names = [n for n in os.environ.get("BENCH_HEALTH", "10k,10k+pods").split(",") if n]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"BENCH_HEALTH: unknown scenario {', '.join(unknown)}: choose from {', '.join(SCENARIOS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-health-") as tmp:
        release = Path(tmp) / "release.json"
        release.write_text(json.dumps(scaleapi.release(VALUES, POLICY)))
        for name in names:
            with Run(SCENARIOS[name], release, [], Path(tmp)) as run:
                info = run.start_api()
                config = kubeconfig(Path(tmp) / "kubeconfig", run.port)
                served = proc(run.api.pid)["cpu"]
                out = subprocess.run(
                    [sys.executable, "-c", READ, str(config), scaleapi.NS], capture_output=True, text=True, check=True
                )
                read = json.loads(out.stdout)
                served = proc(run.api.pid)["cpu"] - served
                assert read["nodes"] == SCENARIOS[name].nodes, read
                rows.append((name, info.get("pods", "?"), read, served))
    print("| nodes (pods) | snapshot wall | its CPU | its peak RSS above the runner's | the API server's CPU |")
    print("| --- | --- | --- | --- | --- |")
    for name, pods, read, served in rows:
        print(
            f"| {name} ({pods}) | {read['wall']:.2f} s | {read['cpu']:.2f} s | "
            f"{read['peak'] - read['rss_before']:.0f} MiB | {served:.2f} s |"
        )


if __name__ == "__main__":
    main()
