"""`metax-operator nodes`: the GPU side of the cluster, one row per GPU node.

What an administrator wants before submitting work: each node's gpu-device mode and sGPU QoS
policy (its labels), allocatable `metax-tech.com/gpu`, `sgpu` and `vfio-gpu`, the VF count
(gpu-label's `metax-tech.com/gpu.vfnum`), the driver pod's revision and whether it is the current
one of its DaemonSet (the driver's own, or its driver pool's), the MXMACA versions its maca pod
deploys, and the GPUs vfio-manager bound to vfio-pci (its node annotation). Below the table, the
runner's `WorkloadsValid` condition when it reports problems.

Four requests whatever the cluster's size, none per node: a LIST of the GPU nodes, a LIST of the
release's driver and maca pods (one set-based label selector), a LIST of the driver's
ControllerRevisions (the current revision is the newest one, as the staged rollout defines it; the
CR's status can lag it), and a GET of the CR. `build` is the pure part.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import asdict, dataclass, field

import urllib3
from kubernetes.client.exceptions import ApiException

from metax_operator import contract, workloads
from metax_operator.conditions import CrCondition
from metax_operator.contract import COMPONENT_LABEL, DRIVER_DAEMONSET, POOL_DAEMONSET_PREFIX, POOL_LABEL, REVISION_LABEL
from metax_operator.errors import UserError
from metax_operator.lookup import lookup
from metax_operator.runtime.kube import Client, add_arguments

POD_SELECTOR = f"{COMPONENT_LABEL} in (driver,maca)"
REVISION_SELECTOR = f"{COMPONENT_LABEL}=driver"
DEFAULT_NAMESPACE = "metax-operator"


@dataclass
class NodeRow:
    name: str
    mode: str
    qos_policy: str
    allocatable: dict[str, str]
    vfnum: str
    driver_revision: str
    driver_current: bool | None  # None: no driver pod on the node
    maca_versions: list[str] = field(default_factory=list)
    maca_ready: bool | None = None  # None: no maca pod on the node
    vfio_bound: list[str] = field(default_factory=list)
    vfio_failed: list[str] = field(default_factory=list)


@dataclass
class View:
    nodes: list[NodeRow]
    current_driver_revision: str
    problems: list[str]  # the runner's WorkloadsValid condition, one problem a line


def build(nodes: list[dict], pods: list[dict], revisions: list[dict], cr: dict | None) -> View:
    """The view from what the four requests returned (pure)."""
    newest: dict[str | None, dict] = {}  # each driver DaemonSet's (by pool: None the driver's own) newest revision
    for r in revisions:
        for owner in lookup(r, "metadata", "ownerReferences") or []:
            name = owner.get("name") or ""
            if owner.get("kind") != "DaemonSet" or not (name == DRIVER_DAEMONSET or name.startswith(POOL_DAEMONSET_PREFIX)):
                continue
            pool = name.removeprefix(POOL_DAEMONSET_PREFIX) if name != DRIVER_DAEMONSET else None
            if int(r.get("revision") or 0) >= int(newest.get(pool, {}).get("revision") or 0):
                newest[pool] = r
    currents = {pool: lookup(r, "metadata", "labels", REVISION_LABEL) or "" for pool, r in newest.items()}
    current = currents.get(None, "")
    by_node: dict[tuple[str, str], dict] = {}
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp"):
            continue
        component = (pod["metadata"].get("labels") or {}).get(COMPONENT_LABEL, "")
        by_node[(component, (pod.get("spec") or {}).get("nodeName") or "")] = pod
    rows = []
    for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
        driver = by_node.get(("driver", node["metadata"]["name"]))
        pool = lookup(driver, "metadata", "labels", POOL_LABEL)  # a driver pool's pod carries its pool
        rows.append(_row(node, driver, by_node.get(("maca", node["metadata"]["name"])), currents.get(pool, "")))
    condition = next((c for c in lookup(cr, "status", "conditions") or [] if c.get("type") == CrCondition.WORKLOADS_VALID), None)
    problems = condition["message"].splitlines() if condition and condition.get("status") == "False" else []
    return View(rows, current, problems)


def _row(node: dict, driver: dict | None, maca: dict | None, current: str) -> NodeRow:
    meta = node["metadata"]
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    revision = lookup(driver, "metadata", "labels", REVISION_LABEL) or ""
    bound, failed = workloads.vfio_gpus(annotations.get(contract.VFIO_ANNOTATION))
    mode = labels.get(contract.MODE_LABEL, workloads.DEFAULT_MODE)
    return NodeRow(
        name=meta["name"],
        mode=mode,
        qos_policy=labels.get(contract.QOS_LABEL, workloads.DEFAULT_QOS if mode == "sgpu" else ""),
        allocatable={r: allocatable.get(r, "0") for r in workloads.GPU_RESOURCES},
        vfnum=labels.get(contract.GPU_VFNUM_LABEL, ""),
        driver_revision=revision,
        driver_current=(revision == current) if driver else None,
        maca_versions=workloads.deployed_maca_versions(
            c.get("image", "")
            for c in lookup(maca, "spec", "initContainers") or []
            if c.get("name", "").startswith(contract.MACA_PAYLOAD_PREFIX)
        ),
        maca_ready=workloads.ready(maca) if maca else None,
        vfio_bound=bound,
        vfio_failed=failed,
    )


def render(view: View, output: str = "table") -> str:
    if output == "json":
        return json.dumps(_camel(asdict(view)), indent=2)
    header = ["NODE", "MODE", "QOS", "GPU", "SGPU", "VFIO-GPU", "VFNUM", "DRIVER", "MXMACA", "VFIO-BOUND"]
    rows = [header] + [
        [
            r.name,
            r.mode,
            r.qos_policy or "-",
            *r.allocatable.values(),
            r.vfnum or "-",
            "-" if r.driver_current is None else f"{r.driver_revision}{'' if r.driver_current else ' (old)'}",
            _maca(r),
            ",".join(r.vfio_bound) + (f" (failed: {','.join(r.vfio_failed)})" if r.vfio_failed else "") or "-",
        ]
        for r in view.nodes
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip() for row in rows]
    if not view.nodes:
        lines.append(f"(no node is labelled {contract.GPU_NODE_LABEL}=true)")
    lines.append(f"current driver revision: {view.current_driver_revision or '(no driver ControllerRevision)'}")
    if view.problems:
        lines.append(f"problems the runner reports ({CrCondition.WORKLOADS_VALID}=False):")
        lines += [f"  {p}" for p in view.problems]
    return "\n".join(lines)


def _camel(value):
    """Keys in the Kubernetes JSON style (`driver_revision` -> `driverRevision`); resource names kept."""
    if isinstance(value, dict):
        return {re.sub(r"_(.)", lambda m: m.group(1).upper(), k) if "/" not in k else k: _camel(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_camel(v) for v in value]
    return value


def _maca(row: NodeRow) -> str:
    if row.maca_ready is None:
        return "-"
    return ",".join(row.maca_versions) + ("" if row.maca_ready else " (not ready)")


def slim_node(node: dict) -> dict:
    """What `build` reads of a node (10,000 whole nodes are about 300 MB as Python objects)."""
    meta = node["metadata"]
    return {
        "metadata": {k: meta.get(k) for k in ("name", "labels", "annotations")},
        "status": {"allocatable": (node.get("status") or {}).get("allocatable")},
    }


def slim_pod(pod: dict) -> dict:
    """What `build` reads of a driver or maca pod."""
    meta, spec = pod["metadata"], pod.get("spec") or {}
    return {
        "metadata": {k: meta.get(k) for k in ("name", "labels", "deletionTimestamp")},
        "spec": {
            "nodeName": spec.get("nodeName"),
            "initContainers": [{"name": c.get("name"), "image": c.get("image")} for c in spec.get("initContainers") or ()],
        },
        "status": {"conditions": (pod.get("status") or {}).get("conditions")},
    }


def read(api: Client, namespace: str) -> View:
    """The four requests (the lists a page at a time, each object slimmed), then `build`."""
    gpu = f"{contract.GPU_NODE_LABEL}=true"
    nodes = [slim_node(n) for page in api.pages("v1", "Node", label_selector=gpu) for n in page]
    pods = [slim_pod(p) for page in api.pages("v1", "Pod", namespace, label_selector=POD_SELECTOR) for p in page]
    revisions = api.list("apps/v1", "ControllerRevision", namespace, label_selector=REVISION_SELECTOR)
    cr = api.get(contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME)
    return build(nodes, pods, revisions, cr)


def run(args: argparse.Namespace) -> int:
    api = Client.from_args(args)
    server = api.api_client.configuration.host
    try:
        view = read(api, args.namespace)
    except urllib3.exceptions.HTTPError as err:
        raise UserError(
            server,
            f"the API server does not answer ({type(err).__name__})",
            "check that the cluster is up and that --kubeconfig/--context name it",
        ) from None
    except ApiException as err:
        if err.status in (401, 403):
            raise UserError(
                server,
                f"refused the request ({err.status} {err.reason})",
                f"use credentials that may list nodes, and pods and controllerrevisions in namespace {args.namespace}",
            ) from None
        raise
    print(render(view, args.output))
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "nodes",
        help="the GPU side of the cluster per node: mode, QoS, GPUs, driver revision, MXMACA versions, vfio-bound GPUs",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "--namespace",
        "-n",
        default=os.environ.get("POD_NAMESPACE") or DEFAULT_NAMESPACE,
        help=f"the release namespace (default: $POD_NAMESPACE, else {DEFAULT_NAMESPACE})",
    )
    parser.add_argument("--output", "-o", choices=("table", "json"), default="table")
    add_arguments(parser)
    parser.set_defaults(func=run)
