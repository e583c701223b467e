"""The support bundle at scale: the real `metax-operator gather` against a real API server holding
500, then 10,000 GPU nodes, and the size of what it writes.

On etcd and kube-apiserver alone (`ControlPlane.start(api_only=True)`): the chart installed with
the real Helm 3 (no hooks) and the CR bootstrapped by `metax-operator bootstrap`, as the e2e tests
do; then, written the way the cluster's own writers would, the nodes (the metax labels and
annotations gpu-label and the runner set, a GPU taint, a kubelet's status with its conditions and
~40 images), one driver pod per node (the driver DaemonSet's template, Running), the DaemonSet
controller's event for each, the runner's pod and the CR's status in mid-rollout: a wave of 10% of
the nodes, failures, held back, cordoned, timed out, needing a reboot (`rollout.status`'s types).

No node runs a kubelet, so the container logs come from a stand-in kubelet on loopback that every
node's status points at (InternalIP 127.0.0.1, no Hostname address: nothing is looked up): it
honours `limitBytes` as a kubelet does and has 8 MiB of log for every container, current and
previous: the worst case, each log at its cap (varied klog lines, compressing about 4.6 times). The
runner pod has no IP, so the scrape is not gathered (the manifest says why). No controller
manager runs: there are no ControllerRevisions, and the pods of the components other than the
driver are left out (a cluster has a `pods.txt` line for each component's pod on each node).

It prints each part's size (plain and gzip-compressed on its own), the bundle's, the gather's wall
time and peak memory (the process's maximum RSS), and each ratio 10,000/500.
`python -m tests.bench gather` (part of `make bench`); `BENCH_GATHER_NODES=500,2000` sets the sizes.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import json
import os
import random
import ssl
import string
import subprocess
import tarfile
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from kubernetes import client

from metax_operator import contract
from metax_operator.rollout import status as rollout
from tests.controlplane import ControlPlane, issue_cert, node_manifest
from tests.e2e.tools import METAX, bootstrap, install_chart, release_values

SIZES = [int(n) for n in os.environ.get("BENCH_GATHER_NODES", "500,10000").split(",")]
NS, RELEASE = "metax-operator", "metax"
VALUES = {"registry": "cr.example.com/metax", "driver": {"payload": {"version": "2.32.0.6"}}}
LOG_SIZE = 8 * 2**20  # each container's log on the stand-in kubelet, current and previous
WAVE_SHARE = 0.1  # the step in flight: 10% of the nodes


def driver_log(size: int) -> bytes:
    """`size` bytes of a driver container's log: klog lines whose times, GPUs and counters vary,
    so that it compresses about as a real one does (not as one line repeated)."""
    rng, lines, total, n = random.Random(7), [], 0, 0
    events = ("heartbeat ok", "ecc corrected 0", "power 412 W", "temp 61 C", "clock 1600 MHz", "vf 0 bound")
    while total < size:
        n += 1
        line = (
            f"I1202 {n // 36000 % 24:02d}:{n // 600 % 60:02d}:{n // 10 % 60:02d}.{rng.randrange(10**6):06d} "
            f"{rng.randrange(1, 400)} driver.go:{rng.randrange(100, 900)}] mxgvm: GPU 0000:{rng.randrange(16):02x}:00.0 "
            f"{rng.choice(events)} seq={n} id={rng.getrandbits(32):08x}\n"
        ).encode()
        lines.append(line)
        total += len(line)
    return b"".join(lines)[:size]


class StandInKubelet:
    """Serves `/containerLogs/NS/POD/CONTAINER` over TLS on 127.0.0.1: LOG_SIZE bytes of log,
    the last `limitBytes` of them; counts what it served."""

    def __init__(self, pki: Path):
        issue_cert(pki, "kubelet", "/CN=stand-in-kubelet", "serverAuth", "IP:127.0.0.1")
        log = driver_log(LOG_SIZE)
        served = self.served = [0, 0]  # requests, bytes

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_):
                pass

            def do_GET(self):
                url = urlsplit(self.path)
                if not url.path.startswith("/containerLogs/"):
                    self.send_error(404)
                    return
                limit = int(parse_qs(url.query).get("limitBytes", [LOG_SIZE])[0])
                body = log[-min(limit, LOG_SIZE) :]
                served[0], served[1] = served[0] + 1, served[1] + len(body)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(pki / "kubelet.crt", pki / "kubelet.key")
        self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


# -- the cluster's objects, as their writers would have them ------------------------------------


def gpu_node(name: str, kubelet_port: int, index: int) -> dict:
    """A GPU node as gpu-label, the runner and a kubelet leave it."""
    node = node_manifest(
        name,
        8,
        {
            contract.GPU_PRODUCT_LABEL: "C500",
            contract.GPU_VFNUM_LABEL: "0",
            "metax-tech.com/gpu.count": "8",
            "metax-tech.com/gpu.memory": "65536",
            "metax-tech.com/driver.version": "2.32.0.6",
            "metax-tech.com/maca.version": "2.32.0.6",
            contract.STATE_LABEL: "done",
            "node.kubernetes.io/instance-type": "gpu.8xc500",
            "topology.kubernetes.io/zone": f"zone-{index % 4}",
        },
        [{"key": contract.GPU_TAINT, "value": "present", "effect": "NoSchedule"}],
    )
    node["metadata"]["annotations"].update(
        {
            contract.VFIO_ANNOTATION: json.dumps({str(i): 1 for i in range(8)}),
            "metax-tech.com/gpu.topology": json.dumps([[0, 1, 2, 3], [4, 5, 6, 7]]),
            "node.alpha.kubernetes.io/ttl": "0",
            "volumes.kubernetes.io/controller-managed-attach-detach": "true",
        }
    )
    now = rollout.rfc3339(time.time())
    conditions = [
        ("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
        ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
        ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
        ("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
    ]
    resources = {"cpu": "128", "memory": "1056587764Ki", "pods": "110", contract.GPU_RESOURCE: "8"}
    node["status"] = {
        "capacity": resources,
        "allocatable": resources,
        "conditions": [
            {"type": t, "status": s, "reason": r, "message": m, "lastHeartbeatTime": now, "lastTransitionTime": now}
            for t, s, r, m in conditions
        ],
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
        "nodeInfo": {
            "architecture": "amd64",
            "operatingSystem": "linux",
            "osImage": "Ubuntu 22.04.4 LTS",
            "kernelVersion": "5.15.0-105-generic",
            "containerRuntimeVersion": "containerd://1.7.13",
            "kubeletVersion": "v1.34.4",
            "kubeProxyVersion": "v1.34.4",
            "machineID": f"{index:032x}",
            "systemUUID": f"{index:08x}-0000-0000-0000-000000000000",
            "bootID": f"{index:08x}-0000-0000-0000-000000000001",
        },
        "images": [
            {
                "names": [f"cr.example.com/metax/image-{i}@sha256:{i:064x}", f"cr.example.com/metax/image-{i}:v1.{i}"],
                "sizeBytes": 10**8 + i,
            }
            for i in range(40)
        ],
    }
    return node


def suffix(index: int) -> str:
    """Five characters as a controller's generated names end, distinct for each index (7919 is
    prime to 36, so index -> index * 7919 mod 36**5 is one to one)."""
    digits, n = string.digits + string.ascii_lowercase, index * 7919 % 36**5
    return "".join(digits[n // 36**i % 36] for i in range(5))


def pod_of(template: dict, owner: dict, kind: str, node: str, name: str) -> dict:
    """A pod of `owner` (a `kind`) on `node`, as its controller creates it."""
    meta = template["metadata"]
    spec = json.loads(json.dumps(template["spec"]))
    spec["nodeName"] = node
    spec["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]
            }
        }
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {**meta.get("labels", {}), contract.REVISION_LABEL: "6d5f8b7c9d", "pod-template-generation": "1"},
            "annotations": meta.get("annotations", {}),
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": kind,
                    "name": owner["metadata"]["name"],
                    "uid": owner["metadata"]["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": spec,
    }


def running_status(pod: dict, index: int) -> dict:
    """What a kubelet reports of the pod once its containers run."""
    now = rollout.rfc3339(time.time())

    def container(c: dict, init: bool) -> dict:
        state = {"terminated": {"exitCode": 0, "reason": "Completed"}} if init else {"running": {"startedAt": now}}
        return {
            "name": c["name"],
            "image": c["image"],
            "imageID": f"{c['image'].split(':')[0]}@sha256:{index:064x}",
            "containerID": f"containerd://{index:064x}",
            "ready": not init,
            "started": not init,
            "restartCount": index % 3,
            "state": state,
        }

    spec = pod["spec"]
    return {
        "phase": "Running",
        "hostIP": "127.0.0.1",
        "conditions": [
            {"type": t, "status": "True", "lastTransitionTime": now}
            for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")
        ],
        "startTime": now,
        "initContainerStatuses": [container(c, True) for c in spec.get("initContainers") or ()],
        "containerStatuses": [container(c, False) for c in spec["containers"]],
        "qosClass": "Burstable",
    }


def created_event(owner: dict, pod: str, index: int) -> dict:
    now = rollout.rfc3339(time.time())
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{owner['metadata']['name']}.{index:016x}"},
        "involvedObject": {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "name": owner["metadata"]["name"],
            "namespace": NS,
            "uid": owner["metadata"]["uid"],
            "resourceVersion": owner["metadata"]["resourceVersion"],
        },
        "reason": "SuccessfulCreate",
        "message": f"Created pod: {pod}",
        "source": {"component": "daemonset-controller"},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
        "type": "Normal",
        "reportingComponent": "daemonset-controller",
    }


def in_parallel(work, items) -> None:
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(work, items))


class Fleet:
    """The cluster grown to n nodes, each with its driver pod and that pod's event."""

    def __init__(self, cp: ControlPlane, kubelet: StandInKubelet):
        self.cp, self.kubelet, self.nodes = cp, kubelet, 0
        self.local = threading.local()
        api = cp.api()
        apps = client.AppsV1Api(api)
        component = f"{contract.COMPONENT_LABEL}=%s"
        (driver,) = apps.list_namespaced_daemon_set(NS, label_selector=component % "driver").items
        (runner,) = apps.list_namespaced_deployment(NS, label_selector=component % "runner").items
        self.driver, self.runner = api.sanitize_for_serialization(driver), api.sanitize_for_serialization(runner)

    def core(self) -> client.CoreV1Api:
        if not hasattr(self.local, "core"):
            self.local.core = client.CoreV1Api(self.cp.api())
        return self.local.core

    def grow(self, n: int) -> list[str]:
        names = [f"gpu-node-{i:05d}" for i in range(self.nodes, n)]

        def one(pair: tuple[int, str]) -> None:
            index, node = pair
            core = self.core()
            core.create_node(gpu_node(node, self.kubelet.port, index), _preload_content=False)
            pod = pod_of(
                self.driver["spec"]["template"],
                self.driver,
                "DaemonSet",
                node,
                f"{self.driver['metadata']['name']}-{suffix(index)}",
            )
            core.create_namespaced_pod(NS, pod, _preload_content=False)
            status = {"status": running_status(pod, index)}
            core.patch_namespaced_pod_status(pod["metadata"]["name"], NS, status, _preload_content=False)
            core.create_namespaced_event(NS, created_event(self.driver, pod["metadata"]["name"], index), _preload_content=False)

        in_parallel(one, list(enumerate(names, self.nodes)))
        if self.nodes == 0:
            self.add_runner(names[0])
        self.nodes = n
        return [f"gpu-node-{i:05d}" for i in range(n)]

    def add_runner(self, node: str) -> None:
        """The runner's pod, Running but with no IP: its logs are gathered, its scrape is not."""
        pod = pod_of(
            self.runner["spec"]["template"], self.runner, "ReplicaSet", node, f"{RELEASE}-metax-operator-runner-{suffix(0)}"
        )
        del pod["spec"]["affinity"]
        self.core().create_namespaced_pod(NS, pod, _preload_content=False)
        self.core().patch_namespaced_pod_status(pod["metadata"]["name"], NS, {"status": running_status(pod, 0)})


def mid_rollout(nodes: list[str]) -> dict:
    """The CR's `status.upgradeStatus` in mid-rollout over `nodes`: a wave of WAVE_SHARE of them,
    as the runner writes it."""
    wave = nodes[: int(len(nodes) * WAVE_SHARE)]
    tail = nodes[len(wave) :]
    status = rollout.UpgradeStatus(upgrading=True, phase=rollout.PROGRESSING, message="step 2 of 4: waiting for the wave")
    status.step = rollout.StepStatus(
        current_step_index=1,
        current_upgrade_replicas=len(wave),
        total_upgrade_replicas=len(nodes),
        current_step_state=rollout.STEP_UPGRADE,
        message=f"{len(wave)} driver pods in the wave",
    )
    resume = status.resume
    resume.wave, resume.wave_kind = wave, rollout.WaveKind.UPGRADE
    resume.cordoned = rollout.NodeList.of(wave)
    resume.failed = rollout.NodeList.of(tail[: len(nodes) // 50])
    resume.held = rollout.NodeList.of(tail[len(nodes) // 50 : len(nodes) // 25])
    resume.timed_out_nodes = tail[len(nodes) // 25 : len(nodes) // 25 + 5]
    resume.need_reboot = rollout.NodeList.of(tail[-(len(nodes) // 100) :])
    return {"status": {"upgradeStatus": status.to_json()}}


# -- the measurement ----------------------------------------------------------------------------


def gather(cp: ControlPlane, out: Path) -> dict:
    """One `metax-operator gather`: its wall time, peak RSS, and each part's size."""
    started = time.monotonic()
    process = subprocess.Popen(
        [METAX, "gather", "--kubeconfig", str(cp.kubeconfig), "-n", NS, "--output", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    _, code, usage = os.wait4(process.pid, 0)
    wall = time.monotonic() - started
    printed, errors = process.stdout.read().decode(), process.stderr.read().decode()
    if code:
        raise RuntimeError(f"metax-operator gather failed: {errors or printed}")
    parts: dict[str, list[int]] = {}
    with tarfile.open(out) as archive:
        for member in archive.getmembers():
            name = member.name.split("/", 1)[1]
            content = archive.extractfile(member).read()
            group = "logs/*" if name.startswith("logs/") else name
            sizes = parts.setdefault(group, [0, 0, 0])
            sizes[0], sizes[1], sizes[2] = sizes[0] + 1, sizes[1] + len(content), sizes[2] + len(gzip.compress(content))
            if name == "manifest.json":
                manifest = json.loads(content)
    return {
        "wall": wall,
        "rss": usage.ru_maxrss * 1024,
        "bundle": out.stat().st_size,
        "plain": sum(p[1] for p in parts.values()),
        "parts": parts,
        "manifest": manifest,
        "printed": printed.strip(),
    }


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def report(figures: dict[int, dict]) -> None:
    small, big = min(figures), max(figures)
    a, b = figures[small], figures[big]
    print(f"{'part':<26}{f'{small:,} nodes':>26}{f'{big:,} nodes':>26}{'ratio':>8}")
    print(f"{'':<26}{'plain':>13}{'gzip':>13}{'plain':>13}{'gzip':>13}")
    for name in sorted(set(a["parts"]) | set(b["parts"])):
        pa, pb = a["parts"].get(name, [0, 0, 0]), b["parts"].get(name, [0, 0, 0])
        label = f"{name} ({pa[0]}/{pb[0]} files)" if name == "logs/*" else name
        ratio = f"{pb[1] / pa[1]:.1f}" if pa[1] else "-"
        print(f"{label:<26}{pa[1]:>13,}{pa[2]:>13,}{pb[1]:>13,}{pb[2]:>13,}{ratio:>8}")
    ratio = b["bundle"] / a["bundle"]
    print(f"{'bundle (tar.gz)':<26}{a['plain']:>13,}{a['bundle']:>13,}{b['plain']:>13,}{b['bundle']:>13,}{ratio:>8.1f}")
    print(f"{'wall time':<26}{a['wall']:>25.1f}s{b['wall']:>25.1f}s{b['wall'] / a['wall']:>8.1f}")
    print(f"{'peak RSS':<26}{mib(a['rss']):>26}{mib(b['rss']):>26}{b['rss'] / a['rss']:>8.1f}")
    for size, f in sorted(figures.items()):
        notes = f["manifest"]["logNodes"]
        missing = [name for name, outcome in f["manifest"]["parts"].items() if outcome != "ok"]
        print(
            f"{size:,} nodes: logs of {len(notes['gathered'])} nodes gathered, {notes['notGathered']:,} more named left out; "
            f"{len(missing)} parts not gathered (e.g. {', '.join(missing[:2])})"
        )
    per_node = (b["plain"] - a["plain"]) / (big - small)
    print(f"growth: {per_node:,.0f} bytes plain per node between {small:,} and {big:,} nodes")


def main() -> None:
    print(
        f"metax-operator gather at {', '.join(f'{n:,}' for n in SIZES)} GPU nodes (one driver pod each, a wave of "
        f"{WAVE_SHARE:.0%} in flight, every log {LOG_SIZE // 2**20} MiB: the worst case); {os.cpu_count()} CPUs"
    )
    figures: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="metax-bench-gather-") as tmp:
        cp = ControlPlane.start(Path(tmp) / "cp", api_only=True, timeout=120)
        try:
            kubelet = StandInKubelet(cp.workdir / "pki")
            install_chart(cp, cp.api(), Path(tmp), RELEASE, NS, VALUES)
            bootstrap(cp, Path(tmp), RELEASE, release_values(cp, RELEASE, NS))
            fleet = Fleet(cp, kubelet)
            custom = client.CustomObjectsApi(cp.api())
            for size in sorted(SIZES):
                started = time.monotonic()
                nodes = fleet.grow(size)
                custom.patch_cluster_custom_object_status(
                    "gpu.metax-tech.com", "v1", contract.CR_PLURAL, contract.CR_NAME, mid_rollout(nodes)
                )
                print(f"{size:,} nodes, pods and events written in {time.monotonic() - started:.0f} s", flush=True)
                figures[size] = gather(cp, Path(tmp) / f"bundle-{size}.tar.gz")
                print(f"  {figures[size]['printed'].splitlines()[0]}", flush=True)
            print(f"the stand-in kubelet served {kubelet.served[0]:,} log requests, {mib(kubelet.served[1])}")
        finally:
            cp.stop()
    report(figures)


if __name__ == "__main__":
    main()
