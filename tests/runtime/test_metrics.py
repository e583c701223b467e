"""The runner's Prometheus metrics without a cluster: the gauges a rollout pass sets, the wave
histogram, the text exposition served on the health port (parsed back with prometheus_client's own
parser). Scraped from a real runner during a rollout: tests/e2e/test_node_safety.py."""

from __future__ import annotations

import json
import re
import urllib.request

from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from metax_operator.chart.upgrade_policy import HealthSignal, validate
from metax_operator.conditions import PASS_FAILURES, Condition, rfc3339
from metax_operator.rollout.health_gate import Comparison
from metax_operator.rollout.status import (
    COMPLETED,
    IDLING,
    PROGRESSING,
    STEP_UPGRADE,
    NodeList,
    Resume,
    StepStatus,
    UpgradeStatus,
)
from metax_operator.runtime.cr_status import pass_condition
from metax_operator.runtime.health import Health, serve
from metax_operator.runtime.metrics import NODE_STATES, Metrics, names
from tests.helm import find, helm_bin, render_chart  # noqa: F401 - helm_bin is a fixture
from tests.runtime.test_health import FakeElector
from tests.templates.test_chart_render import SEED_INSTALL

T0 = 1_800_000_000.0


def samples(metrics: Metrics) -> dict[tuple, float]:
    text = metrics.exposition()[0].decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def status(phase: str, step: int, state: str, total: int, upgraded: int, wave: list[str], start: float) -> UpgradeStatus:
    return UpgradeStatus(
        phase=phase,
        step=StepStatus(
            current_step_index=step, current_step_state=state, total_upgrade_replicas=total, total_upgrade_ready_replicas=upgraded
        ),
        resume=Resume(
            wave=wave,
            wave_start_time=rfc3339(start),
            failed=NodeList(count=1),
            held=NodeList(count=2),
            skipped=NodeList(count=3),
            cordoned=NodeList(count=len(wave)),
            need_reboot=NodeList(count=5),
            out_of_service=NodeList(count=6),
        ),
    )


def test_a_pass_sets_phase_step_and_node_counts():
    m = Metrics()
    m.rollout_pass(None, status(PROGRESSING, 2, STEP_UPGRADE, 10, 4, ["n1", "n2"], T0), T0)
    got = samples(m)
    assert got[("metax_operator_rollout_phase", (("metax_operator_rollout_phase", "Progressing"),))] == 1
    assert got[("metax_operator_rollout_phase", (("metax_operator_rollout_phase", "Idling"),))] == 0
    assert got[("metax_operator_rollout_step", ())] == 2
    assert got[("metax_operator_rollout_step_state", (("metax_operator_rollout_step_state", "StepUpgrade"),))] == 1
    nodes = {state: got[("metax_operator_rollout_nodes", (("state", state),))] for state in NODE_STATES}
    assert nodes == {
        "total": 10,
        "upgraded": 4,
        "failed": 1,
        "held": 2,
        "skipped": 3,
        "cordoned": 2,
        "in_wave": 2,
        "out_of_service": 6,
    }
    assert got[("metax_operator_nodes_need_reboot", ())] == 5


def test_a_wave_is_timed_from_its_start_to_the_pass_that_saw_it_done():
    m = Metrics()
    first = status(PROGRESSING, 0, STEP_UPGRADE, 10, 0, ["n1"], T0)
    m.rollout_pass(None, first, T0)
    m.rollout_pass(first, first, T0 + 3)  # still in flight
    assert samples(m)[("metax_operator_rollout_wave_duration_seconds_count", ())] == 0
    second = status(PROGRESSING, 0, STEP_UPGRADE, 10, 1, ["n2"], T0 + 7)
    m.rollout_pass(first, second, T0 + 7)  # the next wave replaced it
    done = status(IDLING, 0, COMPLETED, 10, 10, [], T0 + 7)
    m.rollout_pass(second, done, T0 + 12)
    got = samples(m)
    assert got[("metax_operator_rollout_wave_duration_seconds_count", ())] == 2
    assert got[("metax_operator_rollout_wave_duration_seconds_sum", ())] == 12
    assert got[("metax_operator_rollout_wave_duration_seconds_bucket", (("le", "5.0"),))] == 1


def test_the_health_port_serves_the_exposition_with_the_prometheus_content_type():
    m = Metrics()
    m.pass_seconds.observe(0.2)
    m.leader.set(1)
    server = serve(Health(FakeElector(), lambda: (), stall_timeout=30, api_timeout=15), "127.0.0.1", 0, m)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=5) as answer:
            assert answer.headers["Content-Type"].startswith("text/plain; version=")
            body = answer.read().decode()
        families = {f.name: f for f in text_string_to_metric_families(body)}
        assert families["metax_operator_runner_pass_duration_seconds"].type == "histogram"
        assert families["metax_operator_leader"].samples[0].value == 1
        assert families["metax_operator_api_requests"].type == "counter"
    finally:
        server.shutdown()


def test_every_exported_name_has_the_prefix():
    exported = names(Metrics())
    assert exported and all(n.startswith("metax_operator_") for n in exported)
    assert {
        "metax_operator_api_requests_total",
        "metax_operator_nodes_need_reboot",
        "metax_operator_rollout_wave_duration_seconds_bucket",
    } <= exported


# -- the chart's ServiceMonitor and Grafana dashboard ------------------------------------------

METRIC_NAME = re.compile(r"\bmetax_operator_[a-z_]+\b")
ON = SEED_INSTALL + ("--set", "runner.serviceMonitor.enabled=true", "--set", "runner.dashboard.enabled=true")


def dashboard(objects) -> dict:
    config = find(objects, "ConfigMap", "metax-operator-runner-dashboard")
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    return json.loads(config["data"]["metax-driver-rollout.json"])


def test_every_dashboard_query_names_only_metrics_the_runner_exports(helm_bin):
    board = dashboard(render_chart(helm=helm_bin, args=ON))
    exported = names(Metrics())
    exprs = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    assert len(exprs) >= 10
    for expr in exprs:
        named = set(METRIC_NAME.findall(expr))  # an Enum's label bears its metric's name: exported too
        assert named, f"a query that reads no runner metric: {expr}"
        assert named <= exported, f"{expr} names {named - exported}, which the runner does not export"
    shown = {name for expr in exprs for name in METRIC_NAME.findall(expr)}
    wanted = {
        "metax_operator_rollout_phase",
        "metax_operator_rollout_step",
        "metax_operator_rollout_nodes",
        "metax_operator_rollout_wave_duration_seconds_bucket",
        "metax_operator_runner_pass_duration_seconds_bucket",
        "metax_operator_api_requests_total",
        "metax_operator_leader",
        "metax_operator_nodes_need_reboot",
    }
    assert wanted <= shown


def test_the_checker_above_catches_a_misspelt_metric():
    exported = names(Metrics())
    assert not set(METRIC_NAME.findall("rate(metax_operator_api_request_total[5m])")) <= exported


def test_the_service_monitor_scrapes_the_health_port_and_both_are_off_by_default(helm_bin):
    objects = render_chart(helm=helm_bin, args=ON + ("--set", "runner.health.port=9090"))
    service = find(objects, "Service", "metax-operator-runner")
    assert service["spec"]["ports"] == [{"name": "health", "protocol": "TCP", "port": 9090, "targetPort": "health"}]
    runner = find(objects, "Deployment", "metax-operator-runner")
    assert service["spec"]["selector"].items() <= runner["spec"]["template"]["metadata"]["labels"].items()
    monitor = find(objects, "ServiceMonitor", "metax-operator-runner")
    assert monitor["spec"]["endpoints"] == [{"port": "health", "path": "/metrics", "interval": "30s"}]
    assert monitor["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    kinds = {(o["kind"], o["metadata"]["name"]) for o in render_chart(helm=helm_bin, args=SEED_INSTALL)}
    assert not kinds & {
        ("ServiceMonitor", "metax-operator-runner"),
        ("Service", "metax-operator-runner"),
        ("ConfigMap", "metax-operator-runner-dashboard"),
    }


# -- what the alert rules read (docs/alerts.md) ----------------------------------------------

POLICY = {
    "enableRollout": True,
    "upgradeSteps": [{"replicas": 2, "pauseDuration": "1m"}, {"replicas": "100%"}],
    "maxParallel": 1,
    "readinessTimeout": "10m",
    "maxFailureThreshold": 1,
}


def progressing(step: int, start: float, **resume) -> UpgradeStatus:
    return UpgradeStatus(
        phase=PROGRESSING,
        step=StepStatus(current_step_index=step, current_step_state=STEP_UPGRADE, total_upgrade_replicas=10),
        resume=Resume(step_start_time=rfc3339(start), **resume),
    )


def deadline(m: Metrics, after: UpgradeStatus) -> float:
    m.rollout_pass(None, after, T0)
    return samples(m)[("metax_operator_rollout_step_deadline_timestamp_seconds", ())]


def test_the_step_deadline_counts_waves_retries_and_the_timed_pause_of_the_step():
    m = Metrics()
    m.read_policy(validate(POLICY))
    # step 0: 2 nodes at maxParallel 1 = 2 waves, 1 retry, 10 min each, then a 1 min pause
    assert deadline(m, progressing(0, T0)) == T0 + 3 * 600 + 60
    # step 1: the other 8 nodes = 8 waves, 1 retry, no pause
    assert deadline(m, progressing(1, T0)) == T0 + 9 * 600


def test_the_step_deadline_adds_the_bounded_wait_and_drain_to_each_wave():
    m = Metrics()
    waited = {**POLICY, "waitForCompletion": {"podSelector": "app=training", "timeout": "1h"}, "drain": {"enable": True}}
    m.read_policy(validate(waited))
    assert deadline(m, progressing(1, T0)) == T0 + 9 * (3600 + 300 + 600)


def test_no_step_deadline_applies_while_paused_waiting_without_limit_or_with_an_invalid_policy():
    m = Metrics()
    m.read_policy(validate({**POLICY, "pause": True}))
    assert deadline(m, progressing(0, T0)) == 0
    m.read_policy(validate(POLICY))
    assert deadline(m, progressing(0, T0, paused_by_runner=True, pause_reason="failure")) == 0
    assert deadline(m, status(IDLING, 0, COMPLETED, 10, 10, [], T0)) == 0
    m.read_policy(validate({**POLICY, "waitForCompletion": {"podSelector": "app=training"}}))
    assert deadline(m, progressing(0, T0)) == 0
    m.read_policy(None)  # the pass found the policy invalid
    assert deadline(m, progressing(0, T0)) == 0


def test_the_rollout_conditions_that_hold_are_1_and_those_that_ended_go():
    m = Metrics()
    failed = progressing(0, T0)
    failed.conditions = [
        Condition("Failed", "True", "StepFailed", "step 0: 3 failed pods exceed toleration 0"),
        Condition("Progressing", "True", "Failed", "step 0: ..."),
        Condition("Succeed", "False", "Started", ""),
    ]
    m.rollout_pass(None, failed, T0)
    got = {k: v for k, v in samples(m).items() if k[0] == "metax_operator_rollout_condition"}
    assert got == {
        ("metax_operator_rollout_condition", (("reason", "StepFailed"), ("type", "Failed"))): 1,
        ("metax_operator_rollout_condition", (("reason", "Failed"), ("type", "Progressing"))): 1,
    }
    resumed = progressing(0, T0)
    resumed.conditions = [Condition("Failed", "False", "Resumed", ""), Condition("Progressing", "True", "Resumed", "")]
    m.rollout_pass(failed, resumed, T0 + 60)
    got = {k: v for k, v in samples(m).items() if k[0] == "metax_operator_rollout_condition"}
    assert got == {("metax_operator_rollout_condition", (("reason", "Resumed"), ("type", "Progressing"))): 1}


def test_a_failed_pass_counts_its_reason_and_holds_it_until_a_pass_succeeds():
    m = Metrics()
    m.pass_ended(pass_condition(ApiException(status=403, reason="Forbidden")))
    m.pass_ended(pass_condition(ApiException(status=403, reason="Forbidden")))
    got = samples(m)
    unhealthy = {r: got[("metax_operator_runner_unhealthy", (("reason", r),))] for r in PASS_FAILURES}
    assert unhealthy == {"Forbidden": 1, "APIError": 0, "PassFailed": 0}
    assert got[("metax_operator_runner_pass_failures_total", (("reason", "Forbidden"),))] == 2
    m.pass_ended(pass_condition(None))
    got = samples(m)
    assert all(got[("metax_operator_runner_unhealthy", (("reason", r),))] == 0 for r in PASS_FAILURES)
    assert got[("metax_operator_runner_pass_failures_total", (("reason", "Forbidden"),))] == 2


def test_the_health_gates_last_comparison_is_each_groups_share_by_signal():
    m = Metrics()
    assert not any(k[0] == "metax_operator_rollout_health_share" for k in samples(m))  # before the gate compared
    compared = [
        Comparison(HealthSignal.NOT_READY, 1, 4, 1, 8, 0),
        Comparison(HealthSignal.RESTARTS, 0, 4, 2, 8, 0),
    ]
    m.health_gate(compared)
    m.health_gate([])  # a pass that compared nothing keeps the last comparison
    got = {k[1]: v for k, v in samples(m).items() if k[0] == "metax_operator_rollout_health_share"}
    assert got == {
        (("group", "upgraded"), ("signal", "notReady")): 25.0,
        (("group", "others"), ("signal", "notReady")): 12.5,
        (("group", "upgraded"), ("signal", "restarts")): 0.0,
        (("group", "others"), ("signal", "restarts")): 25.0,
    }


def test_each_driver_pools_rollout_has_its_series_beside_the_drivers_own():
    metrics = Metrics()
    status = UpgradeStatus(phase=PROGRESSING, step=StepStatus(total_upgrade_replicas=3, total_upgrade_ready_replicas=1))
    metrics.pool_rollout("rack-a", status)
    text = metrics.exposition()[0].decode()
    assert 'metax_operator_pool_rollout_phase{phase="Progressing",pool="rack-a"} 1.0' in text
    assert 'metax_operator_pool_rollout_phase{phase="Idling",pool="rack-a"} 0.0' in text
    assert 'metax_operator_pool_rollout_nodes{pool="rack-a",state="upgraded"} 1.0' in text
    assert 'metax_operator_rollout_phase{metax_operator_rollout_phase="Progressing"} 0.0' in text  # the driver's own, untouched
