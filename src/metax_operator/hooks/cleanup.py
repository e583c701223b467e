"""`metax-operator cleanup`: the pre-delete hook that removes what the release added outside Helm.

Helm deletes what it rendered; this removes the rest:
1. the `cluster-operator` CR (bootstrap created it), and at the same time
2. the DaemonSets that write to nodes (metax-gpu-label, metax-vfio-manager), waiting for their
   pods, so none of them re-adds a node key after step 3 (Helm would delete them next anyway);
3. once those pods and the runner's (step 5) are gone, on every node, exactly the keys our
   components and the runner set (NODE_LABELS, NODE_ANNOTATIONS; the runner's upgrade state and
   driver pool, and the admin's retry request, which nothing would consume any more) — never another key,
   not even one under `metax-tech.com/`:
   `gpu-device.mode`, `gpu-device.qos-policy` (seed §3.2.10) and `driver-upgrade.skip` are the
   admin's. Once the runner is stopped too (step 5), every node it cordoned for a driver swap
   (its label `driver-upgrade.cordoned`) is uncordoned and loses the label, as the runner does
   (`cordon.uncordon`): a node an admin cordoned has no such label and stays cordoned. The nodes
   are patched NODE_WORKERS at a time, one request each, from the list;
4. once the CR is gone, the CRD, only when `crds.keep` is false (`--delete-crd`): other
   releases or kept data may need it;
5. the runner's Deployment or CronJob (`--runner`), at the same time as 1 and 2, waiting for its
   pods; once they are gone, its Lease of the same name (the runner creates it, Helm does not
   know it; stopped first, no runner can re-create it);
6. the `helm test` pod (`--test-pod`): kept after a pass for `helm test --logs`, and Helm never
   deletes test hooks on uninstall;
7. with `--delete-own-rbac NAME`, its own ClusterRole and ClusterRoleBinding NAME. Under Argo CD
   the cleanup is a PostDelete hook, but its cluster-scoped RBAC cannot be one (Argo CD before
   3.4 re-creates cluster-scoped PostDelete hooks forever: "already exists", and the
   Application is never deleted), so the chart renders them as resources Argo CD keeps
   (`Delete=false`) and this step removes them. The binding is made a dependent of the role
   (ownerReference), then the role is deleted while the binding still grants that right, and
   the garbage collector deletes the binding.
The whole run has one time budget (`--timeout`, which the chart sets to the Job's deadline less
the time its pod may take to start: docs/hooks.md has the arithmetic for 10,000 nodes); a wait
that outlasts it ends the run with a line naming what is still there. Every step is idempotent:
a second run finds nothing to do.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import time

from metax_operator import contract
from metax_operator.cli import bounded
from metax_operator.contract import (
    CORDONED_LABEL,
    DAEMONSETS,
    GPU_NODE_LABEL,
    GPU_PRODUCT_LABEL,
    GPU_VFNUM_LABEL,
    POOL_LABEL,
    RETRY_LABEL,
    STATE_LABEL,
    VFIO_ANNOTATION,
)
from metax_operator.hooks import common
from metax_operator.runtime import api_failures, cordon, kube

#: Node labels our components set: gpu-label marks GPU nodes and describes their GPUs; the
#: runner labels each with its upgrade state and its driver pool; an admin's retry label means
#: nothing without the runner.
NODE_LABELS = (GPU_NODE_LABEL, GPU_PRODUCT_LABEL, GPU_VFNUM_LABEL, STATE_LABEL, POOL_LABEL, RETRY_LABEL)
#: Node annotations our components set: vfio-manager's binding result (seed §3.2.6.1).
NODE_ANNOTATIONS = (VFIO_ANNOTATION,)
#: DaemonSets whose pods write the keys above.
NODE_WRITERS = (DAEMONSETS["gpuLabel"], DAEMONSETS["vfioManager"])
#: Node patches in flight at once: the client's connection pool size (kube.PARALLEL_REQUESTS).
NODE_WORKERS = kube.PARALLEL_REQUESTS


def node_patch(node: dict) -> dict | None:
    """The merge patch removing our keys from `node`, or None when it carries none (pure)."""
    meta = node["metadata"]
    labels = [k for k in NODE_LABELS if k in (meta.get("labels") or {})]
    annotations = [k for k in NODE_ANNOTATIONS if k in (meta.get("annotations") or {})]
    if not labels and not annotations:
        return None
    patch: dict = {"metadata": {}}
    if labels:
        patch["metadata"]["labels"] = dict.fromkeys(labels)
    if annotations:
        patch["metadata"]["annotations"] = dict.fromkeys(annotations)
    return patch


def delete_and_wait(
    client: kube.Client,
    api_version: str,
    kind: str,
    name: str,
    namespace: str | None,
    timeout: float,
    propagation: str = "Background",
) -> bool:
    current = client.get(api_version, kind, name, namespace)
    if current is None:
        return False
    uid = current["metadata"]["uid"]
    client.delete(api_version, kind, name, namespace, uid=uid, propagation=propagation)
    client.wait_deleted(api_version, kind, name, namespace, uid=uid, timeout=timeout)
    return True


def clean_node(client: kube.Client, node: dict) -> bool:
    """Remove our keys from `node` as listed; True if it had any. The merge patch names only those
    keys, so it loses no concurrent change to the node and needs no re-read (a resourceVersion
    precondition made every node whose status moved since the list conflict and cost two more
    requests). A node deleted meanwhile is skipped."""
    patch = node_patch(node)
    if patch is None:
        return False
    try:
        client.patch("v1", "Node", node["metadata"]["name"], patch)
    except Exception as err:  # only a vanished node is expected
        if not api_failures.is_status(err, 404):
            raise
        return False
    return True


def delete_own_rbac(client: kube.Client, name: str) -> bool:
    """Step 7: delete ClusterRole `name`, ClusterRoleBinding `name` going with it."""
    rbac = "rbac.authorization.k8s.io/v1"
    role = client.get(rbac, "ClusterRole", name)
    if role is None:
        return False
    owner = {"apiVersion": rbac, "kind": "ClusterRole", "name": name, "uid": role["metadata"]["uid"]}
    if client.get(rbac, "ClusterRoleBinding", name) is not None:
        client.patch(rbac, "ClusterRoleBinding", name, {"metadata": {"ownerReferences": [owner]}})
    return client.delete(rbac, "ClusterRole", name, uid=owner["uid"])


def cleanup(
    client: kube.Client,
    namespace: str,
    *,
    delete_crd: bool,
    runner: str | None = None,
    test_pod: str | None = None,
    timeout: float = 240,
    own_rbac: str | None = None,
) -> list[str]:
    """Run the steps of the module docstring within `timeout` seconds; what was done, one line each."""
    deadline = time.monotonic() + timeout
    left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
    crd = client.get(common.CRD_API_VERSION, "CustomResourceDefinition", contract.CRD_NAME)
    waits = {
        f"deleted DaemonSet {namespace}/{name} and its pods":  # Foreground: gone only after its pods
        functools.partial(delete_and_wait, client, "apps/v1", "DaemonSet", name, namespace, left(), "Foreground")
        for name in NODE_WRITERS
    }
    if crd is not None:
        waits[f"deleted {contract.CR_KIND} {contract.CR_NAME}"] = functools.partial(
            delete_and_wait, client, contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME, None, left()
        )
    for api_version, kind in (("apps/v1", "Deployment"), ("batch/v1", "CronJob")) if runner else ():
        waits[f"deleted {kind} {namespace}/{runner} and its pods"] = functools.partial(
            delete_and_wait, client, api_version, kind, runner, namespace, left(), "Foreground"
        )
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(waits)) as pool:
        happened = dict(zip(waits, pool.map(lambda wait: wait(), waits.values()), strict=True))
    done = [line for line, deleted in happened.items() if deleted]
    listed = client.list("v1", "Node")
    nodes = [node for node in listed if node_patch(node) is not None]
    cordoned = [n["metadata"]["name"] for n in listed if (n["metadata"].get("labels") or {}).get(CORDONED_LABEL) == "true"]
    with concurrent.futures.ThreadPoolExecutor(max_workers=NODE_WORKERS) as pool:
        cleaned = list(pool.map(functools.partial(clean_node, client), nodes))
        uncordoned = list(pool.map(functools.partial(cordon.uncordon, client), cordoned))
    done += [
        f"removed our labels/annotations from node {node['metadata']['name']}"
        for node, had in zip(nodes, cleaned, strict=True)
        if had
    ]
    done += [f"uncordoned node {name} (the runner cordoned it)" for name, did in zip(cordoned, uncordoned, strict=True) if did]
    if (
        delete_crd
        and crd is not None
        and delete_and_wait(client, common.CRD_API_VERSION, "CustomResourceDefinition", contract.CRD_NAME, None, left())
    ):
        done.append(f"deleted CRD {contract.CRD_NAME}")
    if runner and delete_and_wait(client, "coordination.k8s.io/v1", "Lease", runner, namespace, left()):
        done.append(f"deleted Lease {namespace}/{runner}")
    if test_pod and delete_and_wait(client, "v1", "Pod", test_pod, namespace, left()):
        done.append(f"deleted Pod {namespace}/{test_pod}")
    if own_rbac and delete_own_rbac(client, own_rbac):
        done.append(f"deleted its ClusterRole and ClusterRoleBinding {own_rbac}")
    return done


def run(args: argparse.Namespace) -> int:
    done = cleanup(
        kube.Client.from_args(args),
        args.namespace,
        delete_crd=args.delete_crd,
        runner=args.runner,
        test_pod=args.test_pod,
        timeout=args.timeout,
        own_rbac=args.delete_own_rbac,
    )
    for line in done or ["nothing to clean up"]:
        print(f"cleanup: {line}")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "cleanup", help="remove the CR and our node labels before uninstall (hook)", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--delete-crd", action="store_true", help=f"also delete the CRD {contract.CRD_NAME} (crds.keep=false)")
    parser.add_argument(
        "--runner", metavar="NAME", help="also stop the runner: delete its Deployment or CronJob NAME, then its Lease NAME"
    )
    parser.add_argument("--test-pod", metavar="NAME", help="also delete the helm test pod NAME")
    parser.add_argument(
        "--delete-own-rbac",
        metavar="NAME",
        help="last, delete ClusterRole and ClusterRoleBinding NAME that grant this command "
        "its rights (where they are not Helm hooks: Argo CD)",
    )
    parser.add_argument(
        "--timeout", type=bounded(float, 1, 86400), default=240, help="seconds the whole cleanup may take (default: 240)"
    )
    common.add_api_arguments(parser)
    parser.set_defaults(func=run)
