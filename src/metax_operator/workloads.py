"""The workload side of the stack as rules: what administrators set on nodes and users set on pods
(sGPU mode and QoS policy labels, GPU resources, `METAX_MACA_VERSION`, vfio-bound GPUs), and the
checks of those settings against what the release deploys.

Pure: every function takes plain data (node labels, the pods' environment, the spec's switches)
and returns values or `UserError`s. The runner (`runtime/workload_check.py`), `helm test` (`hooks/test.py`),
the preflight hook (`hooks/preflight.py`), `metax-operator nodes` and the tests of
docs/workloads.md all take these names and checks from here, so the same problem reads the same
everywhere.

The rules:
- `metax-tech.com/gpu-device.mode` is `native` (the default) or `sgpu`; on `sgpu` gpu-device
  registers the node's GPUs as `metax-tech.com/sgpu`, which needs the container-runtime component
  deployed and the HAMi scheduler running (HAMi: its scheduler pods, labelled
  `app.kubernetes.io/component=hami-scheduler` by HAMi's chart, Ready in any namespace).
- `metax-tech.com/gpu-device.qos-policy` is `best-effort` (the default), `fixed-share` or
  `burst-share`.
- `METAX_MACA_VERSION` on a container that requests a MetaX GPU selects the MXMACA version it
  runs with: the newest deployed version whose name (`maca-2.18.0.3`) starts with the value;
  `maca` and `maca-` are refused, and so is a value no deployed version starts with. The deployed
  versions are those of the `maca` payload images (`maca-c500:2.18.0.3-ubuntu18.04-amd64` deploys
  `maca-2.18.0.3`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from metax_operator.contract import (
    COMPONENT_LABEL,
    GPU_NODE_LABEL,
    GPU_PRODUCT_LABEL,
    GPU_RESOURCE,
    GPU_VFNUM_LABEL,
    MODE_LABEL,
    QOS_LABEL,
    RESOURCE_PREFIX,
    SGPU_RESOURCE,
    VFIO_RESOURCE,
)
from metax_operator.errors import UserError
from metax_operator.lookup import lookup

# -- names: node labels and annotations, resources, environment -----------------------------------

#: gpu-label's labels on GPU nodes.
GPU_LABELS = (GPU_NODE_LABEL, GPU_PRODUCT_LABEL, GPU_VFNUM_LABEL)

#: The values of the admin's labels that switch gpu-device per node (never removed by the operator).
MODES = ("native", "sgpu")
DEFAULT_MODE = "native"
#: The sGPU scheduling policies and what each does.
QOS_POLICIES = {
    "best-effort": "sGPUs are not limited in compute (the default)",
    "fixed-share": "each sGPU has a fixed compute quota and cannot exceed it",
    "burst-share": "each sGPU has a fixed compute quota and may use the GPU's idle compute beyond it",
}
DEFAULT_QOS = "best-effort"

#: Extended resources gpu-device advertises.
GPU_RESOURCES = (GPU_RESOURCE, SGPU_RESOURCE, VFIO_RESOURCE)
#: The MetaX PCI vendor ID (`lspci -nn` shows `[9999:4001]`: vendor 9999, device 4001).
PCI_VENDOR_ID = "9999"

#: How the checks recognise a running HAMi scheduler: a Ready pod with the label HAMi's Helm chart
#: sets on its scheduler pods.
HAMI_SCHEDULER_LABEL = (COMPONENT_LABEL, "hami-scheduler")
HAMI_SCHEDULER_SELECTOR = "=".join(HAMI_SCHEDULER_LABEL)

MACA_VERSION_ENV = "METAX_MACA_VERSION"
#: What the kubelet sets on the API server's copy of a static pod (`kubectl drain` skips those too).
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
MACA_PREFIX = "maca-"
#: Values the runtime refuses: they name no version.
MACA_REFUSED = ("maca", "maca-")

#: Nodes or pods named in one problem before "and N more".
SHOWN = 5


# -- MXMACA versions ---------------------------------------------------------------------------


def maca_version(image: str) -> str | None:
    """The MXMACA version a payload image deploys: `maca-c500:2.18.0.3-ubuntu18.04-amd64` ->
    `maca-2.18.0.3`; None when its tag does not start with a version."""
    _, _, tag = image.rpartition(":")
    match = re.match(r"\d+(?:\.\d+)*", tag) if "/" not in tag else None
    return f"{MACA_PREFIX}{match.group()}" if match else None


def version_key(version: str) -> tuple[int, ...]:
    """`maca-2.18.0.3` -> (2, 18, 0, 3): what "newest" sorts by."""
    return tuple(int(part) for part in version[len(MACA_PREFIX) :].split("."))


def payload_images(spec: Mapping) -> list[str]:
    """`maca.payload.images` of the values or of the CR spec (the same shape)."""
    return list(lookup(spec, "maca", "payload", "images") or [])


def deployed_maca_versions(images: Iterable[str]) -> list[str]:
    """The MXMACA versions of these payload images, newest first, each once."""
    versions = {v for v in map(maca_version, images) if v}
    return sorted(versions, key=version_key, reverse=True)


def choose_maca(requested: str, deployed: Sequence[str]) -> str | None:
    """The version a container with `METAX_MACA_VERSION=requested` gets: the newest deployed one
    whose name starts with it; None when the value is refused or matches nothing."""
    if requested in MACA_REFUSED:
        return None
    matches = [v for v in deployed if v.startswith(requested)]
    return max(matches, key=version_key) if matches else None


# -- what the checks read of nodes and pods ----------------------------------------------------


@dataclass(frozen=True)
class GpuPod:
    """A pod with a container that requests a MetaX resource, and the `METAX_MACA_VERSION` values
    (literal `value`s) its GPU containers set. `node` is empty while it is not scheduled.
    `workload`: what a driver rollout waits for or drains, as `kubectl drain --ignore-daemonsets`
    does: not a DaemonSet's pod (on every node, and back at once on a cordoned one) nor a static
    (mirror) pod."""

    namespace: str
    name: str
    node: str
    maca_versions: tuple[str, ...] = ()
    workload: bool = True


def requests_gpu(container: Mapping) -> bool:
    resources = container.get("resources") or {}
    return any(name.startswith(RESOURCE_PREFIX) for section in ("requests", "limits") for name in resources.get(section) or {})


def gpu_pod(obj: Mapping) -> GpuPod | None:
    """The `GpuPod` of a Pod object, or None when no container requests a MetaX resource."""
    spec = obj.get("spec") or {}
    containers = [c for key in ("containers", "initContainers") for c in spec.get(key) or () if requests_gpu(c)]
    if not containers:
        return None
    versions = tuple(
        e["value"] for c in containers for e in c.get("env") or [] if e.get("name") == MACA_VERSION_ENV and e.get("value")
    )
    meta = obj.get("metadata") or {}
    daemon = any(owner.get("kind") == "DaemonSet" for owner in meta.get("ownerReferences") or [])
    mirror = MIRROR_ANNOTATION in (meta.get("annotations") or {})
    return GpuPod(meta.get("namespace", ""), meta.get("name", ""), spec.get("nodeName") or "", versions, not (daemon or mirror))


def node_labels(obj: Mapping) -> dict[str, str]:
    """The labels of a Node object that the checks read (mode and QoS policy)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return {k: labels[k] for k in (MODE_LABEL, QOS_LABEL) if k in labels}


def ready(obj: Mapping) -> bool:
    """Whether a Pod's or a Node's `Ready` condition is True."""
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in (obj.get("status") or {}).get("conditions") or [])


def hami_running(pods: Iterable[Mapping]) -> bool:
    """Whether one of these Pod objects is a Ready HAMi scheduler."""
    key, value = HAMI_SCHEDULER_LABEL
    return any(lookup(p, "metadata", "labels", key) == value and ready(p) for p in pods)


def vfio_gpus(annotation: str | None) -> tuple[list[str], list[str]]:
    """vfio-manager's annotation as (bound GPU indices, failed ones), each sorted by index."""
    try:
        state = json.loads(annotation) if annotation else {}
    except ValueError:
        state = {}
    if not isinstance(state, dict):
        state = {}
    ordered = sorted(state, key=lambda k: (len(k), k))
    return [k for k in ordered if state[k] == 1], [k for k in ordered if state[k] != 1]


# -- the checks --------------------------------------------------------------------------------

# What each problem is about, for callers that treat some differently (preflight blocks a release
# only on what its values cause).
BAD_MODE = "bad-mode"
BAD_QOS = "bad-qos"
SGPU_WITHOUT_RUNTIME = "sgpu-without-runtime"
SGPU_WITHOUT_HAMI = "sgpu-without-hami"
MACA_VERSION_REFUSED = "maca-version-refused"
MACA_VERSION_UNMATCHED = "maca-version-unmatched"


class WorkloadProblem(UserError):
    """A misconfiguration of nodes or GPU pods; `rule` says which check found it."""

    def __init__(self, rule: str, where: str, problem: str, fix: str):
        self.rule = rule
        super().__init__(where, problem, fix)


def problems(
    nodes: Mapping[str, Mapping[str, str]],
    pods: Iterable[GpuPod],
    *,
    runtime_deployed: bool,
    maca_images: Sequence[str] | None,
    hami_running: bool | None,
) -> list[WorkloadProblem]:
    """Every misconfiguration, one problem per rule and bad value, in a fixed order.

    `nodes`: node name -> its labels (at least those `node_labels` keeps); `pods`: the GPU pods;
    `runtime_deployed`: `runtime.deploy`; `maca_images`: `maca.payload.images`, None when the
    maca component is not deployed; `hami_running`: whether a HAMi scheduler is Ready (None:
    not known, not checked).
    """
    found = _label_problems(nodes)
    sgpu = sorted(n for n, labels in nodes.items() if labels.get(MODE_LABEL) == "sgpu")
    back = f"kubectl label node -l {MODE_LABEL}=sgpu {MODE_LABEL}=native --overwrite"
    if sgpu and not runtime_deployed:
        found.append(
            WorkloadProblem(
                SGPU_WITHOUT_RUNTIME,
                _names("node", sgpu),
                f"labelled {MODE_LABEL}=sgpu, but sGPU needs the container-runtime component and it is not "
                "deployed (runtime.deploy is false)",
                f"deploy it (helm upgrade --set runtime.deploy=true) or set the nodes back to native: {back}",
            )
        )
    if sgpu and hami_running is False:
        found.append(
            WorkloadProblem(
                SGPU_WITHOUT_HAMI,
                _names("node", sgpu),
                f"labelled {MODE_LABEL}=sgpu, but no HAMi scheduler runs (no Ready pod labelled "
                f"{HAMI_SCHEDULER_SELECTOR} in any namespace), so pods requesting {SGPU_RESOURCE} cannot be "
                "scheduled",
                f"install HAMi or set the nodes back to native: {back}",
            )
        )
    found += _maca_problems(pods, maca_images)
    return found


def problems_of_objects(
    nodes: Iterable[Mapping], pods: Sequence[Mapping], *, runtime_deployed: bool, maca_images: Sequence[str] | None
) -> list[WorkloadProblem]:
    """`problems` over listed Node and Pod objects (every live pod of the cluster: the GPU pods and
    HAMi's scheduler are found among them)."""
    return problems(
        {n["metadata"]["name"]: node_labels(n) for n in nodes},
        filter(None, map(gpu_pod, pods)),
        runtime_deployed=runtime_deployed,
        maca_images=maca_images,
        hami_running=hami_running(pods),
    )


def _label_problems(nodes: Mapping[str, Mapping[str, str]]) -> list[WorkloadProblem]:
    found = []
    for rule, label, allowed in ((BAD_MODE, MODE_LABEL, MODES), (BAD_QOS, QOS_LABEL, tuple(QOS_POLICIES))):
        bad: dict[str, list[str]] = {}
        for name, labels in nodes.items():
            value = labels.get(label)
            if value is not None and value not in allowed:
                bad.setdefault(value, []).append(name)
        for value, names in sorted(bad.items()):
            found.append(
                WorkloadProblem(
                    rule,
                    _names("node", sorted(names)),
                    f"label {label}={value} is not one of {', '.join(allowed)}",
                    f"relabel them: kubectl label node -l {label}={value} {label}={allowed[0]} --overwrite",
                )
            )
    return found


def _maca_problems(pods: Iterable[GpuPod], maca_images: Sequence[str] | None) -> list[WorkloadProblem]:
    deployed = deployed_maca_versions(maca_images or [])
    if maca_images is None:
        shown = "none: the maca component is not deployed (maca.deploy is false)"
    else:
        shown = ", ".join(deployed) or "none: maca.payload.images is empty"
    refused: dict[str, list[str]] = {}
    unmatched: dict[str, list[str]] = {}
    chosen: dict[str, str | None] = {}  # each value's version, worked out once: thousands of pods share a few
    for pod in pods:
        for value in dict.fromkeys(pod.maca_versions):
            if value in MACA_REFUSED:
                refused.setdefault(value, []).append(f"{pod.namespace}/{pod.name}")
                continue
            if value not in chosen:
                chosen[value] = choose_maca(value, deployed)
            if chosen[value] is None:
                unmatched.setdefault(value, []).append(f"{pod.namespace}/{pod.name}")
    example = f"e.g. {deployed[0].rsplit('.', 2)[0]}" if deployed else "once maca deploys one"
    found = [
        WorkloadProblem(
            MACA_VERSION_REFUSED,
            _names("pod", sorted(names)),
            f"{MACA_VERSION_ENV}={value} names no version, so the runtime refuses it (deployed: {shown})",
            f"set a version or a prefix of one, {example}",
        )
        for value, names in sorted(refused.items())
    ]
    found += [
        WorkloadProblem(
            MACA_VERSION_UNMATCHED,
            _names("pod", sorted(names)),
            f"{MACA_VERSION_ENV}={value} matches none of the MXMACA versions deployed ({shown})",
            "use one of them or a prefix of one, or add a payload image of that version to maca.payload.images",
        )
        for value, names in sorted(unmatched.items())
    ]
    return found


def _names(kind: str, names: Sequence[str]) -> str:
    """`node a`, `nodes a, b` or `nodes a, b, c, d, e and 3 more`."""
    shown = ", ".join(names[:SHOWN])
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return f"{kind}{'s' if len(names) > 1 else ''} {shown}{more}"
