"""The runner's Prometheus metrics, served at `/metrics` on its health port.

Made with `prometheus_client` (the Prometheus project's own library: text exposition format,
histogram buckets, `_total`/`_created` series) in a registry of the runner's own, so nothing of
the library's process collectors or of another registry mixes in. The names are the runner's
contract with dashboards and alerts (the chart's Grafana dashboard reads them: `NAMES`):

- `metax_operator_rollout_phase{phase}`: 1 for the rollout's phase, 0 for the others;
- `metax_operator_rollout_step`, `metax_operator_rollout_step_state{state}`: the current step's
  index, and 1 for its state;
- `metax_operator_rollout_nodes{state}`: nodes by state: `total` (eligible), `upgraded` (Ready
  at the upgrading revision), `failed`, `held` (GPU work), `skipped` (skip label), `cordoned`
  (by the runner), `in_wave`, `out_of_service` (cordoned by someone else, NotReady or without a
  driver pod, beyond what the next wave allows: it waits for them);
- `metax_operator_node_upgrade_state{state}`: GPU nodes by the upgrade state the runner keeps in
  each node's `metax-tech.com/driver-upgrade.state` label (`pending`, `cordoned`, ... `skipped`:
  `NodeUpgradeState`), as the last pass decided it; every state's series exists, at 0 when no
  node is in it;
- `metax_operator_rollout_wave_duration_seconds`: histogram, from a wave's start until the pass
  that saw it done;
- `metax_operator_runner_pass_duration_seconds`: histogram, one runner pass (reconcile and
  rollout);
- `metax_operator_api_requests_total{method}`: the runner's requests to the API server by HTTP
  method (GET, PUT, PATCH, DELETE, POST), its watch caches' LISTs and WATCHes included;
- `metax_operator_runner_pass_failures_total{reason}`: passes that failed, by the reason of the
  CR's RunnerHealthy condition (each reason's series exists from the start, at 0);
- `metax_operator_leader`: 1 while this runner holds the lease;
- `metax_operator_nodes_need_reboot`: nodes that reported a `NodeNeedReboot` event
  (driver-manager, after a firmware upgrade) and have not restarted since;
- `metax_operator_rollout_condition{type,reason}`: 1 for each condition of the rollout
  (`status.upgradeStatus.condition`) whose status is True, e.g. `Failed`/`StepFailed`;
- `metax_operator_rollout_step_deadline_timestamp_seconds`: when the current step should be done
  by under the upgrade policy (`rollout.budget.step_deadline`), 0 while no bound applies;
- `metax_operator_runner_unhealthy{reason}`: 1 for the reason of the CR's RunnerHealthy=False
  after a failed pass, all 0 after a pass that succeeded.
- `metax_operator_rollout_health_share{signal,group}`: at the health gate's last comparison
  (`driver.upgradePolicy.healthGate`), the percentage of the `upgraded` nodes and of the `others`
  showing each signal (`HealthSignal`); no series before the gate first compared.
- `metax_operator_pool_rollout_phase{pool,phase}`, `metax_operator_pool_rollout_nodes{pool,state}`:
  each driver pool's rollout (`driver.pools`), as the two above are the driver DaemonSet's own:
  1 for its phase, and its nodes `total`, `upgraded`, `failed`, `in_wave`, `out_of_service`.

The rollout metrics without a `pool` label are the driver DaemonSet's own rollout; the node
upgrade states count every GPU node, of any pool.

The chart's alert rules (`chart.alerts`) read these.

The rollout gauges are what the last pass of this runner decided; a runner that does not lead
keeps what it last saw (`metax_operator_leader` says which runner to read).
"""

from __future__ import annotations

import collections

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from metax_operator.chart.upgrade_policy import Policy
from metax_operator.conditions import FALSE, PASS_FAILURES, Condition, parse_time
from metax_operator.rollout.budget import step_deadline
from metax_operator.rollout.health_gate import Comparison
from metax_operator.rollout.node_state import NodeUpgradeState
from metax_operator.rollout.status import (
    COMPLETED,
    DISABLED,
    DISABLING,
    IDLING,
    PROGRESSING,
    STEP_INIT,
    STEP_PAUSED,
    STEP_READY,
    STEP_UPGRADE,
    TERMINATING,
    UpgradeStatus,
)

PREFIX = "metax_operator_"
PHASES = [IDLING, PROGRESSING, TERMINATING, DISABLED, DISABLING]
STEP_STATES = ["", STEP_INIT, STEP_UPGRADE, STEP_PAUSED, STEP_READY, COMPLETED]
NODE_STATES = ("total", "upgraded", "failed", "held", "skipped", "cordoned", "in_wave", "out_of_service")
# A wave lasts from seconds (kwok) to the readiness timeout (10 min by default) or longer.
WAVE_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600)
PASS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """The runner's metrics and the registry that exports them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.phase = Enum(
            PREFIX + "rollout_phase", "The driver rollout's phase (status.upgradeStatus.phase).", states=PHASES, registry=r
        )
        self.step = Gauge(PREFIX + "rollout_step", "The rollout's current step index.", registry=r)
        self.step_state = Enum(
            PREFIX + "rollout_step_state", "The current step's state ('' before a rollout).", states=STEP_STATES, registry=r
        )
        self.nodes = Gauge(PREFIX + "rollout_nodes", "Nodes of the driver rollout by state.", ["state"], registry=r)
        self.upgrade_states = Gauge(
            PREFIX + "node_upgrade_state",
            "GPU nodes by their upgrade state (the node label metax-tech.com/driver-upgrade.state).",
            ["state"],
            registry=r,
        )
        for state in NodeUpgradeState:
            self.upgrade_states.labels(state.value)
        self.wave_seconds = Histogram(
            PREFIX + "rollout_wave_duration_seconds",
            "Seconds from a wave's start until a pass saw it done.",
            buckets=WAVE_BUCKETS,
            registry=r,
        )
        self.pass_seconds = Histogram(
            PREFIX + "runner_pass_duration_seconds", "Seconds one runner pass took.", buckets=PASS_BUCKETS, registry=r
        )
        self.requests = Counter(
            PREFIX + "api_requests", "Requests to the Kubernetes API server by HTTP method.", ["method"], registry=r
        )
        self.pass_failures = Counter(
            PREFIX + "runner_pass_failures",
            "Runner passes that failed, by the reason of the CR's RunnerHealthy condition.",
            ["reason"],
            registry=r,
        )
        for reason in PASS_FAILURES:  # each series exists from the start, at 0, for rate() and alerts
            self.pass_failures.labels(reason)
        self.leader = Gauge(PREFIX + "leader", "1 while this runner holds the lease.", registry=r)
        self.pool_phase = Gauge(
            PREFIX + "pool_rollout_phase", "1 for each driver pool's rollout phase.", ["pool", "phase"], registry=r
        )
        self.pool_nodes = Gauge(
            PREFIX + "pool_rollout_nodes", "Nodes of each driver pool's rollout by state.", ["pool", "state"], registry=r
        )
        self.need_reboot = Gauge(
            PREFIX + "nodes_need_reboot", "Nodes that reported NodeNeedReboot and have not restarted since.", registry=r
        )
        self.conditions = Gauge(
            PREFIX + "rollout_condition",
            "1 for each condition of the rollout whose status is True.",
            ["type", "reason"],
            registry=r,
        )
        self._true_conditions: set[tuple[str, str]] = set()
        self.step_deadline = Gauge(
            PREFIX + "rollout_step_deadline_timestamp_seconds",
            "When the current step should be done by under the upgrade policy (0: no bound applies).",
            registry=r,
        )
        self.unhealthy = Gauge(
            PREFIX + "runner_unhealthy",
            "1 for the reason of RunnerHealthy=False after a failed pass; all 0 after a pass that succeeded.",
            ["reason"],
            registry=r,
        )
        for reason in PASS_FAILURES:
            self.unhealthy.labels(reason)
        self.health_share = Gauge(
            PREFIX + "rollout_health_share",
            "At the health gate's last comparison, the percentage of the upgraded nodes and of the others showing each signal.",
            ["signal", "group"],
            registry=r,
        )
        #: The upgrade policy of the CR the pass read (`read_policy`): the step deadline's bound.
        self.policy: Policy | None = None
        for state in NODE_STATES:
            self.nodes.labels(state)
        for method in ("GET", "PUT", "PATCH", "DELETE", "POST"):
            self.requests.labels(method)

    def count_requests(self, api_client) -> None:
        """Count every request `api_client` (a kubernetes `ApiClient`) sends: the typed APIs (the
        lease), `kube.Client` calls and the watch caches all end in its `request` method."""
        send = api_client.request

        def counted(method: str, url: str, *args, **kwargs):
            self.requests.labels(method.upper()).inc()
            return send(method, url, *args, **kwargs)

        api_client.request = counted

    def pass_ended(self, condition: Condition) -> None:
        """Count a failed pass by its RunnerHealthy reason, and say which reason holds now."""
        failed = condition.status == FALSE
        if failed:
            self.pass_failures.labels(condition.reason).inc()
        for reason in PASS_FAILURES:
            self.unhealthy.labels(reason).set(1 if failed and reason == condition.reason else 0)

    def read_policy(self, policy: Policy | None) -> None:
        """Keep the CR's upgrade policy as the pass validated it (None when it is invalid: SpecValid
        says why) for the step deadline of the rollout pass that follows."""
        self.policy = policy

    def rollout_pass(self, before: UpgradeStatus | None, after: UpgradeStatus, now: float) -> None:
        """Set the rollout gauges from the status a pass wrote (`after`); a wave that `before` had
        in flight and `after` no longer has (or replaced) is observed as done now."""
        step, resume = after.step, after.resume
        self.phase.state(after.phase)
        self.step.set(step.current_step_index)
        self.step_state.state(step.current_step_state or "")
        counts = {
            "total": step.total_upgrade_replicas,
            "upgraded": step.total_upgrade_ready_replicas,
            "failed": resume.failed.count,
            "held": resume.held.count,
            "skipped": resume.skipped.count,
            "cordoned": resume.cordoned.count,
            "in_wave": len(resume.wave),
            "out_of_service": resume.out_of_service.count,
        }
        for state, value in counts.items():
            self.nodes.labels(state).set(value)
        self.need_reboot.set(resume.need_reboot.count)
        self.step_deadline.set(step_deadline(after, self.policy) or 0)
        true = {(c.type, c.reason) for c in after.conditions if c.status == "True"}
        for labels in self._true_conditions - true:
            self.conditions.remove(*labels)
        for labels in true:
            self.conditions.labels(*labels).set(1)
        self._true_conditions = true
        was = before.resume if before is not None else None
        started = parse_time(was.wave_start_time) if was is not None else None
        if (
            was is not None
            and was.wave
            and started is not None
            and (not resume.wave or resume.wave_start_time != was.wave_start_time)
        ):
            self.wave_seconds.observe(max(0.0, now - started))

    def pool_rollout(self, pool: str, after: UpgradeStatus) -> None:
        """A driver pool's rollout gauges, from the status a pass wrote for it."""
        for phase in PHASES:
            self.pool_phase.labels(pool, phase).set(1 if after.phase == phase else 0)
        step, resume = after.step, after.resume
        counts = {
            "total": step.total_upgrade_replicas,
            "upgraded": step.total_upgrade_ready_replicas,
            "failed": resume.failed.count,
            "in_wave": len(resume.wave),
            "out_of_service": resume.out_of_service.count,
        }
        for state, value in counts.items():
            self.pool_nodes.labels(pool, state).set(value)

    def health_gate(self, compared: list[Comparison]) -> None:
        """The health gate's comparison of a pass (none: the last one stays)."""
        for c in compared:
            self.health_share.labels(c.signal.value, "upgraded").set(100 * c.upgraded / c.upgraded_total)
            self.health_share.labels(c.signal.value, "others").set(100 * c.others / c.others_total)

    def node_states(self, states: dict[str, NodeUpgradeState]) -> None:
        """Count the nodes of each upgrade state a pass decided (all of them, also those whose
        label the pass left for the next one)."""
        counts = collections.Counter(states.values())
        for state in NodeUpgradeState:
            self.upgrade_states.labels(state.value).set(counts[state])

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition of every metric, and its Content-Type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def names(metrics: Metrics) -> set[str]:
    """Every series name the registry exports (histograms' `_bucket`/`_sum`/`_count`, counters'
    `_total` and `_created` included), and each gauge's name (a labelled gauge has no series
    before its first label set, `metax_operator_rollout_condition`): what a query may name."""
    families = list(metrics.registry.collect())
    return {s.name for f in families for s in f.samples} | {f.name for f in families if f.type == "gauge"}
