"""A real Prometheus (Debian's 2.42, the `prometheus` binary) scrapes the runner during a staged
rollout on the local control plane, with the chart's alert rules (alerts/metax-operator-rules.yaml)
loaded: every query of the rollout dashboard (dashboards/driver-rollout.json) returns data through
Prometheus's HTTP API while the rollout runs, and a driver pod that never becomes Ready makes the
"step failed" and "nodes failed" alerts fire within their `for:` windows (and the node counts as
`failed` by its upgrade state), then resolve once the node is fixed and the rollout resumed.

The scrape target is the runner process's /metrics on loopback, as a static config: what the
chart's ServiceMonitor points the Prometheus Operator at in a cluster (the runner pod's `metrics`
port). Grafana's `$__rate_interval` is given as 1m, what Grafana picks for a 15 s scrape; the
instant query stands for the panel's last point.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.controlplane import free_port
from tests.e2e.test_rollout_cluster import (  # noqa: F401 - fixtures used by name
    FAILING,
    Runner,
    all_at,
    api,
    condition,
    idle,
    installed,
    patch_driver,
    start_rollout,
    sub,
    upgrade_status,
)
from tests.e2e.tools import seed_patch
from tests.waiting import eventually

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "alerts/metax-operator-rules.yaml"
DASHBOARD = REPO / "dashboards/driver-rollout.json"
RATE_INTERVAL = "1m"
SCRAPE = "1s"


class Prometheus:
    """A Prometheus server of its own: one static target, the rules file, 1 s scrapes and rule
    evaluations, its data in a temporary directory."""

    def __init__(self, tmp: Path, target: str):
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus is missing: run 'make e2e' (it installs Debian's prometheus package)", pytrace=False)
        self.port = free_port()
        config = {
            "global": {"scrape_interval": SCRAPE, "evaluation_interval": SCRAPE},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "metax-operator-runner", "static_configs": [{"targets": [target]}]}],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = tmp / "prometheus.log"
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("w"),
        )
        eventually(self._ready, 60, f"Prometheus ready (log: {self.log})")

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"Prometheus exited: {self.log.read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def query(self, expr: str) -> list[dict]:
        """The instant vector `expr` gives now (HTTP API /api/v1/query)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as answer:
            body = json.load(answer)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def alert_state(self, name: str) -> str | None:
        """`firing`, `pending`, or None (inactive) for the alert `name`."""
        states = {r["metric"]["alertstate"] for r in self.query(f'ALERTS{{alertname="{name}"}}')}
        return "firing" if "firing" in states else next(iter(states), None)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the dashboard, as the panel would ask."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [
        (panel["title"], target["expr"].replace("$__rate_interval", RATE_INTERVAL))
        for panel in panels
        for target in panel.get("targets", [])
    ]


@pytest.fixture
def scraped(control_plane, idle, tmp_path):
    """The leading runner serves /metrics on loopback, and a Prometheus scrapes it."""
    runners = idle["runners"]
    runners[-1].stop()  # SIGTERM: the lease is released at once
    port = free_port()
    runners.append(
        Runner(idle["kubeconfig"], idle["tmp"], "runner-metrics", "--health-port", str(port), "--health-host", "127.0.0.1")
    )
    prometheus = Prometheus(tmp_path, f"127.0.0.1:{port}")
    try:
        eventually(lambda: prometheus.query("metax_operator_leader == 1"), 60, "the runner scraped, leading")
        yield prometheus
    finally:
        prometheus.stop()


def test_prometheus_answers_every_panel_and_fires_then_resolves_the_failure_alerts(control_plane, api, idle, faults, scraped):
    cp, prometheus = control_plane, scraped
    bad = "gpu-node-0000"  # first in node order: in the first wave
    faults.pods_never_ready([bad])
    old, _new = start_rollout(cp, api, {**FAILING, "fallback": "pause"})
    try:
        eventually(lambda: upgrade_status(api).get("phase") == "Progressing", 30, "the rollout started")
        # While it runs (waves, retries): every panel has data. A wave must have ended inside the
        # rate window for the wave-duration quantiles.
        eventually(lambda: prometheus.query("metax_operator_rollout_wave_duration_seconds_count > 0"), 60, "a wave ended")
        queries = dashboard_queries()
        assert len(queries) >= 15
        for title, expr in queries:
            eventually(lambda expr=expr: prometheus.query(expr), 30, f"data for the panel {title!r}: {expr}")
        # The planted failure: the step fails after its retries (fallback pause).
        eventually(lambda: condition(api, "Failed").get("reason") == "StepFailed", 120, "the step failed")
        failed_at = time.monotonic()
        assert upgrade_status(api)["resume"]["failedNodes"] == [bad]
        failed_nodes = 'metax_operator_node_upgrade_state{state="failed"}'
        eventually(lambda: [r["value"][1] for r in prometheus.query(failed_nodes)] == ["1"], 30, "one node counted failed")
        eventually(lambda: prometheus.alert_state("MetaxRolloutStepFailed") == "firing", 60 + 45, "StepFailed firing")
        assert time.monotonic() - failed_at >= 50, "fired before its for: 1m"
        assert prometheus.alert_state("MetaxRolloutNodesFailed") == "pending"
        eventually(lambda: prometheus.alert_state("MetaxRolloutNodesFailed") == "firing", 300 + 45, "NodesFailed firing")
        assert time.monotonic() - failed_at >= 290, "fired before its for: 5m"
        (firing,) = [r for r in prometheus.query('ALERTS{alertname="MetaxRolloutNodesFailed",alertstate="firing"}')]
        assert firing["metric"]["severity"] == "warning"
        # Fixed: the node's driver comes up, the admin resumes; both alerts resolve.
        faults.clear_faults()
        seed_patch(cp, "pause", False)
        for alert in ("MetaxRolloutStepFailed", "MetaxRolloutNodesFailed"):
            eventually(lambda alert=alert: prometheus.alert_state(alert) is None, 180, f"{alert} resolved")
        eventually(lambda: sub(api).get("currentStepState") == "Completed", 180, "the rollout completed after the fix")
    finally:  # a rollout the test did not see through goes back to the old revision: the next test starts idle
        faults.clear_faults()
        if sub(api).get("currentStepState") != "Completed":
            seed_patch(cp, "enableRollout", False)
            eventually(lambda: upgrade_status(api).get("phase") == "Disabled" and all_at(api, old), 120, "rolled back")
            patch_driver(api, {"upgradePolicy": {"enableRollout": True, "pause": False}})
