"""A fake Kubernetes API server that serves the runner a cluster of 10,000 GPU nodes: the server of
the runner's benchmark at scale (tests/bench/bench_scale.py).

It speaks the request semantics of tests/fakeapi.py (its kinds and discovery, label and field
selectors `matches`, merge and JSON patches with `test` (here into new objects that share what a patch
leaves, not copies), the status subresource, the
`PartialObjectMetadata` forms of `negotiate`), with the storage, LIST and WATCH built for size:
fakeapi.py deep-copies every object for every LIST page, every watcher and every history entry,
and keeps every change forever, so one LIST page of 500 realistic nodes takes seconds there. Here
each object is serialized once per version and that JSON is shared by LIST pages, watchers and a
bounded history (`HISTORY_SECONDS`); a LIST pages over a snapshot of the matching keys, with the
first page's resourceVersion for every page as the API server's snapshot does; pods are indexed by
node for `spec.nodeName=` LISTs. Strategic merge and server-side apply merge lists of named items
by name (`strategic_merge`), which covers the runner's partial DaemonSets.

What it plays besides the API (`Cluster`):
- the kubelets: each Node's status rewritten every `node_period` seconds (kubelet's
  nodeStatusReportFrequency, 5 min by default), spread evenly, a whole Node per event;
- the DaemonSet controller of `metax-driver`: a template change makes a ControllerRevision and the
  generation observed; a deleted driver pod gets its deletionTimestamp, goes `terminate` seconds
  later, is created again (Pending) 0.2 s after at the newest revision, Running 1 s later and
  Ready `ready` seconds after that; the DaemonSet's status counts follow at most once a second;
- with `other_pods` K, K more DaemonSet pods per node (the chart's other components, then the
  platform's), a GPU training pod on `busy_fraction` of the nodes, replaced `job_churn` times a
  second (the old one Succeeded, then gone; the new one Pending, then Running);
- a BOOKMARK on every watch each minute, and 410 Gone for a watch older than the history.

Its own endpoints (not Kubernetes): GET /_ctl/stats (requests served, events, bytes), GET
/_ctl/progress (the driver rollout as the cluster shows it), POST /_ctl/rollout?version=V (the
CR's `spec.driver.payload.version` edited, as an admin does).

`python -m tests.scaleapi --release FILE --nodes N [...] --ready-file F`: populates, serves on
127.0.0.1 (plain HTTP), writes its port to F; `release()` makes FILE's contents.
"""

from __future__ import annotations

import argparse
import collections
import copy
import heapq
import itertools
import json
import os
import queue
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import yaml

from metax_operator import contract
from tests import scale_objects as objects
from tests.fakeapi import (
    KINDS,
    PARTIAL,
    PARTIAL_LIST,
    PatchTestFailed,
    as_form,
    cluster_wide,
    is_collection,
    matches,
    negotiate,
    status_body,
    subresource_write,
)

NS = "metax-operator"
DS_PATH = f"/apis/apps/v1/namespaces/{NS}/daemonsets"
DRIVER = f"{DS_PATH}/{contract.DRIVER_DAEMONSET}"
CR = f"/apis/{contract.CR_API_VERSION}/{contract.CR_PLURAL}/{contract.CR_NAME}"
REVISIONS = f"/apis/apps/v1/namespaces/{NS}/controllerrevisions"
PODS = f"/api/v1/namespaces/{NS}/pods"
NODES = "/api/v1/nodes"
TRAINING = "/api/v1/namespaces/ml/pods"
#: Seconds of changes a watch can resume from (older: 410 Gone).
HISTORY_SECONDS = 600
#: Kinds whose spec changes move metadata.generation.
GENERATION_KINDS = frozenset({"DaemonSet", "ClusterOperator", "Deployment"})
_VERSION = re.compile(rb'"resourceVersion":"\d+"')
#: What a pod made once and copied for each node says in place of the node, its name's suffix and
#: its time.
_PROTO_NODE, _PROTO_SUFFIX, _PROTO_TIME = "gpu-node-99999", "qqqqq", "2000-01-01T00:00:00Z"


def dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def rfc3339(t: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if t is None else t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def selectable(obj: dict) -> dict:
    """What the selectors the runner sends read of an object: kept beside its JSON."""
    meta = obj.get("metadata") or {}
    out: dict = {"metadata": {k: meta.get(k) for k in ("name", "namespace", "labels")}}
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    out["spec"] = {k: spec[k] for k in ("nodeName", "unschedulable") if k in spec}
    out["status"] = {"phase": status["phase"]} if "phase" in status else {}
    if "involvedObject" in obj:
        out["involvedObject"] = {"kind": (obj["involvedObject"] or {}).get("kind")}
        out["reason"] = obj.get("reason")
    return out


def shared_merge(target, patch):
    """RFC 7386 merge patch (as `merge_patch`) into a new object that shares every part of
    `target` the patch leaves: the stored objects are never changed, so nothing needs the copy of
    a whole 20 KB Node that `merge_patch` makes."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = shared_merge(out.get(key), value)
    return out


def shared_json_patch(target: dict, ops: list) -> dict:
    """RFC 6902 (as `json_patch`: add, remove, replace and test on object members) into a new
    object that shares every part of `target` the operations leave."""
    out = target
    for op in ops:
        path = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        out = _patched(out, path, op)
    return out


def _patched(node: dict, path: list[str], op: dict) -> dict:
    """`node` with `op` applied at `path` under it: the dicts along the path copied."""
    if not isinstance(node, dict):
        raise PatchTestFailed(f"{op['path']}: no such path")
    key, *rest = path
    if rest:
        if key not in node:
            raise PatchTestFailed(f"{op['path']}: no such path")
        return {**node, key: _patched(node[key], rest, op)}
    if op["op"] == "test":
        if node.get(key) != op["value"]:
            raise PatchTestFailed(f"test of {op['path']} failed: {node.get(key)!r} != {op['value']!r}")
        return node
    if op["op"] in ("remove", "replace") and key not in node:
        raise PatchTestFailed(f"{op['op']} of {op['path']}: no such member")
    out = dict(node)
    if op["op"] == "remove":
        del out[key]
    else:
        out[key] = op["value"]
    return out


def strategic_merge(target, patch):
    """Strategic merge patch, enough for the runner's: maps merged, lists of named items merged by
    name (order kept), other lists replaced, null removes, `$patch: replace` replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key == "$patch":
            continue
        live = out.get(key)
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and value.get("$patch") == "replace":
            out[key] = {k: v for k, v in copy.deepcopy(value).items() if k != "$patch"}
        elif (
            isinstance(value, list)
            and isinstance(live, list)
            and value
            and all(isinstance(v, dict) and "name" in v for v in value)
        ):
            by_name = {v.get("name"): v for v in live if isinstance(v, dict)}
            merged = [strategic_merge(by_name.get(item["name"], {}), item) for item in value]
            names = {v["name"] for v in value}
            merged += [v for v in live if not (isinstance(v, dict) and v.get("name") in names)]
            order = [v.get("name") for v in live if isinstance(v, dict)]
            out[key] = sorted(merged, key=lambda v: order.index(v["name"]) if v["name"] in order else len(order))
        else:
            out[key] = strategic_merge(live, value) if isinstance(value, dict) else copy.deepcopy(value)
    return out


class Entry:
    """One version of an object: the object (None for a pod kept only as JSON), its JSON, what the
    selectors read of it, and its metadata-only JSON once asked for."""

    __slots__ = ("obj", "raw", "view", "_partial")

    def __init__(self, obj: dict | None, raw: bytes, view: dict):
        self.obj, self.raw, self.view, self._partial = obj, raw, view, None

    def json(self, form: str) -> bytes:
        if form != PARTIAL:
            return self.raw
        if self._partial is None:
            self._partial = dumps(as_form(self.obj if self.obj is not None else json.loads(self.raw), PARTIAL))
        return self._partial


class Watch:
    """An open WATCH: its collection, selectors, form and the lines to stream (None ends it)."""

    __slots__ = ("collection", "labels", "fields", "form", "lines")

    def __init__(self, collection: str, labels: str | None, fields: str | None, form: str):
        self.collection, self.labels, self.fields, self.form = collection, labels, fields, form
        self.lines: queue.SimpleQueue = queue.SimpleQueue()

    def send(self, change: str, entry: Entry) -> None:
        self.lines.put(b'{"type":"%s","object":%s}\n' % (change.encode(), entry.json(self.form)))


class Cluster:
    """The API's objects, their watches, and the controllers and kubelets acting on them."""

    def __init__(
        self,
        nodes: int,
        *,
        node_period: float = 300.0,
        other_pods: int = 0,
        busy_fraction: float = 0.0,
        job_churn: float = 0.0,
        ready: float = 3.0,
        terminate: float = 1.0,
    ):
        self.nodes, self.node_period, self.other_pods = nodes, node_period, other_pods
        self.busy_fraction, self.job_churn, self.ready, self.terminate = busy_fraction, job_churn, ready, terminate
        self.lock = threading.RLock()
        self.version = 1000
        self.entries: dict[str, Entry] = {}
        self.collections: dict[str, dict[str, None]] = collections.defaultdict(dict)  # ordered sets of paths
        self.on_node: dict[str, dict[str, None]] = collections.defaultdict(dict)  # pod paths by node
        self.watches: list[Watch] = []
        self.history: collections.deque = collections.deque()  # (version, monotonic, path, change, entry, before view)
        self.history_floor = 0  # changes at or below this version can no longer be replayed
        self.snapshots: dict[str, tuple[int, list[str], float]] = {}  # LIST continue token -> (version, keys, when)
        self.serial = itertools.count()
        self.requests: collections.Counter = collections.Counter()
        self.sent_bytes = self.events = self.node_updates = 0
        self.timers: list = []  # heap of (when, serial, fn)
        self.timer_cv = threading.Condition()
        self.driver_revision, self.revision_number, self.template_seen = "", 0, None
        self.prototypes: dict[tuple, tuple[bytes, bytes]] = {}  # (revision, generation, ready) -> a driver pod's JSON, its uid
        self.ds_dirty = False

    # -- storage --------------------------------------------------------------------------------

    def put(self, path: str, obj: dict, change: str) -> Entry:
        """Store `obj` (never mutated afterwards) at `path` with a new resourceVersion and tell
        the watches; the lock is held."""
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        return self._keep(path, Entry(obj, dumps(obj), selectable(obj)), change)

    def put_json(self, path: str, raw: bytes, view: dict) -> None:
        """Store an object kept only as its JSON (a pod the runner never writes): no dict in memory."""
        self.version += 1
        raw = raw.replace(b'"resourceVersion":"1"', b'"resourceVersion":"%d"' % self.version, 1)
        self._keep(path, Entry(None, raw, view), "ADDED")

    def _keep(self, path: str, entry: Entry, change: str) -> Entry:
        before = self.entries.get(path)
        self.entries[path] = entry
        collection = path.rsplit("/", 1)[0]
        self.collections[collection][path] = None
        self.collections[cluster_wide(collection)][path] = None
        node = entry.view["spec"].get("nodeName")
        if node and collection.endswith("/pods"):
            self.on_node[node][path] = None
        self._notify(path, change, entry, before.view if before else None)
        return entry

    def remove(self, path: str) -> None:
        entry = self.entries.pop(path)
        collection = path.rsplit("/", 1)[0]
        self.collections[collection].pop(path, None)
        self.collections[cluster_wide(collection)].pop(path, None)
        self.on_node.get(entry.view["spec"].get("nodeName") or "", {}).pop(path, None)
        self.version += 1
        raw = _VERSION.sub(b'"resourceVersion":"%d"' % self.version, entry.raw, count=1)
        obj = (
            None
            if entry.obj is None
            else {**entry.obj, "metadata": {**entry.obj["metadata"], "resourceVersion": str(self.version)}}
        )
        self._notify(path, "DELETED", Entry(obj, raw, entry.view), None)

    def _notify(self, path: str, change: str, entry: Entry, before: dict | None) -> None:
        self.events += 1
        now = time.monotonic()
        self.history.append((self.version, now, path, change, entry, before))
        while self.history and (now - self.history[0][1] > HISTORY_SECONDS or len(self.history) > 400_000):
            self.history_floor = self.history.popleft()[0]
        for watch in self.watches:
            self._send(watch, path, change, entry, before)

    @staticmethod
    def _send(watch: Watch, path: str, change: str, entry: Entry, before: dict | None) -> None:
        """`change` to `watch` if it selects the object; DELETED if it selected it only before."""
        collection = path.rsplit("/", 1)[0]
        if watch.collection not in (collection, cluster_wide(collection)):
            return
        if matches(entry.view, watch.labels, watch.fields):
            watch.send(change, entry)
        elif before is not None and matches(before, watch.labels, watch.fields):
            watch.send("DELETED", entry)

    def obj(self, path: str) -> dict | None:
        entry = self.entries.get(path)
        if entry is None:
            return None
        return entry.obj if entry.obj is not None else json.loads(entry.raw)

    # -- the API ----------------------------------------------------------------------------------

    def handle(self, method: str, path: str, query: dict, body, content_type: str, accept: str):
        """(status, JSON bytes), or (200, Watch) for a WATCH."""
        watch = method == "GET" and query.get("watch") == "true"
        self.requests[method + (" watch" if watch else "")] += 1
        if path == "/version":
            return 200, dumps({"major": "1", "minor": "34", "gitVersion": "v1.34.4", "platform": "linux/amd64"})
        if method == "GET" and path in {gv for gv, *_ in KINDS}:
            resources = [{"name": p, "kind": k, "namespaced": n} for gv, p, k, n in KINDS if gv == path]
            return 200, dumps({"resources": resources})
        if path.startswith("/_ctl/"):
            return self.control(method, path, query)
        listing = method == "GET" and is_collection(path)
        form = negotiate(accept, "watch" if watch else "list" if listing else "get")
        if form is None:
            return 406, dumps(status_body(406, f"the server cannot answer {accept!r}"))
        with self.lock:
            if watch:
                return 200, self.watch(path, query, form)
            if method == "GET":
                entry = self.entries.get(path)
                if entry is not None:
                    return 200, entry.json(form)
                if listing:
                    return 200, self.list(path, query, form)
                return 404, dumps(status_body(404, "not found"))
            if method == "POST":
                return self.create(path, body)
            target = path.removesuffix("/status")
            live = self.obj(target)
            if live is None:
                return 404, dumps(status_body(404, "not found"))
            if method == "DELETE":
                return self.delete(target, live, body or {})
            return self.write(method, path, target, live, body, content_type)

    def create(self, path: str, body: dict):
        if path.endswith("/eviction"):
            target = path.removesuffix("/eviction")
            live = self.obj(target)
            return (404, dumps(status_body(404, "not found"))) if live is None else self.delete(target, live, {})
        meta = body.setdefault("metadata", {})
        if not meta.get("name"):
            meta["name"] = (meta.get("generateName") or "generated-") + f"{next(self.serial):x}"
        target = f"{path}/{meta['name']}"
        if target in self.entries:
            return 409, dumps(status_body(409, "already exists"))
        meta.setdefault("uid", objects.uid(target + str(self.version)))
        meta.setdefault("creationTimestamp", rfc3339())
        if body.get("kind") in GENERATION_KINDS:
            meta.setdefault("generation", 1)
        return 201, self.put(target, body, "ADDED").raw

    def write(self, method: str, path: str, target: str, live: dict, body, content_type: str):
        if method == "PUT":
            if body["metadata"].get("resourceVersion") != live["metadata"]["resourceVersion"]:
                return 409, dumps(status_body(409, "the object has been modified"))
            written = subresource_write(path, live, body)
        elif method == "PATCH":
            try:
                if content_type.startswith("application/json-patch"):
                    patched = shared_json_patch(live, body)
                elif content_type.startswith("application/merge-patch"):
                    patched = shared_merge(live, body)
                else:  # strategic merge patch, server-side apply
                    patched = strategic_merge(live, body)
            except PatchTestFailed as err:
                return 422, dumps(status_body(422, str(err)))
            wanted = (body.get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) else None
            if wanted and wanted != live["metadata"]["resourceVersion"]:
                return 409, dumps(status_body(409, "the object has been modified"))
            written = subresource_write(path, live, patched)
        else:
            return 405, dumps(status_body(405, f"{method} not supported"))
        written["metadata"] = dict(written["metadata"])
        if written.get("kind") in GENERATION_KINDS and not path.endswith("/status") and written.get("spec") != live.get("spec"):
            written["metadata"]["generation"] = live["metadata"].get("generation", 1) + 1
        entry = self.put(target, written, "MODIFIED")
        if target == DRIVER:
            self.after(0.05, self.driver_controller)
        return 200, entry.raw

    def delete(self, target: str, live: dict, body: dict):
        uid = (body.get("preconditions") or {}).get("uid")
        if uid and uid != live["metadata"]["uid"]:
            return 409, dumps(status_body(409, "precondition failed: uid"))
        if target.startswith(PODS + "/"):
            if "deletionTimestamp" in live["metadata"]:
                return 200, self.entries[target].raw
            grace = 30
            meta = {**live["metadata"], "deletionTimestamp": rfc3339(time.time() + grace), "deletionGracePeriodSeconds": grace}
            entry = self.put(target, {**live, "metadata": meta}, "MODIFIED")
            self.after(self.terminate, lambda: self.pod_gone(target))
            return 200, entry.raw
        self.remove(target)
        return 200, dumps(status_body(200, "deleted"))

    def list(self, path: str, query: dict, form: str) -> bytes:
        labels, fields = query.get("labelSelector"), query.get("fieldSelector")
        token = query.get("continue")
        if token:
            snapshot, offset = token.rsplit(":", 1)
            version, keys, _ = self.snapshots[snapshot]
            offset = int(offset)
        else:
            candidates = self.collections.get(path, {})
            node = next((t.split("=", 1)[1] for t in (fields or "").split(",") if t.startswith("spec.nodeName=")), None)
            if node is not None:
                candidates = {
                    p: None
                    for p in self.on_node.get(node, {})
                    if path in (p.rsplit("/", 1)[0], cluster_wide(p.rsplit("/", 1)[0]))
                }
            keys = [p for p in candidates if matches(self.entries[p].view, labels, fields)]
            version, offset, snapshot = self.version, 0, f"s{next(self.serial):x}"
            now = time.monotonic()
            for old in [k for k, v in self.snapshots.items() if now - v[2] > HISTORY_SECONDS]:
                del self.snapshots[old]
            self.snapshots[snapshot] = (version, keys, now)
        limit = int(query.get("limit") or 0) or len(keys) or 1
        items = [self.entries[p].json(PARTIAL if form else "") for p in keys[offset : offset + limit] if p in self.entries]
        meta = {"resourceVersion": str(version)}
        if offset + limit < len(keys):
            meta["continue"] = f"{snapshot}:{offset + limit}"
        else:
            self.snapshots.pop(snapshot, None)
        kind, api_version = (PARTIAL_LIST, "meta.k8s.io/v1") if form else ("List", "v1")
        return b'{"kind":"%s","apiVersion":"%s","metadata":%s,"items":[%s]}' % (
            kind.encode(),
            api_version.encode(),
            dumps(meta),
            b",".join(items),
        )

    def watch(self, path: str, query: dict, form: str) -> Watch:
        watch = Watch(path, query.get("labelSelector"), query.get("fieldSelector"), form)
        since = int(query.get("resourceVersion") or 0)
        if since and since < self.history_floor:
            watch.lines.put(b'{"type":"ERROR","object":%s}\n' % dumps(status_body(410, "too old resource version")))
            watch.lines.put(None)
            return watch
        for version, _, path_, change, entry, before in self.history if since else ():
            if version > since:
                self._send(watch, path_, change, entry, before)
        self.watches.append(watch)
        return watch

    def unwatch(self, watch: Watch) -> None:
        with self.lock:
            if watch in self.watches:
                self.watches.remove(watch)

    # -- the simulated controllers and kubelets -----------------------------------------------------

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        with self.timer_cv:
            heapq.heappush(self.timers, (time.monotonic() + delay, next(self.serial), fn))
            self.timer_cv.notify()

    def run_timers(self) -> None:
        while True:
            with self.timer_cv:
                while not self.timers or self.timers[0][0] > time.monotonic():
                    self.timer_cv.wait(max(0.0, self.timers[0][0] - time.monotonic()) if self.timers else 1.0)
                _, _, fn = heapq.heappop(self.timers)
            try:
                fn()
            except Exception:  # noqa: BLE001 - a simulated controller's bug must show, not stop the others
                traceback.print_exc()

    def pod_gone(self, path: str) -> None:
        with self.lock:
            entry = self.entries.get(path)
            if entry is None:
                return
            node = entry.view["spec"]["nodeName"]
            self.remove(path)
            self.ds_dirty = True
        self.after(0.2, lambda: self.create_driver_pod(node))

    def create_driver_pod(self, node: str, ready: bool = False) -> None:
        """The DaemonSet controller's pod on `node`, at the newest revision: Pending, then Running,
        then Ready (or Running and Ready at once with `ready`, as populated)."""
        with self.lock:
            ds = self.obj(DRIVER)
            serial = next(self.serial)
            name = f"{contract.DRIVER_DAEMONSET}-{objects.digest(node + str(serial), 5)}"
            while f"{PODS}/{name}" in self.entries:  # the name is taken: the controller tries another
                serial = next(self.serial)
                name = f"{contract.DRIVER_DAEMONSET}-{objects.digest(node + str(serial), 5)}"
            generation = str(ds["metadata"].get("generation", 1))
            key = (self.driver_revision, generation, ready)
            if key not in self.prototypes:  # one pod made per revision, then copied for each node
                pod = objects.pod(
                    ds["spec"]["template"],
                    f"{contract.DRIVER_DAEMONSET}-{_PROTO_SUFFIX}",
                    NS,
                    _PROTO_NODE,
                    owner=objects.daemonset_owner(contract.DRIVER_DAEMONSET, ds["metadata"]["uid"]),
                    labels={contract.REVISION_LABEL: self.driver_revision, "pod-template-generation": generation},
                    phase="Running" if ready else "Pending",
                    ready=ready,
                    created=_PROTO_TIME,
                )
                self.prototypes[key] = (dumps(pod), pod["metadata"]["uid"].encode())
            raw, proto_uid = self.prototypes[key]
            created = objects.CREATED if ready else rfc3339()
            # a name comes back once its pod is gone (five hex digits); a uid never does
            uid = objects.uid(f"pod/{NS}/{name}/{serial}").encode()
            raw = raw.replace(_PROTO_NODE.encode(), node.encode()).replace(
                _PROTO_SUFFIX.encode(), name.rsplit("-", 1)[1].encode()
            )
            raw = raw.replace(proto_uid, uid).replace(_PROTO_TIME.encode(), created.encode())
            self.put(f"{PODS}/{name}", json.loads(raw), "ADDED")
            self.ds_dirty = True
        if not ready:
            self.after(1.0, lambda: self.pod_phase(f"{PODS}/{name}", "Running", False))
            self.after(1.0 + self.ready, lambda: self.pod_phase(f"{PODS}/{name}", "Running", True))

    def pod_phase(self, path: str, phase: str, ready: bool) -> None:
        with self.lock:
            pod = self.obj(path)
            if pod is None or "deletionTimestamp" in pod["metadata"]:
                return
            status = objects.pod_status(pod["spec"], pod["metadata"]["name"], phase, ready, rfc3339())
            meta = dict(pod["metadata"])
            meta["managedFields"] = [*meta["managedFields"][:1], {**meta["managedFields"][1], "time": rfc3339()}]
            self.put(path, {**pod, "metadata": meta, "status": status}, "MODIFIED")
            self.ds_dirty = True

    def driver_controller(self) -> None:
        """The driver DaemonSet's template as a new ControllerRevision, its generation observed."""
        with self.lock:
            ds = self.obj(DRIVER)
            template = ds["spec"]["template"]
            if template != self.template_seen:
                self.template_seen = copy.deepcopy(template)
                self.revision_number += 1
                self.driver_revision = objects.digest(json.dumps(template, sort_keys=True), 10)
                name = f"{contract.DRIVER_DAEMONSET}-{self.driver_revision}"
                labels = {**(template.get("metadata") or {}).get("labels", {}), contract.REVISION_LABEL: self.driver_revision}
                revision = {
                    "apiVersion": "apps/v1",
                    "kind": "ControllerRevision",
                    "metadata": {
                        "name": name,
                        "namespace": NS,
                        "uid": objects.uid(name),
                        "creationTimestamp": rfc3339(),
                        "labels": labels,
                        "ownerReferences": [objects.daemonset_owner(contract.DRIVER_DAEMONSET, ds["metadata"]["uid"])],
                    },
                    "revision": self.revision_number,
                    "data": {"spec": {"template": {**copy.deepcopy(template), "$patch": "replace"}}},
                }
                self.put(f"{REVISIONS}/{name}", revision, "ADDED")
            self.ds_dirty = True
        self.driver_status()

    def driver_status(self) -> None:
        """The driver DaemonSet's status counts, when its pods changed."""
        with self.lock:
            if not self.ds_dirty:
                return
            self.ds_dirty = False
            ds = self.obj(DRIVER)
            pods = self.driver_pods()
            ready = sum(1 for p in pods if _ready(p))
            status = {
                "currentNumberScheduled": len(pods),
                "desiredNumberScheduled": self.nodes,
                "numberAvailable": ready,
                "numberMisscheduled": 0,
                "numberReady": ready,
                "numberUnavailable": max(0, self.nodes - ready),
                "observedGeneration": ds["metadata"].get("generation", 1),
                "updatedNumberScheduled": sum(1 for p in pods if _revision(p) == self.driver_revision),
            }
            if status != ds.get("status"):
                self.put(DRIVER, {**ds, "metadata": dict(ds["metadata"]), "status": status}, "MODIFIED")

    def driver_pods(self) -> list[dict]:
        prefix = f"{PODS}/{contract.DRIVER_DAEMONSET}-"
        return [self.entries[p].obj for p in self.collections.get(PODS, {}) if p.startswith(prefix)]

    def every(self, seconds: float, fn: Callable[[], None]) -> None:
        while True:
            time.sleep(seconds)
            fn()

    def bookmark(self) -> None:
        with self.lock:
            for watch in self.watches:
                kind, api_version = (PARTIAL, "meta.k8s.io/v1") if watch.form else ("Bookmark", "v1")
                watch.lines.put(
                    b'{"type":"BOOKMARK","object":{"kind":"%s","apiVersion":"%s","metadata":{"resourceVersion":"%d"}}}\n'
                    % (kind.encode(), api_version.encode(), self.version)
                )

    def kubelets(self) -> None:
        """Each node's status report every `node_period` seconds, spread evenly."""
        if self.node_period <= 0 or not self.nodes:
            return
        start, step = time.monotonic(), self.node_period / self.nodes
        for i in itertools.count():
            delay = start + i * step - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            path = f"{NODES}/{objects.node_name(i % self.nodes)}"
            with self.lock:
                entry = self.entries.get(path)
                if entry is not None:
                    self.put(path, objects.heartbeat(entry.obj, rfc3339()), "MODIFIED")
                    self.node_updates += 1

    def busy(self, i: int) -> bool:
        """Whether node `i` runs a GPU training pod (a deterministic `busy_fraction` of them)."""
        return (i * 7919) % 1000 < self.busy_fraction * 1000

    def jobs(self) -> None:
        """Training pods replaced at `job_churn` a second, node after node of the busy ones."""
        busy = [i for i in range(self.nodes) if self.busy(i)]
        if self.job_churn <= 0 or not busy:
            return
        start = time.monotonic()
        for k in itertools.count():
            delay = start + k / self.job_churn - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            i = busy[k % len(busy)]
            node = objects.node_name(i)
            name = f"pretrain-{(i + k) // 64}-worker-{i % 64}-{k:x}"
            with self.lock:
                for path in [p for p in self.on_node.get(node, {}) if p.startswith(TRAINING + "/")]:
                    old = self.obj(path)
                    self.put(
                        path,
                        {**old, "metadata": dict(old["metadata"]), "status": {**old["status"], "phase": "Succeeded"}},
                        "MODIFIED",
                    )
                    self.remove(path)
                pod = objects.pod(
                    objects.training_template(i + k), name, "ml", node, phase="Pending", ready=False, created=rfc3339()
                )
                self.put(f"{TRAINING}/{name}", pod, "ADDED")
            self.after(2.0, lambda name=name: self.pod_phase(f"{TRAINING}/{name}", "Running", True))

    # -- the cluster as installed ---------------------------------------------------------------------

    def populate(self, release: dict) -> None:
        """The installed release on N GPU nodes: its DaemonSets, ConfigMaps and Service, the CR,
        the driver's ControllerRevision, the nodes (upgrade state `done`), a Ready driver pod per
        node, and the other pods per node when asked."""
        with self.lock:
            for obj in release["objects"]:
                live = copy.deepcopy(obj)
                kind, name = live["kind"], live["metadata"]["name"]
                live["metadata"].update(
                    namespace=NS, uid=objects.uid(f"{kind}/{name}"), generation=1, creationTimestamp=objects.CREATED
                )
                if kind == "DaemonSet":
                    live["spec"].setdefault("updateStrategy", copy.deepcopy(contract.COMPONENT_UPDATE_STRATEGY))
                    live["status"] = {"observedGeneration": 1}
                plural = {"DaemonSet": "apis/apps/v1/namespaces/{}/daemonsets", "ConfigMap": "api/v1/namespaces/{}/configmaps"}
                path = "/" + plural.get(kind, "api/v1/namespaces/{}/services").format(NS) + f"/{name}"
                self.put(path, live, "ADDED")
            self.put(CR, copy.deepcopy(release["cr"]), "ADDED")
            for i in range(self.nodes):
                self.put(f"{NODES}/{objects.node_name(i)}", objects.node(i), "ADDED")
        self.driver_controller()
        for i in range(self.nodes):
            self.create_driver_pod(objects.node_name(i), ready=True)
        self._other_pods(release["other_templates"][: self.other_pods])
        self.ds_dirty = True
        self.driver_status()

    def _other_pods(self, templates: list) -> None:
        """The other DaemonSets' pods on each node, made from one prototype per DaemonSet by
        replacing its node name, name suffix and uid in the JSON (kept only as JSON), and a
        training pod on each busy node."""
        prototypes = []
        for namespace, name, template in templates:
            pod = objects.pod(
                template,
                f"{name}-{_PROTO_SUFFIX}",
                namespace,
                _PROTO_NODE,
                owner=objects.daemonset_owner(name, objects.uid(name)),
            )
            prototypes.append((namespace, name, dumps(pod), pod["metadata"]["uid"].encode(), pod["metadata"]["labels"]))
        for i in range(self.nodes if templates or self.busy_fraction else 0):
            node = objects.node_name(i)
            with self.lock:
                for namespace, ds, raw, proto_uid, labels in prototypes:
                    suffix = objects.digest(node + ds, 5)
                    name = f"{ds}-{suffix}"
                    uid = objects.uid(f"pod/{namespace}/{name}").encode()
                    body = (
                        raw.replace(_PROTO_NODE.encode(), node.encode())
                        .replace(_PROTO_SUFFIX.encode(), suffix.encode())
                        .replace(proto_uid, uid)
                    )
                    view = {
                        "metadata": {"name": name, "namespace": namespace, "labels": labels},
                        "spec": {"nodeName": node},
                        "status": {"phase": "Running"},
                    }
                    self.put_json(f"/api/v1/namespaces/{namespace}/pods/{name}", body, view)
                if self.busy(i):
                    name = f"pretrain-{i // 64}-worker-{i % 64}"
                    self.put(f"{TRAINING}/{name}", objects.pod(objects.training_template(i), name, "ml", node), "ADDED")

    def start(self) -> None:
        """The simulated controllers, kubelets and jobs, in daemon threads."""
        for target in (
            self.run_timers,
            self.kubelets,
            self.jobs,
            lambda: self.every(1.0, self.driver_status),
            lambda: self.every(60.0, self.bookmark),
        ):
            threading.Thread(target=target, daemon=True).start()

    # -- its own endpoints -------------------------------------------------------------------------------

    def control(self, method: str, path: str, query: dict):
        with self.lock:
            if path == "/_ctl/stats":
                stats = {
                    "version": self.version,
                    "objects": len(self.entries),
                    "watches": len(self.watches),
                    "requests": dict(self.requests),
                }
                stats.update(events=self.events, node_updates=self.node_updates, sent_bytes=self.sent_bytes)
                return 200, dumps(stats)
            if path == "/_ctl/progress":
                return 200, dumps(self.progress())
            if path == "/_ctl/rollout" and method == "POST":
                cr = copy.deepcopy(self.obj(CR))
                cr["spec"]["driver"]["payload"]["version"] = query.get("version", "2.33.0.1")
                cr["metadata"]["generation"] += 1
                self.put(CR, cr, "MODIFIED")
                return 200, b"{}"
        return 404, dumps(status_body(404, "no such control"))

    def progress(self) -> dict:
        """The driver rollout as the cluster shows it: the newest revision, the driver pods (on the
        nodes without GPU work: those a rollout may take), at it and Ready, nodes cordoned, the
        CR's phase."""
        busy = {objects.node_name(i) for i in range(self.nodes) if self.busy(i)}
        pods = [p for p in self.driver_pods() if p["spec"]["nodeName"] not in busy]
        new = [p for p in pods if _revision(p) == self.driver_revision]
        cordoned = sum(1 for p in self.collections[NODES] if self.entries[p].obj["spec"].get("unschedulable"))
        upgrade = (self.obj(CR).get("status") or {}).get("upgradeStatus") or {}
        return {
            "revision": self.driver_revision,
            "pods": len(pods),
            "new": len(new),
            "new_ready": sum(1 for p in new if _ready(p)),
            "cordoned": cordoned,
            "phase": upgrade.get("phase"),
        }


def _ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def _revision(pod: dict) -> str:
    return pod["metadata"]["labels"].get(contract.REVISION_LABEL, "")


# -- HTTP ----------------------------------------------------------------------------------------------


def _handler(cluster: Cluster):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_):
            pass

        def setup(self):
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def _serve(self, method: str) -> None:
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = None
            if raw:
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = yaml.safe_load(raw)  # a server-side apply's YAML
            headers = self.headers
            try:
                code, answer = cluster.handle(
                    method, url.path, query, body, headers.get("Content-Type", ""), headers.get("Accept", "")
                )
            except Exception as err:  # noqa: BLE001 - the server's own bug: a 500 the runner sees, and the trace
                traceback.print_exc()
                code, answer = 500, dumps(status_body(500, f"{type(err).__name__}: {err}"))
            if isinstance(answer, Watch):
                return self._stream(answer)
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
            cluster.sent_bytes += len(answer)

        def _stream(self, watch: Watch) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                while (line := watch.lines.get()) is not None:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    cluster.sent_bytes += len(line)
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                pass  # the client closed the watch
            finally:
                cluster.unwatch(watch)
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


class _Server(ThreadingHTTPServer):
    request_queue_size = 256
    daemon_threads = True


def serve(cluster: Cluster, port: int = 0) -> ThreadingHTTPServer:
    """The API of `cluster` on 127.0.0.1:`port` (0: any free port), served by a daemon thread."""
    server = _Server(("127.0.0.1", port), _handler(cluster))
    threading.Thread(target=server.serve_forever, name="scaleapi", daemon=True).start()
    return server


# -- the release it serves -------------------------------------------------------------------------------


def release(values: dict, policy: dict) -> dict:
    """The chart installed with `values` (rendered by Helm 3): its DaemonSets, ConfigMaps and
    Service; the CR with `values` and the upgrade `policy`; and the pod templates of the other
    DaemonSets on each node (the chart's components but the driver, then the platform's)."""
    from tests.helm import render_chart  # the harness's Helm, only where a release is made

    rendered = [o for o in render_chart(values) if o["kind"] in ("DaemonSet", "ConfigMap", "Service")]
    spec = copy.deepcopy(values)
    spec.setdefault("driver", {})["upgradePolicy"] = policy
    cr = {
        "apiVersion": contract.CR_API_VERSION,
        "kind": contract.CR_KIND,
        "metadata": {"name": contract.CR_NAME, "generation": 1, "uid": "cr-uid", "creationTimestamp": objects.CREATED},
        "spec": spec,
    }
    others = []
    for ds in rendered:
        if ds["kind"] == "DaemonSet" and ds["metadata"]["name"] != contract.DRIVER_DAEMONSET:
            template = copy.deepcopy(ds["spec"]["template"])
            template.setdefault("metadata", {}).setdefault("labels", {})[contract.REVISION_LABEL] = objects.digest(
                ds["metadata"]["name"], 10
            )
            others.append([NS, ds["metadata"]["name"], template])
    others += [list(entry) for entry in objects.PLATFORM_DAEMONSETS]
    return {"objects": rendered, "cr": cr, "other_templates": others}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.scaleapi", description=__doc__.splitlines()[0])
    parser.add_argument("--release", required=True, help="JSON of `release()`")
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--node-period", type=float, default=300.0, help="seconds between two status reports of a node")
    parser.add_argument("--other-pods", type=int, default=0, help="more DaemonSet pods per node")
    parser.add_argument("--busy-fraction", type=float, default=0.0, help="share of the nodes with a GPU training pod")
    parser.add_argument("--job-churn", type=float, default=0.0, help="training pods replaced per second")
    parser.add_argument("--ready", type=float, default=3.0, help="seconds from a driver pod's Running to its Ready")
    parser.add_argument("--terminate", type=float, default=1.0, help="seconds a deleted driver pod takes to go")
    parser.add_argument("--ready-file", required=True, help="where to write the port once serving (JSON)")
    args = parser.parse_args(argv)
    with open(args.release) as f:
        contents = json.load(f)
    options = {k: getattr(args, k) for k in ("node_period", "other_pods", "busy_fraction", "job_churn", "ready", "terminate")}
    cluster = Cluster(args.nodes, **options)
    started = time.monotonic()
    cluster.populate(contents)
    cluster.start()
    server = serve(cluster)
    info = {
        "port": server.server_address[1],
        "populate_seconds": round(time.monotonic() - started, 1),
        "objects": len(cluster.entries),
    }
    info["pods"] = sum(1 for path in cluster.entries if "/pods/" in path)
    with open(args.ready_file + ".tmp", "w") as f:
        json.dump(info, f)
    os.rename(args.ready_file + ".tmp", args.ready_file)
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
