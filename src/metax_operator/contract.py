"""The names the chart, the hooks, the runner and the components agree on: each written once.

Python modules import them from here; the chart's templates get them from the generated
templates/_contract.tpl (`python -m metax_operator.chart.generate`, checked for staleness by
tests/chart/test_schema.py). Defaults the chart states in values.yaml (`Component.deploy`) are
checked against values.yaml by tests/test_contract.py.

Plain constants and namedtuples only: the post-renderer imports this inside every `helm
template`, where importing dataclasses would cost more than the work.
"""

from __future__ import annotations

from collections import namedtuple

# -- the components ------------------------------------------------------------------------------

#: A component of the stack. `key`: its values key, its key under the CR's `spec`, and the value
#: of its pods' `app.kubernetes.io/component` label; `daemonset`: its DaemonSet (and
#: ServiceAccount) name; `prerequisites`: the values keys that must be deployed (and Ready on the
#: node) before it (seed §3.2.3); `deploy`: its values.yaml default.
Component = namedtuple("Component", "key daemonset prerequisites deploy")

#: In install order.
COMPONENTS: dict[str, Component] = {
    c.key: c
    for c in (
        Component("gpuLabel", "metax-gpu-label", (), True),
        Component("runtime", "metax-container-runtime", ("gpuLabel",), True),
        Component("driver", "metax-driver", ("gpuLabel", "runtime"), True),
        Component("maca", "metax-maca", ("gpuLabel", "runtime"), True),
        Component("gpuDevice", "metax-gpu-device", ("gpuLabel", "runtime", "maca"), True),
        Component("exporter", "metax-data-exporter", ("gpuLabel", "driver"), False),
        Component("vfioManager", "metax-vfio-manager", ("gpuLabel",), True),
    )
}
#: values key -> DaemonSet name, in install order.
DAEMONSETS: dict[str, str] = {key: c.daemonset for key, c in COMPONENTS.items()}
#: values key -> the values keys it needs first, for the components that have prerequisites.
PREREQUISITES: dict[str, tuple[str, ...]] = {key: c.prerequisites for key, c in COMPONENTS.items() if c.prerequisites}
#: `deploy` of each component when the values or the CR leave it out.
DEFAULT_DEPLOY: dict[str, bool] = {key: c.deploy for key, c in COMPONENTS.items()}
#: The exporter's Service has its DaemonSet's name.
EXPORTER_SERVICE = DAEMONSETS["exporter"]
#: The components whose pods patch their own node (labels, annotations; templates/node-write-policy.yaml).
NODE_PATCHERS = ("driver", "gpuDevice", "gpuLabel", "vfioManager")

#: The init containers that copy the payloads into the pods: the driver's one `payload`, MXMACA's
#: `payload-0`, `payload-1`, ... one per image of `maca.payload.images`, in its order.
DRIVER_PAYLOAD_CONTAINER = "payload"
MACA_PAYLOAD_PREFIX = "payload-"
#: The payload contract (docs/chart.md, "Payload images"): a payload image holds its files under
#: PAYLOAD_DIR, and needs nothing else: each payload init container runs a static busybox that the
#: init container PAYLOAD_COPIER_CONTAINER (tools image) put into the pod, with the image's
#: reference in PAYLOAD_IMAGE_ENV. An image without a PAYLOAD_DIR (or an empty one) ends its
#: container at once with exit code PAYLOAD_CONTRACT_EXIT and one line naming the image (its
#: termination message).
PAYLOAD_DIR = "/payload"
PAYLOAD_COPIER_CONTAINER = "copier"
PAYLOAD_IMAGE_ENV = "PAYLOAD_IMAGE"
PAYLOAD_CONTRACT_EXIT = 3
#: The init container that waits for a component's prerequisites on its node (tools image): in
#: the driver's pods, where the runner reads the tools image, its pull policy and the pull secrets
#: that run a node's validation pod.
WAIT_FOR_CONTAINER = "wait-for"

#: The driver's DaemonSet, whose pods the staged rollout replaces node by node.
DRIVER_DAEMONSET = DAEMONSETS["driver"]
#: A driver pool's DaemonSet is this prefix and the pool's name; the DaemonSet carries the name in
#: POOL_ANNOTATION.
POOL_DAEMONSET_PREFIX = f"{DRIVER_DAEMONSET}-pool-"
#: The DaemonSet controller's label on each pod and ControllerRevision: the template's revision.
REVISION_LABEL = "controller-revision-hash"
#: The driver DaemonSet's update strategy, whatever the policy: a driver pod is replaced only when
#: the runner deletes it, in waves with a staged rollout, all at once (GPU-busy and skipped nodes
#: held back) without one. What the chart renders and the runner applies. Never derived from
#: `enableRollout`: a strategy that let the DaemonSet controller replace pods would take effect
#: the moment any writer (a Helm upgrade, an Argo CD sync, a rollback) rendered it mid-rollout.
DRIVER_UPDATE_STRATEGY = {"type": "OnDelete"}
#: The other components' update strategy, which the runner alone writes (with the runner enabled
#: the chart leaves it out): the DaemonSet controller replaces their pods, a tenth of the nodes at
#: a time. Left out of every release's manifest so that `helm rollback` cannot write it: the
#: pre-rollback hook sets these DaemonSets to `OnDelete` while Helm re-applies an old release's
#: pod templates (which may hold fields as they were before that release's own change reached
#: the CR), and the runner puts this back with the CR's fields in one write, so the pods are
#: replaced once (`hooks/rollback_hold.py`).
COMPONENT_UPDATE_STRATEGY = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}}
#: Environment variables rendered from a values field the CR also carries, VAR -> the field's path
#: under the component's values (the CR's `spec.<component>`): the chart renders them, and the
#: runner sets them from the CR. `LOG_ENV` is on every component container (and the runner's, from
#: `runner.log`); `COMPONENT_ENV` on a component's main container. A list is joined with commas.
LOG_ENV = {"LOG_LEVEL": ("log", "level"), "LOG_FORMAT": ("log", "format")}
COMPONENT_ENV = {
    "driver": {
        "DEPLOY_POLICY": ("deployPolicy",),
        "FW_UPGRADE_POLICY": ("fwUpgradePolicy",),
        "FW_ENABLE_VIRT": ("fwEnableVirt",),
    },
    "gpuDevice": {"HEALTHY_INTERVAL": ("healthyInterval",)},
    "maca": {"PAYLOAD_IMAGES": ("payload", "images")},
}
#: Field selector of the pods the runner and the hooks read: every pod not yet finished.
LIVE_PODS = "status.phase!=Succeeded,status.phase!=Failed"

#: The product manual's own spellings of two options, accepted beside the chart's (seed 000 table
#: 3.1 writes `vfio-manager`, §3.1 `driver.enableRollout`): the seed's path -> the chart's path.
#: chart/seed_spellings.py reads them as the chart's key (values) or checks they agree (the CR).
SEED_SPELLINGS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("vfio-manager",): ("vfioManager",),
    ("driver", "enableRollout"): ("driver", "upgradePolicy", "enableRollout"),
}

# -- the ClusterOperator custom resource -----------------------------------------------------------

CR_GROUP = "gpu.metax-tech.com"
CR_VERSION = "v1"
CR_API_VERSION = f"{CR_GROUP}/{CR_VERSION}"
CR_KIND = "ClusterOperator"
CR_PLURAL = "clusteroperators"
CR_SHORT_NAMES = ("mxco",)
#: The one ClusterOperator there is.
CR_NAME = "cluster-operator"
CRD_NAME = f"{CR_PLURAL}.{CR_GROUP}"
#: The CRD's file in the chart (crds/), also the key of the hook ConfigMap holding it.
CRD_FILE_NAME = f"{CRD_NAME}.yaml"

# -- labels and annotations ---------------------------------------------------------------------

#: Pod label: the component's values key (also the selector of the runner and `wait-for`).
COMPONENT_LABEL = "app.kubernetes.io/component"
PART_OF_LABEL = "app.kubernetes.io/part-of"
PART_OF = "metax-operator"

#: On each component DaemonSet, for the post-renderer and the runner (chart/merge.py): its values
#: key, the scheduling fields the chart renders before any merge, the merge's inputs.
COMPONENT_ANNOTATION = "gpu.metax-tech.com/component"
SCHEDULING_BASE_ANNOTATION = "gpu.metax-tech.com/scheduling-base"
SCHEDULING_INPUTS_ANNOTATION = "gpu.metax-tech.com/scheduling-inputs"
#: On a component DaemonSet rendered once the release is installed, with the value "live": its
#: fields that the runner writes from the CR (docs/runner.md) are the live DaemonSet's, so the
#: post-renderer leaves its scheduling fields as they are.
SHARED_FIELDS_ANNOTATION = "gpu.metax-tech.com/shared-fields"
#: On a driver pool's DaemonSet: the pool's name (`driver.pools[].name`).
POOL_ANNOTATION = "gpu.metax-tech.com/driver-pool"
#: On each hook object: the hook's name.
HOOK_LABEL = "gpu.metax-tech.com/hook"
#: On the CR: the spec the last bootstrap applied, and (written by chart versions before the
#: three-way merge) the two rollout controls it set.
BOOTSTRAP_APPLIED_ANNOTATION = "gpu.metax-tech.com/bootstrap-applied"
BOOTSTRAP_CONTROLS_ANNOTATION = "gpu.metax-tech.com/bootstrap-controls"
#: On each admin-editable ConfigMap: the CR value (JSON, by key) the runner last wrote there.
CR_APPLIED_ANNOTATION = "gpu.metax-tech.com/cr-applied"
#: A Helm release revision (`.Release.Revision`): on each component DaemonSet, the one whose
#: manifest Helm applied last; on the CR, the one the bootstrap hook last ran for (before a
#: rollback, the older one restored). A DaemonSet at another revision than the CR means Helm has
#: run its pre-upgrade (pre-rollback) hooks and not yet applied the release: the
#: runner then writes nothing (`runtime/helm_hold.py`), for at most HELM_APPLY_WAIT seconds
#: after the bootstrap's write (an upgrade that fails after its hooks never applies).
RELEASE_REVISION_ANNOTATION = "gpu.metax-tech.com/release-revision"
HELM_APPLY_WAIT = 600

#: The prefix of the product's node labels (and of its extended resources, below).
NODE_LABEL_PREFIX = "metax-tech.com/"
#: gpu-label's labels on GPU nodes (`gpu.installed` marks them; the others describe the GPUs and
#: are what jobs select on, e.g. `nodeSelector: {metax-tech.com/gpu.product: C500}`).
GPU_NODE_LABEL = f"{NODE_LABEL_PREFIX}gpu.installed"
GPU_PRODUCT_LABEL = "metax-tech.com/gpu.product"
GPU_VFNUM_LABEL = "metax-tech.com/gpu.vfnum"
#: The admin's labels that switch gpu-device per node (never removed by the operator).
MODE_LABEL = "metax-tech.com/gpu-device.mode"
QOS_LABEL = "metax-tech.com/gpu-device.qos-policy"
#: The staged rollout's node keys: the runner's and the admins', never a component's (the node
#: write policy refuses them to the components' ServiceAccounts).
ROLLOUT_NODE_KEY_PREFIX = "metax-tech.com/driver-upgrade."
#: On a node: the runner cordoned it for a driver swap and will uncordon it.
CORDONED_LABEL = f"{ROLLOUT_NODE_KEY_PREFIX}cordoned"
#: On a node, set by an admin: the rollout never replaces this node's driver.
SKIP_LABEL = f"{ROLLOUT_NODE_KEY_PREFIX}skip"
#: On each GPU node, set by the runner: where the node is in the driver rollout
#: (`rollout.node_state.NodeUpgradeState`), for `kubectl get nodes -L`.
STATE_LABEL = f"{ROLLOUT_NODE_KEY_PREFIX}state"
#: On a GPU node, set by the runner only: the driver pool (`driver.pools`) whose DaemonSet runs
#: the node's driver; without it the node is the driver DaemonSet's own. The runner works it out
#: from the pools' node selectors and writes it inside the rollout's budget: the write is the swap.
POOL_LABEL = f"{ROLLOUT_NODE_KEY_PREFIX}pool"
#: On a node whose new driver failed, set by an admin: delete its driver pod once more; the runner
#: removes the label once it did (or once the node is not failed).
RETRY_LABEL = f"{ROLLOUT_NODE_KEY_PREFIX}retry"
#: The validation of a swapped node (`driver.upgradePolicy.validation`): the runner runs one pod
#: per new driver pod on its node, its app.kubernetes.io/component VALIDATION_COMPONENT and its
#: VALIDATES_LABEL the driver pod's uid (the driver pod owns it, so it goes with it), and records
#: the outcome on the driver pod (VALIDATION_ANNOTATION): VALIDATION_PASSED, or
#: VALIDATION_FAILED_PREFIX and why. A new driver pod (a retry, a rollback) is validated anew.
VALIDATION_COMPONENT = "driver-validation"
VALIDATES_LABEL = "metax-tech.com/validates"
VALIDATION_ANNOTATION = "metax-tech.com/driver-validation"
VALIDATION_PASSED = "passed"
VALIDATION_FAILED_PREFIX = "failed: "
#: vfio-manager's node annotation: `{"GPU index": 1 bound | 0 failed}`.
VFIO_ANNOTATION = "metax-tech.com/gpu-vfio"

# -- extended resources -----------------------------------------------------------------------

#: Extended resources gpu-device advertises: whole GPUs (or VFs), sGPUs in sGPU mode, and GPUs
#: bound to vfio-pci for virtual machines. GPU nodes also carry a taint with the GPU resource's key.
RESOURCE_PREFIX = "metax-tech.com/"
GPU_RESOURCE = f"{RESOURCE_PREFIX}gpu"
SGPU_RESOURCE = f"{RESOURCE_PREFIX}sgpu"
VFIO_RESOURCE = f"{RESOURCE_PREFIX}vfio-gpu"
#: HAMi's resources that size an sGPU: percent of the GPU's compute, GiB of device memory.
HAMI_RESOURCES = (f"{RESOURCE_PREFIX}vcore", f"{RESOURCE_PREFIX}vmemory")
#: HAMi's allocation protocol (HAMi v2.10.0, docs/workloads.md "What HAMi and gpu-device write"):
#: the node annotation HAMi's scheduler locks a node with while it binds an sGPU pod there, which
#: the node's device plugin (gpu-device) removes once it has allocated; the pod annotation with the
#: MetaX sGPUs the scheduler assigned and the device plugin has yet to allocate, which the device
#: plugin empties container by container as it allocates (HAMi's device plugins:
#: `EraseNextDeviceTypeFromAnnotation`); and the pod annotation the device plugin sets to
#: `success` or `failed` then.
HAMI_NODE_LOCK = "hami.io/mutex.lock"
HAMI_TO_ALLOCATE = "hami.io/metax-sgpu-devices-to-allocate"
HAMI_BIND_PHASE = "hami.io/bind-phase"
GPU_TAINT = GPU_RESOURCE

# -- the ConfigMaps admins edit in place (seed §3.2.6-3.2.7) ---------------------------------------

DRIVER_CONFIG = "driver-config"
VFIO_CONFIG = "metax-vfio-config"
#: A key of one of them: the ConfigMap, the key, the component that reads it, the CR field
#: (path under `spec`) the chart writes there, the mapping key the chart wraps the field's value
#: in (None: the value itself) and the type of an unset field's value (its empty value).
ConfigMapKey = namedtuple("ConfigMapKey", "configmap key component field wrap empty")
NODE_VFNUMS = ConfigMapKey(DRIVER_CONFIG, "node-vfnums", "driver", ("driver", "config", "nodeVfnums"), "nodes", dict)
MODULE_PARAMS = ConfigMapKey(DRIVER_CONFIG, "module-params", "driver", ("driver", "config", "moduleParams"), None, dict)
NODE_MODULE_PARAMS = ConfigMapKey(
    DRIVER_CONFIG, "node-module-params", "driver", ("driver", "config", "nodeModuleParams"), None, dict
)
VFIO_CONFIG_KEY = ConfigMapKey(VFIO_CONFIG, "config", "vfioManager", ("vfioManager", "vfioConfig"), None, list)
CONFIGMAP_KEYS = (NODE_VFNUMS, MODULE_PARAMS, NODE_MODULE_PARAMS, VFIO_CONFIG_KEY)
CONFIGMAPS = (DRIVER_CONFIG, VFIO_CONFIG)

# -- compatibility with the release before ------------------------------------------------------

#: Blocks of the spec newer than the release before (paths under `spec`). The CRD gives them no
#: default: with one, the API server would fill them into the CR at every write, also while that
#: release runs again after a `helm rollback` (the CRD stays this release's), whose bootstrap hook
#: and runner would refuse fields they do not know. For the same reason the bootstrap writes one
#: into the CR only when the values turn it on (`enable: true`). Their defaults are values.yaml's
#: and those of the code that reads them (`upgrade_policy.Validation`, `HealthGate`: checked against
#: values.yaml).
UNDEFAULTED = (("driver", "upgradePolicy", "validation"), ("driver", "upgradePolicy", "healthGate"))

# -- who writes -----------------------------------------------------------------------------------

#: Server-side apply field managers.
RUNNER_FIELD_MANAGER = "metax-operator-runner"
#: The Lease the runners elect their leader with (`metax-operator run --lease-name`).
RUNNER_LEASE = "metax-operator-runner"
BOOTSTRAP_FIELD_MANAGER = "metax-operator-bootstrap"
UPGRADE_CRDS_FIELD_MANAGER = "metax-operator-upgrade-crds"

#: Where the hook Jobs mount the release's values and the CRD (`/etc/metax-operator/<volume>`).
HOOK_MOUNT_ROOT = "/etc/metax-operator"
#: The key of the hook values ConfigMap holding the release's values (JSON).
HOOK_VALUES_KEY = "values.json"
HOOK_VALUES_FILE = f"{HOOK_MOUNT_ROOT}/values/{HOOK_VALUES_KEY}"
HOOK_CRD_FILE = f"{HOOK_MOUNT_ROOT}/crds/{CRD_FILE_NAME}"  # the portable CRD (the chart's crds/)
FULL_CRD_KEY = f"full-{CRD_FILE_NAME}"  # the whole CRD (the chart's files/), beside it in the ConfigMap
HOOK_FULL_CRD_FILE = f"{HOOK_MOUNT_ROOT}/crds/{FULL_CRD_KEY}"
