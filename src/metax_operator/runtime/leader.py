"""Leader election for the runner: the kubernetes client's `LeaderElection` over a Lease.

The pinned client (kubernetes 35.0.0) ships only a `ConfigMapLock`. `LeaseLock` implements the
same resourcelock interface (`get`, `create`, `update`) on a coordination.k8s.io/v1 Lease, with
optimistic concurrency (every update carries the resourceVersion it read, so two candidates
racing for an expired lease cannot both win: the loser gets 409 and stays a follower).

`Elector` runs the library's election loop in a daemon thread and adds what the runner needs and
the library lacks:
- `is_leader()` is conservative: true only while the last successful renewal, counted from when
  its request was sent, is younger than the renew deadline. A follower counts the lease duration
  from when it saw that renewal, which is later, so a leader cut off from the API server, or
  answered late, stops acting before its lease can expire and another runner take over;
- `MonotonicElection` times both sides on a monotonic clock (the library uses the wall clock);
- after a lost lease it enters the election again (the library's `run()` returns);
- `release()` on shutdown hands the lease over at once (holder cleared, as client-go's
  ReleaseOnCancel does) and closes the lock so the election thread can never write, nor read, again.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import socket
import threading
import time
import uuid
from collections.abc import Callable
from http import HTTPStatus

from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.leaderelectionrecord import LeaderElectionRecord

from metax_operator.jsonlog import event
from metax_operator.runtime.api_failures import failure_line

log = logging.getLogger("metax_operator.runtime.leader")


def default_identity() -> str:
    """The pod name (the hostname in a pod) plus a random suffix, as client-go does."""
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


class LeaseLock:
    """A coordination.k8s.io/v1 Lease as a resource lock for `kubernetes.leaderelection`.

    The library passes times as `str(datetime.fromtimestamp(t))` (naive local time); they are
    stored in the Lease as MicroTime (UTC) and read back in the library's form, so a record read,
    kept and written again round-trips exactly.
    """

    def __init__(
        self,
        name: str,
        namespace: str,
        identity: str,
        api_client: client.ApiClient,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.name = name
        self.namespace = namespace
        self.identity = identity
        self.api = client.CoordinationV1Api(api_client)
        self.clock = clock
        self.holder: str | None = None  # the holder seen on the last read
        self.renewed_at = -math.inf  # clock() when our last successful write of our own record was SENT
        self.answered_at: float | None = None  # clock() the API server last answered us
        self._lease: client.V1Lease | None = None
        self._closed = False
        self._mutex = threading.Lock()

    def get(self, name, namespace):
        if self._closed:  # released: the election thread, which never ends, stays off the API server
            return False, _unavailable(RuntimeError("the lease was released"))
        try:
            lease = self.api.read_namespaced_lease(name, namespace, _request_timeout=10)
        except ApiException as err:
            if err.status == 404:  # no lease yet: the server answered
                self.answered_at = self.clock()
            return False, err
        except Exception as err:  # noqa: BLE001 - network errors: the library expects an ApiException-like body
            return False, _unavailable(err)
        self.answered_at = self.clock()
        with self._mutex:
            self._lease = lease
        spec = lease.spec
        self.holder = spec.holder_identity or None
        return True, LeaderElectionRecord(
            spec.holder_identity or None,
            str(spec.lease_duration_seconds) if spec.lease_duration_seconds else None,
            _to_record_time(spec.acquire_time),
            _to_record_time(spec.renew_time),
        )

    def create(self, name, namespace, election_record):
        body = client.V1Lease(
            metadata=client.V1ObjectMeta(name=name, namespace=namespace), spec=self._spec(election_record, transitions=0)
        )
        return self._write(lambda: self.api.create_namespaced_lease(namespace, body, _request_timeout=10), election_record)

    def update(self, name, namespace, updated_record):
        with self._mutex:
            lease = self._lease
        if lease is None:
            return False
        old = lease.spec
        transitions = (old.lease_transitions or 0) + (old.holder_identity != updated_record.holder_identity)
        body = client.V1Lease(metadata=lease.metadata, spec=self._spec(updated_record, transitions))
        return self._write(lambda: self.api.replace_namespaced_lease(name, namespace, body, _request_timeout=10), updated_record)

    def release(self) -> bool:
        """Clear the holder if we hold the lease, and refuse every later read and write. True if released."""
        with self._mutex:
            self._closed = True
            lease = self._lease
            if lease is None or lease.spec.holder_identity != self.identity:
                return False
            now = dt.datetime.now(dt.timezone.utc)
            spec = client.V1LeaseSpec(
                holder_identity="",
                lease_duration_seconds=1,
                acquire_time=now,
                renew_time=now,
                lease_transitions=lease.spec.lease_transitions,
            )
            try:
                self.api.replace_namespaced_lease(
                    self.name, self.namespace, client.V1Lease(metadata=lease.metadata, spec=spec), _request_timeout=10
                )
            except Exception as err:  # noqa: BLE001 - the lease then simply expires
                event(log, "release-lease-failed", logging.WARNING, lease=self.name, error=failure_line(err))
                return False
            return True

    def _spec(self, record: LeaderElectionRecord, transitions: int) -> client.V1LeaseSpec:
        return client.V1LeaseSpec(
            holder_identity=record.holder_identity,
            lease_duration_seconds=int(float(record.lease_duration)),
            acquire_time=_from_record_time(record.acquire_time),
            renew_time=_from_record_time(record.renew_time),
            lease_transitions=transitions,
        )

    def renewed_within(self, seconds: float) -> bool:
        """Our last successful write of our own record was sent less than `seconds` ago."""
        return self.clock() - self.renewed_at < seconds

    def _write(self, call, record: LeaderElectionRecord) -> bool:
        """Write `record`; a write of our own record renews from when it was sent, not answered:
        a follower restarts its count once it sees the write, so never before it was sent."""
        with self._mutex:
            if self._closed:
                return False
            sent = self.clock()
            try:
                self._lease = call()
            except ApiException as err:
                if err.status == 409:  # another candidate wrote first
                    self.answered_at = self.clock()
                else:
                    event(log, "lease-write-failed", logging.WARNING, lease=self.name, status=err.status, error=failure_line(err))
                return False
            except Exception as err:  # noqa: BLE001 - a failed renewal is a lost lease, never a crash
                event(log, "lease-write-failed", logging.WARNING, lease=self.name, error=failure_line(err))
                return False
            self.answered_at = self.clock()
            if record.holder_identity == self.identity:
                self.renewed_at = sent
            self.holder = record.holder_identity
            return True


class MonotonicElection(leaderelection.LeaderElection):
    """The library's election with its two timings on the lock's monotonic clock.

    The library times with `time.time()`: a forward step of the wall clock would end a follower's
    wait for an unrenewed lease early (while its holder may still act), and a backward step keep a
    leader in its renew loop past the deadline. Here a follower counts the lease duration from
    when it saw the holder's record change, and the renew loop ends once `is_leader()` would say
    no. The records' times stay wall-clock times: nobody times anything from them.
    """

    observed_at = -math.inf  # lock.clock() when `observed_record` last changed

    def try_acquire_or_renew(self) -> bool:
        config, lock = self.election_config, self.election_config.lock
        now = str(dt.datetime.now())  # the library's record format: naive local time
        found, old = lock.get(lock.name, lock.namespace)
        record = LeaderElectionRecord(lock.identity, str(config.lease_duration), now, now)
        if not found:
            if json.loads(old.body)["code"] != HTTPStatus.NOT_FOUND or not lock.create(lock.name, lock.namespace, record):
                return False
            self.observed_record, self.observed_at = record, lock.clock()
            return True
        if old is None or None in (old.holder_identity, old.lease_duration, old.acquire_time, old.renew_time):
            return self.update_lock(record)  # no holder (released) or an incomplete record
        if self.observed_record is None or old.__dict__ != self.observed_record.__dict__:
            self.observed_record, self.observed_at = old, lock.clock()
        if old.holder_identity != lock.identity:
            if lock.clock() - self.observed_at < config.lease_duration:
                return False  # held by another, its record changed less than a lease duration ago
        else:
            record.acquire_time = old.acquire_time  # renewing: the acquire time stays
        return self.update_lock(record)

    def renew_loop(self) -> None:
        config, lock = self.election_config, self.election_config.lock
        while lock.renewed_within(config.renew_deadline):
            self.try_acquire_or_renew()
            if lock.renewed_within(config.renew_deadline):
                time.sleep(config.retry_period)


class Elector:
    """Campaigns for the lease in the background; `is_leader()` says whether to act now."""

    def __init__(self, lock: LeaseLock, lease_duration: float, renew_deadline: float, retry_period: float):
        self.lock = lock
        self.renew_deadline = renew_deadline
        self._config = dict(lease_duration=lease_duration, renew_deadline=renew_deadline, retry_period=retry_period)
        self._leading = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._campaign, name="leader-election", daemon=True)
        #: Called from the election thread each time it takes the lease: the loop passes at once,
        #: not after the wait it began while another held the lease (or before anyone was asked).
        self.on_leading: Callable[[], None] | None = None

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        """The election thread runs (started and not dead)."""
        return self._thread.is_alive()

    def is_leader(self) -> bool:
        return self._leading.is_set() and not self._stopping.is_set() and self.lock.renewed_within(self.renew_deadline)

    def wait_for_leadership(self, timeout: float) -> bool:
        return self._leading.wait(timeout) and self.is_leader()

    def release(self) -> bool:
        """Stop campaigning and hand the lease over if we hold it."""
        self._stopping.set()
        self._leading.clear()
        return self.lock.release()

    def _campaign(self) -> None:
        while not self._stopping.is_set():
            config = electionconfig.Config(
                self.lock, onstarted_leading=self._started, onstopped_leading=self._stopped, **self._config
            )
            MonotonicElection(config).run()

    def _started(self) -> None:
        self._leading.set()
        event(log, "lease-acquired", lease=self.lock.name, identity=self.lock.identity)
        if self.on_leading is not None:
            self.on_leading()

    def _stopped(self) -> None:
        self._leading.clear()
        if not self._stopping.is_set():
            event(log, "lease-lost", logging.WARNING, lease=self.lock.name, identity=self.lock.identity)


def _unavailable(err: Exception) -> ApiException:
    wrapped = ApiException(status=503, reason=f"{type(err).__name__}: {err}")
    wrapped.body = json.dumps({"code": 503})
    return wrapped


def _to_record_time(value: dt.datetime | None) -> str | None:
    return str(value.astimezone().replace(tzinfo=None)) if value else None


def _from_record_time(value: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(value).astimezone(dt.timezone.utc) if value else None
