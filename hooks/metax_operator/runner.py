"""`metax-operator run`: the in-cluster loop that makes CR edits take effect.

Level-triggered: every `--interval` seconds one pass observes the CR, the DaemonSets and the
ConfigMaps, decides (`reconcile.plan`) and writes what differs (`reconcile.execute`); a pass
over an unchanged cluster writes nothing. Only the holder of a coordination.k8s.io Lease acts
(`leader.Elector`); the others log that they wait. SIGTERM (or SIGINT) lets the current pass
finish, then releases the lease so a successor takes over at once. `--once` makes one pass (the
chart's CronJob mode) after taking the lease, and exits. API failures back off exponentially
(up to `MAX_BACKOFF`) before the next pass.
"""
from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import signal
import threading
import time

from . import jsonlog, reconcile, rollout_exec
from .cli import bounded
from .errors import UserError
from .kube import Client, add_arguments
from .leader import Elector, LeaseLock, default_identity

log = logging.getLogger("metax_operator.runner")

#: Longest wait between passes after repeated API failures, seconds.
MAX_BACKOFF = 60.0


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Runner:
    """One pass at a time, acting only while `is_leader()` holds."""

    def __init__(self, api: Client, namespace: str, is_leader, identity: str = ""):
        self.api = api
        self.namespace = namespace
        self.is_leader = is_leader
        self.identity = identity
        self.rollout = rollout_exec.RolloutExecutor(api, namespace, is_leader, identity)

    def run_pass(self) -> int:
        """Observe, decide, write; returns the number of writes."""
        started = time.monotonic()
        observed = reconcile.observe(self.api, self.namespace)
        if observed.cr is None:
            jsonlog.event(log, "no-cr", logging.DEBUG,
                          msg=f"no {reconcile.CR_KIND} {reconcile.CR_NAME} yet: nothing to do")
            return 0
        outcome = reconcile.plan(observed)
        writes = reconcile.execute(self.api, observed, outcome, self.is_leader, utc_now, self.identity)
        writes += self.rollout.run_pass()
        jsonlog.event(log, "pass", logging.INFO if writes else logging.DEBUG, writes=writes,
                      generation=observed.cr["metadata"].get("generation"),
                      seconds=round(time.monotonic() - started, 3))
        return writes


def loop(runner: Runner, elector: Elector, interval: float, stop: threading.Event) -> None:
    """Pass every `interval` seconds while leading, until `stop` is set; then release the lease."""
    failures = 0
    waiting_for = object()
    while not stop.is_set():
        delay = interval
        if elector.is_leader():
            waiting_for = object()
            try:
                runner.run_pass()
                failures = 0
            except reconcile.LostLeadership as err:
                jsonlog.event(log, "lost-lease-mid-pass", logging.WARNING, msg=str(err))
            except Exception as err:  # noqa: BLE001 - a pass must never kill the loop
                failures += 1
                delay = min(MAX_BACKOFF, interval * 2 ** failures)
                jsonlog.event(log, "pass-failed", logging.ERROR, error=f"{type(err).__name__}: {err}",
                              failures=failures, retry_in=delay)
        elif elector.lock.holder != waiting_for:
            waiting_for = elector.lock.holder
            jsonlog.event(log, "wait-lease", lease=elector.lock.name, holder=waiting_for,
                          identity=elector.lock.identity,
                          msg=f"waiting for the lease {elector.lock.name} (held by {waiting_for or 'nobody'})")
        stop.wait(delay)
    released = elector.release()
    jsonlog.event(log, "stopped", released_lease=released, identity=elector.lock.identity)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="the runner: reconcile the ClusterOperator CR into the DaemonSets",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE"),
                        help="the release namespace (default: $POD_NAMESPACE)")
    parser.add_argument("--interval", type=bounded(float, 0.1, 3600), default=5.0,
                        help="seconds between passes (default 5)")
    parser.add_argument("--once", action="store_true", help="one pass, then exit (CronJob mode)")
    parser.add_argument("--lease-name", default="metax-operator-runner", help="the Lease the runners elect with")
    parser.add_argument("--lease-duration", type=bounded(int, 1, 3600), default=15,
                        help="seconds a lease lasts without renewal: the longest handover after a crash (default 15)")
    parser.add_argument("--renew-deadline", type=bounded(int, 1, 3600), default=10,
                        help="seconds the leader keeps trying to renew before it stops acting (default 10)")
    parser.add_argument("--retry-period", type=bounded(int, 1, 3600), default=2,
                        help="seconds between lease attempts (default 2)")
    parser.add_argument("--identity", default=None, help="this runner's name in the lease (default: hostname_random)")
    parser.add_argument("--log-level", default="info", help="debug, info, warn or error")
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
    jsonlog.setup(args.log_level)
    identity = args.identity or default_identity()
    lock = LeaseLock(args.lease_name, args.namespace, identity, api.api_client)
    elector = Elector(lock, args.lease_duration, args.renew_deadline, args.retry_period)
    runner = Runner(api, args.namespace, elector.is_leader, identity)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: (jsonlog.event(log, "stopping", signal=signal.Signals(signum).name),
                                                   stop.set()))
    jsonlog.event(log, "start", namespace=args.namespace, identity=identity, once=args.once,
                  interval=args.interval, lease=args.lease_name)
    elector.start()
    if not args.once:
        loop(runner, elector, args.interval, stop)
        return 0
    # CronJob mode: a previous run that died may still hold the lease until it expires.
    if not elector.wait_for_leadership(args.lease_duration + 2 * args.retry_period):
        jsonlog.event(log, "skip", lease=args.lease_name, holder=lock.holder,
                      msg="another runner holds the lease: this run does nothing")
        elector.release()
        return 0
    try:
        runner.run_pass()
    finally:
        elector.release()
    return 0
