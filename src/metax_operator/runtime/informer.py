"""A watch-fed cache of one kind of object: what the runner reads each pass instead of listing.

One paginated LIST (label/field selectors), then a WATCH from the list's resourceVersion with
`allowWatchBookmarks`, in a background thread. A watch the server closes (timeoutSeconds) is
reopened from the last resourceVersion seen (bookmarks keep it fresh); `410 Gone` (the version
was compacted away) and every `resync` seconds a full relist replaces the store, so a missed
event cannot live longer than that. Each object is stored as `project(obj)`, a small immutable
value (or skipped when it returns None), so a cluster-wide pod watch costs little memory. With
`metadata_only` the API server sends only each object's metadata (`PartialObjectMetadata`, served
since Kubernetes 1.15): a Node's labels without its status, a third of its bytes to receive and
parse. With `index`, the store keeps the keys of its values by each term `index(value)` gives
(`indexed(term)`), as client-go's indexers do: a few of 10,000 nodes found without walking them.

Parsing: simdjson parses each LIST page and watch event into a lazy, read-only view; `project`
reads what it keeps, and nothing else becomes Python objects (building them is what json.loads
spends its time on: about 26 MB/s of Pods). So one watch can follow every pod of the cluster for
the few requesting a GPU, which Kubernetes cannot select. `project` must return plain values
(`plain` converts a view): simdjson refuses the next parse while a view is held. One page is
parsed at a time in the process (`_DECODING`), by a parser that lives for one LIST, and after a
LIST the heap's free memory is given back (`give_back_memory`): the runner's RSS is its stores
and about one page, not the high-water mark of every cache's first LIST.

With `gather`, a steady stream's events are read in bursts (`watch_stream.chunks`).

`snapshot()` is a consistent copy for one pass; `stats` counts the requests and bytes received,
which is what a pass costs the API server in steady state. `on_change`, when set, is called
(from the informer's thread) whenever what the store holds changes: an object added, removed or
projected to a value that `differs` from the one before (by default: any other value), not a
bookmark or an update `project` does not see; `changes` counts them, so a reader can tell
whether anything changed since it last looked without a snapshot.
"""

from __future__ import annotations

import logging
import operator
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import simdjson
from kubernetes.client.exceptions import ApiException

from metax_operator.jsonlog import event
from metax_operator.runtime import watch_stream
from metax_operator.runtime.api_failures import failure_line, with_backoff
from metax_operator.runtime.kube import Client, plain
from metax_operator.runtime.memory import give_back_memory
from metax_operator.runtime.resource_version import compare_versions

log = logging.getLogger("metax_operator.runtime.informer")

#: Seconds a pass waits for a cache's first LIST.
SYNC_TIMEOUT = 60.0
#: Seconds the server keeps one watch open (randomized 5-10 min as client-go does).
WATCH_SECONDS = (300, 600)
#: Seconds between full relists (the safety net for a missed event).
DEFAULT_RESYNC = 1800.0
#: What a metadata-only LIST and WATCH accept: the metadata of each object (a WATCH's events are
#: single objects, a LIST's answer a list), else the objects themselves.
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"
METADATA_WATCH = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"
#: Objects per LIST page, which is held whole while parsed: 100 realistic Nodes are 2 MB of JSON;
#: 500 (`kube.PAGE_SIZE`, for a `Client.list` that keeps every object anyway) would be 10 MB.
PAGE_SIZE = 100
#: Held while a LIST page is parsed and stored: one page's objects in memory at a time.
_DECODING = threading.Lock()


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

    `project(obj)` turns an object (simdjson's lazy view of it) into what is stored, a plain
    value (None: not stored); by default the whole object (`plain`). Keys are `namespace/name`
    (or `name` when cluster-scoped).
    """

    def __init__(
        self,
        api: Client,
        path: str,
        *,
        project: Callable[[Any], Any] = plain,
        label_selector: str | None = None,
        field_selector: str | None = None,
        metadata_only: bool = False,
        index: Callable[[Any], Iterable[str]] | None = None,
        differs: Callable[[Any, Any], bool] = operator.ne,
        gather: float = 0.0,
        resync: float = DEFAULT_RESYNC,
        name: str = "",
    ):
        self.api, self.path, self.project = api, path, project
        self.label_selector, self.field_selector = label_selector, field_selector
        self.metadata_only, self.index, self.differs, self.gather = metadata_only, index, differs, gather
        self.resync = resync
        self.name = name or path
        self.stats = Stats()
        self._store: dict[str, Any] = {}
        self._indexed: dict[str, set[str]] = {}  # term -> the keys of the values `index` gives it
        self._lock = threading.Lock()
        self._synced = threading.Event()
        self._failing = False  # the last LIST or WATCH failed; the next successful LIST clears it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._response = None  # the open watch, closed by stop()
        self.resource_version = ""
        self.on_change: Callable[[], None] | None = None
        self.changes = 0  # the store's changes so far (`on_change`), counted with the store's update

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

    def versioned_snapshot(self) -> tuple[dict[str, Any], str]:
        """`snapshot()`, and the resourceVersion it holds every change up to (`has_seen`), read
        together."""
        with self._lock:
            return dict(self._store), self.resource_version

    def get(self, key: str) -> Any:
        """What the store holds under `key` (`namespace/name`, or `name`), or None."""
        with self._lock:
            return self._store.get(key)

    def indexed(self, term: str) -> set[str]:
        """The keys of the values whose `index` gives `term`."""
        with self._lock:
            return set(self._indexed.get(term, ()))

    def has_seen(self, resource_version: str) -> bool:
        """Whether the store holds every change up to `resource_version` (of this kind: an
        object's, e.g. what a write returned), by its last LIST, event or bookmark
        (`resource_version.compare_versions`)."""
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
        query = {"labelSelector": self.label_selector, "fieldSelector": self.field_selector, "limit": PAGE_SIZE}
        parser = simdjson.Parser()  # dropped with this LIST: its buffers are as large as the largest page
        while True:
            data = with_backoff(lambda token=token: self._get({**query, "continue": token}), self.api.backoff)
            self.stats.list_requests += 1
            with _DECODING:
                meta = self._put_page(parser, store, data)
            del data
            version, token = meta.get("resourceVersion", version), meta.get("continue")
            if not token:
                break
        del parser
        indexed: dict[str, set[str]] = {}
        for key, value in store.items() if self.index else ():
            for term in self.index(value):
                indexed.setdefault(term, set()).add(key)
        with self._lock:
            changed = store.keys() != self._store.keys() or any(
                self.differs(self._store[key], value) for key, value in store.items()
            )
            self._store, self._indexed, self.resource_version = store, indexed, version
            self.changes += changed
        give_back_memory()
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
        self._response = self._open(query, accept=METADATA_WATCH if self.metadata_only else "application/json")
        self.stats.watch_requests += 1
        parser = simdjson.Parser()
        try:
            for line in self._lines(self._response):
                if not self._apply(parser, line):
                    return False
        finally:
            self._response.release_conn()
            self._response = None
        return True

    def _apply(self, parser: simdjson.Parser, line: bytes) -> bool:
        """Apply one watch event to the store; False for 410 Gone (relist)."""
        change = parser.parse(line)
        kind, obj = change.get("type"), change.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                return False
            raise ApiException(status=obj.get("code"), reason=obj.get("message"))
        version = (obj.get("metadata") or {}).get("resourceVersion") or self.resource_version
        if kind == "BOOKMARK":
            self.resource_version = version
            return True
        self.stats.events += 1
        key = _key(obj)
        with self._lock:  # the store, then the version it holds (what `has_seen` reads)
            before = self._store.get(key)
            if kind == "DELETED":
                self._store.pop(key, None)
            else:
                self._put(self._store, obj)
            after = self._store.get(key)
            changed = (before is None) != (after is None) or (before is not None and self.differs(before, after))
            if changed and self.index:
                self._reindex(key, before, after)
            self.resource_version = version
            self.changes += changed
        if changed:
            self._changed()
        return True

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _put_page(self, parser: simdjson.Parser, store: dict[str, Any], data: bytes) -> dict:
        """Store one LIST page's objects; its list metadata (`resourceVersion`, `continue`)."""
        page = parser.parse(data)
        for obj in page.get("items") or ():
            self._put(store, obj)
        return plain(page.get("metadata")) or {}

    def _put(self, store: dict[str, Any], obj) -> None:
        value = self.project(obj)
        if value is None:
            store.pop(_key(obj), None)
        else:
            store[_key(obj)] = value

    def _reindex(self, key: str, before: Any, after: Any) -> None:
        """The index moved from `before`'s terms to `after`'s (None: no value); the lock is held."""
        for term in self.index(before) if before is not None else ():
            keys = self._indexed.get(term)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._indexed[term]
        for term in self.index(after) if after is not None else ():
            self._indexed.setdefault(term, set()).add(key)

    # -- HTTP -----------------------------------------------------------------------------------

    def _get(self, query: dict) -> bytes:
        """One LIST page's JSON."""
        response = self._open(query, timeout=(5, 60), accept=METADATA_LIST if self.metadata_only else "application/json")
        try:
            data = response.data
        finally:
            response.release_conn()
        self.stats.bytes += len(data)
        return data

    def _open(self, query: dict, timeout: tuple[float, float] | None = None, accept: str = "application/json"):
        params = [(k, v) for k, v in query.items() if v is not None]
        if timeout is None:  # a watch: the read timeout outlasts the server's timeoutSeconds
            timeout = (5, query["timeoutSeconds"] + 30)
        try:
            return self.api.api_client.call_api(
                self.path,
                "GET",
                query_params=params,
                header_params={"Accept": accept},
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
        for chunk in watch_stream.chunks(response, self.gather, self._stop):
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


def _key(obj) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else meta.get("name", "")
