"""The real node of the local cluster, beside the kwok nodes: containerd + runc (Debian), the CNI
bridge, a kubelet and kube-proxy (built from the same k8s.io/kubernetes module as the control
plane), where the tools image's pods really run. tests/controlplane.py starts and stops it;
this module holds what the node is made of. docs/control-plane.md tells the why of each choice.

Isolation, so that several clusters (xdist workers, other checkouts) run side by side and the
host is left as it was:
- network: a namespace of its own (`metax-node-<id>`, tests/netns.py) holding the node's address
  and the address the API server advertises; the bridge, the pods' veths and kube-proxy's
  iptables rules are all inside it. tests/noderelay.py joins it to the host's loopback.
- mounts: containerd, the kubelet and kube-proxy share one private mount namespace in which the
  node's directories (/var/lib/kubelet, /var/lib/containerd, /run/containerd, /var/lib/cni,
  /var/log/pods, /etc/cni/net.d) are bind mounts of the work directory, and the six kernel
  settings the kubelet insists on read as it wants them (bind mounts over /proc/sys files), so
  it changes none of the host's. Everything mounted goes away with the node's last process.
- cgroups: one tree, `/metax-node-<id>`, in every hierarchy: `system/` holds containerd (and so
  every shim), the kubelet and kube-proxy; the kubelet's pods go under `kubepods/` (its
  cgroupRoot). Stopping the node kills whatever is left in that tree and removes it.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests import netns

NODE_NAME = "tools-node"
TOOLS_NODE = "metax-operator.test/tools-node"  # its label (value "true") and NoSchedule taint
TOOLS_NODE_TAINT = {"key": TOOLS_NODE, "value": "true", "effect": "NoSchedule"}
APISERVER_IP = "10.77.0.1"  # advertised by the API server, relayed to its 127.0.0.1 port
NODE_IP = "10.77.0.2"
POD_SUBNET = "10.88.0.0/24"
CLUSTER_DNS_IP = "10.96.0.10"
PAUSE_TAG = "3.10"
CONTAINERD_SOCKET = "unix:///run/containerd/containerd.sock"
CNI_BIN = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
PORTS = {"containerd-metrics": 1338, "kubelet": 10250, "kubelet-healthz": 10248, "kube-proxy-healthz": 10256}

# The node's own directories, bind-mounted over these paths in its mount namespace.
NODE_DIRS = ("/var/lib/kubelet", "/var/lib/containerd", "/run/containerd", "/var/lib/cni", "/var/log/pods", "/etc/cni/net.d")
# What the kubelet requires of the kernel (it would write these host-wide settings itself).
KERNEL_SETTINGS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}


def cgroup_mounts() -> list[Path]:
    """Where each cgroup hierarchy is mounted (every v1 controller, and the v2 tree)."""
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[fields.index("-") + 1] in ("cgroup", "cgroup2"):
            mounts.append(Path(fields[4]))
    return mounts


@dataclass
class RealNode:
    """One real node. `id` names its network namespace and cgroup tree; `workdir` holds its
    configuration, state, logs of its pods and images."""

    workdir: Path
    id: str

    @property
    def netns(self) -> Path:
        return netns.path(self.id)

    @property
    def cgroup(self) -> str:
        return f"/{self.id}"

    # -- network and cgroups -------------------------------------------------------------------

    def create(self) -> None:
        """The network namespace and the cgroup tree (before any of the node's processes)."""
        netns.create(self.id, "node0", [f"{APISERVER_IP}/32", f"{NODE_IP}/32"])
        for mount in cgroup_mounts():
            root = mount / self.id
            for path in (root, root / "system"):
                path.mkdir(exist_ok=True)
                if (path / "cpuset.cpus").exists():  # v1 cpuset: a new cgroup starts with no CPUs
                    for key in ("cpuset.cpus", "cpuset.mems"):
                        (path / key).write_text((path.parent / key).read_text())
            if (mount / "cgroup.subtree_control").exists() and root.parent == mount:  # v2: delegate controllers
                wanted = (mount / "cgroup.subtree_control").read_text().split()
                if wanted:
                    (root / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in wanted))

    def join_system_cgroup(self) -> None:
        """Move the calling process into `system/` (a Popen preexec_fn: it runs in the child)."""
        for mount in cgroup_mounts():
            (mount / self.id / "system" / "cgroup.procs").write_text(str(os.getpid()))

    def _cgroup_pids(self, within: str = "") -> set[int]:
        """The processes in the node's cgroup tree (`within`: only under a cgroup of that name)."""
        pids = set()
        for mount in cgroup_mounts():
            for directory, _, files in os.walk(mount / self.id):
                if "cgroup.procs" in files and (not within or within in Path(directory).parts):
                    pids.update(int(p) for p in Path(directory, "cgroup.procs").read_text().split())
        return pids

    def pod_pids(self, uid: str) -> set[int]:
        """The processes of the pod with this uid: its sandbox's and its containers' (the kubelet
        makes a cgroup `pod<uid>` for each pod)."""
        return self._cgroup_pids(within=f"pod{uid}")

    def destroy(self, grace: float = 10) -> None:
        """Kill whatever still runs in the node's cgroup tree (containers, shims, containerd),
        remove the tree and the network namespace. Idempotent; needs nothing but the id."""
        end = time.monotonic() + grace
        while pids := self._cgroup_pids():
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > end:
                break
            time.sleep(0.1)
        for mount in cgroup_mounts():
            for directory, _, _ in os.walk(mount / self.id, topdown=False):
                try:
                    os.rmdir(directory)
                except OSError:
                    pass
        netns.delete(self.id)

    # -- configuration -------------------------------------------------------------------------

    def write_config(self, pki: Path, server: str, registry: str, kubelet_minor: int) -> None:
        """containerd's, the kubelet's (of the minor version `kubelet_minor`) and kube-proxy's
        configuration, the CNI network, the registry's hosts.toml, and the files read in place of
        the kernel settings."""
        for directory in NODE_DIRS:
            self._own(directory).mkdir(parents=True, exist_ok=True)
        kernel = self.workdir / "kernel"
        for key, value in KERNEL_SETTINGS.items():
            (kernel / key).parent.mkdir(parents=True, exist_ok=True)
            (kernel / key).write_text(value + "\n")

        certs = self.workdir / "certs.d" / registry
        certs.mkdir(parents=True, exist_ok=True)
        # The CA on both entries: containerd tries the [host] entry, then falls back to the server
        # (after a 404 too, whose "not found" must not turn into an x509 error); the [host]
        # entry makes it speak TLS to a loopback address, which it would otherwise try as HTTP.
        ca = pki / "ca.crt"
        (certs / "hosts.toml").write_text(
            f'server = "https://{registry}"\nca = "{ca}"\n\n[host."https://{registry}"]\n'
            f'  capabilities = ["pull", "resolve"]\n  ca = "{ca}"\n'
        )
        (self.workdir / "containerd.toml").write_text(f"""\
version = 2
[metrics]
  address = "127.0.0.1:{PORTS["containerd-metrics"]}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{self.pause_image(registry)}"
  # No CAP_SYS_RESOURCE on CI machines: runc could not lower the sandbox's oom_score_adj.
  restrict_oom_score_adj = true
  # The pods' network namespaces under containerd's state (not the host's /run/netns).
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{self.workdir / "certs.d"}"
""")
        (self._own("/etc/cni/net.d") / "10-bridge.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "1.0.0",
                    "name": "metax-node",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": "cni0",
                            "isGateway": True,
                            "ipMasq": False,
                            "hairpinMode": True,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": POD_SUBNET}]],
                                "routes": [{"dst": "0.0.0.0/0"}],
                            },
                        }
                    ],
                },
                indent=1,
            )
        )

        def kubeconfig(user: str) -> Path:
            path = self.workdir / f"{user}.kubeconfig"
            path.write_text(
                yaml.safe_dump(
                    {
                        "apiVersion": "v1",
                        "kind": "Config",
                        "current-context": "node",
                        "clusters": [
                            {"name": "node", "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")}}
                        ],
                        "users": [
                            {
                                "name": user,
                                "user": {"client-certificate": str(pki / f"{user}.crt"), "client-key": str(pki / f"{user}.key")},
                            }
                        ],
                        "contexts": [{"name": "node", "context": {"cluster": "node", "user": user}}],
                    }
                )
            )
            return path

        (self.workdir / "kubelet.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubelet.config.k8s.io/v1beta1",
                    "kind": "KubeletConfiguration",
                    "address": NODE_IP,
                    "port": PORTS["kubelet"],
                    "readOnlyPort": 0,
                    "healthzBindAddress": "127.0.0.1",
                    "healthzPort": PORTS["kubelet-healthz"],
                    "authentication": {
                        "anonymous": {"enabled": False},
                        "webhook": {"enabled": True},
                        "x509": {"clientCAFile": str(pki / "ca.crt")},
                    },
                    "authorization": {"mode": "Webhook"},
                    **({"containerRuntimeEndpoint": CONTAINERD_SOCKET} if kubelet_minor >= 27 else {}),
                    "cgroupDriver": "cgroupfs",
                    "cgroupRoot": self.cgroup,
                    **({"failCgroupV1": False} if kubelet_minor >= 31 else {}),
                    "failSwapOn": False,
                    "protectKernelDefaults": True,  # the settings read as wanted; never write the host's
                    "registerWithTaints": [TOOLS_NODE_TAINT],
                    # No DNS service runs: pods get a cluster DNS address nothing answers at (and
                    # nothing routes out of the namespace); the hooks and the runner use the
                    # service's IP from their environment, as the Kubernetes client does in a pod.
                    "clusterDNS": [CLUSTER_DNS_IP],
                    "clusterDomain": "cluster.local",
                    "resolvConf": "",
                    "serializeImagePulls": False,
                    "evictionHard": {
                        "memory.available": "100Mi",
                        "nodefs.available": "1%",
                        "imagefs.available": "1%",
                        "nodefs.inodesFree": "1%",
                    },
                }
            )
        )
        (self.workdir / "kube-proxy.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
                    "kind": "KubeProxyConfiguration",
                    "clientConnection": {"kubeconfig": str(kubeconfig("kube-proxy"))},
                    "hostnameOverride": NODE_NAME,
                    "mode": "iptables",
                    "clusterCIDR": POD_SUBNET,
                    "healthzBindAddress": f"127.0.0.1:{PORTS['kube-proxy-healthz']}",
                    "metricsBindAddress": "127.0.0.1:10249",
                    # Leave the host-wide conntrack table settings alone.
                    "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
                }
            )
        )
        kubeconfig("kubelet")

    def _own(self, directory: str) -> Path:
        return self.workdir / "fs" / directory.lstrip("/")

    @staticmethod
    def pause_image(registry: str) -> str:
        return f"{registry}/node/pause:{PAUSE_TAG}"

    # -- processes -----------------------------------------------------------------------------

    def containerd_command(self) -> list[str]:
        """containerd in a new mount namespace that first binds the node's directories and the
        kernel settings' files, then enters the network namespace. Its pid is that namespace's
        holder: the kubelet and kube-proxy join it through /proc/<pid>/ns/mnt."""
        lines = ["set -e"]
        for directory in NODE_DIRS:
            lines.append(f"mkdir -p {shlex.quote(directory)}")
            lines.append(f"mount --bind {shlex.quote(str(self._own(directory)))} {shlex.quote(directory)}")
        for key in KERNEL_SETTINGS:
            lines.append(f"mount --bind {shlex.quote(str(self.workdir / 'kernel' / key))} /proc/sys/{key}")
        lines.append(
            f"exec nsenter --net={shlex.quote(str(self.netns))} -- containerd "
            f"--config {shlex.quote(str(self.workdir / 'containerd.toml'))}"
        )
        return ["unshare", "--mount", "--propagation", "slave", "--", "sh", "-c", "\n".join(lines)]

    def joined(self, holder: int, binary: Path, *args: str) -> list[str]:
        """`binary args` inside the node's mount namespace (held by pid `holder`) and network."""
        return ["nsenter", f"--mount=/proc/{holder}/ns/mnt", f"--net={self.netns}", "--", str(binary), *args]

    def kubelet_args(self, kubelet_minor: int) -> list[str]:
        return [
            f"--config={self.workdir / 'kubelet.yaml'}",
            f"--kubeconfig={self.workdir / 'kubelet.kubeconfig'}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={NODE_IP}",
            f"--node-labels={TOOLS_NODE}=true",
            # Before 1.27 the runtime's socket is a flag, and before 1.24 "remote" (not dockershim) too.
            *([f"--container-runtime-endpoint={CONTAINERD_SOCKET}"] if kubelet_minor < 27 else []),
            *(["--container-runtime=remote"] if kubelet_minor < 24 else []),
        ]

    def kube_proxy_args(self) -> list[str]:
        return [f"--config={self.workdir / 'kube-proxy.yaml'}"]
