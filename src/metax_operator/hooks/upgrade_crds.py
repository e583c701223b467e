"""`metax-operator upgrade-crds`: apply the chart's current CRD (Helm never updates `crds/`).

Runs as a pre-install and pre-upgrade hook. The CRD comes from a ConfigMap the chart renders
with `.Files.Get`, mounted as files, in two forms: the portable one Helm installs from `crds/`,
which every supported API server admits, and the whole one from files/ (validate's lines as the
rules' messages), applied where the API server admits it (`admission.for_server`). Server-side
apply with our own field manager and `force`: the CRD was created by Helm (`crds/`, manager
"helm") or by an earlier run of this hook, and the chart's copy is the truth. The hook then gives
up its claim on the fields (`release_fields`): Helm 4 installs `crds/` by server-side apply
without force, so a claim on the whole form's rules would make a later `helm install` over the
kept CRD (a reinstall after uninstall) fail with a conflict. On install
(`--if-exists`) it only updates a CRD that is already there (Helm created it from `crds/` just
before, or an earlier release left it with `crds.keep`): creating it is Helm's job, and
`helm install --skip-crds` must be respected. It then waits until the API server serves the new
version (condition Established), so the post-install bootstrap can write the CR.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

from metax_operator import contract
from metax_operator.chart import admission
from metax_operator.errors import UserError
from metax_operator.hooks import common
from metax_operator.runtime import api_failures, kube
from metax_operator.yamltext import load_one, read_text


def load_crd(path: Path) -> dict:
    crd = load_one(read_text(path, "mount the CRD ConfigMap or pass --crd FILE"), str(path))
    if (
        not isinstance(crd, dict)
        or crd.get("kind") != "CustomResourceDefinition"
        or crd.get("metadata", {}).get("name") != contract.CRD_NAME
    ):
        raise UserError(
            str(path), f"is not the {contract.CRD_NAME} CustomResourceDefinition", "pass the chart's crds/ or files/ copy of it"
        )
    return crd


def established(crd: dict | None, generation: int) -> bool:
    status = (crd or {}).get("status") or {}
    conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
    return (
        conditions.get("Established") == "True"
        and conditions.get("NamesAccepted") == "True"
        and (crd or {}).get("metadata", {}).get("generation", 0) >= generation
    )


def wait_established(client: kube.Client, generation: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not established(client.get(common.CRD_API_VERSION, "CustomResourceDefinition", contract.CRD_NAME), generation):
        if time.monotonic() > deadline:
            raise UserError(
                f"CRD {contract.CRD_NAME}",
                f"is not Established after {timeout:g}s",
                "see its status conditions (kubectl describe crd), then run the hook again",
            )
        time.sleep(0.5)


def upgrade(client: kube.Client, crd: dict, full_crd: dict | None = None, *, if_exists: bool, timeout: float = 60) -> str:
    """Apply `crd` (the portable form), or `full_crd` where the API server admits it; returns
    what happened ("skipped", "unchanged", "applied")."""
    current = client.get(common.CRD_API_VERSION, "CustomResourceDefinition", contract.CRD_NAME)
    if current is None and if_exists:
        return "skipped"
    if full_crd is not None:
        crd = admission.for_server(crd, full_crd, client.server_version()[1])
    apply = functools.partial(client.apply, crd, field_manager=contract.UPGRADE_CRDS_FIELD_MANAGER, force=True)
    if current is not None and stored_part(apply(dry_run=True)) == stored_part(current):
        return "unchanged"
    apply()
    applied = release_fields(client)
    wait_established(client, applied["metadata"]["generation"], timeout)
    client.forget(contract.CR_API_VERSION)
    return "applied"


def stored_part(crd: dict) -> tuple:
    """What the chart's copy decides: the spec, labels and annotations (not managedFields)."""
    meta = crd["metadata"]
    return crd["spec"], meta.get("labels") or {}, meta.get("annotations") or {}


def release_fields(client: kube.Client) -> dict:
    """Drop our field manager's entry from the CRD's managedFields, keeping the values: no
    later apply (Helm 4's `crds/`, an administrator's) conflicts with this hook. The other
    managers' entries stay (read again on a conflict: the API server writes the CRD's status
    as it establishes it); an emptied list is written as [{}], the API's way to clear it."""

    def attempt() -> dict:
        meta = client.get(common.CRD_API_VERSION, "CustomResourceDefinition", contract.CRD_NAME)["metadata"]
        others = [m for m in meta.get("managedFields") or [] if m.get("manager") != contract.UPGRADE_CRDS_FIELD_MANAGER]
        patch = {"metadata": {"resourceVersion": meta["resourceVersion"], "managedFields": others or [{}]}}
        return client.patch(common.CRD_API_VERSION, "CustomResourceDefinition", contract.CRD_NAME, patch)

    return api_failures.retry_on_conflict(attempt)


def run(args: argparse.Namespace) -> int:
    crd, full_crd = load_crd(args.crd), load_crd(args.full_crd) if args.full_crd else None
    outcome = upgrade(kube.Client.from_args(args), crd, full_crd, if_exists=args.if_exists)
    message = {
        "skipped": "not installed (Helm installs it from crds/); nothing to upgrade",
        "unchanged": "already current",
        "applied": "applied",
    }[outcome]
    print(f"upgrade-crds: {contract.CRD_NAME} {message}", file=sys.stdout)
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "upgrade-crds", help="apply the chart's current CRD (hook)", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--crd", type=Path, default=Path(contract.HOOK_CRD_FILE), help=f"the CRD manifest (default: {contract.HOOK_CRD_FILE})"
    )
    parser.add_argument(
        "--full-crd",
        type=Path,
        help=f"the whole CRD, applied instead where the API server admits it (the chart's: {contract.HOOK_FULL_CRD_FILE})",
    )
    parser.add_argument("--if-exists", action="store_true", help="only update an existing CRD, never create it (pre-install)")
    common.add_api_arguments(parser, namespace=False)
    parser.set_defaults(func=run)
