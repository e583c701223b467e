"""The alert rules on the runner's metrics (`runtime.metrics`) and the exporter's scrape target.

Written once, here: `chart.generate` writes them as a plain Prometheus rules file
(`alerts/metax-operator-rules.yaml`, for a Prometheus without the Prometheus Operator), and the
chart's `runner.prometheusRule` renders that file's groups as a `PrometheusRule`. Each alert's
`runbook_url` points at its section of docs/alerts.md (the anchor is the alert's name in lower
case); the chart replaces the base with `runner.prometheusRule.runbookBaseURL`.
tests/chart/alerts_test.yaml holds the `promtool test rules` cases, one that fires and one that
does not per alert.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from metax_operator.contract import DAEMONSETS

RULES_FILE = "alerts/metax-operator-rules.yaml"
#: Where docs/alerts.md is read; the chart's `runner.prometheusRule.runbookBaseURL` replaces it.
RUNBOOK_BASE = "https://git.example.com/gpu/metax-operator/blob/main/docs/alerts.md"
RUNNER_GROUP = "metax-operator-runner"
#: The exporter's scrape job: its Service's (and DaemonSet's) name, which its ServiceMonitor's
#: targets carry; also the name of its rule group, which the chart includes where that job exists.
EXPORTER_JOB = EXPORTER_GROUP = DAEMONSETS["exporter"]
#: Keeps a rollout alert to the runner that leads: the others keep the gauges they last set.
LEADING = "and on(instance) metax_operator_leader == 1"


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str

    def rule(self, runbook_base: str = RUNBOOK_BASE) -> dict:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {
                "summary": self.summary,
                "description": self.description,
                "runbook_url": f"{runbook_base}#{self.name.lower()}",
            },
        }


RUNNER_ALERTS = (
    Alert(
        "MetaxRolloutStepStuck",
        "(time() - metax_operator_rollout_step_deadline_timestamp_seconds) > 0"
        " and metax_operator_rollout_step_deadline_timestamp_seconds > 0 " + LEADING,
        "10m",
        "warning",
        "The driver rollout's current step is past the longest its upgrade policy allows.",
        "The step has run {{ $value | humanizeDuration }} longer than its waves, retries and timed pause"
        " may take under driver.upgradePolicy: nodes are held back or a wave waits on something.",
    ),
    Alert(
        "MetaxRolloutStepFailed",
        'metax_operator_rollout_condition{type="Failed",reason=~"StepFailed|UnhealthyStep"} == 1 ' + LEADING,
        "1m",
        "critical",
        "A step of the driver rollout failed: more driver pods failed than it tolerates, or its upgraded nodes"
        " were less healthy than the others (healthGate).",
        "The rollout took its fallback: it paused (fallback: pause) until the admin sets pause: false,"
        " or rolled back (fallback: rollback).",
    ),
    Alert(
        "MetaxRolloutRolledBack",
        'metax_operator_rollout_condition{type="Terminating",reason="FallbackRollback"} == 1 ' + LEADING,
        "1m",
        "critical",
        "The driver rollout failed a step and rolls the driver back (fallback: rollback).",
        "Every node returns to the previous driver revision; the new revision stays abandoned until the driver changes again.",
    ),
    Alert(
        "MetaxRolloutNodesFailed",
        'metax_operator_rollout_nodes{state="failed"} > 0 ' + LEADING,
        "5m",
        "warning",
        "Driver pods of the rollout failed on {{ $value }} nodes.",
        "Their new driver pod did not become Ready within readinessTimeout, failed, or kept restarting.",
    ),
    Alert(
        "MetaxNodesNeedReboot",
        "metax_operator_nodes_need_reboot > 0 " + LEADING,
        "15m",
        "warning",
        "{{ $value }} GPU nodes need a reboot to finish a firmware upgrade.",
        "They reported a NodeNeedReboot event and have not restarted since.",
    ),
    Alert(
        "MetaxNodesLeftCordoned",
        '(metax_operator_rollout_nodes{state="cordoned"} - ignoring(state) metax_operator_rollout_nodes{state="in_wave"})'
        " > 0 " + LEADING,
        "15m",
        "warning",
        "{{ $value }} nodes cordoned by the runner are not in the rollout's current wave.",
        "The runner cordons a node while its driver pod is replaced and uncordons it once the new one is Ready;"
        " a node whose new driver failed stays cordoned on purpose, any other is left unschedulable.",
    ),
    Alert(
        "MetaxRunnerUnhealthy",
        "metax_operator_runner_unhealthy == 1",
        "5m",
        "critical",
        "The runner's passes fail ({{ $labels.reason }}): CR edits and the rollout do not take effect.",
        "The CR's RunnerHealthy condition is False with reason {{ $labels.reason }}; its message says what failed.",
    ),
    Alert(
        "MetaxRunnerNoLeader",
        "absent(metax_operator_leader == 1)",
        "5m",
        "critical",
        "No runner holds the lease, or none is scraped: nothing reconciles the CR.",
        "No scraped runner reports metax_operator_leader 1.",
    ),
    Alert(
        "MetaxRunnerPassFailures",
        "sum by (reason) (increase(metax_operator_runner_pass_failures_total[15m])) >= 3",
        "0m",
        "warning",
        "Runner passes failed {{ $value | humanize }} times in 15 minutes ({{ $labels.reason }}).",
        "Passes that fail now and then: each is retried with backoff, so work is delayed.",
    ),
)

EXPORTER_ALERTS = (
    Alert(
        "MetaxDataExporterDown",
        f'up{{job="{EXPORTER_JOB}"}} == 0',
        "5m",
        "warning",
        "The GPU metrics exporter on {{ $labels.instance }} cannot be scraped.",
        "metax-data-exporter does not answer on its metrics port: GPU metrics of that node are missing.",
    ),
)


def groups(runbook_base: str = RUNBOOK_BASE) -> list[dict]:
    """The rule groups of the rules file."""
    return [
        {"name": RUNNER_GROUP, "rules": [a.rule(runbook_base) for a in RUNNER_ALERTS]},
        {"name": EXPORTER_GROUP, "rules": [a.rule(runbook_base) for a in EXPORTER_ALERTS]},
    ]


def render_rules_file(note: str) -> str:
    """The plain Prometheus rules file, headed by `note` (the generator's)."""
    body = yaml.safe_dump({"groups": groups()}, sort_keys=False, width=1000, allow_unicode=True)
    return (
        f"# {note}\n"
        "# The alerts of metax-operator (docs/alerts.md) as a Prometheus rules file (rule_files:). The\n"
        f"# {EXPORTER_GROUP} group expects the exporter's targets under job {EXPORTER_JOB}.\n{body}"
    )
