"""A fake Kubernetes API server on 127.0.0.1, for the failures the real one of tests/controlplane.py
cannot be told to answer: a 409 or 422 on a chosen request, a 5xx, a watch whose version is gone
(410). It speaks the API's JSON over HTTP, so the code under test runs on the real client
(`runtime.kube.Client` on the kubernetes package's ApiClient: its paths, query strings, status
codes, retries and watch streaming), with just enough of the API behind it:

- objects in memory by path, each write bumping a global resourceVersion;
- GET of an object or a collection (label selectors `k=v`, field selectors `a.b=v`/`a.b!=v`,
  pagination with `limit`/`continue`), WATCH of a collection (the changes since its
  resourceVersion, then each write and the events the test pushes, one JSON line each, or the
  410 a test asks for);
- PUT with the resourceVersion precondition (409 on a stale one), PATCH by its content type:
  JSON patch (add, remove, replace, test: a failed test is 422), merge patch, strategic merge
  patch and server-side apply (`_strategic`: lists of named items merged by their merge key,
  `$patch: replace` and `$patch: delete`; an apply also creates), DELETE with a uid precondition
  (409), POST;
- what the API server itself does on a write that comes over HTTP: `metadata.generation` set at
  creation and raised when anything but the metadata and the status changes, for the kinds that
  have one (`GENERATION`); the Eviction subresource of a pod (`pods/NAME/eviction`: the pod
  deleted, or 429 while a PodDisruptionBudget selecting it allows no disruption, whose
  `status.disruptionsAllowed` an eviction uses up); with a `clock`, the graceful deletion of a
  pod bound to a node (`deletionTimestamp` set, the object kept until the kubelet, here the
  test's `delete`, removes it). `put` and `delete`, the test's own writes, store and remove as
  they are told, as other parts of the cluster would leave the objects;
- discovery of the kinds the runner uses;
- GET, LIST and WATCH of metadata only, as the API server answers an `Accept` of
  `application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1` (`PartialObjectMetadataList` for
  a LIST; the other form is refused with 406), and field selector values as it formats them
  (booleans `true`/`false`, an absent `spec.unschedulable` false);
- `fail(method, path, status, times, message=...)`: the next matching requests get that status
  instead; `interceptors`: functions that see each request before it is answered (under the
  server's lock: they may change objects) and may answer it instead; neither touches the
  requests of a client whose user agent the test lists in `exempt` (an admin's kubectl);
- a watch ends after it sent an ERROR event, as the API server's does.

Every request is recorded (`requests`) so a test can assert what was sent and in which order.
"""

from __future__ import annotations

import copy
import json
import queue
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from kubernetes import client as k8s

from metax_operator.conditions import rfc3339
from metax_operator.lookup import lookup
from metax_operator.runtime.api_failures import Backoff
from metax_operator.runtime.kube import Client

# (group/version path, plural, kind, namespaced)
KINDS = [
    ("/api/v1", "pods", "Pod", True),
    ("/api/v1", "nodes", "Node", False),
    ("/api/v1", "events", "Event", True),
    ("/api/v1", "configmaps", "ConfigMap", True),
    ("/api/v1", "services", "Service", True),
    ("/apis/apps/v1", "daemonsets", "DaemonSet", True),
    ("/apis/apps/v1", "controllerrevisions", "ControllerRevision", True),
    ("/apis/coordination.k8s.io/v1", "leases", "Lease", True),
    ("/apis/batch/v1", "cronjobs", "CronJob", True),
    ("/apis/policy/v1", "poddisruptionbudgets", "PodDisruptionBudget", True),
    ("/apis/gpu.metax-tech.com/v1", "clusteroperators", "ClusterOperator", False),
]
#: The kinds (plurals) whose objects the API server gives a `metadata.generation`.
GENERATION = frozenset({"daemonsets", "clusteroperators"})
#: Strategic merge: the key that names an item of each list merged item by item (the Kubernetes
#: API's patchMergeKey); any other list is replaced whole.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
    "conditions": "type",
}
#: Maps a server-side apply replaces whole (`+mapType=atomic`); a strategic merge patch merges them.
ATOMIC_MAPS = frozenset({"nodeSelector"})
#: The grace period of a pod that names none (`terminationGracePeriodSeconds`' default), seconds.
GRACE_PERIOD = 30


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict
    body: object
    content_type: str = ""
    user_agent: str = ""


class FakeApi:
    def __init__(self, clock: Callable[[], float] | None = None, apply_as_merge_patch: bool = False):
        """`clock`: pods bound to a node are deleted gracefully, stamped by this clock (without
        it a deletion removes the pod at once), and objects created over HTTP get their
        creationTimestamp from it. `apply_as_merge_patch`: a server-side apply is
        merged as a merge patch (lists replaced whole), as this server did before it merged
        applies by their keys, for the golden traces recorded then."""
        self.clock, self.apply_as_merge_patch = clock, apply_as_merge_patch
        self.interceptors: list[Callable[[Request], tuple[int, object] | None]] = []
        # User agents of the test's own clients (an admin's kubectl), whose requests neither the
        # faults nor the interceptors meant for the code under test touch.
        self.exempt: set[str] = set()
        self.objects: dict[str, dict] = {}  # object path -> object
        self.requests: list[Request] = []
        self.version = 100
        self._faults: list[list] = []  # [method, path, watch, status, times left, message]
        self._watchers: list[tuple[str, dict, queue.Queue]] = []  # (collection, query, events)
        self.last_sent: dict[int, str] = {}  # id(events) -> resourceVersion of the last event sent there
        self._history: list[tuple] = []  # (version, path, change, object, before): what a watch replays
        self._lock = threading.RLock()  # reentrant: an interceptor may change objects
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    # -- the test's side ------------------------------------------------------------------------

    def __enter__(self) -> FakeApi:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.close_watches()
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        """Where it listens, as a kubeconfig names a server."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def client(self, attempts: int = 3, user_agent: str = "") -> Client:
        """A runner's client of this server; transient failures retried `attempts` times, quickly.
        With a `user_agent` in `exempt`, no fault or interceptor touches its requests."""
        configuration = k8s.Configuration()
        configuration.host = self.url
        configuration.retries = 0
        api_client = k8s.ApiClient(configuration)
        if user_agent:
            api_client.user_agent = user_agent
        return Client(api_client, Backoff(attempts=attempts, base=0.01, cap=0.02))

    def put(self, path: str, obj: dict) -> dict:
        """Store `obj` at `path` (an object's path), as created by someone else."""
        with self._lock:
            return self._store(path, obj, "ADDED")

    def delete(self, path: str) -> None:
        """Remove the object at `path`, as deleted by someone else (the watches get DELETED)."""
        with self._lock:
            live = self.objects.pop(path)
            self.version += 1
            self._notify(path, "DELETED", deleted(live, self.version))

    def get(self, path: str) -> dict | None:
        with self._lock:
            return copy.deepcopy(self.objects.get(path))

    def fail(
        self, method: str, path: str, status: int, times: int = 1, watch: bool = False, message: str = "injected by the test"
    ) -> None:
        """Answer the next `times` requests `method path` (path without the query; a WATCH, or
        not, as `watch` says) with `status` and a Status object saying `message`."""
        with self._lock:
            self._faults.append([method, path, watch, status, times, message])

    def clear_faults(self) -> None:
        """Answer every request normally again."""
        with self._lock:
            self._faults.clear()

    def push(self, collection: str, kind: str, obj: dict) -> None:
        """Send a watch event (BOOKMARK, ERROR...) to the open watches of `collection`."""
        with self._lock:
            for path, _, events in self._watchers:
                if path == collection:
                    events.put({"type": kind, "object": obj})

    def watching(self, collection: str) -> int:
        """How many watches of `collection` are open."""
        with self._lock:
            return sum(1 for path, _, _ in self._watchers if path == collection)

    def expire_watches(self) -> None:
        """Answer every open watch with `410 Gone`, as the API server does when the version the
        watch resumed from was compacted away: the watchers list again."""
        with self._lock:
            for _, _, events in self._watchers:
                events.put({"type": "ERROR", "object": status_body(410, "too old resource version")})

    def close_watches(self) -> None:
        """End every open watch (as the server does at timeoutSeconds)."""
        with self._lock:
            for _, _, events in self._watchers:
                events.put(None)

    def sent(self, method: str, path_part: str = "") -> list[Request]:
        """The requests `method` whose path contains `path_part`, in order."""
        return [r for r in self.requests if r.method == method and path_part in r.path]

    # -- the server's side ----------------------------------------------------------------------

    def _store(self, path: str, obj: dict, change: str) -> dict:
        self.version += 1
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = str(self.version)
        meta.setdefault("uid", f"uid-{path.rsplit('/', 1)[-1]}")
        before = self.objects.get(path)
        self.objects[path] = obj
        self._notify(path, change, obj, before)
        return obj

    def _notify(self, path: str, change: str, obj: dict, before: dict | None = None) -> None:
        """Send `change` to the open watches (and keep it for the watches opened later): one copy
        of the object, which every watch serializes and nothing changes."""
        obj, before = copy.deepcopy(obj), copy.deepcopy(before)
        self._history.append((self.version, path, change, obj, before))
        for watched, query, events in self._watchers:
            self._send(watched, query, events, path, change, obj, before)

    def _send(self, watched: str, query: dict, events: queue.Queue, path: str, change: str, obj: dict, before) -> None:
        """`change` to the watch of `watched` if its selectors match `obj`; as the API server
        does, a watch that matched the object `before` the write and no longer does gets a DELETED."""
        collection = path.rsplit("/", 1)[0]
        if watched not in (collection, cluster_wide(collection)):
            return
        selectors = query.get("labelSelector"), query.get("fieldSelector")
        if matches(obj, *selectors):
            events.put({"type": change, "object": copy.deepcopy(obj)})
        elif before is not None and matches(before, *selectors):
            events.put({"type": "DELETED", "object": copy.deepcopy(obj)})
        else:
            return
        self.last_sent[id(events)] = obj["metadata"]["resourceVersion"]

    def delivered(self, informers) -> bool:
        """Whether each of `informers` that runs follows an open watch and holds every event sent
        to it (`has_seen` the resourceVersion of the last one): one between a 410 and its next
        watch (relisting) or failing does not."""
        with self._lock:
            watches = [
                ((path, query.get("labelSelector"), query.get("fieldSelector")), self.last_sent.get(id(events)))
                for path, query, events in self._watchers
            ]
        for informer in informers:
            if informer.state == "stopped":
                continue
            key = (informer.path, informer.label_selector or None, informer.field_selector or None)
            versions = [version for watched, version in watches if watched == key]
            if not versions or any(v is not None and not informer.has_seen(v) for v in versions):
                return False
        return True

    def answer(
        self, method: str, path: str, query: dict, body, content_type: str = "", user_agent: str = "", accept: str = ""
    ) -> tuple[int, object]:
        """The status and the body of a request; a WATCH's body is the form its events take
        (`negotiate`), which the handler streams."""
        with self._lock:
            request = Request(method, path, query, body, content_type, user_agent)
            self.requests.append(request)
            exempt = user_agent in self.exempt
            for intercept in () if exempt else self.interceptors:
                answered = intercept(request)
                if answered is not None:
                    return answered
            for fault in () if exempt else self._faults:
                if fault[:3] == [method, path, query.get("watch") == "true"] and fault[4] > 0:
                    fault[4] -= 1
                    return fault[3], status_body(fault[3], fault[5])
            watch = method == "GET" and query.get("watch") == "true"
            form = negotiate(accept, "watch" if watch else "list" if method == "GET" and is_collection(path) else "get")
            if form is None:
                return 406, status_body(406, f"the server cannot answer {accept!r}")
            if watch:
                return 200, form
            code, answer = self._answer(method, path, query, body, content_type)
            return code, as_form(answer, form) if code == 200 else answer

    def _answer(self, method: str, path: str, query: dict, body, content_type: str = "") -> tuple[int, object]:
        if method == "GET" and path in {group for group, *_ in KINDS}:
            return 200, {
                "resources": [
                    {"name": plural, "kind": kind, "namespaced": namespaced}
                    for gv, plural, kind, namespaced in KINDS
                    if gv == path
                ]
            }
        target = path.removesuffix("/status")
        if method == "GET":
            if path in self.objects:
                return 200, copy.deepcopy(self.objects[path])
            if is_collection(path):
                return 200, self._list(path, query)
            return 404, status_body(404, "not found")
        if method == "POST" and path.endswith("/eviction"):
            return self._evict(path.removesuffix("/eviction"))
        if method == "POST":
            name = (body.get("metadata") or {}).get("name") or f"generated-{self.version}"
            return 201, self._write(f"{path}/{name}", body, "ADDED")
        live = self.objects.get(target)
        if live is None and method == "PATCH" and content_type == APPLY and not self.apply_as_merge_patch:
            return 201, self._write(target, _strategic({}, body, apply=True), "ADDED")  # an apply creates
        if live is None:
            return 404, status_body(404, "not found")
        if method == "PUT":
            if body["metadata"].get("resourceVersion") != live["metadata"]["resourceVersion"]:
                return 409, status_body(409, "the object has been modified")
            return 200, self._write(target, subresource_write(path, live, body), "MODIFIED")
        if method == "PATCH":
            try:
                patched = self._patch(live, body, content_type)
            except PatchTestFailed as err:
                return 422, status_body(422, str(err))
            wanted = (body.get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) else None
            if wanted and wanted != live["metadata"]["resourceVersion"]:
                return 409, status_body(409, "the object has been modified")
            return 200, self._write(target, subresource_write(path, live, patched), "MODIFIED")
        if method == "DELETE":
            uid = ((body or {}).get("preconditions") or {}).get("uid")
            if uid and uid != live["metadata"]["uid"]:
                return 409, status_body(409, "precondition failed: uid")
            return self._delete(target, live, (body or {}).get("gracePeriodSeconds"))
        return 405, status_body(405, f"{method} not supported")

    def _patch(self, live: dict, body, content_type: str) -> dict:
        """`live` patched by `body` as its content type says (a list: a JSON patch; no content
        type: a merge patch)."""
        if isinstance(body, list) or content_type == "application/json-patch+json":
            return json_patch(live, body)
        if content_type == "application/strategic-merge-patch+json":
            return _strategic(live, body)
        if content_type == APPLY and not self.apply_as_merge_patch:
            return _strategic(live, body, apply=True)
        return merge_patch(live, body)

    def _write(self, path: str, obj: dict, change: str) -> dict:
        """Store a write that came over HTTP, with the API server's `metadata.generation`: 1 at
        creation, raised when anything but the metadata and the status changes (`GENERATION`'s
        kinds); the one the client sent is ignored."""
        if self.clock is not None and path not in self.objects:  # created: stamped as the API server does
            obj = copy.deepcopy(obj)
            obj.setdefault("metadata", {}).setdefault("creationTimestamp", rfc3339(self.clock()))
        if path.rsplit("/", 2)[-2] in GENERATION:
            live = self.objects.get(path)
            obj = copy.deepcopy(obj)
            generation = 1 if live is None else (live["metadata"].get("generation") or 1) + (_content(obj) != _content(live))
            obj.setdefault("metadata", {})["generation"] = generation
        return self._store(path, obj, change)

    def _delete(self, path: str, live: dict, grace: int | None) -> tuple[int, object]:
        """Remove the object; with a clock, a pod bound to a node is only marked (its deletion
        has a grace period, which the kubelet ends by removing it), and marked once."""
        if grace is None:
            grace = (live.get("spec") or {}).get("terminationGracePeriodSeconds", GRACE_PERIOD)
        bound = path.rsplit("/", 2)[-2] == "pods" and (live.get("spec") or {}).get("nodeName")
        if self.clock is not None and bound and grace > 0:
            if live["metadata"].get("deletionTimestamp"):
                return 200, copy.deepcopy(live)
            marked = copy.deepcopy(live)
            marked["metadata"].update(deletionTimestamp=rfc3339(self.clock() + grace), deletionGracePeriodSeconds=grace)
            return 200, self._store(path, marked, "MODIFIED")
        del self.objects[path]
        self.version += 1
        self._notify(path, "DELETED", deleted(live, self.version))
        return 200, status_body(200, "deleted")

    def _evict(self, pod_path: str) -> tuple[int, object]:
        """The Eviction subresource: 429 while a PodDisruptionBudget of the pod's namespace that
        selects it allows no disruption; else one disruption of each such budget used up and
        the pod deleted (gracefully, as any deletion)."""
        pod = self.objects.get(pod_path)
        if pod is None:
            return 404, status_body(404, "not found")
        namespace = pod_path.split("/")[-3]
        labels = pod["metadata"].get("labels") or {}
        prefix = f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/"
        selecting = lambda pdb: all(labels.get(k) == v for k, v in (lookup(pdb, "spec", "selector", "matchLabels") or {}).items())  # noqa: E731
        budgets = [path for path, pdb in self.objects.items() if path.startswith(prefix) and selecting(pdb)]
        if any((self.objects[path].get("status") or {}).get("disruptionsAllowed", 0) < 1 for path in budgets):
            return 429, status_body(429, "Cannot evict pod as it would violate the pod's disruption budget.")
        for path in budgets:
            pdb = copy.deepcopy(self.objects[path])
            pdb["status"]["disruptionsAllowed"] -= 1
            self._store(path, pdb, "MODIFIED")
        self._delete(pod_path, pod, None)
        return 201, status_body(201, "evicted")

    def _list(self, path: str, query: dict) -> dict:
        items = [
            copy.deepcopy(obj)
            for key, obj in sorted(self.objects.items())
            if key.rsplit("/", 1)[0] in (path, *_namespaced(path, self.objects))
            and matches(obj, query.get("labelSelector"), query.get("fieldSelector"))
        ]
        start = int(query.get("continue") or 0)
        limit = int(query.get("limit") or len(items) or 1)
        page = items[start : start + limit]
        meta = {"resourceVersion": str(self.version)}
        if start + limit < len(items):
            meta["continue"] = str(start + limit)
        return {"kind": "List", "metadata": meta, "items": page}

    def watch(self, path: str, query: dict) -> queue.Queue:
        """A watch of `path`, first replaying the changes since its `resourceVersion` (as the API
        server does from its watch cache; none for "" or "0", which ask for now)."""
        events: queue.Queue = queue.Queue()
        with self._lock:
            self._watchers.append((path, query, events))
            since = query.get("resourceVersion") or "0"
            for version, changed, change, obj, before in self._history if since != "0" else ():
                if version > int(since):
                    self._send(path, query, events, changed, change, obj, before)
        return events

    def unwatch(self, events: queue.Queue) -> None:
        with self._lock:
            self._watchers = [w for w in self._watchers if w[2] is not events]


#: The content type of a server-side apply.
APPLY = "application/apply-patch+yaml"


class PatchTestFailed(Exception):
    pass


def _content(obj: dict) -> dict:
    """What a change of raises `metadata.generation`: all but the metadata and the status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


PARTIAL, PARTIAL_LIST = "PartialObjectMetadata", "PartialObjectMetadataList"


def negotiate(accept: str, request: str) -> str | None:
    """The form of the answer to `request` ("get", "list" or "watch") that `Accept` asks for, as
    the API server picks it: the first media range it can serve, "" for the objects themselves,
    PARTIAL or PARTIAL_LIST for metadata only (meta.k8s.io/v1: a LIST's answer is a
    PartialObjectMetadataList, a GET's and a WATCH's events' a PartialObjectMetadata); None when it
    can serve none (406)."""
    wanted = PARTIAL_LIST if request == "list" else PARTIAL
    for media in (accept or "application/json").split(","):
        kind, *options = (part.strip() for part in media.split(";"))
        params = dict(option.partition("=")[::2] for option in options)
        if kind not in ("application/json", "application/*", "*/*"):
            continue
        if "as" not in params:
            return ""
        if (params["as"], params.get("g"), params.get("v")) == (wanted, "meta.k8s.io", "v1"):
            return wanted
    return None


def as_form(answer: dict, form: str) -> dict:
    """`answer` (an object, or a List of them) in `form` (`negotiate`)."""
    if form == PARTIAL:
        return {"kind": PARTIAL, "apiVersion": "meta.k8s.io/v1", "metadata": answer.get("metadata") or {}}
    if form == PARTIAL_LIST:
        items = [as_form(item, PARTIAL) for item in answer["items"]]
        return {"kind": PARTIAL_LIST, "apiVersion": "meta.k8s.io/v1", "metadata": answer["metadata"], "items": items}
    return answer


def deleted(obj: dict, version: int) -> dict:
    """The object as a DELETED event carries it: at the resourceVersion of its deletion, as the API
    server sends it (a watch that has seen that version has seen the deletion)."""
    return {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(version)}}


def status_body(code: int, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure" if code >= 400 else "Success",
        "message": message,
        "code": code,
    }


def subresource_write(path: str, live: dict, written: dict) -> dict:
    """What a write keeps, as with a status subresource: through /status only the status, else
    everything but the status."""
    if path.endswith("/status"):
        return {**live, "status": written.get("status")}
    return {**written, **({"status": live["status"]} if "status" in live else {})}


def is_collection(path: str) -> bool:
    return any(path.endswith("/" + plural) for _, plural, _, _ in KINDS)


def cluster_wide(collection: str) -> str:
    """/api/v1/namespaces/ns/pods -> /api/v1/pods (the cluster-wide collection)."""
    parts = collection.split("/")
    if "namespaces" in parts:
        i = parts.index("namespaces")
        return "/".join(parts[:i] + parts[i + 2 :])
    return collection


def _namespaced(path: str, objects: dict) -> set[str]:
    """The namespaced collections a cluster-wide collection path lists."""
    return {key.rsplit("/", 1)[0] for key in objects if cluster_wide(key.rsplit("/", 1)[0]) == path}


#: The value the API server gives a selectable field an object leaves out (Go's zero value).
_FIELD_ZERO = {"spec.unschedulable": False}


def field_text(value) -> str:
    """A field's value as a field selector compares it (Go's formatting)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


# A label selector's terms: split at the commas outside a set's parentheses.
_LABEL_TERM = re.compile(r"(?:[^,(]|\([^)]*\))+")
_SET_TERM = re.compile(r"(\S+)\s+(in|notin)\s*\(([^)]*)\)")


def matches(obj: dict, labels: str | None, fields: str | None) -> bool:
    have = (obj.get("metadata") or {}).get("labels") or {}
    for term in _LABEL_TERM.findall(labels or ""):
        if (found := _SET_TERM.fullmatch(term.strip())) is not None:  # `key in (a,b)`, `key notin (a,b)`
            key, operator, values = found.groups()
            if (have.get(key) in {v.strip() for v in values.split(",")}) == (operator == "notin"):
                return False
            continue
        key, equals, value = term.partition("=")
        if (have.get(key) != value) if equals else (key not in have):  # `key=value`, or `key`: it exists
            return False
    for term in filter(None, (fields or "").split(",")):
        negate = "!=" in term
        key, _, value = term.partition("!=" if negate else "=")
        node = obj
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if (field_text(_FIELD_ZERO.get(key) if node is None else node) == value) == negate:
            return False
    return True


def merge_patch(target, patch):
    """RFC 7386 merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _strategic(target, patch, apply: bool = False, field: str = ""):
    """`patch` merged into `target` as a strategic merge patch (`apply`: as a server-side apply):
    maps key by key (a null removes the key; `$patch: replace` replaces the map; with `apply` the
    `ATOMIC_MAPS` are replaced whole), the lists of `MERGE_KEYS` item by item by that key (an item
    `$patch: delete` removes it), any other value replaced. Not modelled: the removal, by an
    apply, of fields its manager set before and leaves out now (no managedFields are kept)."""
    if isinstance(patch, dict):
        if patch.get("$patch") == "replace" or (apply and field in ATOMIC_MAPS):
            return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
        out = copy.deepcopy(target) if isinstance(target, dict) else {}
        for key, value in patch.items():
            if key.startswith("$"):
                continue
            if value is None:
                out.pop(key, None)
            else:
                out[key] = _strategic(out.get(key), value, apply, key)
        return out
    key = MERGE_KEYS.get(field)
    if isinstance(patch, list) and key and isinstance(target, list):
        out = [copy.deepcopy(item) for item in target]
        for item in patch:
            at = next((i for i, have in enumerate(out) if have.get(key) == item.get(key)), None)
            if item.get("$patch") == "delete":
                if at is not None:
                    del out[at]
            elif at is None:
                out.append(_strategic({}, item, apply))
            else:
                out[at] = _strategic(out[at], item, apply)
        return out
    return copy.deepcopy(patch)


def json_patch(target: dict, ops: list) -> dict:
    """RFC 6902: add, remove, replace and test on object members (and on array items by index,
    as the API server: `add` at an index inserts, at `-` appends)."""
    out = copy.deepcopy(target)
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node = out
        for part in parents:
            node = _member(node, part, op["path"])
        if isinstance(node, list):
            _list_op(node, last, op)
        elif op["op"] == "test":
            if node.get(last) != op["value"]:
                raise PatchTestFailed(f"test of {op['path']} failed: {node.get(last)!r} != {op['value']!r}")
        elif op["op"] == "remove":
            if last not in node:
                raise PatchTestFailed(f"remove of {op['path']}: no such member")
            del node[last]
        elif op["op"] == "replace" and last not in node:
            raise PatchTestFailed(f"replace of {op['path']}: no such member")
        else:
            node[last] = copy.deepcopy(op["value"])
    return out


def _member(node, part: str, path: str):
    if isinstance(node, dict) and part in node:
        return node[part]
    if isinstance(node, list) and part.isdigit() and int(part) < len(node):
        return node[int(part)]
    raise PatchTestFailed(f"{path}: no such path")


def _list_op(node: list, last: str, op: dict) -> None:
    """One operation on an array item (`last` its index, or `-` past the end for `add`)."""
    index = len(node) if last == "-" and op["op"] == "add" else int(last) if last.isdigit() else -1
    if not 0 <= index <= len(node) or (index == len(node) and op["op"] != "add"):
        raise PatchTestFailed(f"{op['path']}: no such item")
    if op["op"] == "test":
        if node[index] != op["value"]:
            raise PatchTestFailed(f"test of {op['path']} failed: {node[index]!r} != {op['value']!r}")
    elif op["op"] == "remove":
        del node[index]
    elif op["op"] == "add":
        node.insert(index, copy.deepcopy(op["value"]))
    else:
        node[index] = copy.deepcopy(op["value"])


def _handler(api: FakeApi):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_):
            pass

        def _serve(self, method: str) -> None:
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
            headers = self.headers
            code, answer = api.answer(
                method, url.path, query, body, content_type, headers.get("User-Agent") or "", headers.get("Accept", "")
            )
            if method == "GET" and query.get("watch") == "true" and code == 200:
                return self._stream(url.path, query, answer)
            data = json.dumps(answer).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _stream(self, path: str, query: dict, form: str) -> None:
            """Chunked JSON lines, each object in `form` (`negotiate`), until the test closes the
            watches (or the client goes)."""
            events = api.watch(path, query)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            # This server closes the connection after a watch: say so, or the client returns it
            # to its pool and its next request fails on the closed socket (a race under load).
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                while (change := events.get()) is not None:
                    if change["type"] != "ERROR":
                        change = {**change, "object": as_form(change["object"], form)}
                    line = json.dumps(change).encode() + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    self.wfile.flush()
                    if change["type"] == "ERROR":
                        break  # as the API server, which ends a watch after its error
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                pass  # the client closed the watch
            finally:
                api.unwatch(events)
                self.close_connection = True

        def do_GET(self):
            self._serve("GET")

        def do_PUT(self):
            self._serve("PUT")

        def do_PATCH(self):
            self._serve("PATCH")

        def do_DELETE(self):
            self._serve("DELETE")

        def do_POST(self):
            self._serve("POST")

    return Handler
