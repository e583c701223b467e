"""The staged rollout at scale on the real control plane: 500 kwok GPU nodes, then 5,000.

For each size: a `metax-driver` DaemonSet (OnDelete, one pod per GPU node, pods Ready
`READY_LATENCY` s after creation), the ClusterOperator CRD and CR with a 4-step policy, and one
`metax-operator run` process (admin credentials, 1 s interval). The driver template changes; the
runner rolls it out. Printed: the time the control plane took to come up with every driver pod
Ready and its processes' memory, the rollout's wall time against the ideal schedule (the
engine's simulator with the same Ready latency and passes 50 ms apart: pod re-creation only),
the runner's API requests and bytes per pass in steady state (its own request counter and
watch-cache counters from its log, and the bytes it read from its sockets, /proc/PID/io rchar),
its CPU seconds and peak memory, with the load average (the machine is shared). Each size is
bounded in time: `python -m tests.bench rollout_cluster` (env METAX_BENCH_SIZES="500,5000" to
choose; METAX_BENCH_PROFILE=1 runs the runner under cProfile and prints where its passes spend
their time).
"""

from __future__ import annotations

import contextlib
import io
import os
import pstats
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from kubernetes import client

from metax_operator.chart import upgrade_policy as policy_mod
from metax_operator.rollout.simulate import simulate
from tests.controlplane import GPU_LABEL, ControlPlane, stop_pid
from tests.e2e.tools import log_entries, ready

NS = "bench-rollout"
READY_LATENCY = 2.0
INTERVAL = 1.0
POLICY = {
    "enableRollout": True,
    "maxParallel": "50%",
    "maxFailureThreshold": 0,
    "upgradeSteps": [
        {"replicas": "10%", "pauseDuration": 0},
        {"replicas": "30%", "pauseDuration": 0},
        {"replicas": "60%", "pauseDuration": 0},
        {"replicas": "100%", "pauseDuration": 0},
    ],
}
CRD = Path(__file__).resolve().parents[2] / "crds" / "clusteroperators.gpu.metax-tech.com.yaml"
METAX = str(Path(sys.executable).with_name("metax-operator"))
CR = ("gpu.metax-tech.com", "v1", "clusteroperators", "cluster-operator")
STEADY_PASSES = 10


def daemonset(image: str) -> dict:
    labels = {"app.kubernetes.io/component": "driver", "app.kubernetes.io/name": "metax-operator"}
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "metax-driver", "namespace": NS},
        "spec": {
            "selector": {"matchLabels": labels},
            "updateStrategy": {"type": "OnDelete"},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": {GPU_LABEL: "true"},
                    "tolerations": [{"operator": "Exists"}],
                    "containers": [{"name": "driver-manager", "image": image}],
                },
            },
        },
    }


def proc_stats(pid: int) -> dict:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return {
        "cpu": (int(stat[11]) + int(stat[12])) / ticks,
        "rss_mb": int(status["VmRSS"].split()[0]) / 1024,
        "peak_mb": int(status["VmHWM"].split()[0]) / 1024,
        "rchar": int(io["rchar"]),
    }


def passes(log: Path) -> list[dict]:
    """The runner's rollout passes, as it logged them."""
    return log_entries(log, "rollout-pass")


def rolled_out(log: Path, since: int = 0) -> bool:
    """Whether the rollout begun after the runner's `since`-th logged pass is done: a pass that
    deleted pods, then one that found them all done (the state of an earlier rollout, still in
    the status until the new one starts, does not count)."""
    entries = passes(log)[since:]
    first = next((i for i, p in enumerate(entries) if p.get("deleted")), None)
    return first is not None and any(p.get("state") == "Completed" for p in entries[first:])


def start_runner(cp: ControlPlane, log: Path, runners: list, *args: str, profile: Path | None = None) -> subprocess.Popen:
    """`metax-operator run` (debug log to `log`, `args` added), appended to `runners` for the
    session to stop; returned once its first pass found the cluster idle. With `profile`, under
    cProfile (its main thread: the passes), the profile written there when it stops."""
    profiler = [sys.executable, "-m", "cProfile", "-o", str(profile)] if profile else []
    runner = subprocess.Popen(
        [*profiler, METAX, "run", "--namespace", NS, "--kubeconfig", str(cp.kubeconfig), "--log-level", "debug", *args],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )
    runners.append(runner)
    while not any(p["phase"] == "Idling" for p in passes(log)):
        if runner.poll() is not None:
            raise RuntimeError(f"the runner exited ({runner.returncode}): see {log}")
        time.sleep(0.2)
    return runner


def start_cluster(tmp: Path, nodes: int, policy: dict, started: float, budget: float) -> tuple[ControlPlane, object]:
    """A control plane with `nodes` GPU nodes, the CRD, the CR (`policy`) and the driver
    DaemonSet, every driver pod Ready; the caller stops it. TimeoutError past `budget`."""
    cp = ControlPlane.start(tmp / "cp", gpu_nodes=nodes, plain_nodes=0, timeout=120 + nodes / 10)
    try:
        api = cp.api()
        print(f"{nodes} nodes: control plane up in {time.monotonic() - started:.0f} s", flush=True)
        client.CoreV1Api(api).create_namespace({"metadata": {"name": NS}})
        subprocess.run(
            [
                str(Path(os.environ.get("METAX_CACHE", Path.home() / ".cache/metax-operator")) / "bin" / "kubectl"),
                "--kubeconfig",
                str(cp.kubeconfig),
                "apply",
                "--server-side",
                "-f",
                str(CRD),
            ],
            check=True,
            capture_output=True,
        )
        time.sleep(2)
        client.CustomObjectsApi(api).create_cluster_custom_object(
            *CR[:3],
            {
                "apiVersion": "gpu.metax-tech.com/v1",
                "kind": "ClusterOperator",
                "metadata": {"name": "cluster-operator"},
                "spec": {"registry": "registry.example", "driver": {"payload": {"version": "1"}, "upgradePolicy": policy}},
            },
        )
        client.AppsV1Api(api).create_namespaced_daemon_set(NS, daemonset("registry.example/driver:1"))
        while pods_at(api) < nodes:
            if time.monotonic() - started > budget:
                raise TimeoutError(f"{pods_at(api)} of {nodes} driver pods Ready within the budget")
            time.sleep(2)
    except BaseException:
        cp.stop()
        raise
    return cp, api


def pods_at(api, image: str | None = None) -> int:
    """Driver pods Ready (at `image`, if given)."""
    items = client.CoreV1Api(api).list_namespaced_pod(NS, label_selector="app.kubernetes.io/component=driver").items
    return sum(
        1
        for p in items
        if p.metadata.deletion_timestamp is None and ready(p) and (image is None or p.spec.containers[0].image == image)
    )


def run_size(nodes: int, budget: float, profile: bool = False) -> None:
    with cluster_session(nodes, budget, "bench-rollout-") as session:
        if session is None:
            return
        cp, api, tmp, started, runners = session
        up, up_load = time.monotonic() - started, os.getloadavg()[0]
        apps = client.AppsV1Api(api)
        cp.pods_ready_after([f"gpu-node-{i:04d}" for i in range(nodes)], READY_LATENCY)
        log, profiled = tmp / "runner.log", tmp / "runner.prof"
        runner = start_runner(cp, log, runners, "--interval", str(INTERVAL), profile=profiled if profile else None)
        idle_at = time.monotonic() - started
        image = "registry.example/driver:2"
        apps.patch_namespaced_daemon_set(
            "metax-driver", NS, {"spec": {"template": {"spec": {"containers": [{"name": "driver-manager", "image": image}]}}}}
        )
        t0 = time.monotonic()
        while not rolled_out(log):
            if time.monotonic() - started > budget:
                raise TimeoutError(f"not completed within the budget ({pods_at(api, image)} of {nodes} upgraded)")
            time.sleep(0.5)
        wall, wall_load = time.monotonic() - t0, os.getloadavg()[0]
        # The ideal: pod re-creation and Ready latency only (passes 50 ms apart).
        ideal = simulate(policy_mod.validate(POLICY), nodes, ready_latency=READY_LATENCY, interval=0.05)
        during, control_plane = proc_stats(runner.pid), cp.rss()
        # Steady state: passes over an unchanged cluster.
        before, first = proc_stats(runner.pid), passes(log)[-1]
        count = len(passes(log))
        while len(passes(log)) < count + STEADY_PASSES:
            time.sleep(0.5)
        after, last = proc_stats(runner.pid), passes(log)[-1]
        n = len(passes(log)) - count
        waves = sum(1 for p in passes(log) if p.get("deleted"))
        print(
            f"{nodes} nodes, 4 steps (10/30/60/100%, maxParallel 50%), pods Ready {READY_LATENCY:g} s after "
            f"creation, --interval {INTERVAL:g} (passes woken by the watches){', runner under cProfile' * profile}:"
        )
        print(
            f"  control plane up with the driver pods Ready in {up:.0f} s (load average {up_load:.1f}); "
            f"memory "
            + ", ".join(
                f"{k} {v / 2**20:,.0f} MiB"
                for k, v in control_plane.items()
                if k in ("etcd", "kube-apiserver", "kube-controller-manager", "kwok")
            )
        )
        print(
            f"  rollout wall time {wall:.1f} s; ideal schedule {ideal.end_time:.1f} s "
            f"({wall / ideal.end_time:.2f}x, {(wall - ideal.end_time) / max(waves, 1):+.2f} s per wave over "
            f"{waves} passes that deleted); runner idle (caches listed) {idle_at:.0f} s into the run "
            f"(load average {wall_load:.1f})"
        )
        print(
            f"  steady state per pass: rollout requests "
            f"{(last['requests'] - first['requests']) / n:.1f}, watch-cache requests "
            f"{(last['cache_requests'] - first['cache_requests']) / n:.2f}, watch bytes "
            f"{(last['cache_bytes'] - first['cache_bytes']) / n:,.0f}; all sockets of the runner "
            f"(reconcile included, TLS) {(after['rchar'] - before['rchar']) / n:,.0f} bytes read"
        )
        print(
            f"  runner CPU {during['cpu']:.1f} s for the rollout, {(after['cpu'] - before['cpu']) / n:.3f} s "
            f"per steady pass; memory {after['rss_mb']:.0f} MB (peak {after['peak_mb']:.0f} MB); "
            f"the watch caches received {first['cache_bytes'] / 1e6:.1f} MB from their first LIST to the end "
            f"of the rollout",
            flush=True,
        )
        if profile:
            stop_pid(runner.pid, runner)
            runners.remove(runner)
            out = io.StringIO()
            stats = pstats.Stats(str(profiled), stream=out)
            stats.sort_stats("tottime").print_stats(15)
            stats.sort_stats("cumulative").print_stats("metax_operator", 20)
            print("  where the runner's passes spend their time (cProfile of its main thread; the watch caches'")
            print("  threads, which parse the events, are not in it):")
            print(
                "\n".join(
                    "    " + line
                    for line in out.getvalue().splitlines()
                    if line.strip() and not line.startswith(("   Ordered", "   List reduced"))
                ),
                flush=True,
            )


def over_budget(nodes: int, budget: float, err: TimeoutError) -> None:
    print(f"{nodes} nodes: stopped at the time budget ({budget:.0f} s): {err}", flush=True)


@contextlib.contextmanager
def cluster_session(nodes: int, budget: float, prefix: str) -> Iterator[tuple | None]:
    """A benchmark's cluster (`start_cluster` with POLICY, in a temporary directory): yields
    (cp, api, tmp, started, runners), or None when it did not start within `budget` seconds.
    The runners the body appends are stopped, then the cluster; a TimeoutError is reported."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        try:
            cp, api = start_cluster(Path(tmp), nodes, POLICY, started, budget)
        except TimeoutError as err:
            over_budget(nodes, budget, err)
            yield None
            return
        runners: list[subprocess.Popen] = []
        try:
            yield cp, api, Path(tmp), started, runners
        except TimeoutError as err:
            over_budget(nodes, budget, err)
        finally:
            for runner in runners:
                stop_pid(runner.pid, runner)
            cp.stop()


def main() -> None:
    sizes = [int(s) for s in os.environ.get("METAX_BENCH_SIZES", "500,5000").split(",") if s]
    for nodes in sizes:
        run_size(nodes, budget=300 + nodes * 0.3, profile=bool(os.environ.get("METAX_BENCH_PROFILE")))


if __name__ == "__main__":
    main()
