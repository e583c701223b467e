"""Nodes and pods as a large GPU cluster holds them, for the runner's benchmark at scale
(tests/scaleapi.py serves them).

A Node is what a kubelet and the usual node agents (kube-controller-manager, calico,
node-feature-discovery, the chart's gpu-label, node-problem-detector, the runner) leave on a GPU
server: 34 labels, 10 annotations, 8 managedFields entries, the GPU taint, capacity with
`metax-tech.com/gpu: 8`, 7 conditions, nodeInfo and 40-60 container images with their digests,
about 20 KB of JSON. A pod is a DaemonSet's pod template (the chart's own, rendered by Helm, or a
platform DaemonSet's: kube-proxy, calico-node, ...) as the DaemonSet controller, the API server's
defaulting and the kubelet leave it: the controller's tolerations and node affinity, the
projected service-account volume, container defaults, 5 conditions, init and container statuses,
managedFields. A training pod requests 8 GPUs and sets `METAX_MACA_VERSION`.

Everything is a function of its index: the same cluster on every run.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random

from metax_operator.contract import GPU_RESOURCE, STATE_LABEL

CREATED = "2025-06-02T08:14:31Z"
HEARTBEAT = "2025-07-01T10:00:00Z"


def digest(seed: str, length: int = 64) -> str:
    """`length` hex digits derived from `seed`."""
    out, i = "", 0
    while len(out) < length:
        out += hashlib.sha256(f"{seed}/{i}".encode()).hexdigest()
        i += 1
    return out[:length]


def uid(seed: str) -> str:
    x = digest(seed, 32)
    return f"{x[:8]}-{x[8:12]}-{x[12:16]}-{x[16:20]}-{x[20:]}"


def node_name(i: int) -> str:
    return f"gpu-node-{i:05d}"


# -- managedFields ---------------------------------------------------------------------------------


def fields_of(obj) -> dict:
    """The FieldsV1 set covering `obj` (list items keyed as the API server keys them)."""
    if isinstance(obj, dict):
        out = {".": {}} if obj else {}
        out.update({f"f:{k}": fields_of(v) for k, v in obj.items()})
        return out
    if isinstance(obj, list):
        out = {".": {}} if obj else {}
        for item in obj:
            if not isinstance(item, dict):
                out[f"v:{json.dumps(item)}"] = {}
                continue
            key = next((k for k in ("name", "type", "containerPort", "mountPath", "key") if k in item), None)
            if key is not None:
                out[f"k:{json.dumps({key: item[key]}, separators=(',', ':'))}"] = fields_of(item)
        return out
    return {}


def managed(manager: str, fields: dict, time: str, subresource: str = "") -> dict:
    entry = {"manager": manager, "operation": "Update", "apiVersion": "v1", "time": time, "fieldsType": "FieldsV1"}
    entry["fieldsV1"] = fields
    if subresource:
        entry["subresource"] = subresource
    return entry


# -- the images a GPU node has pulled ----------------------------------------------------------------

_INFRA_IMAGES = [
    ("registry.k8s.io/kube-proxy", ["v1.30.4", "v1.30.2"]),
    ("registry.k8s.io/pause", ["3.9", "3.8"]),
    ("registry.k8s.io/sig-storage/csi-node-driver-registrar", ["v2.11.1"]),
    ("registry.k8s.io/sig-storage/livenessprobe", ["v2.13.1"]),
    ("registry.k8s.io/nfd/node-feature-discovery", ["v0.16.4"]),
    ("registry.k8s.io/node-problem-detector/node-problem-detector", ["v0.8.19"]),
    ("docker.io/calico/node", ["v3.28.1", "v3.27.3"]),
    ("docker.io/calico/cni", ["v3.28.1", "v3.27.3"]),
    ("docker.io/calico/pod2daemon-flexvol", ["v3.28.1"]),
    ("docker.io/calico/csi", ["v3.28.1"]),
    ("docker.io/calico/node-driver-registrar", ["v3.28.1"]),
    ("quay.io/prometheus/node-exporter", ["v1.8.2", "v1.8.1"]),
    ("cr.fluentbit.io/fluent/fluent-bit", ["3.1.7", "3.0.4"]),
    ("registry.example.com/infra/nas-csi-plugin", ["v1.4.2", "v1.4.1"]),
    ("registry.example.com/infra/rdma-shared-dp", ["v1.5.1"]),
    ("registry.example.com/infra/multus-cni", ["v4.1.0"]),
    ("registry.example.com/infra/sriov-cni", ["v2.8.1"]),
    ("cr.metax-tech.com/public-cloud-native/metax-driver", ["2.32.0.6-amd64", "2.31.0.4-amd64"]),
    ("cr.metax-tech.com/public-cloud-native/driver-manager", ["0.10.0", "0.9.2"]),
    ("cr.metax-tech.com/public-cloud-native/gpu-label", ["0.10.0", "0.9.2"]),
    ("cr.metax-tech.com/public-cloud-native/gpu-device", ["0.10.0", "0.9.2"]),
    ("cr.metax-tech.com/public-cloud-native/container-runtime", ["0.10.0"]),
    ("cr.metax-tech.com/public-cloud-native/mx-exporter", ["0.10.0", "0.9.2"]),
    ("cr.metax-tech.com/public-cloud-native/maca-c500", ["2.18.0.3-ubuntu18.04-amd64", "2.17.0.7-ubuntu18.04-amd64"]),
    ("cr.metax-tech.com/public-cloud-native/metax-operator-tools", ["0.10.0"]),
]
_ML_REPOS = [
    *(f"maca-{name}" for name in ("pytorch", "vllm", "megatron", "deepspeed", "tensorflow", "paddle", "triton", "sglang")),
    *(f"team-{t}/{job}" for t in "abcde" for job in ("train", "infer")),
]


def _image(repo: str, tag: str, extra: tuple[str, ...] = ()) -> dict:
    return {"names": [f"{repo}@sha256:{digest(repo + tag)}", f"{repo}:{tag}", *extra], "sizeBytes": 0}


def _image_pools() -> tuple[list[dict], list[dict]]:
    infra = [_image(repo, tag) for repo, tags in _INFRA_IMAGES for tag in tags]
    ml = [
        _image(
            f"hub.local/ml/{name}", f"2.{v}-maca2.{18 + v % 3}-py310", (f"hub.local/ml/{name}:latest-{v}",) if v % 4 == 0 else ()
        )
        for name in _ML_REPOS
        for v in range(8)
    ]
    sizes = random.Random(7)
    for image in infra + ml:
        image["sizeBytes"] = sizes.randint(30_000_000, 28_000_000_000)
    return infra, ml


_INFRA, _ML = _image_pools()


def node_images(i: int) -> list[dict]:
    """40-60 images: the infrastructure's and a node's own choice of training images, largest
    first as the kubelet reports them."""
    rnd = random.Random(i * 7919 + 1)
    count = rnd.randint(40, 60)
    infra = _INFRA[: count - 12]
    return sorted(infra + rnd.sample(_ML, count - len(infra)), key=lambda image: -image["sizeBytes"])


# -- nodes -----------------------------------------------------------------------------------------

NODE_CONDITIONS = [
    ("KernelDeadlock", "False", "KernelHasNoDeadlock", "kernel has no deadlock"),
    ("GPUUnhealthy", "False", "GPUIsHealthy", "all 8 MetaX GPUs report healthy"),
    ("NetworkUnavailable", "False", "CalicoIsUp", "Calico is running on this node"),
    ("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
    ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
    ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
    ("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
]
_NFD_LABELS = {
    "feature.node.kubernetes.io/cpu-cpuid.AVX512F": "true",
    "feature.node.kubernetes.io/cpu-cpuid.AMXTILE": "true",
    "feature.node.kubernetes.io/cpu-model.vendor_id": "Intel",
    "feature.node.kubernetes.io/cpu-model.family": "6",
    "feature.node.kubernetes.io/cpu-model.id": "143",
    "feature.node.kubernetes.io/kernel-version.full": "5.15.0-105-generic",
    "feature.node.kubernetes.io/kernel-version.major": "5",
    "feature.node.kubernetes.io/kernel-version.minor": "15",
    "feature.node.kubernetes.io/pci-9999.present": "true",
    "feature.node.kubernetes.io/pci-15b3.present": "true",
    "feature.node.kubernetes.io/network-sriov.capable": "true",
    "feature.node.kubernetes.io/system-os_release.ID": "ubuntu",
    "feature.node.kubernetes.io/system-os_release.VERSION_ID": "22.04",
    "feature.node.kubernetes.io/memory-numa": "true",
}
_GPU_LABELS = {
    "metax-tech.com/gpu.installed": "true",
    "metax-tech.com/gpu.product": "C500",
    "metax-tech.com/gpu.vfnum": "0",
    "metax-tech.com/gpu.count": "8",
    "metax-tech.com/gpu.memory": "65536",
    "metax-tech.com/driver.version": "2.32.0.6",
}


def node(i: int) -> dict:
    """GPU node `i` as its kubelet and node agents left it, its driver upgrade state `done`."""
    name = node_name(i)
    rack, block = i // 32, i // 1024
    ip = f"10.{20 + i // 65536}.{(i // 256) % 256}.{i % 256}"
    kubelet_labels = {
        "beta.kubernetes.io/arch": "amd64",
        "beta.kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "node.kubernetes.io/instance-type": "gpu.c500x8.224c2t",
        "topology.kubernetes.io/region": "cn-north-7",
        "topology.kubernetes.io/zone": f"cn-north-7{'abc'[block % 3]}",
    }
    labels = {
        **kubelet_labels,
        "node-role.kubernetes.io/worker": "",
        "cluster.example.com/pool": f"train-{'abcd'[i % 4]}",
        "cluster.example.com/rack": f"r{rack:04d}",
        "topology.example.com/spine": f"s{block:02d}",
        "topology.example.com/leaf": f"l{rack:04d}",
        **_NFD_LABELS,
        **_GPU_LABELS,
        STATE_LABEL: "done",
    }
    annotations = {
        "csi.volume.kubernetes.io/nodeid": json.dumps({"csi.tigera.io": name, "nas.csi.example.com": name}),
        "kubeadm.alpha.kubernetes.io/cri-socket": "unix:///var/run/containerd/containerd.sock",
        "node.alpha.kubernetes.io/ttl": "0",
        "projectcalico.org/IPv4Address": f"{ip}/16",
        "projectcalico.org/IPv4VXLANTunnelAddr": f"192.168.{(i // 64) % 256}.{(i % 64) * 4}",
        "volumes.kubernetes.io/controller-managed-attach-detach": "true",
        "nfd.node.kubernetes.io/feature-labels": ",".join(k.split("/", 1)[1] for k in _NFD_LABELS),
        "nfd.node.kubernetes.io/extended-resources": "",
        "nfd.node.kubernetes.io/master.version": "v0.16.4",
        "nfd.node.kubernetes.io/worker.version": "v0.16.4",
    }
    capacity = {
        "cpu": "224",
        "ephemeral-storage": "3750738540Ki",
        "hugepages-1Gi": "0",
        "hugepages-2Mi": "0",
        "memory": "2113327768Ki",
        GPU_RESOURCE: "8",
        "pods": "110",
        "rdma/hca_shared_devices_a": "1k",
    }
    allocatable = {**capacity, "cpu": "222", "ephemeral-storage": "3456700324070", "memory": "2102739608Ki"}
    conditions = [
        {
            "type": t,
            "status": s,
            "lastHeartbeatTime": HEARTBEAT,
            "lastTransitionTime": "2025-06-02T08:15:40Z",
            "reason": r,
            "message": m,
        }
        for t, s, r, m in NODE_CONDITIONS
    ]
    spec = {
        "podCIDR": f"10.{128 + i // 256}.{i % 256}.0/24",
        "podCIDRs": [f"10.{128 + i // 256}.{i % 256}.0/24"],
        "providerID": f"baremetal://cn-north-7/{name}",
        "taints": [{"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}],
    }
    status = {
        "capacity": capacity,
        "allocatable": allocatable,
        "conditions": conditions,
        "addresses": [{"type": "InternalIP", "address": ip}, {"type": "Hostname", "address": name}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
        "nodeInfo": {
            "machineID": digest(f"m{i}", 32),
            "systemUUID": uid(f"s{i}"),
            "bootID": uid(f"b{i}"),
            "kernelVersion": "5.15.0-105-generic",
            "osImage": "Ubuntu 22.04.4 LTS",
            "containerRuntimeVersion": "containerd://1.7.13",
            "kubeletVersion": "v1.30.4",
            "kubeProxyVersion": "v1.30.4",
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
        "images": node_images(i),
        "runtimeHandlers": [
            {"name": "runc", "features": {"recursiveReadOnlyMounts": True, "userNamespaces": True}},
            {"name": "", "features": {"recursiveReadOnlyMounts": True, "userNamespaces": True}},
        ],
        "features": {"supplementalGroupsPolicy": True},
    }
    condition_fields = {f'k:{{"type":"{c["type"]}"}}': fields_of({k: v for k, v in c.items()}) for c in conditions}
    condition_items = list(condition_fields.items())
    managed_fields = [
        managed(
            "kube-controller-manager",
            {
                "f:metadata": {"f:annotations": {"f:node.alpha.kubernetes.io/ttl": {}}},
                "f:spec": fields_of({"podCIDR": "", "podCIDRs": spec["podCIDRs"]}),
            },
            CREATED,
        ),
        managed(
            "kubelet",
            {
                "f:metadata": {
                    "f:annotations": fields_of({"volumes.kubernetes.io/controller-managed-attach-detach": ""}),
                    "f:labels": fields_of(kubelet_labels),
                },
                "f:spec": {"f:providerID": {}},
            },
            CREATED,
        ),
        managed(
            "calico-node",
            {
                "f:metadata": {
                    "f:annotations": {"f:projectcalico.org/IPv4Address": {}, "f:projectcalico.org/IPv4VXLANTunnelAddr": {}}
                },
                "f:status": {"f:conditions": dict(condition_items[2:3])},
            },
            "2025-06-02T08:15:40Z",
            "status",
        ),
        managed(
            "nfd-master",
            {
                "f:metadata": {
                    "f:annotations": {f"f:{k}": {} for k in annotations if k.startswith("nfd.")},
                    "f:labels": fields_of(_NFD_LABELS),
                }
            },
            "2025-06-02T08:16:02Z",
        ),
        managed("gpu-label", {"f:metadata": {"f:labels": fields_of(_GPU_LABELS)}}, "2025-06-02T08:17:11Z"),
        managed("metax-operator-runner", {"f:metadata": {"f:labels": {f"f:{STATE_LABEL}": {}}}}, "2025-06-20T12:00:00Z"),
        managed("node-problem-detector", {"f:status": {"f:conditions": dict(condition_items[:2])}}, HEARTBEAT, "status"),
        managed(
            "kubelet",
            {
                "f:status": {
                    "f:allocatable": fields_of(allocatable),
                    "f:capacity": fields_of(capacity),
                    "f:conditions": dict(condition_items[3:]),
                    "f:daemonEndpoints": {"f:kubeletEndpoint": {"f:Port": {}}},
                    "f:features": {".": {}, "f:supplementalGroupsPolicy": {}},
                    "f:images": {},
                    "f:nodeInfo": {"f:bootID": {}, "f:machineID": {}, "f:systemUUID": {}},
                    "f:runtimeHandlers": {},
                }
            },
            HEARTBEAT,
            "status",
        ),
    ]
    metadata = {
        "name": name,
        "uid": uid(f"node{i}"),
        "resourceVersion": "1",
        "creationTimestamp": CREATED,
        "labels": labels,
        "annotations": annotations,
        "managedFields": managed_fields,
    }
    return {"kind": "Node", "apiVersion": "v1", "metadata": metadata, "spec": spec, "status": status}


def heartbeat(obj: dict, when: str) -> dict:
    """The node after its kubelet's (and node-problem-detector's) next status report: every
    condition's lastHeartbeatTime and the status managers' times moved. A new object sharing the
    unchanged parts: the stored one is never mutated."""
    status = {**obj["status"], "conditions": [{**c, "lastHeartbeatTime": when} for c in obj["status"]["conditions"]]}
    meta = dict(obj["metadata"])
    meta["managedFields"] = [
        {**m, "time": when} if m.get("subresource") == "status" and m["manager"] != "calico-node" else m
        for m in meta["managedFields"]
    ]
    return {**obj, "metadata": meta, "status": status}


# -- pods --------------------------------------------------------------------------------------------

#: What the DaemonSet controller adds to every pod it creates.
DAEMONSET_TOLERATIONS = [
    {"key": f"node.kubernetes.io/{key}", "operator": "Exists", "effect": effect}
    for key, effect in (
        ("not-ready", "NoExecute"),
        ("unreachable", "NoExecute"),
        ("disk-pressure", "NoSchedule"),
        ("memory-pressure", "NoSchedule"),
        ("pid-pressure", "NoSchedule"),
        ("unschedulable", "NoSchedule"),
    )
]
_SERVICE_ACCOUNT_MOUNT = {
    "name": "kube-api-access",
    "readOnly": True,
    "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
}
_SERVICE_ACCOUNT_VOLUME = {
    "name": "kube-api-access",
    "projected": {
        "defaultMode": 420,
        "sources": [
            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            {
                "downwardAPI": {
                    "items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]
                }
            },
        ],
    },
}


def _defaulted(container: dict) -> dict:
    """A container as the API server's defaulting leaves it."""
    c = copy.deepcopy(container)
    c.setdefault("imagePullPolicy", "IfNotPresent")
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    c.setdefault("resources", {})
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        if probe in c:
            c[probe] = {"failureThreshold": 3, "periodSeconds": 10, "successThreshold": 1, "timeoutSeconds": 1, **c[probe]}
    c["volumeMounts"] = [*c.get("volumeMounts", []), _SERVICE_ACCOUNT_MOUNT]
    return c


def _container_status(c: dict, seed: str, ready: bool, init: bool, started: str) -> dict:
    image = c.get("image", "busybox")
    out = {
        "name": c["name"],
        "image": image,
        "imageID": f"{image.rsplit(':', 1)[0]}@sha256:{digest(image)}",
        "containerID": f"containerd://{digest(seed)}",
        "ready": ready,
        "restartCount": 0,
        "started": not init,
        "lastState": {},
        "volumeMounts": [
            {
                "name": m["name"],
                "mountPath": m["mountPath"],
                **({"readOnly": True, "recursiveReadOnly": "Disabled"} if m.get("readOnly") else {}),
            }
            for m in c.get("volumeMounts", [])
        ],
    }
    if init:
        out["state"] = {
            "terminated": {
                "exitCode": 0,
                "reason": "Completed",
                "startedAt": started,
                "finishedAt": started,
                "containerID": out["containerID"],
            }
        }
    else:
        out["state"] = {"running": {"startedAt": started}}
    return out


def pod_status(spec: dict, name: str, phase: str, ready: bool, when: str) -> dict:
    """A pod's status as its kubelet writes it: Pending (containers initializing), Running, or
    Running and Ready."""
    i = int(digest(spec["nodeName"], 6), 16)
    host_ip = f"10.20.{(i // 256) % 256}.{i % 256}"
    running = phase == "Running"

    def condition(kind: str, value: bool) -> dict:
        out = {"type": kind, "status": "True" if value else "False", "lastProbeTime": None, "lastTransitionTime": when}
        if not value and kind in ("Ready", "ContainersReady"):
            out["reason"] = "ContainersNotReady"
            out["message"] = f"containers with unready status: [{' '.join(c['name'] for c in spec['containers'])}]"
        return out

    status = {
        "phase": phase,
        "conditions": [
            condition("PodReadyToStartContainers", running),
            condition("Initialized", running),
            condition("Ready", ready),
            condition("ContainersReady", ready),
            condition("PodScheduled", True),
        ],
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "startTime": when,
        "qosClass": "Burstable",
    }
    if running:
        pod_ip = f"10.{128 + (i // 256) % 64}.{i % 256}.{int(digest(name, 2), 16) % 250 + 2}"
        status.update(podIP=pod_ip, podIPs=[{"ip": pod_ip}])
    if spec.get("initContainers"):
        status["initContainerStatuses"] = [
            _container_status(c, f"{name}/{c['name']}", False, True, when) for c in spec["initContainers"]
        ]
    status["containerStatuses"] = [_container_status(c, f"{name}/{c['name']}", ready, False, when) for c in spec["containers"]]
    if not running:
        for c in status["containerStatuses"]:
            c.update(state={"waiting": {"reason": "PodInitializing"}}, started=False)
    return status


def pod(
    template: dict,
    name: str,
    namespace: str,
    node: str,
    *,
    owner: dict | None = None,
    labels: dict | None = None,
    phase: str = "Running",
    ready: bool = True,
    created: str = CREATED,
) -> dict:
    """A pod of `template` on `node`, as its controller (`owner`, a DaemonSet's ownerReference, or
    none), the API server and the kubelet leave it."""
    t = copy.deepcopy(template)
    meta_t, spec = t.get("metadata") or {}, dict(t.get("spec") or {})
    meta = {
        "name": name,
        "generateName": name.rsplit("-", 1)[0] + "-",
        "namespace": namespace,
        "uid": uid(f"pod/{namespace}/{name}"),
        "resourceVersion": "1",
        "creationTimestamp": created,
        "labels": {**(meta_t.get("labels") or {}), **(labels or {})},
    }
    if meta_t.get("annotations"):
        meta["annotations"] = meta_t["annotations"]
    if owner is not None:
        meta["ownerReferences"] = [owner]
    spec["containers"] = [_defaulted(c) for c in spec.get("containers") or []]
    if spec.get("initContainers"):
        spec["initContainers"] = [_defaulted(c) for c in spec["initContainers"]]
    for key, value in (
        ("restartPolicy", "Always"),
        ("terminationGracePeriodSeconds", 30),
        ("dnsPolicy", "ClusterFirst"),
        ("serviceAccountName", "default"),
        ("securityContext", {}),
        ("schedulerName", "default-scheduler"),
        ("priority", 0),
    ):
        spec.setdefault(key, value)
    spec.update(
        serviceAccount=spec["serviceAccountName"], nodeName=node, enableServiceLinks=True, preemptionPolicy="PreemptLowerPriority"
    )
    if owner is not None and owner.get("kind") == "DaemonSet":
        spec["tolerations"] = [*(spec.get("tolerations") or []), *DAEMONSET_TOLERATIONS]
        terms = [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]
        spec["affinity"] = {
            **(spec.get("affinity") or {}),
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}},
        }
    spec["volumes"] = [*(spec.get("volumes") or []), _SERVICE_ACCOUNT_VOLUME]
    status = pod_status(spec, name, phase, ready, created)
    owned_meta = {k: v for k, v in meta.items() if k in ("generateName", "labels", "ownerReferences", "annotations")}
    meta["managedFields"] = [
        managed(
            "kube-controller-manager" if owner else "kubectl-create",
            {"f:metadata": fields_of(owned_meta), "f:spec": fields_of(spec)},
            created,
        ),
        managed("kubelet", {"f:status": fields_of(status)}, created, "status"),
    ]
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta, "spec": spec, "status": status}


def daemonset_owner(name: str, owner_uid: str) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "name": name,
        "uid": owner_uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _platform_template(app: str, image: str, port: int, args=(), mounts=(), env=(), host_network: bool = True) -> dict:
    volume = lambda path: path.strip("/").replace("/", "-") or "root"  # noqa: E731
    container = {
        "name": app,
        "image": image,
        "args": list(args),
        "env": [{"name": k, "value": v} for k, v in env],
        "ports": [{"name": "metrics", "containerPort": port, "protocol": "TCP", "hostPort": port}],
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "512Mi"}},
        "volumeMounts": [{"name": volume(m), "mountPath": m, "readOnly": True} for m in mounts],
        "securityContext": {"privileged": True} if host_network else {"runAsNonRoot": True, "readOnlyRootFilesystem": True},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": port, "scheme": "HTTP"}},
    }
    return {
        "metadata": {
            "labels": {
                "app.kubernetes.io/name": app,
                "app.kubernetes.io/instance": app,
                "controller-revision-hash": digest(app, 10),
                "pod-template-generation": "3",
            }
        },
        "spec": {
            "hostNetwork": host_network,
            "priorityClassName": "system-node-critical",
            "priority": 2000001000,
            "serviceAccountName": app,
            "containers": [container],
            "volumes": [{"name": volume(m), "hostPath": {"path": m, "type": ""}} for m in mounts],
            "tolerations": [{"operator": "Exists"}],
        },
    }


#: The platform's DaemonSets on every node besides the chart's: (namespace, name, pod template).
PLATFORM_DAEMONSETS = [
    (
        "kube-system",
        "kube-proxy",
        _platform_template(
            "kube-proxy",
            "registry.k8s.io/kube-proxy:v1.30.4",
            10249,
            ("--config=/var/lib/kube-proxy/config.conf", "--hostname-override=$(NODE_NAME)"),
            ("/var/lib/kube-proxy", "/run/xtables.lock", "/lib/modules"),
            (("NODE_NAME", ""),),
        ),
    ),
    (
        "calico-system",
        "calico-node",
        _platform_template(
            "calico-node",
            "docker.io/calico/node:v3.28.1",
            9091,
            (),
            (
                "/lib/modules",
                "/run/xtables.lock",
                "/var/run/calico",
                "/var/lib/calico",
                "/var/run/nodeagent",
                "/etc/cni/net.d",
                "/var/log/calico/cni",
                "/sys/fs",
                "/proc",
            ),
            (
                ("DATASTORE_TYPE", "kubernetes"),
                ("WAIT_FOR_DATASTORE", "true"),
                ("CLUSTER_TYPE", "k8s,operator,bgp"),
                ("FELIX_DEFAULTENDPOINTTOHOSTACTION", "ACCEPT"),
                ("FELIX_HEALTHENABLED", "true"),
                ("FELIX_HEALTHPORT", "9099"),
                ("NODENAME", ""),
                ("NAMESPACE", "calico-system"),
                ("FELIX_TYPHAK8SSERVICENAME", "calico-typha"),
                ("IP", "autodetect"),
                ("IP_AUTODETECTION_METHOD", "first-found"),
                ("CALICO_IPV4POOL_VXLAN", "Always"),
            ),
        ),
    ),
    (
        "monitoring",
        "node-exporter",
        _platform_template(
            "node-exporter",
            "quay.io/prometheus/node-exporter:v1.8.2",
            9100,
            (
                "--path.procfs=/host/proc",
                "--path.sysfs=/host/sys",
                "--path.rootfs=/host/root",
                "--collector.filesystem.mount-points-exclude=^/(dev|proc|sys|var/lib/kubelet/.+)($|/)",
            ),
            ("/host/proc", "/host/sys", "/host/root"),
        ),
    ),
    (
        "logging",
        "fluent-bit",
        _platform_template(
            "fluent-bit",
            "cr.fluentbit.io/fluent/fluent-bit:3.1.7",
            2020,
            (),
            ("/var/log", "/var/lib/containerd/io.containerd.grpc.v1.cri", "/etc/machine-id", "/fluent-bit/etc"),
            (("FLUENT_ELASTICSEARCH_HOST", "es.logging"), ("FLUENT_ELASTICSEARCH_PORT", "9200")),
            host_network=False,
        ),
    ),
    (
        "kube-system",
        "csi-nas-node",
        _platform_template(
            "csi-nas-node",
            "registry.example.com/infra/nas-csi-plugin:v1.4.2",
            9809,
            ("--endpoint=unix:///csi/csi.sock", "--nodeid=$(NODE_ID)", "--v=2"),
            ("/csi", "/var/lib/kubelet", "/dev", "/var/lib/kubelet/plugins_registry"),
            (("NODE_ID", ""), ("CSI_ENDPOINT", "unix:///csi/csi.sock")),
        ),
    ),
    (
        "kube-system",
        "node-problem-detector",
        _platform_template(
            "node-problem-detector",
            "registry.k8s.io/node-problem-detector/node-problem-detector:v0.8.19",
            20256,
            ("--logtostderr", "--config.system-log-monitor=/config/kernel-monitor.json,/config/gpu-monitor.json"),
            ("/var/log", "/dev/kmsg", "/etc/localtime", "/config"),
        ),
    ),
]


def training_template(i: int) -> dict:
    """Worker `i % 64` of a 64-node training job: 8 GPUs, and the MXMACA version it needs."""
    job = f"pretrain-{i // 64}"
    container = {
        "name": "worker",
        "image": "registry.example.com/ml/team-a/llm-pretrain:2.3.2-maca2.19.0.3-py310-ubuntu22.04-amd64",
        "command": ["torchrun"],
        "args": ["--nnodes=64", "--nproc_per_node=8", "train.py", "--config=/etc/job/config.yaml"],
        "env": [
            {"name": "METAX_MACA_VERSION", "value": "maca-2.18"},
            {"name": "MASTER_ADDR", "value": f"{job}-worker-0"},
            {"name": "MASTER_PORT", "value": "23456"},
            {"name": "WORLD_SIZE", "value": "512"},
            {"name": "NCCL_IB_HCA", "value": "mlx5"},
        ],
        "resources": {
            "requests": {"cpu": "200", "memory": "1800Gi", GPU_RESOURCE: "8", "rdma/hca_shared_devices_a": "1"},
            "limits": {GPU_RESOURCE: "8", "rdma/hca_shared_devices_a": "1"},
        },
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "data", "mountPath": "/data"},
            {"name": "config", "mountPath": "/etc/job"},
        ],
    }
    return {
        "metadata": {
            "labels": {
                "app": "llm-pretrain",
                "job-name": job,
                "training.kubeflow.org/replica-type": "worker",
                "training.kubeflow.org/replica-index": str(i % 64),
            },
            "annotations": {"sidecar.istio.io/inject": "false"},
        },
        "spec": {
            "restartPolicy": "Never",
            "containers": [container],
            "volumes": [
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "256Gi"}},
                {"name": "data", "persistentVolumeClaim": {"claimName": "team-a-data"}},
                {"name": "config", "configMap": {"name": f"{job}-config"}},
            ],
            "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
        },
    }
