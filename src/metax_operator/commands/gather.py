"""`metax-operator gather`: the support bundle, one .tar.gz to attach to a ticket.

What it holds (`PARTS`, under one directory named like the file):

- `cr.yaml`: the `cluster-operator` CR with its status and conditions;
- `events.yaml`: the events of the release namespace and those about the CR (namespace `default`);
- `daemonsets.yaml`, `controllerrevisions.yaml`, `configmaps.yaml`: the release namespace's;
- `pods.txt`: every pod of the release namespace, one line each (node, phase, ready, restarts);
  `pods.yaml`: the whole objects of the pods whose logs are gathered; `logs/POD/CONTAINER.log`
  and `CONTAINER.previous.log`: their containers' current and previous logs (each its last
  `LOG_BYTES`, all of them at most `LOG_BUDGET`): the runner's, the hook Jobs', and the
  components' on `--node`'s nodes and on the first `LOG_NODES` the rollout names (failed, timed
  out, needing a reboot, held back, cordoned, in the wave: in that order);
- `nodes.yaml`: each node's metax labels and annotations, taints, conditions, unschedulable;
- `helm-history.yaml`: the Helm release history from Helm's release Secrets, only each
  revision's name, number, status, chart version and the values it was given (decoded:
  base64, gzip, JSON); nothing else of any Secret;
- `metrics.txt`: a scrape of the runner's `/metrics` through the API server's pod proxy;
- `rollout-status.txt`, `nodes.txt`: what `metax-operator rollout status` (and `--pool NAME`
  for each driver pool) and `nodes` print;
- `manifest.json`: when, for which namespace and `--since`, and each part's outcome: a part that
  could not be read (RBAC, a node without logs) says why there, the rest is gathered anyway.

Redacted: values, environment variables and ConfigMap keys whose name says password, token,
secret or credential (`REDACTED`); no Secret is read but Helm's release records. Objects are shown
without `metadata.managedFields`, as `kubectl get -o yaml` shows them.
`--since` bounds the logs and the events.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import gzip
import io
import json
import os
import re
import tarfile
import time
from collections.abc import Callable

import yaml
from kubernetes.client.exceptions import ApiException

from metax_operator import contract
from metax_operator.commands import nodes as nodes_cmd
from metax_operator.commands import rollout_admin as admin
from metax_operator.conditions import parse_time, rfc3339
from metax_operator.errors import UserError
from metax_operator.rollout.status import UpgradeStatus
from metax_operator.rollout.target import targets
from metax_operator.runtime.api_failures import failure_line
from metax_operator.runtime.kube import REQUEST_TIMEOUT, Client, add_arguments

PARTS = (
    "cr.yaml",
    "events.yaml",
    "daemonsets.yaml",
    "controllerrevisions.yaml",
    "configmaps.yaml",
    "pods.txt",
    "pods.yaml",
    "nodes.yaml",
    "helm-history.yaml",
    "metrics.txt",
    "rollout-status.txt",
    "nodes.txt",
)
#: The tail of each container log kept (the API server's `limitBytes`).
LOG_BYTES = 2 * 1024 * 1024
#: All the logs together: each request asks for at most what is left, the runner's and the hooks'
#: first, then the nodes' in `log_nodes`' order.
LOG_BUDGET = 64 * 1024 * 1024
#: The most nodes named by the rollout whose components' logs are gathered (beside `--node`'s): a
#: wave can name a whole step (10% of 10,000 nodes is 1,000), each node adding its pods' logs.
LOG_NODES = 20
#: Keys whose values are replaced by `REDACTED` wherever the bundle shows values.
SECRET_KEY = re.compile(r"password|passwd|token|secret|credential|private.?key", re.I)
REDACTED = "<redacted>"
_SINCE = re.compile(r"(?:[0-9]+[smhd])+")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def since_seconds(text: str) -> int:
    """`--since`: a duration such as 30m, 2h or 1d12h, in seconds."""
    if not _SINCE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 30m, 2h or 1d")
    return sum(int(n) * _UNIT_S[u] for n, u in re.findall(r"([0-9]+)([smhd])", text))


def redact(value):
    """`value` with every mapping entry whose key names a secret replaced, and every
    environment variable (`{name, value}`) whose name does."""
    if isinstance(value, dict):
        if isinstance(value.get("name"), str) and "value" in value and SECRET_KEY.search(value["name"]):
            return {**value, "value": REDACTED}
        return {k: REDACTED if isinstance(k, str) and SECRET_KEY.search(k) else redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def shown(obj: dict) -> dict:
    """An object as the bundle shows it: redacted, without `metadata.managedFields` (as `kubectl get
    -o yaml` leaves them out: a third of a small object's size, of no use to a ticket)."""
    meta = obj.get("metadata")
    if isinstance(meta, dict) and "managedFields" in meta:
        obj = {**obj, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}
    return redact(obj)


def helm_release(secret: dict) -> dict | None:
    """What the bundle keeps of a Helm release Secret (`helm.sh/release.v1`): name, revision,
    status, chart version and values; None when it is not a metax-operator release."""
    packed = (secret.get("data") or {}).get("release")
    if not packed:
        return None
    raw = base64.b64decode(base64.b64decode(packed))
    release = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    chart = (release.get("chart") or {}).get("metadata") or {}
    if chart.get("name") != "metax-operator":
        return None
    return {
        "name": release.get("name"),
        "revision": release.get("version"),
        "status": (release.get("info") or {}).get("status"),
        "chartVersion": chart.get("version"),
        "values": redact(release.get("config") or {}),
    }


def node_summary(node: dict) -> dict:
    """A node as the bundle keeps it: the metax labels and annotations, taints, conditions."""
    meta, spec = node.get("metadata") or {}, node.get("spec") or {}
    metax = lambda pairs: {k: v for k, v in (pairs or {}).items() if "metax" in k}  # noqa: E731
    conditions = [
        {k: c.get(k) for k in ("type", "status", "reason", "message", "lastTransitionTime")}
        for c in (node.get("status") or {}).get("conditions") or ()
    ]
    return {
        "name": meta.get("name"),
        "labels": metax(meta.get("labels")),
        "annotations": metax(meta.get("annotations")),
        "unschedulable": bool(spec.get("unschedulable")),
        "taints": spec.get("taints") or [],
        "conditions": conditions,
    }


def pod_line(pod: dict) -> str:
    meta, status = pod["metadata"], pod.get("status") or {}
    containers = status.get("containerStatuses") or []
    ready = sum(1 for c in containers if c.get("ready"))
    restarts = sum(c.get("restartCount") or 0 for c in containers)
    node = (pod.get("spec") or {}).get("nodeName") or "-"
    return f"{meta['name']}  {node}  {status.get('phase', '-')}  ready {ready}/{len(containers)}  restarts {restarts}"


def named_nodes(cr: dict | None) -> list[str]:
    """The nodes the rollouts' statuses name (the driver DaemonSet's, then each pool's), the most
    telling first: failed, timed out, needing a reboot, held back, cordoned by the runner, in the
    wave; each once."""
    cr = cr or {}
    resumes = [UpgradeStatus.from_json(t.stored(cr.get("status"))).resume for t in targets(cr.get("spec") or {})]
    ordered = [
        *(n for r in resumes for n in r.failed.names),
        *(n for r in resumes for n in sorted(r.timed_out_nodes)),
        *(n for r in resumes for n in r.need_reboot.names),
        *(n for r in resumes for n in r.held.names),
        *(n for r in resumes for n in r.cordoned.names),
        *(n for r in resumes for n in sorted(r.wave)),
    ]
    return list(dict.fromkeys(ordered))


def rollout_status(cr: dict, leader: str | None, namespace: str) -> str:
    """What `metax-operator rollout status` prints, then with `--pool` for each driver pool."""
    shown = [admin.render(cr, "table", leader, namespace)]
    shown += [
        f"--pool {t.pool}\n" + admin.render(cr, "table", leader, namespace, target=t)
        for t in targets(cr.get("spec") or {})
        if t.pool
    ]
    return "\n\n".join(shown) + "\n"


def log_nodes(cr: dict | None, extra: list[str]) -> tuple[list[str], int]:
    """The nodes whose components' logs are gathered, in order: `extra` (`--node`), then the first
    `LOG_NODES` the rollout names; and how many more it names."""
    named = [n for n in named_nodes(cr) if n not in extra]
    return [*dict.fromkeys(extra), *named[:LOG_NODES]], max(0, len(named) - LOG_NODES)


def log_rank(pod: dict, nodes: list[str]) -> int | None:
    """Where the pod's logs come in the bundle: the runner's and the hook Jobs' first (0), then
    those on `nodes` in their order; None: not gathered."""
    labels = pod["metadata"].get("labels") or {}
    if labels.get(contract.COMPONENT_LABEL) == "runner" or contract.HOOK_LABEL in labels:
        return 0
    node = (pod.get("spec") or {}).get("nodeName")
    return nodes.index(node) + 1 if node in nodes else None


def _recent(event: dict, after: float) -> bool:
    when = event.get("lastTimestamp") or event.get("eventTime") or (event.get("metadata") or {}).get("creationTimestamp")
    stamp = parse_time(when)
    return stamp is None or stamp >= after


class Bundle:
    """The files of the bundle by name, and each part's outcome for the manifest."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.outcomes: dict[str, str] = {}
        self.notes: dict = {}  # more for the manifest

    def part(self, name: str, produce: Callable[[], str | bytes]) -> None:
        try:
            content = produce()
        except (ApiException, UserError, OSError, ValueError) as err:
            self.outcomes[name] = f"not gathered: {failure_line(err) if isinstance(err, ApiException) else err}"
            return
        self.files[name] = content.encode() if isinstance(content, str) else content
        self.outcomes[name] = "ok"


def _yaml(value) -> str:
    """YAML by libyaml's emitter (a 10,000-node list takes it about a second, PyYAML's own a minute)."""
    return yaml.dump(value, Dumper=yaml.CSafeDumper, sort_keys=False, allow_unicode=True, width=120)


class Gatherer:
    def __init__(self, api: Client, namespace: str, since: int | None, extra_nodes: list[str], now: float):
        self.api, self.namespace, self.since, self.now = api, namespace, since, now
        self.extra_nodes = extra_nodes
        self.log_left = LOG_BUDGET

    def raw(self, path: str, query: list[tuple[str, str]] = ()) -> bytes:
        """A GET whose answer is not JSON (logs, a scrape), as bytes."""
        try:
            answer = self.api.api_client.call_api(
                path,
                "GET",
                query_params=list(query),
                auth_settings=["BearerToken"],
                _preload_content=False,
                _return_http_data_only=True,
                _request_timeout=REQUEST_TIMEOUT,
            )
        except ApiException as err:
            err.request = f"GET {path}"
            raise
        return answer.data

    def collect(self) -> Bundle:
        ns, api, out = self.namespace, self.api, Bundle()
        cr = self.cr(out)
        out.part("events.yaml", lambda: _yaml(self.events()))
        for name, api_version, kind in (
            ("daemonsets.yaml", "apps/v1", "DaemonSet"),
            ("controllerrevisions.yaml", "apps/v1", "ControllerRevision"),
            ("configmaps.yaml", "v1", "ConfigMap"),
        ):
            out.part(name, lambda api_version=api_version, kind=kind: _yaml([shown(o) for o in api.list(api_version, kind, ns)]))
        nodes, left_out = log_nodes(cr, self.extra_nodes)
        out.notes["logNodes"] = {"gathered": nodes, "notGathered": left_out}
        ranked: list[tuple[int, dict]] = []

        def pod_table() -> str:
            """A line per pod; of the whole objects, only those whose logs are gathered are kept."""
            lines = []
            for page in api.pages("v1", "Pod", ns):
                for pod in page:
                    lines.append(pod_line(pod) + "\n")
                    if (rank := log_rank(pod, nodes)) is not None:
                        ranked.append((rank, pod))
            return "".join(lines)

        out.part("pods.txt", pod_table)
        chosen = [p for _, p in sorted(ranked, key=lambda pair: pair[0])]
        out.part("pods.yaml", lambda: _yaml([shown(p) for p in chosen]))
        for pod in chosen:
            self.logs(pod, out)
        out.part("nodes.yaml", lambda: _yaml([node_summary(n) for page in api.pages("v1", "Node") for n in page]))
        out.part("helm-history.yaml", lambda: _yaml(self.helm_history()))
        out.part("metrics.txt", lambda: self.metrics(chosen))
        if cr is not None:
            leader = admin.no_leader(api, ns, contract.RUNNER_LEASE, self.now)
            out.part("rollout-status.txt", lambda: rollout_status(cr, leader, ns))
        else:
            out.outcomes["rollout-status.txt"] = out.outcomes["cr.yaml"]
        out.part("nodes.txt", lambda: nodes_cmd.render(nodes_cmd.read(api, ns), "table") + "\n")
        return out

    def cr(self, out: Bundle) -> dict | None:
        """The CR (None when it cannot be read), its part written."""
        found: list[dict] = []

        def produce() -> str:
            cr = self.api.get(contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME)
            if cr is None:
                raise ValueError(f"{contract.CR_PLURAL}/{contract.CR_NAME} does not exist")
            found.append(cr)
            return _yaml(shown(cr))

        out.part("cr.yaml", produce)
        return found[0] if found else None

    def events(self) -> list[dict]:
        about_cr = f"involvedObject.kind={contract.CR_KIND},involvedObject.name={contract.CR_NAME}"
        after = self.now - self.since if self.since else 0.0
        return [
            shown(e)
            for namespace, selector in ((self.namespace, None), ("default", about_cr))
            for page in self.api.pages("v1", "Event", namespace, field_selector=selector)
            for e in page
            if _recent(e, after)
        ]

    def logs(self, pod: dict, out: Bundle) -> None:
        name, spec = pod["metadata"]["name"], pod.get("spec") or {}
        path = f"/api/v1/namespaces/{self.namespace}/pods/{name}/log"
        for container in [c["name"] for c in (spec.get("initContainers") or []) + (spec.get("containers") or [])]:
            query = [("container", container)]
            if self.since:
                query.append(("sinceSeconds", str(self.since)))
            for suffix, extra in (("", []), (".previous", [("previous", "true")])):
                out.part(f"logs/{name}/{container}{suffix}.log", lambda q=query + extra: self.log(path, q))

    def log(self, path: str, query: list[tuple[str, str]]) -> bytes:
        """One log's tail, at most `LOG_BYTES` and what is left of `LOG_BUDGET`."""
        if self.log_left <= 0:
            raise ValueError(f"the bundle's {LOG_BUDGET // 2**20} MiB for logs are spent (--node NAME puts a node's first)")
        content = self.raw(path, [*query, ("limitBytes", str(min(LOG_BYTES, self.log_left)))])
        self.log_left -= len(content)
        return content

    def helm_history(self) -> list[dict]:
        secrets = self.api.list(
            "v1", "Secret", self.namespace, label_selector="owner=helm", field_selector="type=helm.sh/release.v1"
        )
        releases = [r for r in (helm_release(s) for s in secrets) if r is not None]
        return sorted(releases, key=lambda r: (r["name"] or "", r["revision"] or 0))

    def metrics(self, pods: list[dict]) -> bytes:
        """A scrape of the first running runner among `pods`."""
        runners = [
            p
            for p in pods
            if (p["metadata"].get("labels") or {}).get(contract.COMPONENT_LABEL) == "runner"
            and (p.get("status") or {}).get("phase") == "Running"
        ]
        if not runners:
            raise ValueError("no runner pod is running (the metrics are served in runner.mode: deployment)")
        pod = runners[0]
        ports = [p for c in pod["spec"]["containers"] for p in c.get("ports") or () if p.get("name") == "health"]
        if not ports:
            raise ValueError(f"pod {pod['metadata']['name']} has no port named health")
        target = f"{pod['metadata']['name']}:{ports[0]['containerPort']}"
        return self.raw(f"/api/v1/namespaces/{self.namespace}/pods/{target}/proxy/metrics")


def write(bundle: Bundle, output: str, meta: dict) -> None:
    """The bundle as a gzipped tarball at `output`, under one directory named like the file."""
    top = os.path.basename(output).removesuffix(".tar.gz").removesuffix(".tgz") or "metax-operator-gather"
    manifest = json.dumps({**meta, **bundle.notes, "parts": bundle.outcomes}, indent=2).encode()
    with tarfile.open(output, "w:gz") as archive:
        for name, content in {"manifest.json": manifest, **bundle.files}.items():
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mtime, info.mode = len(content), int(meta["createdUnix"]), 0o644
            archive.addfile(info, io.BytesIO(content))


def run(args: argparse.Namespace) -> int:
    api = Client.from_args(args)
    api.server_version()  # an API server that cannot be reached is one error line now, not one per part
    now = time.time()
    stamp = dt.datetime.fromtimestamp(now, dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    output = args.output or f"metax-operator-gather-{stamp}.tar.gz"
    try:
        bundle = Gatherer(api, args.namespace, args.since, args.node, now).collect()
    except ApiException as err:
        raise UserError("API server", failure_line(err), "check --kubeconfig/--context and your permissions") from None
    meta = {"created": rfc3339(now), "createdUnix": int(now), "namespace": args.namespace, "sinceSeconds": args.since}
    try:
        write(bundle, output, meta)
    except OSError as err:
        raise UserError("--output", f"cannot write {output}: {err.strerror}", "pass a writable path") from None
    missing = sorted(name for name, outcome in bundle.outcomes.items() if outcome != "ok")
    print(f"wrote {output} ({os.path.getsize(output):,} bytes, {len(bundle.files)} files)")
    if missing:
        listed = ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else "")
        print(f"not gathered ({len(missing)}, the reasons in manifest.json): {listed}")
    left_out = bundle.notes.get("logNodes", {}).get("notGathered")
    if left_out:
        print(f"logs of {left_out} more nodes the rollout names not gathered (the first {LOG_NODES} are): --node NAME adds one")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "gather",
        help="write a support bundle (.tar.gz): the CR, events, workloads, logs, nodes, Helm history, metrics",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "--output", "-o", metavar="FILE", help="the tarball to write (default: metax-operator-gather-TIME.tar.gz)"
    )
    parser.add_argument(
        "--since", type=since_seconds, metavar="DURATION", help="only logs and events of the last DURATION (30m, 2h, 1d)"
    )
    parser.add_argument(
        "--namespace",
        "-n",
        default=os.environ.get("POD_NAMESPACE") or nodes_cmd.DEFAULT_NAMESPACE,
        help=f"the release namespace (default: $POD_NAMESPACE, else {nodes_cmd.DEFAULT_NAMESPACE})",
    )
    parser.add_argument(
        "--node", action="append", default=[], metavar="NAME", help="also the logs of the pods on NAME (repeatable)"
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
