"""The runner at 1,000 to 10,000 GPU nodes: its memory, idle CPU, startup and pass cost, on
realistic objects.

What runs, each in its own process:
- the API: tests/scaleapi.py, serving N nodes as kubelets write them (about 20 KB each: 34
  labels, 8 managedFields entries, 7 conditions, 40-60 images; tests/scale_objects.py), each
  node's status rewritten every 300 s (N/300 updates a second), the chart's DaemonSets,
  ConfigMaps and Service rendered by Helm 3, the CR with a 4-step staged rollout (10/30/60/100 %,
  `maxParallel: 50%`), and one Ready driver pod per node made from the chart's template; in the
  scenario `+pods`, what every real cluster has besides: 10 more DaemonSet pods per node (the
  chart's 5 other components and 5 of the platform's), a GPU training pod on half of the nodes,
  2.8 of them replaced each second;
- the runner: the real `metax-operator run` with the flags of the chart's Deployment (interval 5 s,
  health port, stall timeout; info log) and measuring hooks around it (scale_runner.py).

Phases, each bounded: startup (from the runner's process start to the end of its first pass
after every watch cache listed, with the CR's `upgradeStatus` written: the first decided pass);
settle (3 passes in a row that wrote nothing); idle (`BENCH_SCALE_IDLE` seconds, 120 by default,
the node churn on): the runner's CPU over wall time, its RSS, the main thread's CPU per pass;
then a rollout (the CR's `spec.driver.payload.version` edited, as an admin does) until every
driver pod on a node without GPU work is at the new revision and Ready and no node is cordoned
(`BENCH_SCALE_ROLLOUT` seconds at most, 900 by default): the runner's CPU, its passes' CPU, the
requests it sent. The GPU-busy nodes of `+pods` are held back by the default policy, as designed.
The fake API server's own CPU is printed beside the runner's: it is not the runner's cost.

Each figure is printed beside the figure of the runner before this benchmark existed (BEFORE, at
the same sizes on the same 2-core machine) as a ratio, and the targets at 10,000 nodes with the
cluster's other pods. `BENCH_SCALE=1k,5k,10k,10k+pods` chooses the scenarios (default `1k,10k`,
about 20 minutes; `10k+pods` adds about 15). `python -m tests.bench scale`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests import scaleapi
from tests.controlplane import free_port
from tests.helm import render_chart
from tests.runtime.test_reconcile import VALUES

TICK = os.sysconf("SC_CLK_TCK")
IDLE = float(os.environ.get("BENCH_SCALE_IDLE", "120"))
ROLLOUT = float(os.environ.get("BENCH_SCALE_ROLLOUT", "900"))
STARTUP = 600.0  # seconds
#: A pass failing with one of these is a bug of the runner or of its measuring hooks, not a load.
BROKEN = ("TypeError", "AttributeError", "NameError")
POLICY = {
    "enableRollout": True,
    "maxParallel": "50%",
    "maxFailureThreshold": 0,
    "upgradeSteps": [{"replicas": share, "pauseDuration": 0} for share in ("10%", "30%", "60%", "100%")],
}


@dataclass(frozen=True)
class Scenario:
    name: str
    nodes: int
    other_pods: int = 0
    busy_fraction: float = 0.0
    job_churn: float = 0.0


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("1k", 1000),
        Scenario("5k", 5000),
        Scenario("10k", 10000),
        Scenario("10k+pods", 10000, other_pods=10, busy_fraction=0.5, job_churn=2.8),
    )
}
#: The runner before this benchmark existed (at 64750fb, the same scenarios on this machine):
#: RSS steady (MiB), idle CPU (% of a core), start to first decided pass (s), CPU of an unchanged
#: pass (ms, main thread), the rollout's CPU (s; `+pods`: its 5,000 idle nodes).
BEFORE = {
    "1k": {"rss": 254, "idle": 0.88, "startup": 7.8, "pass_ms": 21, "rollout_cpu": 19},
    "5k": {"rss": 354, "idle": 2.21, "startup": 16.1, "pass_ms": 42, "rollout_cpu": 72},
    "10k": {"rss": 371, "idle": 3.70, "startup": 26.1, "pass_ms": 76, "rollout_cpu": 114},
    "10k+pods": {"rss": 392, "idle": 5.29, "startup": 86.4, "pass_ms": 134, "rollout_cpu": 85},
}
#: What the runner is to reach at 10,000 nodes with the cluster's other pods.
TARGETS = {"rss": 150, "idle": 1.0, "startup": 15.0, "pass_ms": 5, "rollout_cpu": 40}


def proc(pid: int) -> dict:
    """CPU seconds, RSS and peak RSS (MiB) of process `pid`."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {
        "cpu": (int(stat[11]) + int(stat[12])) / TICK,
        "rss": int(status["VmRSS"].split()[0]) / 1024,
        "peak": int(status["VmHWM"].split()[0]) / 1024,
    }


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


def stop(process: subprocess.Popen | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


def runner_command() -> list[str]:
    """The runner's command as the chart's Deployment runs it."""
    (deployment,) = render_chart(VALUES, show_only=["templates/runner/deployment.yaml"])
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "runner"]
    return container["command"]


class Run:
    """One scenario: the API server and the runner, and their measurements."""

    def __init__(self, scenario: Scenario, release: Path, command: list[str], tmp: Path):
        self.scenario, self.release, self.command, self.tmp = scenario, release, command, tmp
        self.api = self.runner = None
        self.port = 0
        self.started = 0.0
        self.log = tmp / f"{scenario.name}.events"

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *_) -> None:
        stop(self.runner)
        stop(self.api)

    def ctl(self, path: str, method: str = "GET") -> dict:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", method=method, data=b"" if method == "POST" else None
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.loads(answer.read())

    def start_api(self) -> dict:
        s, ready = self.scenario, self.tmp / f"{self.scenario.name}.ready"
        options = ["--nodes", str(s.nodes), "--other-pods", str(s.other_pods), "--busy-fraction", str(s.busy_fraction)]
        options += ["--job-churn", str(s.job_churn)]
        self.api = subprocess.Popen(
            [sys.executable, "-m", "tests.scaleapi", "--release", str(self.release), *options, "--ready-file", str(ready)],
            stdout=subprocess.DEVNULL,
            stderr=(self.tmp / f"{s.name}.api.log").open("w"),
        )
        wait(lambda: ready.exists(), 1800, "the API server to populate", self.api)
        info = json.loads(ready.read_text())
        self.port = info["port"]
        return info

    def start_runner(self) -> None:
        kubeconfig = self.tmp / "kubeconfig"
        cluster = {"server": f"http://127.0.0.1:{self.port}"}
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "scale", "cluster": cluster}],
                    "users": [{"name": "runner", "user": {"token": "bench"}}],
                    "contexts": [{"name": "scale", "context": {"cluster": "scale", "user": "runner"}}],
                    "current-context": "scale",
                }
            )
        )
        args = list(self.command[1:])
        args[args.index("--health-port") + 1] = str(free_port())
        args += ["--health-host", "127.0.0.1", "--kubeconfig", str(kubeconfig), "--log-format", "json"]
        self.started = time.monotonic()
        self.runner = subprocess.Popen(
            [sys.executable, "-m", "tests.bench.scale_runner", *args],
            stdout=subprocess.DEVNULL,
            stderr=(self.tmp / f"{self.scenario.name}.runner.log").open("w"),
            env={**os.environ, "SCALE_EVENTS": str(self.log), "POD_NAMESPACE": scaleapi.NS},
        )

    def passes(self, since: float = 0.0) -> list[dict]:
        return [e for e in events(self.log) if e["ev"] == "pass" and e["t"] >= since]

    def broken(self) -> str | None:
        """The error of the first pass that failed with a bug (BROKEN), from the runner's log."""
        for line in (self.tmp / f"{self.scenario.name}.runner.log").read_text().splitlines():
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if entry.get("action") == "pass-failed" and entry.get("error", "").split(":")[0] in BROKEN:
                    return entry["error"]
        return None

    def startup(self) -> dict:
        """Until the first pass that ended with every cache listed and the rollout decided."""

        def decided():
            broken = self.broken()
            if broken is not None:  # the hooks or the runner do not fit: no pass will ever decide
                raise AssertionError(f"a runner pass failed: {broken}")
            return next((p for p in self.passes() if p["decided"] and p["synced"] and p["outcome"] == "ok"), None)

        first = wait(decided, STARTUP, "the runner's first decided pass", self.runner, self.api)
        lists = {}
        for e in events(self.log):
            if e["ev"] == "list":
                lists.setdefault(e["name"], e)
        log = (self.tmp / f"{self.scenario.name}.runner.log").read_text()
        return {
            "seconds": first["t"] - self.started,
            "caches_listed": max(e["start"] + e["wall"] for e in lists.values()) - self.started,
            "list_bytes": sum(e["bytes"] for e in lists.values()),
            "cache_waits": sum(
                log.count(f'"{action}"') for action in ("workloads-wait-cache", "rollout-wait-cache", "wait-cache")
            ),
            **proc(self.runner.pid),
        }

    def settle(self) -> None:
        def quiet():
            passes = self.passes()
            return len(passes) >= 4 and all(p["writes"] == 0 for p in passes[-3:])

        wait(quiet, 180, "three passes in a row that wrote nothing", self.runner, self.api)

    def idle(self) -> dict:
        before, api_before, stats = proc(self.runner.pid), proc(self.api.pid), self.ctl("/_ctl/stats")
        began = time.monotonic()
        wait(lambda: time.monotonic() - began >= IDLE, IDLE + 30, "the idle window", self.runner, self.api)
        after, api_after, stats_after, wall = (
            proc(self.runner.pid),
            proc(self.api.pid),
            self.ctl("/_ctl/stats"),
            time.monotonic() - began,
        )
        passes = self.passes(began)
        return {
            "cpu_percent": 100 * (after["cpu"] - before["cpu"]) / wall,
            "api_cpu_percent": 100 * (api_after["cpu"] - api_before["cpu"]) / wall,
            "rss": after["rss"],
            "peak": after["peak"],
            "node_updates_per_s": (stats_after["node_updates"] - stats["node_updates"]) / wall,
            "passes": len(passes),
            "pass_ms": 1000 * statistics.median(p["cpu"] for p in passes) if passes else None,
            "requests": requests(stats, stats_after),
        }

    def rollout(self) -> dict:
        before, api_before, stats = proc(self.runner.pid), proc(self.api.pid), self.ctl("/_ctl/stats")
        began, old = time.monotonic(), self.ctl("/_ctl/progress")["revision"]
        self.ctl("/_ctl/rollout?version=2.33.0.1", "POST")

        def done():
            p = self.ctl("/_ctl/progress")
            return p["revision"] != old and p["new_ready"] == p["new"] == p["pods"] and p["cordoned"] == 0 and p

        progress = None
        with contextlib.suppress(TimeoutError):
            progress = wait(done, ROLLOUT, "the rollout", self.runner, self.api, interval=2.0)
        after, api_after, stats_after, wall = (
            proc(self.runner.pid),
            proc(self.api.pid),
            self.ctl("/_ctl/stats"),
            time.monotonic() - began,
        )
        passes = [p for p in self.passes(began) if p["writes"]]
        return {
            "completed": progress is not None,
            "progress": progress or self.ctl("/_ctl/progress"),
            "seconds": wall,
            "cpu": after["cpu"] - before["cpu"],
            "api_cpu": api_after["cpu"] - api_before["cpu"],
            "peak": after["peak"],
            "pass_cpu_median": statistics.median(p["cpu"] for p in passes) if passes else None,
            "pass_cpu_max": max((p["cpu"] for p in passes), default=None),
            "pass_wall_max": max((p["wall"] for p in passes), default=None),
            "requests": requests(stats, stats_after),
        }


def requests(before: dict, after: dict) -> dict:
    """Requests the API server answered between two of its stats, by method."""
    return {k: v - before["requests"].get(k, 0) for k, v in after["requests"].items() if v - before["requests"].get(k, 0)}


def wait(check, timeout: float, what: str, *processes: subprocess.Popen, interval: float = 1.0):
    """`check()`'s first truthy value, polled; fails when one of `processes` exits meanwhile."""
    end = time.monotonic() + timeout
    while True:
        for process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"waiting for {what}: {process.args[2]} exited with {process.returncode}")
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"no {what} within {timeout:.0f} s")
        time.sleep(interval)


def measure(scenario: Scenario, release: Path, command: list[str], tmp: Path) -> dict:
    with Run(scenario, release, command, tmp) as run:
        api = run.start_api()
        print(
            f"[{scenario.name}] API server: {api['objects']:,} objects ({api['pods']:,} pods) in {api['populate_seconds']} s",
            flush=True,
        )
        run.start_runner()
        result = {"api": api, "startup": run.startup()}
        print(f"[{scenario.name}] startup: {json.dumps(rounded(result['startup']))}", flush=True)
        run.settle()
        result["idle"] = run.idle()
        print(f"[{scenario.name}] idle: {json.dumps(rounded(result['idle']))}", flush=True)
        result["rollout"] = run.rollout()
        print(f"[{scenario.name}] rollout: {json.dumps(rounded(result['rollout']))}", flush=True)
        return result


def rounded(tree):
    if isinstance(tree, dict):
        return {k: rounded(v) for k, v in tree.items()}
    return round(tree, 3) if isinstance(tree, float) else tree


def beside(value: float | None, name: str, key: str, unit: str, digits: int = 1) -> str:
    """`value` with BEFORE's figure and the ratio (and the target, at 10k+pods)."""
    if value is None:
        return "—"
    before = BEFORE[name][key]
    text = f"{value:,.{digits}f}{unit} ({before:g}{unit} before, ×{value / before:.2f}"
    if name == "10k+pods":
        text += f"; target ≤ {TARGETS[key]:g}{unit}"
    return text + ")"


def table(results: dict[str, dict]) -> None:
    columns = [
        "nodes (pods)",
        "RSS steady (peak)",
        "idle CPU, churn on (API server)",
        "start → first decided pass (caches listed; CPU)",
        "unchanged pass, CPU",
        "rollout: pass CPU median / max",
        "rollout: runner CPU (API server), wall",
        "requests sent in the rollout",
    ]
    print("\n| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for name, r in results.items():
        s, idle, ro = r["startup"], r["idle"], r["rollout"]
        done = f"{ro['seconds']:.0f} s" if ro["completed"] else f"not done in {ro['seconds']:.0f} s: {ro['progress']}"
        waited = "; a cache missed its sync timeout" if s["cache_waits"] else ""
        cells = [
            f"{name} ({r['api']['pods']:,})",
            f"{beside(idle['rss'], name, 'rss', ' MiB', 0)} ({max(idle['peak'], ro['peak']):.0f})",
            f"{beside(idle['cpu_percent'], name, 'idle', ' %', 2)} ({idle['api_cpu_percent']:.1f} %)",
            f"{beside(s['seconds'], name, 'startup', ' s')} ({s['caches_listed']:.1f} s; {s['cpu']:.1f} s{waited})",
            beside(idle["pass_ms"], name, "pass_ms", " ms"),
            f"{(ro['pass_cpu_median'] or 0) * 1000:.0f} / {(ro['pass_cpu_max'] or 0) * 1000:.0f} ms",
            f"{beside(ro['cpu'], name, 'rollout_cpu', ' s')} ({ro['api_cpu']:.0f} s), {done}",
            ", ".join(f"{n:,} {k}" for k, n in sorted(ro["requests"].items())),
        ]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    names = [n for n in os.environ.get("BENCH_SCALE", "1k,10k").split(",") if n]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"BENCH_SCALE: unknown scenario {', '.join(unknown)}: choose from {', '.join(SCENARIOS)}")
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        release = Path(tmp) / "release.json"
        release.write_text(json.dumps(scaleapi.release(VALUES, POLICY)))
        command = runner_command()
        results = {}
        for name in names:
            results[name] = measure(SCENARIOS[name], release, command, Path(tmp))
            if os.environ.get("BENCH_SCALE_KEEP"):  # the logs, for a profile or a post-mortem
                subprocess.run(["cp", "-r", tmp, os.environ["BENCH_SCALE_KEEP"]], check=True)
        table(results)
