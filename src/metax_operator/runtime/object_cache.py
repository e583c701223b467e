"""The objects every runner pass reads, from watch caches (`informer.py`): the ClusterOperator CR,
the DaemonSets of the release namespace, the ConfigMaps `driver-config` and `metax-vfio-config`,
the exporter's Service. With the rollout's caches of pods and nodes, a pass over an unchanged
cluster sends the API server no request.

`ObjectCache.get` and `.list` answer the reads of `reconcile.observe` and of the rollout with the
signatures of `kube.Client`'s, so the same code reads live (a test, a one-off check) or cached.
The CR, the ConfigMaps and the Service are each watched by name (a field selector, which is also
what lets the Service's RBAC rule name the one Service); the DaemonSets are all those of the
namespace, since the rollout reads the driver's whatever its labels.

The three ways a cache could mislead a pass, and what this module does about each:
- Read-your-writes. A pass writes and then reads the same object: the reconcile applies a
  DaemonSet's template or sets the CR's conditions, then the rollout reads that DaemonSet and the
  CR, before the watch delivered the write. Every object the runner's client writes comes back
  from the API server (`Client.on_written`) and is kept; a read returns it until the cache has
  seen its resourceVersion (`Informer.has_seen`), then the cache's object, the same or newer.
- Stale reads under a precondition. The status writes carry the resourceVersion read; when the
  cache is behind someone else's write the API server answers 409: the reconcile's conditions
  wait for the next pass and the rollout does not act, as when a live read raced a write. That
  write's watch event then wakes the next pass, which reads it.
- A cache that has not listed yet, or whose last LIST or WATCH failed (its store may be stale),
  is never read as "absent": the read raises `NotReady` and the pass does not act.

`on_change` is called when what a cache holds changes other than by this runner's own write
(an admin's edit of the CR, spec or status, of a DaemonSet or a ConfigMap; the DaemonSet
controller's status): the next pass is due.
"""

from __future__ import annotations

import collections
import marshal
import threading
from collections.abc import Callable
from typing import Protocol

from metax_operator import contract
from metax_operator.runtime.informer import Informer
from metax_operator.runtime.kube import Client, plain

#: How many of its own writes' resourceVersions the cache remembers to tell them from others'.
OWN_WRITES = 256


class NotReady(RuntimeError):
    """A cache that has not listed yet, or failed: what it holds cannot be trusted."""


class Reader(Protocol):
    """Where a pass reads the objects it decides on: an `ObjectCache`, or a `kube.Client` itself."""

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict | None: ...

    def list(
        self, api_version: str, kind: str, namespace: str | None = None, *, label_selector: str | None = None
    ) -> list[dict]: ...


class ObjectCache:
    """The watch caches of the objects a pass reads, plus this runner's own latest writes."""

    def __init__(self, api: Client, namespace: str, resync: float = 1800.0):
        self.api, self.namespace, self.resync = api, namespace, resync
        self.on_change: Callable[[], None] | None = None
        # (apiVersion, kind, name) -> the informer holding it; the DaemonSets' under name None.
        self._informers: dict[tuple[str, str, str | None], Informer] = {}
        self._lock = threading.Lock()
        self._written: dict[tuple[str, str, str], dict] = {}  # this runner's writes the caches may not hold yet
        self._own: collections.deque[str] = collections.deque(maxlen=OWN_WRITES)
        self._versions: dict[str, dict[str, str]] = {}  # informer -> key -> resourceVersion, for on_change
        api.on_written.append(self._wrote)

    @property
    def informers(self) -> tuple[Informer, ...]:
        return tuple(self._informers.values())

    def start(self) -> ObjectCache:
        """Start the caches (once; the CR's kind must be served: `api_failures.NotServed` otherwise)."""
        if self._informers:
            return self
        ns = self.namespace
        by_name = lambda api_version, kind, name: Informer(  # noqa: E731
            self.api,
            self.api.resource(api_version, kind).path(namespace=ns),
            field_selector=f"metadata.name={name}",
            resync=self.resync,
            name=f"{kind.lower()}-{name}",
        )
        informers = {
            (contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME): by_name(
                contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME
            )
        }
        informers[("apps/v1", "DaemonSet", None)] = Informer(
            self.api, self.api.resource("apps/v1", "DaemonSet").path(namespace=ns), resync=self.resync, name="daemonsets"
        )
        for name in contract.CONFIGMAPS:
            informers[("v1", "ConfigMap", name)] = by_name("v1", "ConfigMap", name)
        informers[("v1", "Service", contract.EXPORTER_SERVICE)] = by_name("v1", "Service", contract.EXPORTER_SERVICE)
        for informer in informers.values():
            informer.on_change = lambda informer=informer: self._changed(informer)
        self._informers = informers
        for informer in informers.values():
            informer.start()
        return self

    def wait_synced(self, timeout: float) -> bool:
        return all(i.wait_synced(timeout) for i in self._informers.values())

    def stop(self) -> None:
        for informer in self._informers.values():
            informer.stop()

    # -- reads, as kube.Client's ------------------------------------------------------------

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict | None:
        """The object (a copy of it), or None when it does not exist."""
        informer = self._informer(api_version, kind, name, namespace)
        return self._read(informer, (api_version, kind, name), f"{namespace}/{name}" if namespace else name)

    def list(self, api_version: str, kind: str, namespace: str | None = None, *, label_selector: str | None = None) -> list[dict]:
        """The DaemonSets of the namespace matching `label_selector` (`key=value` terms)."""
        informer = self._informer(api_version, kind, None, namespace)
        wanted = dict(term.split("=", 1) for term in (label_selector or "").split(",") if term)
        found = []
        for key in sorted(self._ready(informer).snapshot()):
            obj = self._read(informer, (api_version, kind, key.split("/", 1)[1]), key)
            labels = (obj or {}).get("metadata", {}).get("labels") or {}
            if obj is not None and all(labels.get(k) == v for k, v in wanted.items()):
                found.append(obj)
        return found

    # -- inside ---------------------------------------------------------------------------------

    def _informer(self, api_version: str, kind: str, name: str | None, namespace: str | None) -> Informer:
        informer = self._informers.get((api_version, kind, name)) or self._informers.get((api_version, kind, None))
        if informer is None or (kind != contract.CR_KIND and namespace != self.namespace):
            raise LookupError(f"{kind} {namespace}/{name} is not one the runner caches")
        return informer

    @staticmethod
    def _ready(informer: Informer) -> Informer:
        if informer.state != "synced":
            raise NotReady(f"the watch cache {informer.name} is {informer.state}: its objects cannot be read yet")
        return informer

    def _read(self, informer: Informer, written_key: tuple[str, str, str], key: str) -> dict | None:
        self._ready(informer)
        with self._lock:
            written = self._written.get(written_key)
        if written is not None:
            if not informer.has_seen(written["metadata"]["resourceVersion"]):
                return _copy(written)
            with self._lock:
                if self._written.get(written_key) is written:
                    del self._written[written_key]
        return _copy(informer.get(key))

    def _wrote(self, obj) -> None:
        """`Client.on_written`: keep what the runner wrote, if it is an object these caches hold
        (`obj` may be a lazy view: kept as plain Python)."""
        meta = obj.get("metadata") or {}
        api_version, kind, name = obj.get("apiVersion"), obj.get("kind"), meta.get("name")
        version = meta.get("resourceVersion")
        if not (api_version and kind and name and version):
            return
        try:
            self._informer(api_version, kind, name, meta.get("namespace"))
        except LookupError:
            return
        with self._lock:
            self._written[(api_version, kind, name)] = plain(obj)
            self._own.append(version)

    def _changed(self, informer: Informer) -> None:
        """An informer's store changed: signal `on_change` unless every change is one of ours."""
        versions = {key: obj["metadata"].get("resourceVersion", "") for key, obj in informer.snapshot().items()}
        with self._lock:
            before = self._versions.get(informer.name, {})
            self._versions[informer.name] = versions
            own = set(self._own)
        others = versions.keys() != before.keys() or any(
            version != before[key] and version not in own for key, version in versions.items()
        )
        if others and self.on_change is not None:
            self.on_change()


def _copy(obj: dict | None) -> dict | None:
    """A deep copy of a cached object for the pass to change as it likes. The objects are plain
    JSON values (dicts, lists, strings, numbers, booleans, None), which marshal copies in C: a
    DaemonSet in about a quarter of `copy.deepcopy`'s time, and a pass reads a dozen."""
    return marshal.loads(marshal.dumps(obj))
