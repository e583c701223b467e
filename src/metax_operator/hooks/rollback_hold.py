"""`metax-operator rollback-hold`: keep `helm rollback` from replacing component pods twice.

`helm rollback` re-applies the stored manifest of the release it restores. The chart renders the
fields the runner writes from the CR (scheduling, the environment of `daemonset.ENV`) as the live
DaemonSet held them when that release was rendered: before that release's own change of them
reached the CR. So the restored templates can hold values the runner changes again at once: two
new templates, and with `RollingUpdate` the DaemonSet controller would replace the pods for each.

This pre-rollback hook runs after the pre-rollback bootstrap, which has written the restored
release's values and revision into the CR; the DaemonSets carry another revision until Helm has
applied that release, and until then the runner writes nothing (`runtime/helm_hold.py`). The
hook sets every component DaemonSet but the driver's (always `OnDelete`) to `OnDelete`, so Helm's
write of the old templates replaces no pod. No release manifest holds these update strategies
(the runner alone writes them), so Helm leaves this in place. The runner then writes the CR's
fields and `contract.COMPONENT_UPDATE_STRATEGY` in one apply, and each pod is replaced once.

A rollback that fails after this hook leaves `OnDelete` until the runner's hold expires
(`contract.HELM_APPLY_WAIT`); the runner then puts `RollingUpdate` back.
"""

from __future__ import annotations

import argparse

from metax_operator.contract import DAEMONSETS
from metax_operator.hooks import common
from metax_operator.runtime import kube

FIELD_MANAGER = "metax-operator-rollback-hold"
#: The DaemonSets whose pods the DaemonSet controller replaces (the driver's only the runner does).
COMPONENTS = {key: name for key, name in DAEMONSETS.items() if key != "driver"}
ON_DELETE = {"type": "OnDelete", "rollingUpdate": None}


def stop_rolling_updates(client: kube.Client, namespace: str) -> list[str]:
    """Set the component DaemonSets of `namespace` to `OnDelete`; the names of those it changed."""
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
    stopped = stop_rolling_updates(kube.Client.from_args(args), args.namespace)
    print(
        "rollback-hold: OnDelete until the runner has written the CR's fields after Helm's apply: "
        f"{', '.join(stopped) or 'nothing to stop'}"
    )
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "rollback-hold",
        help="stop the component DaemonSets' rolling updates while helm rollback applies (hook)",
        description=__doc__.splitlines()[0],
    )
    common.add_api_arguments(parser)
    parser.set_defaults(func=run)
