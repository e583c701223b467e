"""`metax-operator rollback-hold`: keep `helm rollback` from replacing component pods twice.

`helm rollback` re-applies the stored manifest of the release it restores. The chart renders the
fields the runner writes from the CR (scheduling, the environment of `daemonset.ENV`) as the live
DaemonSet held them when that release was rendered: before that release's own change of them
reached the CR. So the restored templates can hold values the runner changes again once the
post-rollback bootstrap has written the release's values into the CR: two new templates, and
with `RollingUpdate` the DaemonSet controller would replace the pods for each.

This pre-rollback hook, run once the bootstrap's dry run has passed:
1. writes the revision being restored into the CR (`contract.RELEASE_REVISION_ANNOTATION`): the
   DaemonSets carry another revision until Helm has applied the old release, so the runner writes
   nothing until then (`runtime/helm_hold.py`), or it would put the update strategy back before
   Helm writes the templates;
2. sets every component DaemonSet but the driver's (always `OnDelete`) to `OnDelete`, so Helm's
   write of the old templates replaces no pod. No release manifest holds these update strategies
   (the runner alone writes them), so Helm leaves this in place.

Once Helm has applied the release the runner puts `contract.COMPONENT_UPDATE_STRATEGY` back in the
same write as the CR's fields, and each pod is replaced at most once. A rollback that fails after
this hook leaves `OnDelete` until the hold expires (`contract.HELM_APPLY_WAIT`); the runner then
puts `RollingUpdate` back.
"""

from __future__ import annotations

import argparse

from metax_operator import contract
from metax_operator.cli import bounded
from metax_operator.contract import BOOTSTRAP_FIELD_MANAGER, DAEMONSETS, RELEASE_REVISION_ANNOTATION
from metax_operator.hooks import common
from metax_operator.runtime import kube

FIELD_MANAGER = "metax-operator-rollback-hold"
#: The DaemonSets whose pods the DaemonSet controller replaces (the driver's only the runner does).
COMPONENTS = {key: name for key, name in DAEMONSETS.items() if key != "driver"}
ON_DELETE = {"type": "OnDelete", "rollingUpdate": None}


def hold(client: kube.Client, namespace: str, revision: int) -> list[str]:
    """Hold the runner for `revision` and stop the component DaemonSets' rolling updates; the
    names of the DaemonSets set to `OnDelete`. Nothing to do without a CR (no runner acts)."""
    if client.get(contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME) is None:
        return []
    # As the bootstrap's own write: the hold lasts HELM_APPLY_WAIT from the bootstrap manager's last write.
    client.patch(
        contract.CR_API_VERSION,
        contract.CR_KIND,
        contract.CR_NAME,
        {"metadata": {"annotations": {RELEASE_REVISION_ANNOTATION: str(revision)}}},
        field_manager=BOOTSTRAP_FIELD_MANAGER,
    )
    stopped = []
    for name in COMPONENTS.values():
        ds = client.get("apps/v1", "DaemonSet", name, namespace)
        if ds is None or ((ds.get("spec") or {}).get("updateStrategy") or {}).get("type") == "OnDelete":
            continue
        client.patch(
            "apps/v1",
            "DaemonSet",
            name,
            {"spec": {"updateStrategy": ON_DELETE}},
            namespace=namespace,
            field_manager=FIELD_MANAGER,
        )
        stopped.append(name)
    return stopped


def run(args: argparse.Namespace) -> int:
    stopped = hold(kube.Client.from_args(args), args.namespace, args.release_revision)
    print(
        f"rollback-hold: the runner waits for release revision {args.release_revision}; "
        f"OnDelete until it has written the CR's fields: {', '.join(stopped) or 'nothing to stop'}"
    )
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "rollback-hold",
        help="hold the runner and the component DaemonSets' rolling updates while helm rollback applies (hook)",
        description=__doc__.splitlines()[0],
    )
    common.add_api_arguments(parser)
    parser.add_argument(
        "--release-revision",
        type=bounded(int, 1, 2**31 - 1),
        metavar="N",
        required=True,
        help="the release revision being restored (the chart passes .Release.Revision)",
    )
    parser.set_defaults(func=run)
