"""Leader election against the real API server: renewals answered late.

Candidate A reaches the API server through a relay (tests/e2e/relay.py) that is then made to hold
every answer DELAY seconds: A's renewals take effect at once and A hears of them late. Candidate B
reaches the server directly. Both are the runner's `Elector`s in this process, so their
`is_leader()` is sampled on one clock: at no sample may both be true.

The timings make a leader that counted a renewal from its answer overlap with B, not merely risk
it: a renewal sent at S lands at S and is answered at S + DELAY; B sees it within one retry and
takes over at most S + LEASE + 2 x RETRY; counted from the answer A would act until
S + DELAY + RENEW, later. Counted from S, A stops at S + RENEW, before B can take over at
S + LEASE at the earliest. DELAY is short enough for a renewal sent after it began to land before
B may take over (the previous one landed at most RETRY before it), and shorter than RENEW, so A
acts on that late answer for a while first.
"""

from __future__ import annotations

import threading
import time
import uuid
from urllib.parse import urlparse

from kubernetes import client

from metax_operator.runtime.leader import Elector, LeaseLock
from tests.e2e.relay import Relay
from tests.waiting import eventually

LEASE, RENEW, RETRY = 7, 6, 1  # seconds
DELAY = 4.5  # > LEASE + 2 x RETRY - RENEW, < LEASE - RETRY and < RENEW


class Sampler:
    """(time, A leads, B leads, when A's last renewal was sent) every few milliseconds."""

    def __init__(self, a: Elector, b: Elector):
        self.a, self.b, self.samples = a, b, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.005):
            self.samples.append((time.monotonic(), self.a.is_leader(), self.b.is_leader(), self.a.lock.renewed_at))

    def finish(self) -> list[tuple]:
        self.stop.set()
        self.thread.join()
        return self.samples

    def changes(self, since: float) -> str:
        """Every change of who leads or of A's last renewal, in seconds after `since`."""
        lines, last = [], None
        for t, in_a, in_b, sent in self.samples:
            if (in_a, in_b, sent) != last:
                lines.append(f"{t - since:6.2f} s: A leads {in_a}, B leads {in_b}, A's renewal sent at {sent - since:.2f} s")
                last = (in_a, in_b, sent)
        return "\n".join(lines)


def test_a_leader_whose_renewals_are_answered_late_stops_acting_before_a_follower_takes_over(control_plane):
    name, namespace = f"leader-e2e-{uuid.uuid4().hex[:6]}", "default"
    relay = Relay(urlparse(control_plane.server).port)
    through_relay = control_plane.api()
    through_relay.configuration.host = f"https://127.0.0.1:{relay.port}"
    a = Elector(LeaseLock(name, namespace, "a", through_relay), LEASE, RENEW, RETRY)
    b = Elector(LeaseLock(name, namespace, "b", control_plane.api()), LEASE, RENEW, RETRY)
    sampler = None
    try:
        a.start()
        eventually(a.is_leader, 20, "A to lead")
        b.start()
        eventually(lambda: b.lock.holder == "a", 10, "B to see A's lease")
        sampler = Sampler(a, b)
        relay.delay_answers(DELAY)
        delayed = time.monotonic()
        eventually(b.is_leader, LEASE + 3 * DELAY, "B to take over from A")
        eventually(lambda: sampler.samples[-1][2], 5, "a sample of B leading")
        samples = sampler.finish()

        both = [t - delayed for t, in_a, in_b, _ in samples if in_a and in_b]
        assert not both, f"A and B both led {both[0]:.2f} s after the answers slowed:\n{sampler.changes(delayed)}"
        late = [(t, sent) for t, in_a, _, sent in samples if in_a and sent > delayed]
        assert late, "A never acted on a renewal sent after its answers slowed: the test shows nothing"
        sent = late[-1][1]
        a_last = max(t for t, in_a, _, _ in samples if in_a)
        b_first = min(t for t, _, in_b, _ in samples if in_b)
        print(
            f"renewal sent at S, answered {DELAY} s later: A acted from S+{late[0][0] - sent:.2f} to "
            f"S+{a_last - sent:.2f} s, B took over at S+{b_first - sent:.2f} s (lease {LEASE} s, renew deadline {RENEW} s)"
        )
        assert a_last - sent < RENEW < LEASE <= b_first - sent
    finally:
        if sampler is not None:
            sampler.finish()
        a.release()
        b.release()
        relay.close()
        client.CoordinationV1Api(control_plane.api()).delete_namespaced_lease(name, namespace)
