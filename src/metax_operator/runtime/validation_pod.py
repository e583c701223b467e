"""The validation pod of a swapped node (`driver.upgradePolicy.validation`), as the runner creates
it for a Ready driver pod of a wave, and what the runner reads of it back (`check`).

It runs on the driver pod's node (`nodeName`: the node is cordoned, the scheduler is not asked),
tolerates every taint, never restarts, and the kubelet ends it at `timeoutSeconds`
(`activeDeadlineSeconds`; the engine also counts a validation failed at that time, should the
kubelet not). Its first container is the built-in check (`metax-operator check-node`, in the
tools image, reading the host's /sys read-only): the metax module loaded, its version that of the
payload image's tag, GPUs bound. The administrator's `workload`, if any, runs after it as the pod's
container (the check then runs as an init container), with the resources it asks for (one GPU by
default). The check runs as the driver pods' own tools container (`wait-for`) does: its image,
pull policy, resources and restricted security context; so do the pull secrets and the priority
class of those pods: the node already pulled that image for the driver.

The driver pod owns it: a driver pod deleted (the next swap, a retry) takes its validation pod
with it, and until then the pod and its log stay for `kubectl logs` and `gather`.
"""

from __future__ import annotations

import json

from metax_operator.chart.upgrade_policy import Validation
from metax_operator.conditions import parse_time
from metax_operator.contract import (
    COMPONENT_LABEL,
    DRIVER_PAYLOAD_CONTAINER,
    PART_OF,
    PART_OF_LABEL,
    PAYLOAD_COPIER_CONTAINER,
    VALIDATES_LABEL,
    VALIDATION_COMPONENT,
    WAIT_FOR_CONTAINER,
)
from metax_operator.rollout.decision import PodRef
from metax_operator.rollout.observation import Check

SELECTOR = f"{COMPONENT_LABEL}={VALIDATION_COMPONENT}"
HOST_SYS = "/host/sys"


def manifest(driver: PodRef, namespace: str, template: dict, validation: Validation) -> dict:
    """The validation pod for the driver pod `driver`, from the driver DaemonSet's pod `template`."""
    spec = template.get("spec") or {}
    inits = {c.get("name"): c for c in spec.get("initContainers") or []}
    tools = inits.get(WAIT_FOR_CONTAINER) or inits.get(PAYLOAD_COPIER_CONTAINER) or {}
    command = ["metax-operator", "check-node", "--sys", HOST_SYS]
    if tag := image_tag((inits.get(DRIVER_PAYLOAD_CONTAINER) or {}).get("image", "")):
        command += ["--driver-version", tag]
    check = {
        "name": "check-node",
        **{key: tools[key] for key in ("image", "imagePullPolicy", "resources", "securityContext") if key in tools},
        "command": command,
        "volumeMounts": [{"name": "host-sys", "mountPath": HOST_SYS, "readOnly": True}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    containers, init_containers = [check], []
    if validation.workload_image:
        workload = {
            "name": "workload",
            "image": validation.workload_image,
            "resources": json.loads(validation.workload_resources),
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }
        if validation.workload_command:
            workload["command"] = list(validation.workload_command)
        containers, init_containers = [workload], [check]
    pod_spec = {
        "nodeName": driver.node,
        "restartPolicy": "Never",
        "activeDeadlineSeconds": validation.timeout_s,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "tolerations": [{"operator": "Exists"}],
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        **{key: spec[key] for key in ("imagePullSecrets", "priorityClassName") if spec.get(key)},
        **({"initContainers": init_containers} if init_containers else {}),
        "containers": containers,
        "volumes": [{"name": "host-sys", "hostPath": {"path": "/sys", "type": "Directory"}}],
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{driver.name}-validation",
            "namespace": namespace,
            "labels": {COMPONENT_LABEL: VALIDATION_COMPONENT, PART_OF_LABEL: PART_OF, VALIDATES_LABEL: driver.uid},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": driver.name, "uid": driver.uid}],
        },
        "spec": pod_spec,
    }


def image_tag(image: str) -> str:
    """The tag of an image reference (`registry:5000/name:tag@sha256:...` gives `tag`), "" if none."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else ""


def check(obj: dict) -> tuple[str, Check] | None:
    """A validation pod as the runner's cache keeps it: the uid of the driver pod it validates, and
    its `Check` (a pod without the label is none of the runner's)."""
    meta, status = obj["metadata"], obj.get("status") or {}
    driver_uid = (meta.get("labels") or {}).get(VALIDATES_LABEL)
    if not driver_uid:
        return None
    phase = status.get("phase") or "Pending"
    done = phase in ("Succeeded", "Failed")
    reason = failure(status) if phase == "Failed" else ""
    return driver_uid, Check(meta["name"], parse_time(meta.get("creationTimestamp")) or 0.0, done, phase == "Succeeded", reason)


def failure(status: dict) -> str:
    """Why a Failed validation pod failed, in one line: the first container that ended badly and
    its message (the check's own line, or the workload's last log lines), else the pod's reason
    (the kubelet's, such as DeadlineExceeded or a resource it could not admit)."""
    for container in (*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])):
        ended = (container.get("state") or {}).get("terminated") or {}
        if ended and ended.get("exitCode") not in (0, None):
            message = " ".join(str(ended.get("message") or "").split())
            return f"{container.get('name')}: {message or 'exit code ' + str(ended.get('exitCode'))}"
    reason, message = status.get("reason") or "", " ".join(str(status.get("message") or "").split())
    return ": ".join(part for part in (reason, message) if part) or "the validation pod failed"
