"""`metax-operator preflight`: the pre-install/pre-upgrade hook that validates a release.

Two parts: the values (values.schema.json's rules, then the cross-field rules, from
`validation.validate_values`: what the offline `metax-operator validate` and `helm template`
check, so all three give the same verdict), and the cluster prerequisites of seed 000 §3:

| Kubernetes | container runtime            |
| 1.23       | docker >= 18.09.3, containerd >= 1.5.0 |
| >= 1.24    | containerd >= 1.5.0          |
host OS Ubuntu 18.04/20.04/22.04, CentOS 8/9, openEuler 20.03/22.03 "or derivatives".

What fails and what only warns (one line per node either way):
- fails: an API server older than 1.23; on a GPU node, a runtime the container-runtime component
  cannot configure (containerd < 1.5.0, docker < 18.09.3, docker on a kubelet >= 1.24 where
  dockershim is gone, any other runtime such as CRI-O) — the stack cannot run there.
- warns: an OS outside the list. The seed allows derivatives (Kylin, UOS, Rocky, ... cannot all be
  recognised from `osImage`) and what really decides is whether the MetaX kernel driver supports
  the node's kernel, which only driver-manager on the node can tell.
GPU nodes are those labelled `metax-tech.com/gpu.installed=true`. Before gpu-label has ever run
(first install) no node has the label: then every node is checked but problems only warn, since
a node without GPUs may well run another runtime.

Then the payload images against the GPU nodes' architectures (`kubernetes.io/arch`): MetaX tags
its driver and MXMACA payloads per architecture (`2.33.0.9-amd64`), and one DaemonSet pod
template serves every GPU node, so a tag that names an architecture fails on the nodes of any
other one. That fails the release: in a cluster of one architecture, a tag naming another one;
in a mixed cluster, any tag naming one (the chart needs a multi-architecture image there).

Then the workload rules (`workloads.problems`, in the runner's and `helm test`'s words) over the
nodes and every live pod, with the values' `runtime.deploy` and `maca.payload.images`: sGPU nodes
while the values leave container-runtime out fail (the release would cause it); the rest warns
(node labels and pods are the admins' and users', and a pod whose `METAX_MACA_VERSION` matches
no version may have been broken before this release).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field

from metax_operator import workloads
from metax_operator.chart import images
from metax_operator.chart.validation import validate_values
from metax_operator.contract import GPU_NODE_LABEL, LIVE_PODS
from metax_operator.errors import UserError, UserErrors
from metax_operator.hooks import common
from metax_operator.runtime import kube

MIN_KUBERNETES = (1, 23)
MIN_CONTAINERD = (1, 5, 0)
MIN_DOCKER = (18, 9, 3)
#: Supported host OS families (lower-case osImage prefix) and their supported major versions.
SUPPORTED_OS = {"ubuntu": ("18.04", "20.04", "22.04"), "centos": ("8", "9"), "openeuler": ("20.03", "22.03")}
SUPPORTED_OS_TEXT = "Ubuntu 18.04/20.04/22.04, CentOS 8/9, openEuler 20.03/22.03 or a derivative"
#: Workload problems that stop a release: those its values cause.
BLOCKING = (workloads.SGPU_WITHOUT_RUNTIME,)
ARCH_LABEL = "kubernetes.io/arch"
#: The architecture a payload tag's last `-` part names (`2.33.0.9-amd64`, `...-ubuntu22.04-aarch64`).
TAG_ARCHITECTURES = {"amd64": "amd64", "x86_64": "amd64", "arm64": "arm64", "aarch64": "arm64"}
MIXED_ARCH_DOC = "docs/chart.md, 'Clusters of x86 and Arm GPU servers'"


def version_tuple(text: str) -> tuple[int, ...] | None:
    """(major, minor, patch) of the first dotted version in `text` ('v1.23.4-eks' -> (1, 23, 4))."""
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(g or 0) for g in match.groups()) if match else None


@dataclass
class Findings:
    errors: list[UserError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def check_server(git_version: str) -> list[UserError]:
    version = version_tuple(git_version)
    if version is None or version[:2] >= MIN_KUBERNETES:
        return []
    return [
        UserError(
            "cluster",
            f"Kubernetes {git_version} is older than 1.23, the oldest the MetaX GPU operator supports (seed §3)",
            "upgrade the cluster to 1.23 or newer",
        )
    ]


def runtime_problem(runtime: str, kubelet: str) -> str | None:
    """Why the node's container runtime cannot host the stack, or None when it can."""
    name, _, version_text = runtime.partition("://")
    version = version_tuple(version_text)
    kubelet_version = version_tuple(kubelet) or (0, 0, 0)
    if name == "containerd":
        if version is None or version < MIN_CONTAINERD:
            return f"containerd {version_text or '(no version)'} is older than 1.5.0"
        return None
    if name == "docker":
        if kubelet_version[:2] >= (1, 24):
            return f"docker is not supported on Kubernetes {kubelet} (only 1.23 supports docker; use containerd >= 1.5.0)"
        if version is None or version < MIN_DOCKER:
            return f"docker {version_text or '(no version)'} is older than 18.09.3"
        return None
    return f"container runtime {runtime or '(none reported)'} is not supported (containerd >= 1.5.0 is)"


def os_supported(os_image: str) -> bool:
    """Whether `osImage` (e.g. "Ubuntu 22.04.4 LTS", "CentOS Stream 9") is a listed OS."""
    words = os_image.lower().split()
    versions = SUPPORTED_OS.get(words[0]) if words else None
    if versions is None:
        return False
    match = re.search(r"\d+(?:\.\d+)?", os_image)
    if match is None:
        return True  # the family without a number: nothing to hold against it
    return match.group() in versions or match.group().split(".")[0] in versions


def check_node(node: dict, enforce: bool, findings: Findings) -> None:
    name = node["metadata"]["name"]
    info = (node.get("status") or {}).get("nodeInfo") or {}
    runtime = info.get("containerRuntimeVersion", "")
    problem = runtime_problem(runtime, info.get("kubeletVersion", ""))
    if problem:
        fix = (
            "move the node to containerd >= 1.5.0 (docker >= 18.09.3 works only on Kubernetes 1.23), "
            "or keep MetaX components off it"
        )
        if enforce:
            findings.errors.append(UserError(f"node {name}", problem, fix))
        else:
            findings.warnings.append(f"node {name}: {problem}; {fix} if it has MetaX GPUs")
    os_image = info.get("osImage", "")
    if not os_supported(os_image):
        findings.warnings.append(
            f"node {name}: OS {os_image or '(none reported)'} is not one the seed lists "
            f"({SUPPORTED_OS_TEXT}); the driver may not support its kernel {info.get('kernelVersion', '?')}"
        )


def check_cluster(git_version: str, nodes: list[dict]) -> Findings:
    """The seed §3 prerequisites, from the server version and the nodes (pure)."""
    findings = Findings(errors=check_server(git_version))
    gpu_nodes = common.gpu_nodes(nodes)
    enforce = bool(gpu_nodes)
    if not gpu_nodes:
        findings.warnings.append(
            f"no node is labelled {GPU_NODE_LABEL}=true yet (gpu-label has not run): "
            f"checking all {len(nodes)} nodes, reporting problems as warnings"
        )
    for node in sorted(gpu_nodes or nodes, key=lambda n: n["metadata"]["name"]):
        check_node(node, enforce, findings)
    return findings


def tag_architecture(tag: str) -> str | None:
    """The architecture a payload tag names (`2.33.0.9-arm64` -> arm64), or None."""
    return TAG_ARCHITECTURES.get(tag.rsplit("-", 1)[-1])


def payload_tags(values: dict) -> list[tuple[str, str, str]]:
    """(field, as written, tag) of each payload the values deploy; the tag is "" for one pinned
    by digest (a digest may name a multi-architecture index)."""
    found = []
    if (values.get("driver") or {}).get("deploy"):
        payload = values["driver"].get("payload") or {}
        version = payload.get("version") or ""
        found.append(("driver.payload.version", version, "" if payload.get("digest") else version))
    if (values.get("maca") or {}).get("deploy"):
        for image in workloads.payload_images(values):
            _repository, tag, digest = images.split(image)
            found.append(("maca.payload.images", image, "" if digest else tag))
    return found


def check_architectures(values: dict, gpu_nodes: list[dict], findings: Findings) -> None:
    """The payload tags of the values against the GPU nodes' architectures (pure)."""
    fleet = {}
    for node in gpu_nodes:
        arch = (node["metadata"].get("labels") or {}).get(ARCH_LABEL, "?")
        fleet[arch] = fleet.get(arch, 0) + 1
    counted = " and ".join(f"{arch} ({count})" for arch, count in sorted(fleet.items()))
    for field_name, ref, tag in payload_tags(values):
        named = tag_architecture(tag)
        if named is None or set(fleet) <= {named}:
            continue
        findings.errors.append(
            UserError(
                field_name,
                f"{ref} is tagged for {named}, and the GPU nodes are {counted}: its pods would fail on the"
                f" {' and '.join(sorted(set(fleet) - {named}))} ones",
                "publish the payload's images of every architecture the cluster has under one multi-architecture"
                f" tag and set that ({MIXED_ARCH_DOC})"
                if len(fleet) > 1
                else f"set the tag of its {next(iter(fleet))} image",
            )
        )


def check_workloads(values: dict, nodes: list[dict], pods: list[dict], findings: Findings) -> None:
    """The workload rules with the values' components (pure)."""
    deployed = lambda key: bool((values.get(key) or {}).get("deploy"))  # noqa: E731
    for problem in workloads.problems_of_objects(
        nodes,
        pods,
        runtime_deployed=deployed("runtime"),
        maca_images=workloads.payload_images(values) if deployed("maca") else None,
    ):
        if problem.rule in BLOCKING:
            findings.errors.append(problem)
        else:
            findings.warnings.append(str(problem))


def run(args: argparse.Namespace) -> int:
    values = common.load_values(args.values)
    validate_values(values)
    client = kube.Client.from_args(args)
    _major, _minor, git_version = client.server_version()
    nodes = client.list("v1", "Node")
    findings = check_cluster(git_version, nodes)
    check_architectures(values, common.gpu_nodes(nodes), findings)
    pods = client.list("v1", "Pod", field_selector=LIVE_PODS, all_namespaces=True)
    check_workloads(values, nodes, pods, findings)
    for line in findings.warnings:
        print(f"warning: {line}", file=sys.stderr)
    if findings.errors:
        raise UserErrors(findings.errors)
    print(f"preflight: values valid; Kubernetes {git_version}; prerequisites met")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "preflight",
        help="validate the release's values and the cluster's prerequisites (hook)",
        description=__doc__.splitlines()[0],
    )
    common.add_values_argument(parser)
    common.add_api_arguments(parser, namespace=False)
    parser.set_defaults(func=run)
