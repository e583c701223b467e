"""Time from an edit of the CR to its effect, passes woken by the watches against the fixed pace.

The chart installed on the real control plane (bench_steady_pass's `installed_chart`), one
`metax-operator run` as the runner's ServiceAccount with the chart's default interval (5 s), first
with `--interval-only`, then without. Two edits, `EDITS` times each, alternating their value:
- `spec.driver.upgradePolicy.pause` flipped: done when the runner stamps the CR's new generation
  as observed (`status.observedGeneration`: the pass that planned from the edit wrote its status);
- `spec.gpuLabel.log.level` changed: done when the DaemonSet `metax-gpu-label` carries the new
  `LOG_LEVEL` (the reconcile applied it).
Each edit at a moment drawn uniformly over the interval (the same moments in both modes), polled
every `POLL` s by this process. Printed: median and max seconds per edit and mode, with the load
average (the machine is shared).
`python -m tests.bench cr_edit`.
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import time

from kubernetes import client

from tests.bench.bench_rollout_cluster import METAX
from tests.bench.bench_steady_pass import NS, installed_chart
from tests.controlplane import stop_pid
from tests.e2e.tools import CR, log_entries

INTERVAL = 5.0
EDITS = 8
POLL = 0.02
TIMEOUT = 60.0


def until(check, what: str) -> float:
    """Seconds until `check()` holds (polled every POLL s)."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > TIMEOUT:
            raise TimeoutError(f"{what}: no effect within {TIMEOUT:g} s")
        time.sleep(POLL)
    return time.monotonic() - started


def measure(admin) -> dict[str, list[float]]:
    crs, apps = client.CustomObjectsApi(admin), client.AppsV1Api(admin)

    def observed() -> bool:
        cr = crs.get_cluster_custom_object(*CR)
        return (cr.get("status") or {}).get("observedGeneration") == cr["metadata"]["generation"]

    def log_level(level: str) -> bool:
        ds = apps.read_namespaced_daemon_set("metax-gpu-label", NS)
        return any(e.name == "LOG_LEVEL" and e.value == level for c in ds.spec.template.spec.containers for e in c.env or [])

    times: dict[str, list[float]] = {"pause": [], "log level": []}
    moments = random.Random(16)  # edits at moments spread over the interval, the same in both modes
    for i in range(EDITS):
        time.sleep(moments.uniform(0, INTERVAL))
        crs.patch_cluster_custom_object(*CR, {"spec": {"driver": {"upgradePolicy": {"pause": i % 2 == 0}}}})
        times["pause"].append(until(observed, "pause"))
        time.sleep(moments.uniform(0, INTERVAL))
        level = ("debug", "info")[i % 2]
        crs.patch_cluster_custom_object(*CR, {"spec": {"gpuLabel": {"log": {"level": level}}}})
        times["log level"].append(until(lambda level=level: log_level(level), "log level"))
    return times


def main() -> None:
    with installed_chart("bench-cr-edit-") as (_cp, admin, tmp, kubeconfig):
        print(
            f"time from a CR edit to its effect, runner interval {INTERVAL:g} s, {EDITS} edits each "
            f"(polled every {POLL * 1000:.0f} ms):"
        )
        for woken in (False, True):
            log = tmp / f"runner-{'woken' if woken else 'fixed'}.log"
            runner = subprocess.Popen(
                [
                    METAX,
                    "run",
                    "--namespace",
                    NS,
                    "--kubeconfig",
                    str(kubeconfig),
                    "--interval",
                    str(INTERVAL),
                    "--log-level",
                    "debug",
                    "--lease-duration",
                    "4",
                    "--renew-deadline",
                    "3",
                    "--retry-period",
                    "1",
                    *([] if woken else ["--interval-only"]),
                ],
                stdout=subprocess.DEVNULL,
                stderr=log.open("w"),
            )
            try:
                until(lambda log=log: any(p["writes"] == 0 for p in log_entries(log, "pass")), "the runner idle")
                times = measure(admin)
            finally:
                stop_pid(runner.pid, runner)
            mode = "woken by the watches" if woken else "--interval-only     "
            print(
                "  "
                + mode
                + ": "
                + "; ".join(f"{what} median {statistics.median(t):.2f} s, max {max(t):.2f} s" for what, t in times.items())
                + f" (load average {os.getloadavg()[0]:.1f})",
                flush=True,
            )


if __name__ == "__main__":
    main()
