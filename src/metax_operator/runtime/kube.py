"""The one module that talks to the Kubernetes API.

Objects are plain dicts (the JSON the API server speaks), addressed by `apiVersion` and `kind`
like manifests. A `Client` wraps the kubernetes package's `ApiClient` and adds:

- server-side apply of any object (`apply`), with a field manager and `force`;
- get/list/patch/delete, delete with UID/resourceVersion preconditions, waiting for deletion;
- retries: 429, 5xx and network errors/timeouts are retried with bounded exponential backoff
  inside every call (`api_failures.with_backoff`); a 409 conflict is the caller's to resolve, with
  `api_failures.retry_on_conflict`, which calls the caller's function again (it re-reads,
  recomputes, writes).

Why `ApiClient.call_api` with `application/apply-patch+yaml` and not the dynamic client's
`server_side_apply`: the dynamic client discovers every API group of the cluster before its first
call (dozens of requests on a large cluster) and caches the result in a file under the temp
directory, which a hook pod with a read-only root filesystem cannot write. Here discovery asks only
for the group/versions actually used, once each, in memory.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import simdjson
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from metax_operator.errors import UserError
from metax_operator.runtime.api_failures import Backoff, NotServed, with_backoff

T = TypeVar("T")

#: (connect, read) timeout of one request, seconds.
REQUEST_TIMEOUT = (5, 30)
#: Page size of list calls (10,000 nodes = 20 requests, each a bounded response).
PAGE_SIZE = 500
#: Requests one process sends at once (pod deletions, node patches).
PARALLEL_REQUESTS = 8
#: Connections kept open: one per open watch (the runner's caches, about 18) and parallel request;
#: the client's default, 5 per CPU, opened (TLS handshake) and dropped one per request beyond it.
CONNECTIONS = 32
#: The HTTP methods whose answer is the object as written.
WRITES = frozenset({"POST", "PUT", "PATCH"})


def plain(value):
    """A value of simdjson's lazy view as plain Python: dicts, lists, strings, numbers (a plain
    value is returned as it is)."""
    convert = getattr(value, "as_dict", None) or getattr(value, "as_list", None)
    return convert() if convert is not None else value


@dataclass(frozen=True)
class Resource:
    """Where a kind lives in the API (from discovery)."""

    api_version: str
    kind: str
    plural: str
    namespaced: bool

    def path(
        self, name: str | None = None, namespace: str | None = None, subresource: str = "", all_namespaces: bool = False
    ) -> str:
        """The object's (or the collection's) path; `all_namespaces`: a namespaced kind's collection
        across every namespace."""
        prefix = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        if self.namespaced and not all_namespaces:
            if not namespace:
                raise ValueError(f"{self.kind} is namespaced: a namespace is required")
            prefix += f"/namespaces/{namespace}"
        path = f"{prefix}/{self.plural}"
        if name:
            path += f"/{name}"
        if subresource:
            path += f"/{subresource}"
        return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The connection options every command that talks to the API takes."""
    parser.add_argument(
        "--kubeconfig",
        default=os.environ.get("KUBECONFIG") or None,
        help="kubeconfig file (default: $KUBECONFIG, else the in-cluster service account, else ~/.kube/config)",
    )
    parser.add_argument("--context", default=None, help="kubeconfig context (default: current)")


class Client:
    """An API connection: typed-free calls on dict objects, with retries and discovery."""

    def __init__(self, api_client: k8s.ApiClient, backoff: Backoff = Backoff()):
        self.api_client = api_client
        self.backoff = backoff
        self._resources: dict[tuple[str, str], Resource] = {}
        self._discovered: set[str] = set()
        #: Called with every object a write (POST, PUT, PATCH) returns (a projecting call's lazy view:
        #: keep it plain): how a cache of what this client reads learns of its own writes first.
        self.on_written: list[Callable[[Any], None]] = []
        #: The calls made through `call` so far (what the runner's log reports per pass).
        self.requests = 0
        self._counting = threading.Lock()

    @classmethod
    def connect(cls, kubeconfig: str | None = None, context: str | None = None, backoff: Backoff = Backoff()) -> Client:
        """In-cluster credentials when running in a pod and no kubeconfig is given, else the file.

        A kubeconfig that cannot be used (missing, not YAML, no such context) is the user's
        UserError, named with the path.
        """
        configuration = k8s.Configuration()
        in_cluster = kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST")
        where = "in-cluster service account" if in_cluster else kubeconfig or "~/.kube/config"
        if kubeconfig and not os.path.isfile(kubeconfig):
            raise UserError("--kubeconfig", f"{kubeconfig} is not a file", "pass the path of a kubeconfig file")
        try:
            if in_cluster:
                k8s_config.load_incluster_config(client_configuration=configuration)
            else:
                k8s_config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)
        except Exception as err:  # noqa: BLE001 - everything here comes from the user's file
            detail = " ".join(str(err).split()) or type(err).__name__
            raise UserError(
                "--kubeconfig",
                f"{where} cannot be used: {detail}",
                "pass a working kubeconfig with --kubeconfig (or $KUBECONFIG) and --context",
            ) from None
        if backoff.attempts == 1:  # fail fast: no retry by urllib3 either
            configuration.retries = 0
        configuration.connection_pool_maxsize = CONNECTIONS
        return cls(k8s.ApiClient(configuration), backoff)

    @classmethod
    def from_args(cls, args: argparse.Namespace, backoff: Backoff = Backoff()) -> Client:
        return cls.connect(args.kubeconfig, args.context, backoff)

    # -- raw calls ---------------------------------------------------------------------------

    def call(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, Any] | None = None,
        body: Any = None,
        content_type: str | None = None,
        project: Callable[[Any], T] | None = None,
    ) -> Any:
        """One HTTP call, decoded JSON back; transient failures retried. With `project`, `project`
        of simdjson's lazy view of the answer (as the informers parse): only what it reads is built."""
        with self._counting:
            self.requests += 1
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        params = [(k, v) for k, v in (query or {}).items() if v is not None]

        def once() -> Any:
            answer = self.api_client.call_api(
                path,
                method,
                query_params=params,
                header_params=headers,
                body=body,
                response_type="object",
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
                _request_timeout=REQUEST_TIMEOUT,
                _preload_content=project is None,
            )
            if project is None:
                return answer
            try:
                return answer.data
            finally:
                answer.release_conn()

        try:
            result = with_backoff(once, self.backoff)
        except ApiException as err:
            err.request = f"{method} {path}"  # for `failure_line`
            raise
        if project is not None:
            result = simdjson.Parser().parse(result) if result else None
        if method in WRITES and isinstance(result, dict | simdjson.Object):
            for written in self.on_written:
                written(result)
        return result if project is None else project(result)

    def server_version(self) -> tuple[int, int, str]:
        """(major, minor, gitVersion) of the API server; minor stripped of a vendor '+'."""
        info = self.call("GET", "/version")
        digits = lambda s: int("".join(c for c in s if c.isdigit()) or 0)  # noqa: E731
        return digits(info["major"]), digits(info["minor"]), info["gitVersion"]

    # -- discovery ---------------------------------------------------------------------------

    def resource(self, api_version: str, kind: str) -> Resource:
        """Where `kind` of `api_version` is served (one discovery request per group/version)."""
        key = (api_version, kind)
        if key not in self._resources and api_version not in self._discovered:
            path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
            try:
                served = self.call("GET", path).get("resources", [])
            except ApiException as err:
                if err.status != 404:
                    raise
                served = []  # the group/version is not served (yet): a CRD being established
            for item in served:
                if "/" not in item["name"]:  # skip subresources such as pods/status
                    self._resources[(api_version, item["kind"])] = Resource(
                        api_version, item["kind"], item["name"], item["namespaced"]
                    )
            if served:
                self._discovered.add(api_version)
        try:
            return self._resources[key]
        except KeyError:
            raise NotServed(f"the API server does not serve {kind} in {api_version}") from None

    def forget(self, api_version: str) -> None:
        """Drop cached discovery of a group/version (after creating or deleting its CRD)."""
        self._discovered.discard(api_version)
        self._resources = {k: v for k, v in self._resources.items() if k[0] != api_version}

    def _path(self, api_version: str, kind: str, name: str | None, namespace: str | None, subresource: str = "") -> str:
        return self.resource(api_version, kind).path(name, namespace, subresource)

    # -- objects -----------------------------------------------------------------------------

    def apply(self, obj: dict, *, field_manager: str, force: bool = False, subresource: str = "", dry_run: bool = False) -> dict:
        """Server-side apply `obj` (a full or partial manifest) as `field_manager`.

        The fields `obj` contains become owned by `field_manager`; fields it owned before and
        `obj` leaves out are removed unless another manager also owns them. `force` takes
        fields over from other managers instead of failing with 409. `dry_run` returns the
        object as it would be stored (defaults filled in) and stores nothing.
        """
        meta = obj["metadata"]
        path = self._path(obj["apiVersion"], obj["kind"], meta["name"], meta.get("namespace"), subresource)
        return self.call(
            "PATCH",
            path,
            body=obj,
            content_type="application/apply-patch+yaml",
            query={"fieldManager": field_manager, "force": "true" if force else None, "dryRun": "All" if dry_run else None},
        )

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict | None:
        """The object, or None when it does not exist."""
        try:
            return self.call("GET", self._path(api_version, kind, name, namespace))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        all_namespaces: bool = False,
        project: Callable[[Any], Any] | None = None,
    ) -> list:
        """Every matching object (in every namespace with `all_namespaces`), fetched in pages of
        PAGE_SIZE; with `project`, what it returns for each, None left out (`pages`)."""
        selected = {"label_selector": label_selector, "field_selector": field_selector, "all_namespaces": all_namespaces}
        pages = self.pages(api_version, kind, namespace, **selected, project=project or plain)
        return [item for page in pages for item in page if item is not None]

    def pages(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        all_namespaces: bool = False,
        project: Callable[[Any], Any] | None = None,
        page_size: int | None = None,
    ) -> Iterator[list]:
        """`list`'s objects a page at a time, each `project(obj)` of simdjson's lazy view of it (as
        `call`; by default the whole object, `plain`): a caller that keeps a little of each object
        holds one page, not the whole list (10,000 nodes are about 300 MB as Python objects), and
        builds only what it reads; a smaller `page_size` (default `PAGE_SIZE`) holds less at once."""
        path = self.resource(api_version, kind).path(None, namespace, all_namespaces=all_namespaces)
        each = project or plain

        def page_of(view) -> tuple[list, str | None]:
            return [each(obj) for obj in view.get("items") or ()], (view.get("metadata") or {}).get("continue")

        token = None
        while True:
            query = {
                "labelSelector": label_selector,
                "fieldSelector": field_selector,
                "limit": page_size or PAGE_SIZE,
                "continue": token,
            }
            items, token = self.call("GET", path, query=query, project=page_of)
            yield items
            if not token:
                return

    def patch(
        self,
        api_version: str,
        kind: str,
        name: str,
        patch: Any,
        *,
        namespace: str | None = None,
        patch_type: str = "merge",
        field_manager: str | None = None,
        subresource: str = "",
        project: Callable[[Any], T] | None = None,
    ) -> Any:
        """Patch with `patch_type` "merge" (RFC 7386), "json" (RFC 6902) or "strategic" (`project`: as `call`)."""
        content_type = {
            "merge": "application/merge-patch+json",
            "json": "application/json-patch+json",
            "strategic": "application/strategic-merge-patch+json",
        }[patch_type]
        return self.call(
            "PATCH",
            self._path(api_version, kind, name, namespace, subresource),
            body=patch,
            content_type=content_type,
            query={"fieldManager": field_manager},
            project=project,
        )

    def delete(
        self,
        api_version: str,
        kind: str,
        name: str,
        namespace: str | None = None,
        *,
        uid: str | None = None,
        resource_version: str | None = None,
        propagation: str = "Background",
    ) -> bool:
        """Delete; False when it was already gone.

        `uid`/`resource_version` are preconditions: the server refuses (409) to delete another
        object of the same name, or one changed since it was read.
        """
        preconditions = {k: v for k, v in (("uid", uid), ("resourceVersion", resource_version)) if v}
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation}
        if preconditions:
            body["preconditions"] = preconditions
        try:
            self.call("DELETE", self._path(api_version, kind, name, namespace), body=body, project=bool)
            return True
        except ApiException as err:
            if err.status == 404:
                return False
            raise

    def wait_deleted(
        self,
        api_version: str,
        kind: str,
        name: str,
        namespace: str | None = None,
        *,
        uid: str | None = None,
        timeout: float = 120.0,
        interval: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Return once the object (with `uid`, if given) is gone; a UserError after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            current = self.get(api_version, kind, name, namespace)
            if current is None or (uid and current["metadata"].get("uid") != uid):
                return
            if time.monotonic() >= deadline:
                finalizers = current["metadata"].get("finalizers") or []
                raise UserError(
                    f"{kind} {name}",
                    f"still exists after {timeout:g}s" + (f" (finalizers: {', '.join(finalizers)})" if finalizers else ""),
                    "find what holds it (kubectl describe), then run the command again",
                )
            sleep(interval)
