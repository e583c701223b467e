"""How the runner and the hooks meet the API server's failures: what is worth retrying unchanged
and how (`with_backoff`: throttling, a 5xx, the connection failing, with bounded exponential
backoff and the server's Retry-After), a 409 retried by the caller's own re-read
(`retry_on_conflict`), and a failure told to the user (`api_problem`) or to the log
(`failure_line`) in one line."""

from __future__ import annotations

import email.utils
import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import urllib3
from kubernetes.client.exceptions import ApiException

from metax_operator.errors import UserError

T = TypeVar("T")

#: Statuses worth retrying: throttled, or the server (or a proxy in front of it) failed.
TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})


class NotServed(LookupError):
    """The API server does not serve a kind (a CRD not installed, or not established yet)."""


@dataclass(frozen=True)
class Backoff:
    """Bounded exponential backoff with full jitter: attempt n sleeps up to min(cap, base * 2**n)."""

    attempts: int = 6
    base: float = 0.25
    cap: float = 8.0

    def delays(self) -> Iterator[float]:
        for attempt in range(self.attempts - 1):
            yield random.uniform(0, min(self.cap, self.base * 2**attempt))


def is_status(err: BaseException, *statuses: int) -> bool:
    return isinstance(err, ApiException) and err.status in statuses


def is_transient(err: BaseException) -> bool:
    """Worth retrying unchanged: throttling, a 5xx, or the connection failing/timing out."""
    return is_status(err, *TRANSIENT_STATUSES) or isinstance(err, urllib3.exceptions.HTTPError)


def _retry_after(err: BaseException) -> float | None:
    """The server's Retry-After (seconds or an HTTP date), if it sent one."""
    headers = getattr(err, "headers", None) or {}
    value = headers.get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        parsed = email.utils.parsedate_to_datetime(value)
        return max(0.0, parsed.timestamp() - time.time()) if parsed else None


def with_backoff(fn: Callable[[], T], backoff: Backoff = Backoff(), sleep: Callable[[float], None] = time.sleep) -> T:
    """Call `fn`, retrying transient failures (see `is_transient`); others raise at once."""
    for delay in backoff.delays():
        try:
            return fn()
        except Exception as err:  # filtered just below
            if not is_transient(err):
                raise
            hinted = _retry_after(err)
            sleep(min(backoff.cap, hinted) if hinted is not None else delay)
    return fn()


def api_problem(err: BaseException) -> UserError | None:
    """A failure of the API server or of the way to it, as one line for the user (the kubeconfig
    points nowhere, the server is down, the credentials or RBAC refuse, a CRD is not installed);
    None for anything else, which is a bug."""
    fix = "check --kubeconfig/--context (or $KUBECONFIG) and that the cluster is up"
    if isinstance(err, NotServed):
        return UserError("API server", str(err), "install the chart (its CRD) first, or check --context")
    if isinstance(err, ApiException):
        message = err.reason or ""
        try:
            message = json.loads(err.body).get("message") or message
        except (TypeError, ValueError, AttributeError):
            pass
        if err.status in (401, 403):
            fix = "check the credentials of --kubeconfig/--context and their RBAC"
        return UserError("API server", f"answered {err.status}: {message}", fix)
    if isinstance(err, urllib3.exceptions.HTTPError):
        reason = getattr(err, "reason", None) or err
        return UserError("API server", f"cannot be reached: {reason}", fix)
    return None


def failure_line(err: BaseException) -> str:
    """A failure as one log line: for an API server's refusal, the request (`Client.call` records
    it on the exception), the status and the server's own message, which names the object
    (`PATCH /apis/apps/v1/namespaces/ns/daemonsets/metax-driver: 422 Unprocessable Entity:
    DaemonSet.apps "metax-driver" is invalid: ...`), not the client's dump of the response's
    headers and body."""
    if isinstance(err, ApiException):
        message = ""
        try:
            message = json.loads(err.body).get("message") or ""
        except (TypeError, ValueError, AttributeError):
            pass
        request = getattr(err, "request", "")
        text = " ".join(part for part in (f"{request}:" if request else "", str(err.status), err.reason or "") if part)
        return " ".join(f"{text}: {message}".split()) if message else text
    return " ".join(f"{type(err).__name__}: {err}".split())


def retry_on_conflict(fn: Callable[[], T], attempts: int = 5) -> T:
    """Call `fn` again while it fails with 409 Conflict: `fn` must re-read what it writes."""
    for _ in range(attempts - 1):
        try:
            return fn()
        except ApiException as err:
            if err.status != 409:
                raise
    return fn()
