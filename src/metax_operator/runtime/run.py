"""`metax-operator run`: the in-cluster loop that makes CR edits take effect.

Level-triggered: one pass observes the CR, the DaemonSets and the ConfigMaps (from watch caches,
`runtime.object_cache`), validates the spec it acts on once, decides (`reconcile.decide`, then the
rollout's `RolloutPass.decide` on the objects as the reconcile wrote them) and writes what
differs: the objects, then the CR's status once, with the conditions of both halves and the
`upgradeStatus`, then the rollout's actions (`Runner._pass`); a pass over an unchanged cluster
writes nothing and sends no request. A pass runs as soon as a watch sees
a change a decision reads (a driver pod turning Ready, failing or gone, a new ControllerRevision,
an edit of the CR, a DaemonSet, a ConfigMap or the exporter's Service by anyone but this runner)
or the previous pass wrote something (the next step of the rollout may act at once), after
`COALESCE` seconds so that a burst of changes makes one pass, and at the latest `--interval`
seconds after the previous one (what no watch announces: a timed pause running out, a busy
node turning idle). Only the holder of a coordination.k8s.io Lease acts
(`leader.Elector`); the others log that they wait. SIGTERM (or SIGINT) lets the current pass
finish, then releases the lease so a successor takes over at once. `--once` makes one pass (the
chart's CronJob mode) after taking the lease, and exits. API failures back off exponentially
(up to `MAX_BACKOFF`) before the next pass. With `--health-port` the loop serves `/healthz` and
`/readyz` for the kubelet's probes (`health`) and `/metrics` for Prometheus (`metrics`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from metax_operator import contract, jsonlog
from metax_operator.cli import bounded
from metax_operator.conditions import FALSE, CrCondition, rfc3339
from metax_operator.contract import RUNNER_LEASE
from metax_operator.errors import UserError
from metax_operator.rollout import freeze
from metax_operator.rollout.target import DRIVER
from metax_operator.runtime import cr_status, helm_hold, reconcile
from metax_operator.runtime.api_failures import failure_line
from metax_operator.runtime.health import Health, serve
from metax_operator.runtime.informer import SYNC_TIMEOUT
from metax_operator.runtime.kube import Client, add_arguments
from metax_operator.runtime.leader import Elector, LeaseLock, default_identity
from metax_operator.runtime.metrics import Metrics
from metax_operator.runtime.object_cache import NotReady, ObjectCache
from metax_operator.runtime.rollout_observe import Watches
from metax_operator.runtime.rollouts import Rollouts
from metax_operator.runtime.workload_check import WorkloadCheck

log = logging.getLogger("metax_operator.runtime.run")

#: Longest wait between passes after repeated API failures, seconds.
MAX_BACKOFF = 60.0
#: Seconds a pass waits after the change that woke it: a wave's pods turning Ready together
#: make one pass, not one each.
COALESCE = 0.2


def lookup_condition(cr: dict, kind: str) -> str | None:
    """The status of the CR's condition `kind`, or None when it has none."""
    conditions = (cr.get("status") or {}).get("conditions") or []
    return next((c.get("status") for c in conditions if c.get("type") == kind), None)


class Runner:
    """One pass at a time, acting only while `is_leader()` holds."""

    def __init__(
        self,
        api: Client,
        namespace: str,
        is_leader,
        identity: str = "",
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.api, self.clock = api, clock
        self.namespace = namespace
        self.is_leader = is_leader
        self.identity = identity
        self.metrics = metrics
        # Set by the caches whose changes a decision reads: the loop's next pass is due now.
        self.wake = threading.Event()
        # The CR, DaemonSets, ConfigMaps and Service: started at the first pass.
        self.objects = ObjectCache(api, namespace)
        self.objects.on_change = self.wake.set
        # One set of watch caches for the rollout and the workload check, started at the first
        # pass past a Helm hold.
        self.watches = Watches(api, namespace)
        for informer in (self.watches.revisions, self.watches.driver_pods):
            informer.on_change = self.wake.set
        self.rollouts = Rollouts(
            api, namespace, is_leader, identity, clock, watches=self.watches, metrics=metrics, reader=self.objects
        )
        self.workloads = WorkloadCheck(api, self.watches.gpu_pods)

    def run_pass(self) -> int:
        """Observe, decide, write; returns the number of writes. How the pass ended is the CR's
        RunnerHealthy condition: a failure is reported, then raised."""
        try:
            return self._pass()
        except cr_status.LostLeadership:
            raise
        except Exception as err:
            self._report(err)
            raise

    def _report(self, failure: Exception | None) -> int:
        """Set RunnerHealthy for how the pass ended (written only when it changes; the writes
        made). Best effort: the status write may be what fails, and that must not hide the pass's
        own failure."""
        condition = cr_status.pass_condition(failure)
        if self.metrics is not None:
            self.metrics.pass_ended(condition)
        try:
            observed = reconcile.observe(self.objects, self.namespace)
        except NotReady:  # the caches have not listed (yet, or since the failure): nothing to report to
            return 0
        if observed.cr is None:
            return 0
        outcome = reconcile.Outcome(conditions=[condition])
        try:
            return reconcile.apply(self.api, observed, outcome, self.is_leader, self.clock, self.identity, applied=False)
        except Exception as err:  # noqa: BLE001 - reported in the log instead
            jsonlog.event(log, "report-failed", logging.WARNING, error=failure_line(err))
            return 0

    def _pass(self) -> int:
        """One pass, in order: observe (the caches), hold for Helm, the spec in force, decide (the
        reconcile, once validated), write the objects, decide the rollout on the objects as just
        written, write the CR's status and the Events once, then the rollout's actions."""
        started = time.monotonic()
        if not self.objects.start().wait_synced(SYNC_TIMEOUT):
            jsonlog.event(
                log,
                "wait-cache",
                logging.WARNING,
                msg="the caches of the CR, DaemonSets, ConfigMaps and Service have not listed yet",
            )
            return 0
        observed = reconcile.observe(self.objects, self.namespace)
        if observed.cr is None:
            jsonlog.event(log, "no-cr", logging.DEBUG, msg=f"no {contract.CR_KIND} {contract.CR_NAME}: no rollout")
            return self.rollouts.without_cr()
        waiting = helm_hold.hold(observed.cr, {**observed.daemonsets, **observed.pools}, self.clock)
        if waiting is not None:
            jsonlog.event(
                log,
                "helm-hold",
                revision=waiting.revision,
                daemonsets=waiting.behind,
                msg=f"Helm has not applied release revision {waiting.revision} yet (DaemonSets {', '.join(waiting.behind)}): "
                f"nothing is written until it has, or until {rfc3339(waiting.until)}",
            )
            return 0
        self.watches.start()
        self.workloads.start()
        cr = observed.cr
        # Each rollout acts on its spec (an edit made mid-rollout waits for the rollout to end).
        forces = freeze.each_in_force(cr, observed.pools)
        in_force, held = forces[DRIVER], freeze.every_held(forces)
        if held.held:
            jsonlog.event(log, "spec-held", logging.DEBUG, fields=list(held.held))
        pool_specs = {target.pool: force.spec for target, force in forces.items() if target != DRIVER}
        acting = dataclasses.replace(observed, cr={**cr, "spec": in_force.spec}, pool_specs=pool_specs)
        outcome = reconcile.decide(acting, [*reconcile.RECONCILERS, self.workloads.reconcile])
        if held.held or lookup_condition(cr, CrCondition.SPEC_HELD) is not None:
            outcome.conditions.append(held.condition())
        # RunnerHealthy goes with the pass's one status write, which comes before the rollout's
        # actions; after a failed pass it turns True only once the whole pass has succeeded, so
        # that a pass failing in those actions does not set it True and then False again.
        failing = lookup_condition(cr, CrCondition.RUNNER_HEALTHY) == FALSE
        if not failing:
            outcome.conditions.append(cr_status.pass_condition(None))
        policy = acting.check.policy
        applied = reconcile.apply_objects(self.api, outcome.applies, self.is_leader)
        plans = self.rollouts.decide(cr, {target: force.spec for target, force in forces.items()}, policy)
        if (pools_condition := self.rollouts.condition(cr)) is not None:
            outcome.conditions.append(pools_condition)
        written = cr_status.write(
            self.api,
            cr,
            outcome.conditions,
            [*outcome.events, *applied],
            self.is_leader,
            rfc3339(self.clock()),
            self.identity,
            rollout=self.rollouts.status_fields(cr, plans),
        )
        writes = len(outcome.applies) + written.writes
        if written.cr is not None:
            writes += self.rollouts.act(written.cr, plans)
        if failing:
            writes += self._report(None)
        if self.metrics is not None:
            self.metrics.read_policy(policy)
            self.metrics.pass_seconds.observe(time.monotonic() - started)
        jsonlog.event(
            log,
            "pass",
            logging.INFO if writes else logging.DEBUG,
            writes=writes,
            generation=cr["metadata"].get("generation"),
            seconds=round(time.monotonic() - started, 3),
        )
        return writes

    def close(self) -> None:
        """Stop the watch caches (those not started yet included)."""
        self.objects.stop()
        self.rollouts.close()
        self.workloads.stop()

    def caches(self) -> tuple:
        """The watch caches this runner has started (the objects' from its first pass, the
        rollout's from its first pass or the first without a CR, the workload check's once past a
        Helm hold, the driver pools' nodes once a pool is in the spec): what its readiness waits
        for. One not started yet (none of the workload check's before the CR exists) does not
        hold readiness back."""
        return (
            *self.objects.informers,
            *(self.watches.all if self.watches.started else ()),
            *(self.workloads.informers if self.workloads.started else ()),
            *self.rollouts.pool_nodes.informers.values(),
        )


def loop(
    runner: Runner, elector: Elector, interval: float, stop: threading.Event, health: Health | None = None, on_change: bool = True
) -> None:
    """Pass when `runner.wake` is set or the last pass wrote (after COALESCE seconds; neither with
    `on_change` False), when the elector takes the lease, or `interval` seconds after the last
    pass, while leading, until `stop` is set; then release the lease. After a failed pass the backoff holds whatever changes. Each
    finished iteration is reported to `health`."""
    wake = runner.wake if on_change else threading.Event()
    elector.on_leading = wake.set  # the lease taken: the first pass comes at once, not an interval later
    threading.Thread(target=lambda: (stop.wait(), wake.set()), name="stop wakes the loop", daemon=True).start()
    failures = 0
    waiting_for = object()
    while not stop.is_set():
        delay = interval
        passed = False
        if elector.is_leader():
            waiting_for = object()
            try:
                if runner.run_pass() and on_change:
                    # It wrote (a step started or ended, a status moved): the next decision may
                    # act at once, and a status write announces itself to no watch. A pass over
                    # an unchanged cluster writes nothing, so this cannot spin.
                    wake.set()
                failures = 0
                passed = True
            except cr_status.LostLeadership as err:
                jsonlog.event(log, "lost-lease-mid-pass", logging.WARNING, msg=str(err))
            except Exception as err:  # noqa: BLE001 - a pass must never kill the loop
                failures += 1
                delay = min(MAX_BACKOFF, interval * 2**failures)
                jsonlog.event(log, "pass-failed", logging.ERROR, error=failure_line(err), failures=failures, retry_in=delay)
        elif elector.lock.holder != waiting_for:
            waiting_for = elector.lock.holder
            jsonlog.event(
                log,
                "wait-lease",
                lease=elector.lock.name,
                holder=waiting_for,
                identity=elector.lock.identity,
                msg=f"waiting for the lease {elector.lock.name} (held by {waiting_for or 'nobody'})",
            )
        if health is not None:
            health.iteration_done(passed, delay)
        if failures:
            stop.wait(delay)
        elif wake.wait(delay):
            stop.wait(COALESCE)
        wake.clear()
    released = elector.release()
    jsonlog.event(log, "stopped", released_lease=released, identity=elector.lock.identity)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run", help="the runner: reconcile the ClusterOperator CR into the DaemonSets", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--namespace", default=os.environ.get("POD_NAMESPACE"), help="the release namespace (default: $POD_NAMESPACE)"
    )
    parser.add_argument("--interval", type=bounded(float, 0.1, 3600), default=5.0, help="seconds between passes (default 5)")
    parser.add_argument("--once", action="store_true", help="one pass, then exit (CronJob mode)")
    parser.add_argument(
        "--interval-only", action="store_true", help="pass only every --interval seconds, not also when a watch sees a change"
    )
    parser.add_argument("--lease-name", default=RUNNER_LEASE, help=f"the Lease the runners elect with (default {RUNNER_LEASE})")
    parser.add_argument(
        "--lease-duration",
        type=bounded(int, 1, 3600),
        default=15,
        help="seconds a lease lasts without renewal: the longest handover after a crash (default 15)",
    )
    parser.add_argument(
        "--renew-deadline",
        type=bounded(int, 1, 3600),
        default=10,
        help="seconds the leader keeps trying to renew before it stops acting (default 10)",
    )
    parser.add_argument(
        "--retry-period", type=bounded(int, 1, 3600), default=2, help="seconds between lease attempts (default 2)"
    )
    parser.add_argument("--identity", default=None, help="this runner's name in the lease (default: hostname_random)")
    parser.add_argument(
        "--health-port",
        type=bounded(int, 0, 65535),
        default=0,
        help="serve /healthz, /readyz and /metrics on this port (default: none; not with --once)",
    )
    parser.add_argument("--health-host", default="", help="the address to serve them on (default: every address)")
    parser.add_argument(
        "--stall-timeout",
        type=bounded(float, 1, 86400),
        default=300.0,
        help="seconds one iteration of the loop (a pass, API retries included) may run before /healthz fails (default 300)",
    )
    jsonlog.add_arguments(parser)
    add_arguments(parser)
    parser.set_defaults(func=_main)


def _check(args: argparse.Namespace) -> None:
    if not args.namespace:
        raise UserError("--namespace", "is not set", "pass --namespace NS or set $POD_NAMESPACE")
    if not args.renew_deadline > 1.2 * args.retry_period:
        raise UserError("--renew-deadline", "must exceed 1.2 x --retry-period", "use e.g. --renew-deadline 10")
    if not args.lease_duration > args.renew_deadline:
        raise UserError("--lease-duration", "must exceed --renew-deadline", "use e.g. --lease-duration 15")


def _main(args: argparse.Namespace) -> int:
    _check(args)
    api = Client.from_args(args)
    api.server_version()  # an API server that cannot be reached is a one-line error now, not a loop of them
    jsonlog.setup(args.log_level, args.log_format)
    identity = args.identity or default_identity()
    lock = LeaseLock(args.lease_name, args.namespace, identity, api.api_client)
    elector = Elector(lock, args.lease_duration, args.renew_deadline, args.retry_period)
    metrics = None
    if args.health_port and not args.once:
        metrics = Metrics()
        metrics.count_requests(api.api_client)
        metrics.leader.set_function(lambda: float(elector.is_leader()))
    runner = Runner(api, args.namespace, elector.is_leader, identity, metrics)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(
            sig, lambda signum, _frame: (jsonlog.event(log, "stopping", signal=signal.Signals(signum).name), stop.set())
        )
    jsonlog.event(
        log, "start", namespace=args.namespace, identity=identity, once=args.once, interval=args.interval, lease=args.lease_name
    )
    elector.start()
    if not args.once:
        health = None
        if args.health_port:
            health = Health(elector, runner.caches, stall_timeout=args.stall_timeout, api_timeout=args.lease_duration)
            server = serve(health, args.health_host, args.health_port, metrics)
            jsonlog.event(
                log,
                "health",
                address=server.server_address[0],
                port=server.server_address[1],
                msg=f"serving /healthz, /readyz and /metrics on port {server.server_address[1]}",
            )
        loop(runner, elector, args.interval, stop, health, on_change=not args.interval_only)
        return 0
    # CronJob mode: a previous run that died may still hold the lease until it expires.
    if not elector.wait_for_leadership(args.lease_duration + 2 * args.retry_period):
        jsonlog.event(
            log, "skip", lease=args.lease_name, holder=lock.holder, msg="another runner holds the lease: this run does nothing"
        )
        elector.release()
        return 0
    try:
        runner.run_pass()
    finally:
        elector.release()
    return 0
