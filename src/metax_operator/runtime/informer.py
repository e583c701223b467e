"""A watch-fed cache of one kind of object: what the runner reads each pass instead of listing.

One paginated LIST (label/field selectors), then a WATCH from the list's resourceVersion with
`allowWatchBookmarks`, in a background thread. A watch the server closes (timeoutSeconds) is
reopened from the last resourceVersion seen (bookmarks keep it fresh); `410 Gone` (the version
was compacted away) and every `resync` seconds a full relist replaces the store, so a missed
event cannot live longer than that. Each object is stored as `project(obj)`, a small immutable
value (or skipped when it returns None), so a cluster-wide pod watch costs little memory.

`snapshot()` is a consistent copy for one pass; `stats` counts the requests and bytes received,
which is what a pass costs the API server in steady state. `on_change`, when set, is called
(from the informer's thread) whenever what the store holds changes: an object added, removed or
projected to a different value, not a bookmark or an update `project` does not see.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException

from metax_operator.jsonlog import event
from metax_operator.runtime.kube import PAGE_SIZE, Client, failure_line, with_backoff

log = logging.getLogger("metax_operator.runtime.informer")

#: Seconds a pass waits for a cache's first LIST.
SYNC_TIMEOUT = 60.0
#: Seconds the server keeps one watch open (randomized 5-10 min as client-go does).
WATCH_SECONDS = (300, 600)
#: Seconds between full relists (the safety net for a missed event).
DEFAULT_RESYNC = 1800.0


@dataclass
class Stats:
    """Traffic of one informer since it started (read with `Informer.stats`)."""

    list_requests: int = 0
    watch_requests: int = 0
    events: int = 0
    bytes: int = 0
    relists: int = 0

    @property
    def requests(self) -> int:
        return self.list_requests + self.watch_requests


class Informer:
    """List+watch cache of the objects at `path` (e.g. /api/v1/namespaces/ns/pods).

    `project(obj)` turns a JSON object into what is stored (None: not stored). Keys are
    `namespace/name` (or `name` when cluster-scoped).
    """

    def __init__(
        self,
        api: Client,
        path: str,
        *,
        project: Callable[[dict], Any] = lambda o: o,
        label_selector: str | None = None,
        field_selector: str | None = None,
        resync: float = DEFAULT_RESYNC,
        name: str = "",
    ):
        self.api, self.path, self.project = api, path, project
        self.label_selector, self.field_selector = label_selector, field_selector
        self.resync = resync
        self.name = name or path
        self.stats = Stats()
        self._store: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._synced = threading.Event()
        self._failing = False  # the last LIST or WATCH failed; the next successful LIST clears it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._response = None  # the open watch, closed by stop()
        self.resource_version = ""
        self.on_change: Callable[[], None] | None = None

    # -- the reader's side ------------------------------------------------------------------

    def start(self) -> Informer:
        self._thread = threading.Thread(target=self._run, name=f"informer {self.name}", daemon=True)
        self._thread.start()
        return self

    def wait_synced(self, timeout: float) -> bool:
        """True once the first LIST is in the store."""
        return self._synced.wait(timeout)

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    @property
    def state(self) -> str:
        """ "synced" (listed, following its watch), "listing" (first LIST not done), "failing"
        (the API failed its last LIST or WATCH: the store may be stale) or "stopped"."""
        if self._thread is None or not self._thread.is_alive():
            return "stopped"
        if self._failing:
            return "failing"
        return "synced" if self.synced else "listing"

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._store)

    def get(self, key: str) -> Any:
        """What the store holds under `key` (`namespace/name`, or `name`), or None."""
        with self._lock:
            return self._store.get(key)

    def has_seen(self, resource_version: str) -> bool:
        """Whether the store holds every change up to `resource_version` (of this kind: an
        object's, e.g. what a write returned), by its last LIST, event or bookmark. Resource
        versions are compared as the decimal integers the API server gives (`compare_versions`)."""
        with self._lock:
            return bool(self.resource_version) and compare_versions(self.resource_version, resource_version) >= 0

    def stop(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            try:
                response.shutdown()  # unblocks the thread's read at once
            except Exception:  # noqa: BLE001 - already closed
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self._relist()
                failures = 0  # a later failure is a new one: its wait starts from the shortest again
                listed = time.monotonic()
                while not self._stop.is_set() and time.monotonic() - listed < self.resync:
                    if not self._watch():
                        break  # 410 Gone: relist
            except Exception as err:  # noqa: BLE001 - the cache must outlive any API failure
                if self._stop.is_set():
                    return
                self._failing = True
                failures += 1
                delay = min(30.0, 0.5 * 2**failures) * random.uniform(0.5, 1.0)
                event(
                    log,
                    "informer-error",
                    logging.WARNING,
                    informer=self.name,
                    error=failure_line(err),
                    retry_in=round(delay, 2),
                )
                self._stop.wait(delay)

    def _relist(self) -> None:
        store: dict[str, Any] = {}
        token, version = None, ""
        while True:
            page = with_backoff(
                lambda token=token: self._get(
                    {
                        "labelSelector": self.label_selector,
                        "fieldSelector": self.field_selector,
                        "limit": PAGE_SIZE,
                        "continue": token,
                    }
                ),
                self.api.backoff,
            )
            self.stats.list_requests += 1
            for obj in page.get("items") or []:
                self._put(store, obj)
            meta = page.get("metadata") or {}
            version, token = meta.get("resourceVersion", version), meta.get("continue")
            if not token:
                break
        with self._lock:
            changed, self._store = store != self._store, store
            self.resource_version = version
        if changed:
            self._changed()
        self._failing = False
        if self._synced.is_set():
            self.stats.relists += 1
        self._synced.set()

    def _watch(self) -> bool:
        """Follow one watch until the server closes it (True) or says 410 Gone (False)."""
        query = {
            "watch": "true",
            "allowWatchBookmarks": "true",
            "resourceVersion": self.resource_version,
            "timeoutSeconds": random.randint(*WATCH_SECONDS),
            "labelSelector": self.label_selector,
            "fieldSelector": self.field_selector,
        }
        self._response = self._open(query)
        self.stats.watch_requests += 1
        try:
            for line in self._lines(self._response):
                change = json.loads(line)
                kind, obj = change.get("type"), change.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        return False
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                version = (obj.get("metadata") or {}).get("resourceVersion") or self.resource_version
                if kind == "BOOKMARK":
                    self.resource_version = version
                    continue
                self.stats.events += 1
                with self._lock:  # the store, then the version it holds (what `has_seen` reads)
                    before = self._store.get(_key(obj))
                    if kind == "DELETED":
                        self._store.pop(_key(obj), None)
                    else:
                        self._put(self._store, obj)
                    changed = self._store.get(_key(obj)) != before
                    self.resource_version = version
                if changed:
                    self._changed()
        finally:
            self._response.release_conn()
            self._response = None
        return True

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _put(self, store: dict[str, Any], obj: dict) -> None:
        value = self.project(obj)
        if value is None:
            store.pop(_key(obj), None)
        else:
            store[_key(obj)] = value

    # -- HTTP -----------------------------------------------------------------------------------

    def _get(self, query: dict) -> dict:
        response = self._open(query, timeout=(5, 60))
        try:
            data = response.data
        finally:
            response.release_conn()
        self.stats.bytes += len(data)
        return json.loads(data)

    def _open(self, query: dict, timeout: tuple[float, float] | None = None):
        params = [(k, v) for k, v in query.items() if v is not None]
        if timeout is None:  # a watch: the read timeout outlasts the server's timeoutSeconds
            timeout = (5, query["timeoutSeconds"] + 30)
        try:
            return self.api.api_client.call_api(
                self.path,
                "GET",
                query_params=params,
                header_params={"Accept": "application/json"},
                auth_settings=["BearerToken"],
                _preload_content=False,
                _return_http_data_only=True,
                _request_timeout=timeout,
            )
        except ApiException as err:
            if err.status == 410:
                return _Gone()
            raise

    def _lines(self, response) -> Iterator[bytes]:
        buffer = b""
        for chunk in response.stream(amt=None, decode_content=False):
            self.stats.bytes += len(chunk)
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            yield from (line for line in lines if line.strip())


class _Gone:
    """A watch the server refused with 410 Gone at once: reads as one ERROR 410 event."""

    def stream(self, **_):
        yield b'{"type": "ERROR", "object": {"code": 410}}\n'

    def release_conn(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def compare_versions(a: str, b: str) -> int:
    """-1, 0 or 1 as resourceVersion `a` is older than, the same as or newer than `b` (objects
    of the same kind). Kubernetes 1.35 made them comparable (KEP-5504, client-go's
    `CompareResourceVersion`): positive decimal integers without leading zeros, so the longer is
    the newer, and at equal length the string order is the number order. Anything else is a
    ValueError: an API server whose versions cannot be compared is not one this runner supports."""
    for version in (a, b):
        if not (version.isascii() and version.isdigit()) or version.startswith("0"):
            raise ValueError(f"resourceVersion {version!r} is not a positive decimal integer")
    key = lambda v: (len(v), v)  # noqa: E731
    return (key(a) > key(b)) - (key(a) < key(b))


def _key(obj: dict) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else meta.get("name", "")
