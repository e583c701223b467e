"""The user's path on the local cluster: the control plane with its real node and local OCI
registry, the tools image of this working tree (`scripts/image build`) and the chart pushed
there, Helm run as a user runs it, and what the tests observe of the tools pods.

The tools image is built once per session (tests/registry.py: `scripts/image build`, cached by
a hash of its inputs, so a test never runs a stale image). The chart is installed from
`oci://127.0.0.1:PORT/metax/metax-operator` exactly as the seed's command does; the user's
values keep the tools pods (hook Jobs, runner, helm test) on the real node with the chart's own
scheduling values, while every MetaX component stays on kwok nodes.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from kubernetes import client, watch

from tests import registry
from tests.controlplane import K8S_VERSION, ControlPlane
from tests.e2e import tools
from tests.e2e.tools import get_cr, kubectl
from tests.helm import BIN
from tests.realnode import NODE_NAME, TOOLS_NODE

NS = "metax-operator"  # the seed's namespace
GPU_NODES = 4
HOOK_LABEL = "gpu.metax-tech.com/hook"
RUNNER_PODS = "app.kubernetes.io/component=runner"
CRD = "clusteroperators.gpu.metax-tech.com"
CHART_OBJECTS = "app.kubernetes.io/name=metax-operator"  # label of every object the chart renders
TOOLS_UID = 65532

# What an administrator adds to the seed's command (-f) to run the tools pods on a node pool of
# their choice: here the real node, tainted so that nothing else lands there.
TOLERATE_TOOLS_NODE = {"key": TOOLS_NODE, "operator": "Equal", "value": "true", "effect": "NoSchedule"}
ON_TOOLS_NODE = {"nodeSelector": {TOOLS_NODE: "true"}, "tolerations": [TOLERATE_TOOLS_NODE]}

# Two steps over the 4 GPU nodes, no pauses: 1 pod, then the other 3 in waves of 2 (maxParallel 50%).
POLICY = {
    "enableRollout": True,
    "pause": False,
    "maxParallel": "50%",
    "maxUnavailable": 0,
    "maxFailureThreshold": 3,
    "fallback": "pause",
    "upgradeSteps": [{"replicas": 1, "pauseDuration": 0}, {"replicas": "100%", "pauseDuration": 0}],
}


@dataclass
class ToolsCluster:
    cp: ControlPlane
    chart: str  # oci://127.0.0.1:PORT/metax/metax-operator
    image: str  # 127.0.0.1:PORT/metax/metax-operator-tools:APPVERSION
    digest: str  # the image's manifest digest, as scripts/image built it (pushed unchanged)
    helm_home: Path

    @property
    def registry(self) -> str:
        """The `registry` value a user sets: DOMAIN/PROJECT."""
        return f"{self.cp.registry}/{registry.PROJECT}"

    @classmethod
    def start(cls, work: Path, kubernetes: str = K8S_VERSION) -> ToolsCluster:
        cp = ControlPlane.start(
            work / "cluster", gpu_nodes=GPU_NODES, plain_nodes=1, real_node=True, timeout=180, kubernetes=kubernetes
        )
        try:
            published = registry.publish(BIN / "helm3", cp.registry, cp.ca, work / "chart")
        except BaseException:
            cp.stop()
            raise
        return cls(cp, published["chart"], published["image"], published["digest"], work / "helm")

    def env(self) -> dict:
        """The environment a user runs Helm under: the cluster's kubeconfig, the registry's CA
        trusted through SSL_CERT_FILE, Helm's own homes in a temporary directory."""
        return {
            **registry.helm_env(self.cp.ca),
            "KUBECONFIG": str(self.cp.kubeconfig),
            "HELM_CONFIG_HOME": str(self.helm_home / "config"),
            "HELM_CACHE_HOME": str(self.helm_home / "cache"),
            "HELM_DATA_HOME": str(self.helm_home / "data"),
        }

    def helm(self, which: str, *args: str, timeout: float = 600, cwd: Path | None = None) -> subprocess.CompletedProcess:
        """`helm3`/`helm4` ARGS as a user runs it (`env`), in `cwd` when given."""
        run = [str(BIN / which), *args]
        return subprocess.run(run, capture_output=True, text=True, env=self.env(), timeout=timeout, cwd=cwd)

    @staticmethod
    def user_values(tmp: Path, runner: dict | None = None, **more) -> Path:
        """The values file the administrator passes with -f: the tools pods' scheduling, plus
        `runner` settings and `more` top-level values."""
        path = tmp / "my-values.yaml"
        path.write_text(yaml.safe_dump({"hooks": ON_TOOLS_NODE, "runner": {**ON_TOOLS_NODE, **(runner or {})}, **more}))
        return path


def ok(done: subprocess.CompletedProcess) -> str:
    """stdout of a command that must succeed; else an AssertionError with what it printed."""
    assert done.returncode == 0, f"{done.args[0]} {done.args[1]} failed ({done.returncode}):\n{done.stderr}{done.stdout}"
    return done.stdout


@dataclass
class PodWatch:
    """Every pod of a namespace as last seen by a watch started before the action: hook pods are
    deleted with their Job once they succeed, so their final status is only seen this way."""

    api: object
    namespace: str
    pods: dict[str, client.V1Pod] = field(default_factory=dict)

    def __post_init__(self):
        self._watch = watch.Watch()
        core = client.CoreV1Api(self.api)
        start = core.list_namespaced_pod(self.namespace)
        for pod in start.items:
            self.pods[pod.metadata.name] = pod
        self._thread = threading.Thread(target=self._follow, args=(core, start.metadata.resource_version), daemon=True)
        self._thread.start()

    def _follow(self, core, version: str) -> None:
        try:
            for change in self._watch.stream(
                core.list_namespaced_pod, self.namespace, resource_version=version, timeout_seconds=1800
            ):
                pod = change["object"]
                self.pods[pod.metadata.name] = pod
        except Exception:  # noqa: BLE001 - the control plane stopping ends the watch
            pass

    def stop(self) -> None:
        self._watch.stop()

    def hook(self, name: str) -> list[client.V1Pod]:
        """The pods of hook `name` seen so far."""
        return [p for p in self.pods.values() if (p.metadata.labels or {}).get(HOOK_LABEL) == name]


def terminated(pod: client.V1Pod):
    """The container's terminated state, or None while it has not ended."""
    statuses = pod.status.container_statuses or []
    return statuses[0].state.terminated if statuses and statuses[0].state else None


def assert_ran_as_tools_pod(pod: client.V1Pod, cluster: ToolsCluster, exit_code: int = 0) -> None:
    """The pod ran the pushed tools image on the real node, as UID 65532 with a read-only root
    filesystem, and its container exited with `exit_code`. The image is the reference the pod
    names and the digest it ran (the status's image name is whichever tag the node knows that
    digest by: another registry path's, once an earlier test pulled the same image there)."""
    name = pod.metadata.name
    assert pod.spec.node_name == NODE_NAME, f"{name} ran on {pod.spec.node_name}, not on the real node"
    status = pod.status.container_statuses[0]
    assert pod.spec.containers[0].image == cluster.image, f"{name} ran {pod.spec.containers[0].image}"
    assert status.image_id.endswith(cluster.digest), f"{name}: image {status.image_id}, built {cluster.digest}"
    end = status.state.terminated
    assert end is not None and end.exit_code == exit_code, f"{name} ended {end}"
    assert pod.spec.security_context.run_as_user == TOOLS_UID
    assert pod.spec.containers[0].security_context.read_only_root_filesystem is True


def seed_install(cluster, which: str, values, *more: str) -> subprocess.CompletedProcess:
    """The seed's command (§3.2.1) with the administrator's values file."""
    return cluster.helm(
        which,
        "install",
        cluster.chart,
        "--create-namespace",
        "-n",
        NS,
        "--generate-name",
        "--wait",
        "--timeout",
        "5m",
        "--set",
        f"registry={cluster.registry}",
        "--set",
        "driver.payload.version=2.32.0.6",
        "-f",
        str(values),
        *more,
    )


def release_name(output: str) -> str:
    """The release name `helm install --generate-name` printed."""
    return re.search(r"^NAME: (\S+)$", output, re.M).group(1)


def upgrade_status(api) -> dict:
    return ((get_cr(api) or {}).get("status") or {}).get("upgradeStatus") or {}


def rollout_completed(api) -> dict | None:
    """`status.upgradeStatus` once a staged rollout has completed and none is in flight."""
    s = upgrade_status(api)
    done = s.get("phase") == "Idling" and not s.get("upgrading")
    return s if done and (s.get("status") or {}).get("currentStepState") == "Completed" else None


def runner_waves(cluster: ToolsCluster) -> dict[int, list[int]]:
    """The driver pods the runner deleted, pass by pass, per step (from its log)."""
    waves: dict[int, list[int]] = {}
    for line in runner_log(cluster):
        if line.get("action") == "rollout-pass" and line.get("deleted"):
            waves.setdefault(line["step"], []).append(len(line["deleted"]))
    return waves


def driver_daemonset(api) -> client.V1DaemonSet:
    return client.AppsV1Api(api).read_namespaced_daemon_set("metax-driver", NS)


def payload_image(ds: client.V1DaemonSet) -> str:
    return next(c.image for c in ds.spec.template.spec.init_containers if c.name == "payload")


def seed_patch_version(cluster, version: str) -> None:
    """Seed 001 step 8: the version changed in the CR with kubectl."""
    patch = [{"op": "replace", "path": "/spec/driver/payload/version", "value": version}]
    kubectl(
        cluster.cp, "patch", "clusteroperators.gpu.metax-tech.com", "cluster-operator", "--type=json", "-p", json.dumps(patch)
    )


def paused_after_the_first_step(api) -> bool:
    status = upgrade_status(api)
    policy = (get_cr(api) or {})["spec"]["driver"]["upgradePolicy"]
    step = status.get("status") or {}
    return bool(
        status.get("upgrading")
        and policy.get("pause")
        and step.get("currentStepIndex") == 0
        and step.get("currentStepState") == "StepPaused"
    )


def cordoned(api) -> list[str]:
    return [n.metadata.name for n in client.CoreV1Api(api).list_node().items if n.spec.unschedulable]


def runner_pod(api) -> client.V1Pod | None:
    pods = [
        p
        for p in client.CoreV1Api(api).list_namespaced_pod(NS, label_selector=RUNNER_PODS).items
        if p.status.phase == "Running" and p.metadata.deletion_timestamp is None
    ]
    return pods[0] if len(pods) == 1 else None


def runner_log(cluster: ToolsCluster) -> list[dict]:
    """The runner's JSON log lines, read as a user does (`kubectl logs`, through the kubelet)."""
    out = kubectl(cluster.cp, "logs", "-n", NS, "deployment/metax-operator-runner")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def driver_pods(api) -> list:
    return tools.driver_pods(api, NS)
