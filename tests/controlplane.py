"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok simulating the nodes, for the e2e tests, `scripts/cluster` and the demo.

The binaries come from `scripts/setup.d/20-control-plane` ($METAX_CACHE/controlplane/<version>/).
Everything listens on 127.0.0.1 at free ports; certificates, the admin kubeconfig, etcd's data
and each component's log live in one work directory.

kwok's stages come from its config file: our node-initialize (a GPU server's status) and
node-not-ready (for nodes labelled so), kwok's stock pod-ready and pod-delete, our
validation-complete (the runner's validation pods succeed a moment after they are made, on the nodes
no validation fault names), and one more Stage per injected pod fault, with a weight so that it wins
over the stock stage for the nodes it names. A pod fault rewrites the file and restarts kwok (about
a second): kwok's Stage API (`--enable-crds=Stage`) would avoid that, but its stage cache can miss
the latest change (it is keyed on the informer's resource version, which moves before the informer's
store does), and a fault that silently does not apply makes a flaky test. The stock `pod-complete`
stage is deliberately left out: a Job's pod would "succeed" without running anything, so a Helm hook
Job stays Running here rather than faking success.

Simulated nodes send no heartbeats (at thousands of nodes they would cost the API server more
than everything else), so kube-controller-manager's node-lifecycle controller gets a grace period
of a year: it never marks a quiet node unreachable, yet it still does its real work on what the
nodes report: it lifts the `not-ready` taint from new nodes once Ready, and taints a node whose
Ready condition goes False (the node-not-ready fault), evicting pods that do not tolerate it.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml
from kubernetes import client, config

from metax_operator.contract import COMPONENT_LABEL, VALIDATION_COMPONENT
from tests import netns, registry
from tests.netns import NetnsError
from tests.realnode import APISERVER_IP, NODE_NAME, PAUSE_TAG, PORTS, TOOLS_NODE, RealNode
from tests.registry import RegistryError

K8S_VERSION = "v1.34.4"  # the default: scripts/controlplane/go.mod
CACHE = Path(os.environ.get("METAX_CACHE") or Path.home() / ".cache" / "metax-operator")
BIN_DIR = Path(os.environ.get("METAX_CONTROLPLANE_BIN") or CACHE / "controlplane" / K8S_VERSION)
REPO = Path(__file__).resolve().parent.parent
MATRIX = REPO / "scripts" / "controlplane" / "versions" / "matrix"
# Built for every version (scripts/setup.d/20-control-plane); etcd, kwok and the pause image come
# from the default version's directory whatever the version.
KUBERNETES_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy")


@dataclass(frozen=True)
class MatrixVersion:
    """A line of scripts/controlplane/versions/matrix: a Kubernetes version the tests run on."""

    version: str
    binaries: tuple[str, ...]  # what setup builds of it
    runs: str  # "admission" (the API server alone) or "rollout" (also the whole control plane, kwok's nodes)

    @property
    def minor(self) -> int:
        return minor(self.version)


def minor(version: str) -> int:
    """1.28 -> 28 (of v1.28.15, v1.28.15-gke.1, 1.28)."""
    return int(version.lstrip("v").split(".")[1].rstrip("+").split("-")[0])


def matrix() -> list[MatrixVersion]:
    versions = []
    for line in MATRIX.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            version, binaries, runs = line.split()[:3]
            built = KUBERNETES_BINARIES if binaries == "all" else tuple(binaries.split(","))
            versions.append(MatrixVersion(version, built, runs))
    return versions


def beta_policy_flags(version: str) -> list[str]:
    """On 1.28 and 1.29 ValidatingAdmissionPolicy is v1beta1 and off by default: the tests turn it
    on, as a site that uses it does, so the chart's policy runs there (without it the class
    enforces what 1.25 does, which the 1.25 server covers)."""
    if minor(version) not in (28, 29):
        return []
    return ["--feature-gates=ValidatingAdmissionPolicy=true", "--runtime-config=admissionregistration.k8s.io/v1beta1=true"]


def bin_dir(version: str) -> Path:
    return BIN_DIR if version == K8S_VERSION else CACHE / "controlplane" / version


NODE_BINARIES = ("kubelet", "kube-proxy")


def kubelet_skew(version: str) -> int:
    """How many minor versions older than an API server of `version` its kubelets may be, by the
    version skew policy: 3 from 1.28, 2 before."""
    return 3 if minor(version) >= 28 else 2


def node_version(version: str) -> str:
    """The version of the real node's kubelet and kube-proxy under an API server of `version`: of
    those setup builds (the default version's, and each matrix line's that names them), the newest
    that is not newer than the API server and within the skew policy. The newest releases'
    kubelets need containerd 2 and cgroup v2 (from 1.36), which the Debian node here does not
    have, so the newest API server gets an older kubelet."""
    built = [K8S_VERSION, *(v.version for v in matrix() if "kubelet" in v.binaries)]
    fits = [b for b in built if 0 <= minor(version) - minor(b) <= kubelet_skew(version)]
    if fits:
        return max(fits, key=lambda b: tuple(int(part) for part in b.lstrip("v").split(".")))
    raise ControlPlaneError(
        f"Kubernetes {version} has no kubelet built within the skew policy ({kubelet_skew(version)} minor versions "
        f"older at most): add kubelet,kube-proxy to a line of {MATRIX.relative_to(REPO)} and run 'make matrix'"
    )


GPU_LABEL = "metax-tech.com/gpu.installed"
GPU_RESOURCE = "metax-tech.com/gpu"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_STARTUP_RACE = "fatal error: concurrent map writes"
KWOK_STARTS = 3  # starts tried when kwok dies of its own startup race (see `_start_kwok`), which is rare
GPUS_ANNOTATION = "metax-operator.test/gpus"  # how many GPUs a simulated node reports
RESOURCES_ANNOTATION = "metax-operator.test/resources"  # JSON {resource: count} it also reports
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.1/16"  # kwok hands out pod IPs from it; nothing is ever sent to them
NOT_READY_LABEL = "metax-operator.test/not-ready"  # on nodes made NotReady


class ControlPlaneError(Exception):
    """The control plane could not start or act; the message is one line saying what to do."""


@dataclass
class Component:
    name: str
    process: subprocess.Popen
    log: Path
    healthy: Callable[[], bool]  # polled until True
    exe: str  # what /proc/<pid>/exe shows once it runs: `scripts/cluster down` stops only that

    def tail(self, lines: int = 25) -> str:
        if not self.log.exists():
            return "(no log)"
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def rss_bytes(self) -> int:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0


@dataclass
class Fault:
    """One injected fault; `clear()` removes it. A pod fault is a kwok Stage for new pods on the
    nodes: pods it already changed keep their state (a never-ready pod stays unready until it is
    deleted), as on a real node. A node fault is a label on the nodes."""

    clear: Callable[[], None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port_free(port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise ControlPlaneError(
                f"port {port} on 127.0.0.1 is in use: stop what listens there "
                f"('scripts/cluster down' if it is an earlier cluster) or pick another (--port)"
            ) from None


def _openssl(*args: str, cwd: Path) -> None:
    if shutil.which("openssl") is None:
        raise ControlPlaneError("openssl is not on PATH: install it (apt-get install openssl)")
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        raise ControlPlaneError(f"openssl {args[0]} failed: {done.stderr.strip().splitlines()[-1]}")


_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def issue_cert(pki: Path, name: str, subject: str, usage: str = "clientAuth", names: str = "") -> None:
    """`name.crt`/`name.key` signed by the CA in `pki`: a client (`clientAuth`, the subject's O is
    the group) or a server (`serverAuth`, `names` its subjectAltName)."""
    extensions = ["-addext", f"extendedKeyUsage={usage}"] + (["-addext", f"subjectAltName={names}"] if names else [])
    _openssl(
        "req",
        "-x509",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-days",
        "365",
        *_EC,
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.crt",
        "-subj",
        subject,
        *extensions,
        cwd=pki,
    )


def make_certs(pki: Path, apiserver_ips: tuple[str, ...] = ()) -> None:
    """A CA, the API server's serving certificate (also for `apiserver_ips`), an admin client
    certificate (group system:masters) and the service-account signing key, all EC P-256."""
    pki.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req",
        "-x509",
        *_EC,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "3650",
        "-subj",
        "/CN=metax-operator-test-ca",
        cwd=pki,
    )
    issue_cert(
        pki,
        "apiserver",
        "/CN=kube-apiserver",
        "serverAuth",
        "IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,"
        "IP:10.96.0.1" + "".join(f",IP:{ip}" for ip in apiserver_ips),
    )
    issue_cert(pki, "admin", "/O=system:masters/CN=metax-admin")
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "sa.key", cwd=pki)
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def write_kubeconfig(path: Path, pki: Path, server: str) -> None:
    def b64(name: str) -> str:
        return base64.b64encode((pki / name).read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "metax-test",
        "clusters": [{"name": "metax-test", "cluster": {"server": server, "certificate-authority-data": b64("ca.crt")}}],
        "users": [{"name": "admin", "user": {"client-certificate-data": b64("admin.crt"), "client-key-data": b64("admin.key")}}],
        "contexts": [{"name": "metax-test", "context": {"cluster": "metax-test", "user": "admin"}}],
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)


def _status(url: str, context: ssl.SSLContext | None = None) -> int:
    """HTTP status of a GET on loopback, 0 if nothing answers yet."""
    scheme, rest = url.split("://", 1)
    hostport, _, urlpath = rest.partition("/")
    host, port = hostport.rsplit(":", 1)
    conn = (
        http.client.HTTPSConnection(host, int(port), context=context, timeout=2)
        if scheme == "https"
        else http.client.HTTPConnection(host, int(port), timeout=2)
    )
    try:
        conn.request("GET", "/" + urlpath)
        return conn.getresponse().status
    except OSError:
        return 0
    finally:
        conn.close()


def _accepts(path: Path) -> bool:
    """A unix socket at `path` accepts connections."""
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def _check_node_prerequisites() -> None:
    """What the real node needs of this machine, named with the fix."""
    if os.geteuid():
        raise ControlPlaneError(
            "the real node needs root (network namespaces, mounts, cgroups): run as root, "
            "or start without it (scripts/cluster up --no-real-node)"
        )
    missing = [
        tool for tool in ("containerd", "runc", "iptables", "skopeo", "nsenter", "unshare", "ip") if shutil.which(tool) is None
    ]
    if missing:
        raise ControlPlaneError(
            f"{', '.join(missing)} not on PATH: run 'make e2e' or 'make demo' first (scripts/setup.d/15-node-packages)"
        )


ARCH_LABEL = "kubernetes.io/arch"
ARM_SHARE = 0.4  # of the fixture's GPU nodes: arm64


def node_manifest(name: str, gpus: int, labels: dict | None, taints: list | None, resources: dict | None = None) -> dict:
    all_labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        ARCH_LABEL: "amd64",
        "type": "kwok",
        **(labels or {}),
    }
    annotations = {KWOK_NODE_ANNOTATION: "fake"}
    if gpus or resources:
        all_labels[GPU_LABEL] = "true"
    if gpus:
        annotations[GPUS_ANNOTATION] = str(gpus)
    if resources:
        annotations[RESOURCES_ANNOTATION] = json.dumps({k: str(v) for k, v in resources.items()})
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": all_labels, "annotations": annotations},
        "spec": {"taints": taints or []},
    }


# What a kubelet on a GPU server reports, in place of kwok's stock node-initialize stage: the
# node's status is filled in one step from its annotations, so there is no second write to race.
_NODE_INITIALIZE_STATUS = """\
{{ $now := Now }}
{{ $since := or .metadata.creationTimestamp $now }}
{{ $gpus := index (or .metadata.annotations dict) "%(gpus)s" }}
{{ $resources := fromJson (or (index (or .metadata.annotations dict) "%(resources)s") "{}") }}
conditions:
{{ range NodeConditions }}
- {type: {{ .type | Quote }}, status: {{ .status | Quote }}, reason: {{ .reason | Quote }},
   message: {{ .message | Quote }}, lastHeartbeatTime: {{ $now | Quote }}, lastTransitionTime: {{ $since | Quote }}}
{{ end }}
addresses:
- {type: Hostname, address: {{ .metadata.name | Quote }}}
{{ range list "capacity" "allocatable" }}
{{ . }}:
  cpu: "128"
  memory: 1056587764Ki
  ephemeral-storage: 1874079380Ki
  pods: "110"
  {{ with $gpus }}%(resource)s: {{ . | Quote }}{{ end }}
{{ range $name, $count := $resources }}
  {{ $name }}: {{ $count | Quote }}
{{ end }}
{{ end }}
nodeInfo:
  architecture: amd64
  operatingSystem: linux
  osImage: Ubuntu 22.04.4 LTS
  kernelVersion: 5.15.0-105-generic
  containerRuntimeVersion: containerd://1.7.13
  kubeletVersion: %(version)s
  kubeProxyVersion: %(version)s
  machineID: {{ .metadata.uid | replace "-" "" | Quote }}
  systemUUID: {{ .metadata.uid | Quote }}
  bootID: {{ .metadata.uid | Quote }}
phase: Running
""" % {"gpus": GPUS_ANNOTATION, "resources": RESOURCES_ANNOTATION, "resource": GPU_RESOURCE, "version": K8S_VERSION}

NODE_INITIALIZE = {
    "apiVersion": "kwok.x-k8s.io/v1alpha1",
    "kind": "Stage",
    "metadata": {"name": "node-initialize"},
    "spec": {
        "resourceRef": {"apiGroup": "v1", "kind": "Node"},
        "selector": {
            "matchExpressions": [
                {"key": '.status.conditions.[] | select( .type == "Ready" ) | .status', "operator": "NotIn", "values": ["True"]}
            ]
        },
        "next": {"statusTemplate": _NODE_INITIALIZE_STATUS},
    },
}


# --- fault stages ------------------------------------------------------------------------------


def _on_nodes(nodes: list[str], *more: dict) -> dict:
    return {
        "matchExpressions": [
            {"key": ".spec.nodeName", "operator": "In", "values": list(nodes)},
            {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
            *more,
        ]
    }


_NEW_POD = {"key": ".status.podIP", "operator": "DoesNotExist"}

# A running pod whose containers are not ready (readiness probe failing).
_UNREADY_STATUS = """\
{{ $now := Now }}
conditions:
- {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: Ready, status: "False", reason: ContainersNotReady, lastTransitionTime: {{ $now | Quote }}}
- {type: ContainersReady, status: "False", reason: ContainersNotReady, lastTransitionTime: {{ $now | Quote }}}
containerStatuses:
{{ range .spec.containers }}
- {name: {{ .name | Quote }}, image: {{ .image | Quote }}, ready: false, started: true, restartCount: 0,
   state: {running: {startedAt: {{ $now | Quote }}}}}
{{ end }}
hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
podIP: {{ PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) | Quote }}
phase: Running
startTime: {{ $now | Quote }}
"""  # noqa: E501 - one kwok template action per line

# Each application is one more crash: restartCount + 1, waiting in CrashLoopBackOff.
_CRASH_STATUS = """\
{{ $now := Now }}
{{ $restarts := 0 }}
{{ with .status.containerStatuses }}{{ $restarts = (index . 0).restartCount }}{{ end }}
conditions:
- {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: Ready, status: "False", reason: ContainersNotReady, lastTransitionTime: {{ $now | Quote }}}
- {type: ContainersReady, status: "False", reason: ContainersNotReady, lastTransitionTime: {{ $now | Quote }}}
containerStatuses:
{{ range .spec.containers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  ready: false
  started: false
  restartCount: {{ add $restarts 1 }}
  state: {waiting: {reason: CrashLoopBackOff, message: "back-off restarting failed container (injected fault)"}}
  lastState: {terminated: {exitCode: 1, reason: Error, startedAt: {{ $now | Quote }}, finishedAt: {{ $now | Quote }}}}
{{ end }}
hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
podIP: {{ with .status.podIP }}{{ . | Quote }}{{ else }}{{ PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) | Quote }}{{ end }}
phase: Running
startTime: {{ or .status.startTime $now | Quote }}
"""  # noqa: E501 - one kwok template action per line

# Ready=False as a kubelet that stopped reporting leaves it: the heartbeat time freezes, so
# applying the stage again changes nothing (kwok then sends no patch).
_NODE_NOT_READY_STATUS = """\
{{ $now := Now }}
{{ $heartbeat := $now }}
{{ $since := $now }}
{{ range .status.conditions }}{{ if eq .type "Ready" }}
{{ $heartbeat = .lastHeartbeatTime }}
{{ if eq .status "False" }}{{ $since = .lastTransitionTime }}{{ end }}
{{ end }}{{ end }}
conditions:
- type: Ready
  status: "False"
  reason: KubeletNotReady
  message: "node stopped posting status (injected fault)"
  lastHeartbeatTime: {{ $heartbeat | Quote }}
  lastTransitionTime: {{ $since | Quote }}
"""


# A validation pod that ended: every container terminated with `exitCode` (and `message`).
_VALIDATION_ENDED_STATUS = """\
{{{{ $now := Now }}}}
conditions:
- {{type: Initialized, status: "True", lastTransitionTime: {{{{ $now | Quote }}}}}}
- {{type: Ready, status: "False", reason: PodCompleted, lastTransitionTime: {{{{ $now | Quote }}}}}}
initContainerStatuses:
{{{{ range .spec.initContainers }}}}
- {{name: {{{{ .name | Quote }}}}, image: {{{{ .image | Quote }}}}, ready: false, restartCount: 0,
   state: {{terminated: {{exitCode: {code}, reason: {reason}, message: {message}, startedAt: {{{{ $now | Quote }}}}, finishedAt: {{{{ $now | Quote }}}}}}}}}}
{{{{ end }}}}
containerStatuses:
{{{{ range .spec.containers }}}}
- {{name: {{{{ .name | Quote }}}}, image: {{{{ .image | Quote }}}}, ready: false, restartCount: 0,
   state: {{terminated: {{exitCode: {code}, reason: {reason}, message: {message}, startedAt: {{{{ $now | Quote }}}}, finishedAt: {{{{ $now | Quote }}}}}}}}}}
{{{{ end }}}}
hostIP: {{{{ NodeIPWith .spec.nodeName | Quote }}}}
podIP: {{{{ PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) | Quote }}}}
phase: {phase}
startTime: {{{{ $now | Quote }}}}
"""  # noqa: E501 - one kwok template action per line

_VALIDATION_POD = {"key": f'.metadata.labels["{COMPONENT_LABEL}"]', "operator": "In", "values": [VALIDATION_COMPONENT]}


def validation_ended(passed: bool, message: str = "") -> str:
    """The status template of a validation pod that passed, or failed saying `message`."""
    code, reason, phase = (0, "Completed", "Succeeded") if passed else (1, "Error", "Failed")
    return _VALIDATION_ENDED_STATUS.format(code=code, reason=reason, phase=phase, message=json.dumps(message))


def validation_complete(excluded: list[str]) -> dict:
    """The validation pods on every node but `excluded` (those a validation fault names) pass,
    two seconds after they are made: long enough for a node to be seen `validating`."""
    more = [{"key": ".spec.nodeName", "operator": "NotIn", "values": sorted(excluded)}] if excluded else []
    selector = {
        "matchExpressions": [
            _VALIDATION_POD,
            {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
            _NEW_POD,
            *more,
        ]
    }
    return _stage("validation-complete", "Pod", selector, {"statusTemplate": validation_ended(True)}, delay_ms=2000)


def _stage(name: str, kind: str, selector: dict, next_: dict, delay_ms: int = 0) -> dict:
    spec = {
        "resourceRef": {"apiGroup": "v1", "kind": kind},
        "selector": selector,
        "weight": 1,
        "next": next_,
    }  # weight 1 beats the stock stages (weight 0)
    if delay_ms:
        spec["delay"] = {"durationMilliseconds": delay_ms}
    return {"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage", "metadata": {"name": name}, "spec": spec}


NODE_NOT_READY = _stage(
    "node-not-ready",
    "Node",
    {"matchExpressions": [{"key": f'.metadata.labels["{NOT_READY_LABEL}"]', "operator": "In", "values": ["true"]}]},
    {"statusTemplate": _NODE_NOT_READY_STATUS},
)  # always there; the fault is the label


# --- the control plane -------------------------------------------------------------------------


@dataclass
class ControlPlane:
    workdir: Path
    port: int = 0
    kubernetes: str = K8S_VERSION  # the version of the Kubernetes binaries
    node: RealNode | None = None  # the real node, when started with real_node=True
    registry_port: int = 0
    components: dict[str, Component] = field(default_factory=dict)
    _node_count: dict[str, int] = field(default_factory=dict)
    _pod_faults: dict[str, dict] = field(default_factory=dict)  # Stage name -> Stage
    _validation_faults: dict[str, list[str]] = field(default_factory=dict)  # Stage name -> its nodes
    _fault_count: int = 0

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca(self) -> Path:
        return self.workdir / "pki" / "ca.crt"

    @property
    def registry(self) -> str:
        """The local OCI registry's host:port (the same on the host and on the real node)."""
        return f"127.0.0.1:{self.registry_port}"

    def api(self):
        """A new kubernetes.client.ApiClient authenticated as cluster admin."""
        return config.new_client_from_config(config_file=str(self.kubeconfig))

    # -- lifecycle --

    @classmethod
    def start(
        cls,
        workdir: Path,
        gpu_nodes: int = 10,
        plain_nodes: int = 2,
        port: int = 0,
        timeout: float = 90,
        real_node: bool = False,
        kubernetes: str = K8S_VERSION,
        api_only: bool = False,
    ) -> ControlPlane:
        """Start everything and return once the nodes are Ready; on failure stop what was
        started, print each component's log tail and raise ControlPlaneError. The simulated GPU
        fleet is mixed, as a site with x86 and Arm GPU servers: the last ARM_SHARE of the GPU
        nodes are `kubernetes.io/arch=arm64`, the others amd64. With `real_node`,
        also the local OCI registry and the real node (tests/realnode.py); with `api_only`, etcd
        and the API server alone (no nodes). `kubernetes`: a version setup built (the matrix)."""
        cp = cls(workdir=Path(workdir), port=port or free_port(), kubernetes=kubernetes)
        binaries = ["etcd", "kube-apiserver"] + ([] if api_only else ["kube-controller-manager", "kube-scheduler", "kwok"])
        for binary in binaries + (["kubelet", "kube-proxy", "pause-image"] if real_node else []):
            path = cp.binary(binary)
            if not os.access(path, os.X_OK):
                builds = "'make e2e' or 'make demo'" if path.parent == BIN_DIR else "'make matrix' (it builds the version matrix)"
                raise ControlPlaneError(f"{path} is missing: run {builds} first")
        if real_node:
            _check_node_prerequisites()
        if port:
            check_port_free(port)
        cp.workdir.mkdir(parents=True, exist_ok=True)
        try:
            cp._start(gpu_nodes, plain_nodes, time.monotonic() + timeout, real_node, api_only)
        except BaseException as error:
            if isinstance(error, (ControlPlaneError, NetnsError, RegistryError)):
                cp.print_log_tails()
            cp.stop()
            if isinstance(error, (NetnsError, RegistryError)):
                raise ControlPlaneError(str(error)) from None
            raise
        return cp

    def binary(self, name: str) -> Path:
        """A binary (or the pause image, kwok's stages) of this control plane's version (the
        node's: `node_version`)."""
        if name in NODE_BINARIES:
            return bin_dir(node_version(self.kubernetes)) / name
        return (bin_dir(self.kubernetes) if name in KUBERNETES_BINARIES else BIN_DIR) / name

    def _start(self, gpu_nodes: int, plain_nodes: int, deadline: float, real_node: bool, api_only: bool) -> None:
        pki = self.workdir / "pki"
        make_certs(pki, (APISERVER_IP,) if real_node else ())
        write_kubeconfig(self.kubeconfig, pki, self.server)
        if real_node:
            self._start_registry(pki, deadline)
            self.node = RealNode(self.workdir / "node", f"metax-node-{secrets.token_hex(4)}")
            self.node.create()
            self._run(
                "node-relay",
                [
                    sys.executable,
                    "-m",
                    "tests.noderelay",
                    f"--netns={self.node.netns}",
                    f"--forward={APISERVER_IP}:{self.port}=127.0.0.1:{self.port}",
                    f"--forward={self.registry}={self.registry}",
                    f"--connect-proxy={self.workdir / 'egress.sock'}",
                ],
                healthy=lambda: _accepts(self.workdir / "egress.sock"),
                exe=os.path.realpath(sys.executable),
            )
        etcd_port, etcd_peer = free_port(), free_port()
        self._run_binary(
            "etcd",
            [
                "--name=metax-test",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-cluster=metax-test=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync",
                "--quota-backend-bytes=8589934592",
                "--auto-compaction-retention=1",
                "--log-level=warn",
            ],
            health=f"http://127.0.0.1:{etcd_port}/health",
        )
        self._wait_healthy(["etcd"], deadline)
        self._run_binary(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--allow-privileged=true",
                *(
                    self._node_apiserver_flags(pki)
                    if real_node
                    else ["--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none"]
                ),  # the default one refuses a loopback address
                *beta_policy_flags(self.kubernetes),
                "--max-requests-inflight=1000",
                "--max-mutating-requests-inflight=500",
                f"--cert-dir={self.workdir / 'apiserver'}",
                "--profiling=false",
            ],
            health=f"{self.server}/readyz",
            tls=self._admin_tls(),
        )
        self._wait_healthy(["kube-apiserver"], deadline)
        if api_only:
            self._write_state()
            return
        kcm_port, sched_port = free_port(), free_port()
        self._run_binary(
            "kube-controller-manager",
            [
                f"--kubeconfig={self.kubeconfig}",
                "--leader-elect=false",
                "--node-monitor-grace-period=8760h",
                "--node-startup-grace-period=8760h",
                "--node-monitor-period=1s",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--kube-api-qps=1000",
                "--kube-api-burst=2000",
                # a flag of 1.33 (1.30 has none; the DaemonSet controller's default is 2 workers)
                *(["--concurrent-daemonset-syncs=4"] if minor(self.kubernetes) >= 33 else []),
                "--concurrent-gc-syncs=40",
                "--bind-address=127.0.0.1",
                f"--secure-port={kcm_port}",
                f"--cert-dir={self.workdir / 'kcm'}",
                "--profiling=false",
            ],
            health=f"https://127.0.0.1:{kcm_port}/healthz",
        )
        scheduler_config = self.workdir / "scheduler.yaml"
        scheduler_config.write_text(
            yaml.safe_dump(
                {
                    # v1 from 1.25; v1beta3 in 1.23 and 1.24
                    "apiVersion": "kubescheduler.config.k8s.io/" + ("v1" if minor(self.kubernetes) >= 25 else "v1beta3"),
                    "kind": "KubeSchedulerConfiguration",
                    "clientConnection": {"kubeconfig": str(self.kubeconfig), "qps": 1000, "burst": 2000},
                    "leaderElection": {"leaderElect": False},
                }
            )
        )
        self._run_binary(
            "kube-scheduler",
            [
                f"--config={scheduler_config}",
                "--bind-address=127.0.0.1",
                f"--secure-port={sched_port}",
                f"--cert-dir={self.workdir / 'scheduler'}",
            ],
            health=f"https://127.0.0.1:{sched_port}/healthz",
        )
        self._start_kwok(deadline)
        arm = int(gpu_nodes * ARM_SHARE)
        self.add_nodes(gpu_nodes - arm, gpu=True, wait=False)
        self.add_nodes(arm, gpu=True, labels={ARCH_LABEL: "arm64"}, wait=False)
        self.add_nodes(plain_nodes, gpu=False, wait=False)
        self._wait_healthy(["kube-controller-manager", "kube-scheduler"], deadline)
        if real_node:
            self._start_real_node(pki, deadline)
        self.wait_nodes_ready(deadline)
        self._wait_default_service_account(deadline)
        self._write_state()

    # -- the registry and the real node --

    def _start_registry(self, pki: Path, deadline: float) -> None:
        """The local OCI registry on 127.0.0.1 (TLS from our CA), with the node's pause image."""
        self.registry_port = free_port()
        issue_cert(pki, "registry", "/CN=registry", "serverAuth", "IP:127.0.0.1,DNS:localhost")
        binary = CACHE / "bin" / "registry"
        if not os.access(binary, os.X_OK):
            raise ControlPlaneError(f"{binary} is missing: run 'make e2e' or 'make demo' first (they build the registry)")
        context = ssl.create_default_context(cafile=str(self.ca))
        self._run(
            "registry",
            [
                str(binary),
                "serve",
                str(registry.config(self.workdir, self.registry_port, pki / "registry.crt", pki / "registry.key")),
            ],
            healthy=lambda: _status(f"https://{self.registry}/v2/", context) == 200,
            exe=str(binary),
        )
        self._wait_healthy(["registry"], deadline)
        registry.push_image(self.binary("pause-image"), PAUSE_TAG, RealNode.pause_image(self.registry), self.ca)

    def _node_apiserver_flags(self, pki: Path) -> list[str]:
        """The API server advertises an address inside the node's namespace (the `kubernetes`
        Service's endpoint, relayed to its loopback port), reaches kubelets through the relay's
        CONNECT proxy (its egress to the cluster) by their InternalIP, and authenticates to
        them with a client certificate in system:masters."""
        issue_cert(pki, "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client")
        egress = self.workdir / "egress.yaml"
        egress.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "apiserver.k8s.io/v1beta1",
                    "kind": "EgressSelectorConfiguration",
                    "egressSelections": [
                        {
                            "name": "cluster",
                            "connection": {
                                "proxyProtocol": "HTTPConnect",
                                "transport": {"uds": {"udsName": str(self.workdir / "egress.sock")}},
                            },
                        }
                    ],
                }
            )
        )
        return [
            f"--advertise-address={APISERVER_IP}",
            "--endpoint-reconciler-type=lease",
            f"--egress-selector-config-file={egress}",
            "--kubelet-preferred-address-types=InternalIP",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
        ]

    def _start_real_node(self, pki: Path, deadline: float) -> None:
        """containerd, then the kubelet and kube-proxy in its mount namespace; returns once the
        node is Ready and kube-proxy serves."""
        node = self.node
        issue_cert(pki, "kubelet", f"/O=system:nodes/CN=system:node:{NODE_NAME}")
        issue_cert(pki, "kube-proxy", "/CN=system:kube-proxy")
        kubelet_minor = minor(node_version(self.kubernetes))
        node.write_config(pki, f"https://{APISERVER_IP}:{self.port}", self.registry, kubelet_minor)

        def inside(port: int, urlpath: str) -> Callable[[], bool]:
            return lambda: netns.call_in(node.netns, _status, f"http://127.0.0.1:{port}/{urlpath}") == 200

        self._run(
            "containerd",
            node.containerd_command(),
            inside(PORTS["containerd-metrics"], "v1/metrics"),
            exe=shutil.which("containerd") or "containerd",
            preexec_fn=node.join_system_cgroup,
        )
        self._wait_healthy(["containerd"], deadline)
        holder = self.components["containerd"].process.pid
        for name, args, health in (
            ("kubelet", node.kubelet_args(kubelet_minor), inside(PORTS["kubelet-healthz"], "healthz")),
            ("kube-proxy", node.kube_proxy_args(), inside(PORTS["kube-proxy-healthz"], "healthz")),
        ):
            self._run(
                name,
                node.joined(holder, self.binary(name), *args),
                health,
                exe=str(self.binary(name)),
                preexec_fn=node.join_system_cgroup,
            )
        self._wait_healthy(["kubelet", "kube-proxy"], deadline)
        self.wait_nodes_ready(deadline, [NODE_NAME], selector=f"{TOOLS_NODE}=true")

    # -- processes --

    def _write_state(self) -> None:
        """What `scripts/cluster down` stops: each process (pid and binary) and the real node."""
        (self.workdir / "state.json").write_text(
            json.dumps(
                {
                    "port": self.port,
                    "kubeconfig": str(self.kubeconfig),
                    "node": self.node.id if self.node else None,
                    "registry": self.registry if self.node else None,
                    "pids": {name: [c.process.pid, c.exe] for name, c in self.components.items()},
                }
            )
        )

    def _run_binary(self, name: str, args: list[str], health: str, tls: ssl.SSLContext | None = None) -> None:
        """A control-plane binary of this version, healthy once `health` answers 200."""
        if tls is None and health.startswith("https"):
            tls = ssl.create_default_context()  # self-signed serving certs on loopback
            tls.check_hostname = False
            tls.verify_mode = ssl.CERT_NONE
        self._run(name, [str(self.binary(name)), *args], lambda: _status(health, tls) == 200, str(self.binary(name)))

    def log_path(self, name: str) -> Path:
        """Where a component's output goes (appended to across restarts)."""
        return self.workdir / "logs" / f"{name}.log"

    def _run(
        self, name: str, command: list[str], healthy: Callable[[], bool], exe: str, preexec_fn: Callable[[], None] | None = None
    ) -> None:
        log = self.log_path(name)
        log.parent.mkdir(exist_ok=True)
        with log.open("ab") as out:
            process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
                start_new_session=True,
                preexec_fn=preexec_fn,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
        self.components[name] = Component(name, process, log, healthy, exe)

    def _admin_tls(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(self.workdir / "pki" / "admin.crt", self.workdir / "pki" / "admin.key")
        return context

    def _check_alive(self) -> None:
        for c in self.components.values():
            code = c.process.poll()
            if code is not None:
                text = c.log.read_text(errors="replace") if c.log.exists() else ""
                if "address already in use" in text:
                    raise ControlPlaneError(
                        f"{c.name} could not listen: a port it was given is in use (another process "
                        f"took it after we picked it): start again; its log: {c.log}"
                    )
                last = next((line for line in reversed(text.splitlines()) if line.strip()), "no output")
                raise ControlPlaneError(f"{c.name} exited with status {code} ({last[:300]}); log: {c.log}")

    def _wait_healthy(self, names: list[str], deadline: float) -> None:
        pending = list(names)
        while pending:
            self._check_alive()
            pending = [n for n in pending if not self.components[n].healthy()]
            if pending and time.monotonic() > deadline:
                raise ControlPlaneError(f"{', '.join(pending)} not healthy in time; logs in {self.workdir / 'logs'}")
            if pending:
                time.sleep(0.2)

    def _wait_default_service_account(self, deadline: float) -> None:
        core = client.CoreV1Api(self.api())
        while not core.list_namespaced_service_account("default", field_selector="metadata.name=default").items:
            self._check_alive()
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    "kube-controller-manager created no default ServiceAccount in time; "
                    f"log: {self.components['kube-controller-manager'].log}"
                )
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop the components, newest first: SIGTERM, then SIGKILL after 10 s; then whatever
        still runs on the real node (its pods), and remove its network namespace and cgroups."""
        for c in reversed(list(self.components.values())):
            stop_pid(c.process.pid, c.process)
        self.components.clear()
        if self.node:
            self.node.destroy()

    def print_log_tails(self, lines: int = 25, stream=sys.stderr) -> None:
        for c in self.components.values():
            print(f"----- {c.name} ({c.log}), last {lines} lines -----\n{c.tail(lines)}", file=stream)

    def rss(self) -> dict[str, int]:
        return {name: c.rss_bytes() for name, c in self.components.items()}

    # -- kwok and faults --

    def _start_kwok(self, deadline: float) -> None:
        """Start kwok and wait until it is healthy. kwok (0.7 and 0.8 alike) can die as it starts from
        a data race of its own: its stage controllers and its metrics compile CEL environments at
        once, both writing one unguarded map of github.com/wzshiming/easycel ("fatal error:
        concurrent map writes"). Only that death is retried; any other failure is raised."""
        log = self.log_path("kwok")
        for attempt in range(1, KWOK_STARTS + 1):
            start = log.stat().st_size if log.exists() else 0
            self._spawn_kwok()
            try:
                self._wait_healthy(["kwok"], deadline)
                return
            except ControlPlaneError:
                kwok = self.components["kwok"]
                with log.open("rb") as out:
                    out.seek(start)
                    raced = KWOK_STARTUP_RACE in out.read().decode(errors="replace")
                if attempt == KWOK_STARTS or kwok.process.poll() is None or not raced:
                    raise
                self.components.pop("kwok")

    def _spawn_kwok(self) -> None:
        port = free_port()
        config = self.workdir / "kwok.yaml"
        stock = [
            yaml.safe_load((self.binary("kwok-stages") / f"{name}.yaml").read_text()) for name in ("pod-ready", "pod-delete")
        ]
        config.write_text(
            yaml.safe_dump_all(
                [
                    {
                        "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
                        "kind": "KwokConfiguration",
                        "options": {
                            "cidr": POD_CIDR,
                            "nodeLeaseDurationSeconds": 0,
                            "nodePlayStageParallelism": 16,
                            "podPlayStageParallelism": 16,
                            "manageNodesWithAnnotationSelector": f"{KWOK_NODE_ANNOTATION}=fake",
                            "serverAddress": f"127.0.0.1:{port}",
                        },
                    },
                    NODE_INITIALIZE,
                    NODE_NOT_READY,
                    *stock,
                    validation_complete([n for nodes in self._validation_faults.values() for n in nodes]),
                    *self._pod_faults.values(),
                ]
            )
        )
        self._run_binary(
            "kwok",
            [f"--config={config}", f"--kubeconfig={self.kubeconfig}", "--node-lease-duration-seconds=0"],
            health=f"http://127.0.0.1:{port}/healthz",
        )

    def _restart_kwok(self) -> None:
        stop_pid(self.components["kwok"].process.pid, self.components.pop("kwok").process)
        self._start_kwok(time.monotonic() + 30)
        self._write_state()

    def _pod_fault(self, kind: str, stage: Callable[[str], dict], validation_nodes: list[str] | None = None) -> Fault:
        self._fault_count += 1
        name = f"fault-{kind}-{self._fault_count}"
        self._pod_faults[name] = stage(name)
        if validation_nodes is not None:  # taken out of validation-complete's nodes
            self._validation_faults[name] = list(validation_nodes)
        self._restart_kwok()

        def clear() -> None:
            self._validation_faults.pop(name, None)
            if self._pod_faults.pop(name, None):
                self._restart_kwok()

        return Fault(clear)

    def clear_faults(self) -> None:
        if self._pod_faults:
            self._pod_faults.clear()
            self._validation_faults.clear()
            self._restart_kwok()
        down = client.CoreV1Api(self.api()).list_node(label_selector=f"{NOT_READY_LABEL}=true").items
        self._label_nodes([n.metadata.name for n in down], NOT_READY_LABEL, None)

    def _label_nodes(self, nodes: list[str], key: str, value: str | None) -> None:
        core = client.CoreV1Api(self.api())
        for node in nodes:
            core.patch_node(node, {"metadata": {"labels": {key: value}}})

    def pods_never_ready(self, nodes: list[str]) -> Fault:
        """New pods on these nodes run but never pass readiness."""
        return self._pod_fault(
            "never-ready",
            lambda name: _stage(
                name,
                "Pod",
                _on_nodes(nodes, _NEW_POD),
                {
                    "statusTemplate": _UNREADY_STATUS,
                    "event": {"type": "Warning", "reason": "Unhealthy", "message": "Readiness probe failed (injected fault)"},
                },
            ),
        )

    def pods_ready_after(self, nodes: list[str], seconds: float) -> Fault:
        """New pods on these nodes stay Pending, then become Ready after `seconds`."""
        ready = yaml.safe_load((self.binary("kwok-stages") / "pod-ready.yaml").read_text())
        return self._pod_fault(
            "slow",
            lambda name: _stage(name, "Pod", _on_nodes(nodes, _NEW_POD), ready["spec"]["next"], delay_ms=int(seconds * 1000)),
        )

    def pods_crash_loop(self, nodes: list[str], every: float = 2) -> Fault:
        """Pods on these nodes crash every `every` seconds: restartCount rises, never Ready."""
        return self._pod_fault(
            "crash-loop",
            lambda name: _stage(
                name,
                "Pod",
                _on_nodes(nodes),
                {
                    "statusTemplate": _CRASH_STATUS,
                    "event": {
                        "type": "Warning",
                        "reason": "BackOff",
                        "message": "Back-off restarting failed container (injected fault)",
                    },
                },
                delay_ms=int(every * 1000),
            ),
        )

    def validations_fail(self, nodes: list[str], message: str) -> Fault:
        """The validation pods made on these nodes fail, each container saying `message`."""
        selector = _on_nodes(nodes, _NEW_POD, _VALIDATION_POD)
        return self._pod_fault(
            "validation-fails",
            lambda name: _stage(name, "Pod", selector, {"statusTemplate": validation_ended(False, message)}, delay_ms=1000),
            nodes,
        )

    def validations_hang(self, nodes: list[str]) -> Fault:
        """The validation pods made on these nodes run and never end."""
        selector = _on_nodes(nodes, _NEW_POD, _VALIDATION_POD)
        hang = {"statusTemplate": _UNREADY_STATUS}
        return self._pod_fault("validation-hangs", lambda name: _stage(name, "Pod", selector, hang), nodes)

    def nodes_not_ready(self, nodes: list[str]) -> Fault:
        """These nodes report Ready=False (and get tainted not-ready) until the fault is cleared.
        A label, read by the permanent node-not-ready stage: no kwok restart needed."""
        self._label_nodes(nodes, NOT_READY_LABEL, "true")
        return Fault(lambda: self._label_nodes(nodes, NOT_READY_LABEL, None))

    # -- nodes --

    def add_nodes(
        self,
        n: int,
        gpu: bool = True,
        prefix: str | None = None,
        labels: dict | None = None,
        taints: list | None = None,
        gpus: int = 8,
        wait: bool = True,
        resources: dict | None = None,
    ) -> list[str]:
        """Create n simulated nodes (GPU nodes carry the gpu label, `gpus` allocatable GPUs and the
        other allocatable `resources`, e.g. {"metax-tech.com/sgpu": 16}) and return their names;
        with `wait`, return once kwok reports them Ready."""
        prefix = prefix or ("gpu-node" if gpu else "cpu-node")
        first = self._node_count.get(prefix, 0)
        self._node_count[prefix] = first + n
        names = [f"{prefix}-{i:04d}" for i in range(first, first + n)]
        local = threading.local()

        def create(name: str) -> None:
            if not hasattr(local, "core"):
                local.core = client.CoreV1Api(self.api())
            # The answer is not turned into a client model: at thousands of nodes that is most of the cost.
            local.core.create_node(
                node_manifest(name, gpus if gpu else 0, labels, taints, resources if gpu else None), _preload_content=False
            )

        with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, max(1, n))) as pool:
            list(pool.map(create, names))
        if wait:
            self.wait_nodes_ready(time.monotonic() + 60 + n / 20, names)
        return names

    def remove_nodes(self, names: list[str]) -> None:
        core = client.CoreV1Api(self.api())
        for name in names:
            core.delete_node(name)

    def wait_nodes_ready(self, deadline: float, names: list[str] | None = None, selector: str = "type=kwok") -> None:
        """Until the nodes matching `selector` (all of them, or `names`) exist, are Ready and the
        node-lifecycle controller has lifted the not-ready taint every new node starts with."""
        core = client.CoreV1Api(self.api())
        wanted = set(names) if names else None
        while True:
            self._check_alive()
            # Raw JSON: building client models for thousands of nodes costs seconds per poll.
            response = core.list_node(label_selector=selector, _preload_content=False)
            nodes = json.loads(response.data)["items"]
            not_ready = sorted((wanted or set()) - {n["metadata"]["name"] for n in nodes}) + [
                n["metadata"]["name"]
                for n in nodes
                if (wanted is None or n["metadata"]["name"] in wanted) and not is_schedulable(n)
            ]
            if not not_ready:
                return
            if time.monotonic() > deadline:
                log = self.components["kubelet" if NODE_NAME in not_ready else "kwok"].log
                raise ControlPlaneError(f"{len(not_ready)} nodes not Ready in time (e.g. {not_ready[0]}); log: {log}")
            time.sleep(0.3 if len(nodes) < 1000 else 2)


def is_schedulable(node: dict) -> bool:
    """A Node (as JSON) is Ready and free of the not-ready taint."""
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in node.get("status", {}).get("conditions", []))
    return ready and not any(t["key"] == NOT_READY_TAINT for t in node["spec"].get("taints", []))


def stop_pid(pid: int, process: subprocess.Popen | None = None, grace: float = 10) -> None:
    """SIGTERM, wait, SIGKILL one process we started (its Popen when we have it)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end:
        if process is not None:
            if process.poll() is not None:
                return
        elif not Path(f"/proc/{pid}").exists() or _is_zombie(pid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if process is not None:
        process.wait()


def _is_zombie(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    return True


# --- scripts/cluster ---------------------------------------------------------------------------

CLUSTER_DIR = Path(os.environ.get("METAX_CLUSTER_DIR") or CACHE / "cluster")


def _ours(pid: int, exe: str) -> bool:
    """The pid still runs the binary we started there (not a reused pid)."""
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/{pid}/exe") == exe
    return False


def running(workdir: Path) -> bool:
    """Some process of the cluster recorded in workdir still runs (a stale record does not count)."""
    state = workdir / "state.json"
    return state.exists() and any(_ours(pid, exe) for pid, exe in json.loads(state.read_text())["pids"].values())


def cluster_down(workdir: Path = CLUSTER_DIR) -> bool:
    state_file = workdir / "state.json"
    if not state_file.exists():
        return False
    state = json.loads(state_file.read_text())
    for pid, exe in reversed(list(state["pids"].values())):
        if _ours(pid, exe):
            stop_pid(pid)
    if state.get("node"):
        RealNode(workdir / "node", state["node"]).destroy()
    shutil.rmtree(workdir, ignore_errors=True)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/cluster",
        description=(
            "A local Kubernetes control plane with kwok-simulated GPU nodes, a real node for the tools "
            "image's pods and a local OCI registry, for trying the chart."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start it (in the background) and print the KUBECONFIG line")
    up.add_argument("--nodes", type=int, default=10, help="simulated GPU nodes (default 10)")
    up.add_argument("--plain-nodes", type=int, default=2, help="simulated nodes without GPUs (default 2)")
    up.add_argument("--port", type=int, default=6443, help="API server port on 127.0.0.1 (default 6443)")
    up.add_argument(
        "--kubernetes",
        default=K8S_VERSION,
        choices=[K8S_VERSION] + [v.version for v in matrix()],
        help=f"the Kubernetes version (default {K8S_VERSION}; the others, of scripts/controlplane/versions/matrix, "
        "have their API server built alone: with --api-only)",
    )
    up.add_argument("--api-only", action="store_true", help="etcd and the API server alone: no nodes, no registry")
    up.add_argument(
        "--no-real-node",
        dest="real_node",
        action="store_false",
        help="without the local OCI registry and the real node (no root needed; kwok nodes only)",
    )
    sub.add_parser("down", help="stop it and delete its files")
    sub.add_parser(
        "publish",
        help="build the tools image (scripts/image), push it and the chart to the cluster's "
        "registry; print chart=, registry=, image=, digest=, ca=",
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "down":
            print("stopped" if cluster_down() else f"no cluster running (nothing in {CLUSTER_DIR})")
            return 0
        if args.command == "publish":
            state = json.loads((CLUSTER_DIR / "state.json").read_text()) if running(CLUSTER_DIR) else {}
            if not state.get("registry"):
                raise ControlPlaneError("no cluster with a registry is running: 'scripts/cluster up' first")
            ca = CLUSTER_DIR / "pki" / "ca.crt"
            published = registry.publish(CACHE / "bin" / "helm3", state["registry"], ca, CLUSTER_DIR / "chart")
            for key, value in {**published, "ca": str(ca)}.items():
                print(f"{key}={value}")
            return 0
        if running(CLUSTER_DIR):
            raise ControlPlaneError(f"a cluster is already running ({CLUSTER_DIR}): 'scripts/cluster down' first")
        built = next((v.binaries for v in matrix() if v.version == args.kubernetes), KUBERNETES_BINARIES)
        if "kube-controller-manager" not in built and not args.api_only:
            raise ControlPlaneError(f"--kubernetes {args.kubernetes}: only its API server is built; add --api-only")
        shutil.rmtree(CLUSTER_DIR, ignore_errors=True)
        started = time.monotonic()
        cp = ControlPlane.start(
            CLUSTER_DIR,
            gpu_nodes=args.nodes,
            plain_nodes=args.plain_nodes,
            port=args.port,
            real_node=args.real_node and not args.api_only,
            timeout=180 if args.real_node else 90,
            kubernetes=args.kubernetes,
            api_only=args.api_only,
        )
    except (ControlPlaneError, RegistryError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    nodes = "no nodes" if args.api_only else f"{args.nodes} GPU nodes, {args.plain_nodes} plain nodes"
    print(
        f"Kubernetes {args.kubernetes} up in {time.monotonic() - started:.1f} s: {nodes}, "
        f"API server {cp.server}, logs in {CLUSTER_DIR / 'logs'}"
    )
    if cp.node:
        print(
            f"real node {NODE_NAME} (tainted {TOOLS_NODE}=true:NoSchedule), OCI registry {cp.registry} "
            f"(trust {cp.ca}: export SSL_CERT_FILE={cp.ca} for helm)"
        )
    print(f"export KUBECONFIG={cp.kubeconfig}")
    print("stop it with: scripts/cluster down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
