"""The election's bookkeeping on injected clocks: when a renewal counts from, how long a follower
waits, when the renew loop gives up. The Lease here is one in memory with the API server's
optimistic concurrency (tests/e2e/test_leader_election.py runs the same against the real one)."""

from __future__ import annotations

import copy
import json
import time

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.leaderelection import electionconfig, leaderelection

from metax_operator.runtime.leader import Elector, LeaseLock, MonotonicElection

LEASE, RENEW, RETRY = 15, 10, 2


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class Leases:
    """What LeaseLock calls of CoordinationV1Api, on one Lease: 404 before it exists, 409 for a
    write carrying a stale resourceVersion. `on_write(body)` runs once a write has landed and
    before it is answered (what happens while the answer is on its way); `failing` answers 503."""

    def __init__(self):
        self.lease: client.V1Lease | None = None
        self.on_write = lambda body: None
        self.failing = False

    def read_namespaced_lease(self, name, namespace, **_):
        if self.lease is None:
            raise _error(404)
        return copy.deepcopy(self.lease)

    def create_namespaced_lease(self, namespace, body, **_):
        if self.lease is not None:
            raise _error(409)
        return self._land(body)

    def replace_namespaced_lease(self, name, namespace, body, **_):
        if self.lease.metadata.resource_version != body.metadata.resource_version:
            raise _error(409)
        return self._land(body)

    def _land(self, body):
        if self.failing:
            self.on_write(body)
            raise _error(503)
        version = int(self.lease.metadata.resource_version) + 1 if self.lease else 1
        self.lease = copy.deepcopy(body)
        self.lease.metadata.resource_version = str(version)
        self.on_write(body)
        return copy.deepcopy(self.lease)


def _error(status: int) -> ApiException:
    err = ApiException(status=status)
    err.body = json.dumps({"code": status})
    return err


def candidate(identity: str, leases: Leases, clock: Clock, election=MonotonicElection):
    lock = LeaseLock("lease", "ns", identity, client.ApiClient(), clock=clock)
    lock.api = leases
    config = electionconfig.Config(lock, LEASE, RENEW, RETRY, onstarted_leading=lambda: None, onstopped_leading=None)
    return lock, election(config)


def test_a_renewal_answered_late_counts_from_when_it_was_sent_so_the_leader_stops_before_a_follower_takes_over():
    clock, leases = Clock(), Leases()
    lock_a, a = candidate("a", leases, clock)
    lock_b, b = candidate("b", leases, clock)
    elector = Elector(lock_a, LEASE, RENEW, RETRY)
    assert a.try_acquire_or_renew()
    elector._started()  # what the library calls once it holds the lease
    assert not b.try_acquire_or_renew()  # b sees a's record

    sent = clock.now = 1100.0

    def answered_late(body):
        assert b.try_acquire_or_renew() is False  # b sees the renewal as soon as it landed
        clock.now += 7  # and a hears of it 7 s after sending it

    leases.on_write = answered_late
    assert a.try_acquire_or_renew()
    leases.on_write = lambda body: None
    assert (lock_a.renewed_at, lock_a.answered_at) == (sent, sent + 7)

    stopped = took_over = None
    while took_over is None:
        clock.now += 0.25
        if stopped is None and not elector.is_leader():
            stopped = clock.now
        if b.try_acquire_or_renew():
            took_over = clock.now
        assert stopped is not None or took_over is None, f"a still acts at {clock.now - sent} s, b has taken over"
    # Counted from the answer, a would act until sent + 17 s; b takes over at sent + 15 s.
    assert stopped - sent == RENEW and took_over - sent == pytest.approx(LEASE, abs=0.25)


@pytest.mark.parametrize("election, waits", [(MonotonicElection, True), (leaderelection.LeaderElection, False)])
def test_a_forward_step_of_the_wall_clock_does_not_shorten_a_followers_wait(monkeypatch, election, waits):
    """The library's own election takes over at once: the reason MonotonicElection exists."""
    clock, leases = Clock(), Leases()
    _, a = candidate("a", leases, clock)
    _, b = candidate("b", leases, clock, election)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    stepped = time.time() + 3600
    monkeypatch.setattr(time, "time", lambda: stepped)
    clock.now += LEASE - 1
    assert b.try_acquire_or_renew() is not waits
    clock.now += 1.5
    assert b.try_acquire_or_renew()
    assert leases.lease.spec.holder_identity == "b"


@pytest.mark.parametrize("failing", [True, False], ids=["refused", "accepted"])
def test_the_renew_loop_ends_once_the_last_renewal_sent_is_older_than_the_renew_deadline(monkeypatch, failing):
    """A renewal answered after the renew deadline ends the loop even when it was accepted, and a
    backward step of the wall clock does not keep the loop going (the library's would)."""
    clock, leases = Clock(), Leases()
    lock, a = candidate("a", leases, clock)
    assert a.try_acquire_or_renew()
    acquired = lock.renewed_at
    monkeypatch.setattr(time, "time", lambda: 0.0)
    clock.now += RETRY
    leases.failing = failing
    writes = []

    def answered_after_the_deadline(body):
        writes.append(body)
        leases.failing = True  # a loop that went on would end at its next attempt, not hang
        clock.now += RENEW + 1

    leases.on_write = answered_after_the_deadline
    a.renew_loop()  # returns without sleeping: no attempt is left within the deadline
    assert len(writes) == 1 and (leases.lease.spec.holder_identity == "a")
    assert lock.renewed_at == (acquired if failing else acquired + RETRY)
    assert not lock.renewed_within(RENEW)
