"""The runner's health endpoint: what the kubelet's liveness and readiness probes ask.

- `GET /healthz` (liveness): 200 while the loop keeps finishing its iterations (a pass, whether
  it succeeded or failed, or a follower's turn) and the leader-election thread runs; 503 once an
  iteration has run for `stall_timeout` seconds (counted from when it was due: the loop's own
  waits between passes, backoff included, do not count). Only a restart helps a hung pass or a
  dead thread. An unreachable API server does not fail it: its passes fail and the loop goes on,
  and a restart would not bring the API server back.
- `GET /readyz` (readiness): 200 while the API server answers (the last lease read or write is
  younger than `api_timeout`) and the watch caches it has started are listed and connected; 503
  otherwise. The runner starts its caches at its first pass over the CR: before the CR exists
  (a first install: the bootstrap hook creates it after `helm install --wait` saw the runner
  Ready) there is nothing to wait for.

`GET /metrics` is the runner's Prometheus metrics (`metrics.py`), when it has them.

Both probes answer a JSON object with what they decided from: the leader, the lease holder, how long
the current iteration has run, the ages (seconds) of the last successful pass and of the last
API answer, and each cache's state. The server is the standard library's `ThreadingHTTPServer` in a daemon
thread: two read-only routes need no framework.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from metax_operator.runtime.informer import Informer
from metax_operator.runtime.leader import Elector
from metax_operator.runtime.metrics import Metrics


class Health:
    """The runner's liveness and readiness, from its loop's progress, its lease and its caches."""

    def __init__(
        self,
        elector: Elector,
        caches: Callable[[], Iterable[Informer]],
        stall_timeout: float,
        api_timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.elector, self.caches, self.clock = elector, caches, clock
        self.stall_timeout, self.api_timeout = stall_timeout, api_timeout
        self.iteration_due = clock()  # when the running iteration started (or starts)
        self.pass_at: float | None = None

    def iteration_done(self, passed: bool, wait: float) -> None:
        """The loop finished an iteration and starts the next in `wait` seconds; `passed`: it
        ran a pass that succeeded."""
        now = self.clock()
        self.iteration_due = now + wait
        if passed:
            self.pass_at = now

    def liveness(self) -> tuple[bool, dict]:
        detail = self._facts()
        electing = self.elector.alive()
        live = detail["iterationRunningSeconds"] < self.stall_timeout and electing
        return live, {**detail, "stallTimeout": self.stall_timeout, "electionRunning": electing}

    def readiness(self) -> tuple[bool, dict]:
        detail = self._facts()
        api_age = detail["lastApiAnswerSeconds"]
        caches = detail["caches"]
        ready = api_age is not None and api_age < self.api_timeout and all(s == "synced" for s in caches.values())
        return ready, {**detail, "apiTimeout": self.api_timeout}

    def _facts(self) -> dict:
        now = self.clock()
        age = lambda at: None if at is None else round(now - at, 1)  # noqa: E731
        lock = self.elector.lock
        return {
            "leader": self.elector.is_leader(),
            "holder": lock.holder,
            "iterationRunningSeconds": max(0.0, age(self.iteration_due)),
            "lastPassSeconds": age(self.pass_at),
            "lastApiAnswerSeconds": age(lock.answered_at),
            "caches": {cache.name: cache.state for cache in self.caches()},
        }


class _Handler(BaseHTTPRequestHandler):
    """/healthz, /readyz and /metrics, each a GET."""

    server: _Server

    def do_GET(self) -> None:  # the http.server API
        metrics = self.server.metrics
        if metrics is not None and self.path.split("?", 1)[0] == "/metrics":
            data, content_type = metrics.exposition()
            self._send(HTTPStatus.OK, data, content_type)
            return
        probe = {"/healthz": self.server.health.liveness, "/readyz": self.server.health.readiness}.get(self.path.split("?", 1)[0])
        if probe is None:
            routes = "/healthz, /readyz or /metrics" if metrics is not None else "/healthz or /readyz"
            self._answer(HTTPStatus.NOT_FOUND, {"error": f"no {self.path}: use {routes}"})
            return
        ok, detail = probe()
        self._answer(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, {"ok": ok, **detail})

    def _answer(self, status: HTTPStatus, body: dict) -> None:
        self._send(status, json.dumps(body, sort_keys=True).encode() + b"\n", "application/json")

    def _send(self, status: HTTPStatus, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:  # probes every few seconds: no log
        pass


class _Server(ThreadingHTTPServer):
    """The probes' and metrics' HTTP server, on the address family of its host."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], health: Health, family: socket.AddressFamily, metrics: Metrics | None = None):
        self.address_family = family
        self.health, self.metrics = health, metrics
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:  # also IPv4: the pod may have either address
            with contextlib.suppress(OSError):
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def serve(health: Health, host: str, port: int, metrics: Metrics | None = None) -> ThreadingHTTPServer:
    """Serve `health` (and `metrics`) on host:port (every IPv6 and IPv4 address when `host` is
    empty) in a daemon thread; the server's `server_address` holds the port bound (for `port` 0)."""
    if host:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        server = _Server((host, port), health, family, metrics)
    else:
        try:
            server = _Server(("::", port), health, socket.AF_INET6, metrics)
        except OSError:  # no IPv6 in this network namespace
            server = _Server(("0.0.0.0", port), health, socket.AF_INET, metrics)
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    return server
