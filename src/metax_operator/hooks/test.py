"""`metax-operator test`: what `helm test` runs to check an install (seed §3.2.11).

Checks, each failure printed as one line naming what is wrong and where, exit 1 on any:
- the `cluster-operator` CR exists and its spec passes the validation rules;
- every DaemonSet the CR enables has all desired pods ready (not-ready nodes named);
- `driver-config` and `metax-vfio-config` parse (the same parsers the runner uses);
- the exporter Service answers on /metrics, when the exporter is enabled;
- every GPU node (`metax-tech.com/gpu.installed=true`) shows allocatable `metax-tech.com/gpu`
  (or `metax-tech.com/sgpu` in sGPU mode, seed §3.2.10, or `metax-tech.com/vfio-gpu` when
  vfio-manager bound its GPUs to vfio-pci for virtual machines, seed §3.2.6.1): the seed's proof
  that every component works on it;
- the workload rules (`workloads.problems`, the runner's `WorkloadsValid` condition in the same
  words): sGPU mode and QoS labels, sGPU's prerequisites, the GPU pods' `METAX_MACA_VERSION`;
- the runner's last pass did not fail (the CR's `RunnerHealthy` condition is not False: a runner
  whose RBAC was narrowed stalls a rollout without any other sign here).
The component list comes from the CR, not the values: the CR is what the runner applies.
"""

from __future__ import annotations

import argparse
import http.client
import sys

from metax_operator import contract, workloads
from metax_operator.chart.validation import configmap_problems, validate_cr_spec
from metax_operator.conditions import CrCondition
from metax_operator.contract import (
    COMPONENT_LABEL,
    CONFIGMAP_KEYS,
    CONFIGMAPS,
    DAEMONSETS,
    EXPORTER_SERVICE,
    GPU_NODE_LABEL,
    GPU_RESOURCE,
    LIVE_PODS,
    SGPU_RESOURCE,
    VFIO_RESOURCE,
)
from metax_operator.errors import UserError, UserErrors
from metax_operator.hooks import common
from metax_operator.runtime import kube

GPU_RESOURCES = (GPU_RESOURCE, SGPU_RESOURCE, VFIO_RESOURCE)
#: Node names listed per failing DaemonSet before "and N more".
SHOWN_NODES = 5


def check_cr(cr: dict | None) -> list[str]:
    where = f"{contract.CR_KIND} {contract.CR_NAME}"
    if cr is None:
        return [f"{where}: not found; run `helm upgrade` again (the bootstrap hook creates it)"]
    try:
        validate_cr_spec(cr.get("spec") or {})
    except UserErrors as errs:
        return [f"{where}: {e}" for e in errs.errors]
    except UserError as err:
        return [f"{where}: {err}"]
    return []


def check_runner(cr: dict) -> list[str]:
    conditions = (cr.get("status") or {}).get("conditions") or []
    runner = next((c for c in conditions if c.get("type") == CrCondition.RUNNER_HEALTHY), None)
    if runner is None or runner.get("status") != "False":
        return []
    what = f"{contract.CR_KIND} {contract.CR_NAME}: {CrCondition.RUNNER_HEALTHY}=False"
    return [f"{what} ({runner.get('reason')}): {runner.get('message')}"]


def check_daemonset(namespace: str, name: str, ds: dict | None, pods: list[dict]) -> list[str]:
    where = f"DaemonSet {namespace}/{name}"
    if ds is None:
        return [f"{where}: not found, though the CR enables it"]
    status = ds.get("status") or {}
    desired, ready = status.get("desiredNumberScheduled", 0), status.get("numberReady", 0)
    if desired == ready:
        return []
    not_ready = sorted(p["spec"].get("nodeName") or p["metadata"]["name"] for p in pods if not _ready(p))
    shown = ", ".join(not_ready[:SHOWN_NODES])
    more = f" and {len(not_ready) - SHOWN_NODES} more" if len(not_ready) > SHOWN_NODES else ""
    return [f"{where}: {ready} of {desired} pods ready" + (f" (not ready on {shown}{more})" if shown else "")]


def _ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions") or [])


def check_configmap(namespace: str, name: str, cm: dict | None) -> list[str]:
    where = f"ConfigMap {namespace}/{name}"
    if cm is None:
        return [f"{where}: not found"]
    return [f"{where}: {problem}" for problem in configmap_problems(name, cm.get("data"))]


def check_gpu_nodes(nodes: list[dict]) -> list[str]:
    gpu_nodes = common.gpu_nodes(nodes)
    if not gpu_nodes:
        return [f"nodes: none is labelled {GPU_NODE_LABEL}=true (gpu-label found no MetaX GPU)"]
    lines = []
    for node in sorted(gpu_nodes, key=lambda n: n["metadata"]["name"]):
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        if not any(_quantity(allocatable.get(r, "0")) > 0 for r in GPU_RESOURCES):
            lines.append(f"node {node['metadata']['name']}: no allocatable {GPU_RESOURCE} (a component is not working there)")
    return lines


def check_workloads(spec: dict, enabled: list[str], nodes: list[dict], pods: list[dict]) -> list[str]:
    return [
        str(p)
        for p in workloads.problems_of_objects(
            nodes,
            pods,
            runtime_deployed="runtime" in enabled,
            maca_images=workloads.payload_images(spec) if "maca" in enabled else None,
        )
    ]


def _quantity(text: str) -> int:
    return int(text) if str(text).isdigit() else 0


def check_exporter(namespace: str, service: dict | None, timeout: float = 5) -> list[str]:
    where = f"Service {namespace}/{EXPORTER_SERVICE}"
    if service is None:
        return [f"{where}: not found, though the exporter is enabled"]
    spec = service["spec"]
    if spec.get("type") == "ExternalName":
        host, port = spec["externalName"], 8000
    else:
        host, port = f"{EXPORTER_SERVICE}.{namespace}.svc", spec["ports"][0]["port"]
    return check_http(where, host, port, timeout)


def check_http(where: str, host: str, port: int, timeout: float) -> list[str]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/metrics")
        status = conn.getresponse().status
    except OSError as err:
        return [f"{where}: http://{host}:{port}/metrics does not answer ({err})"]
    finally:
        conn.close()
    return [] if status == 200 else [f"{where}: http://{host}:{port}/metrics answered {status}"]


def failures(client: kube.Client, namespace: str) -> list[str]:
    cr = client.get(contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME)
    lines = check_cr(cr)
    if cr is None:
        return lines
    lines += check_runner(cr)
    spec = cr.get("spec") or {}
    enabled = [key for key in DAEMONSETS if (spec.get(key) or {}).get("deploy")]
    for key in enabled:
        name = DAEMONSETS[key]
        ds = client.get("apps/v1", "DaemonSet", name, namespace)
        pods = client.list("v1", "Pod", namespace, label_selector=f"{COMPONENT_LABEL}={key}")
        lines += check_daemonset(namespace, name, ds, pods)
    readers = {key.configmap: key.component for key in CONFIGMAP_KEYS}
    for name in CONFIGMAPS:
        if readers[name] in enabled:
            lines += check_configmap(namespace, name, client.get("v1", "ConfigMap", name, namespace))
    if "exporter" in enabled:
        lines += check_exporter(namespace, client.get("v1", "Service", EXPORTER_SERVICE, namespace))
    nodes = client.list("v1", "Node")
    if "gpuDevice" in enabled:
        lines += check_gpu_nodes(nodes)
    pods = client.list("v1", "Pod", field_selector=LIVE_PODS, all_namespaces=True)
    lines += check_workloads(spec, enabled, nodes, pods)
    return lines


def run(args: argparse.Namespace) -> int:
    lines = failures(kube.Client.from_args(args), args.namespace)
    for line in lines:
        print(f"FAIL {line}", file=sys.stderr)
    if lines:
        return 1
    print("test: the install is healthy")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("test", help="check the install (helm test)", description=__doc__.splitlines()[0])
    common.add_api_arguments(parser)
    parser.set_defaults(func=run)
