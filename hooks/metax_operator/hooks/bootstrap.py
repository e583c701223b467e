"""`metax-operator bootstrap`: create or update the `cluster-operator` CR from the values.

Runs as a post-install and post-upgrade hook, and on every Argo CD sync: it must be safe to repeat.
The spec is the values restricted to what the CRD's spec schema declares (chart-only keys such as
`image`, `resources`, `runner` are dropped; the schema the API server serves is the authority).
It is written by server-side apply with the field manager `metax-operator-bootstrap` and `force`,
so values win for what they set; applying the same values again changes nothing (same
resourceVersion, same managedFields).

Runtime controls (`driver.upgradePolicy.pause` and `.enableRollout`, which admins and the runner
flip with kubectl during a rollout) have defaults in values.yaml, so "this upgrade does not set
them" cannot be read from the values alone. The CR records, in the annotation
`gpu.metax-tech.com/bootstrap-controls`, the values of those fields at the last bootstrap. A
control is left out of the apply when the values did not change it since then AND the live CR
holds something else (someone changed it at run time); otherwise it is applied.

Why leaving it out does not delete the admin's value: server-side apply removes a field that an
applier stops sending only if no other manager owns it. A `kubectl patch`/`edit` (an Update)
that changes a field takes its ownership from the bootstrap manager, so the field is the
admin's, and the bootstrap manager's next apply without it leaves it alone. When the live value
is still the recorded one the field is sent (unchanged), so the bootstrap keeps owning it and a
repeat run neither deletes nor rewrites it.
"""
from __future__ import annotations

import argparse
import json
import time

from .. import kube
from ..errors import UserError
from . import common

FIELD_MANAGER = "metax-operator-bootstrap"
CONTROLS_ANNOTATION = "gpu.metax-tech.com/bootstrap-controls"
#: The runtime controls (seed §3.2.8: the only fields to change during a rollout).
RUNTIME_CONTROLS = (("driver", "upgradePolicy", "pause"), ("driver", "upgradePolicy", "enableRollout"))
_MISSING = object()


def prune(value: object, schema: dict) -> object:
    """`value` restricted to the fields `schema` (structural OpenAPI v3) declares; nulls dropped."""
    if isinstance(value, dict):
        properties = schema.get("properties")
        if properties is not None:
            return {k: prune(v, properties[k]) for k, v in value.items()
                    if k in properties and v is not None}
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            return {k: prune(v, extra) for k, v in value.items() if v is not None}
        return {k: v for k, v in value.items() if v is not None}  # preserve-unknown-fields
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(v, schema["items"]) for v in value]
    return value


def spec_schema(crd: dict) -> dict:
    """The spec schema of the CRD's storage version."""
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _get(tree: object, path: tuple[str, ...]) -> object:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return _MISSING
        tree = tree[key]
    return tree


def _remove(tree: dict, path: tuple[str, ...]) -> None:
    for key in path[:-1]:
        tree = tree[key]
    del tree[path[-1]]


def desired(spec: dict, live: dict | None, labels: dict[str, str]) -> tuple[dict, list[str]]:
    """The apply manifest for values spec `spec` given the `live` CR (or None); pure.

    Returns the manifest and one note per runtime control kept at its run-time value.
    """
    spec = json.loads(json.dumps(spec))  # a copy we may cut
    annotations = (live or {}).get("metadata", {}).get("annotations") or {}
    try:
        recorded = json.loads(annotations.get(CONTROLS_ANNOTATION, "{}"))
    except ValueError:
        recorded = {}
    live_spec = (live or {}).get("spec") or {}
    record, notes = {}, []
    for path in RUNTIME_CONTROLS:
        name = ".".join(path)
        wanted = _get(spec, path)
        if wanted is _MISSING:
            continue
        record[name] = wanted
        before, current = recorded.get(name, _MISSING), _get(live_spec, path)
        if live is not None and before is not _MISSING and wanted == before and current != before:
            _remove(spec, path)
            shown = "unset" if current is _MISSING else json.dumps(current)
            notes.append(f"spec.{name} kept at {shown} (changed at run time; the values did not change it)")
    manifest = {
        "apiVersion": common.CR_API_VERSION, "kind": common.CR_KIND,
        "metadata": {"name": common.CR_NAME, "labels": labels,
                     "annotations": {CONTROLS_ANNOTATION: json.dumps(record, sort_keys=True,
                                                                     separators=(",", ":"))}},
        "spec": spec,
    }
    return manifest, notes


def served_crd(client: kube.Client, timeout: float) -> dict:
    """The CRD once the API server serves the CR kind (the CRD may be seconds old)."""
    deadline = time.monotonic() + timeout
    while True:
        crd = client.get(common.CRD_API_VERSION, "CustomResourceDefinition", common.CRD_NAME)
        try:
            if crd is not None:
                client.resource(common.CR_API_VERSION, common.CR_KIND)
                return crd
        except LookupError:
            client.forget(common.CR_API_VERSION)
        if time.monotonic() > deadline:
            raise UserError(common.CRD_NAME, f"is not served by the API server after {timeout:g}s",
                            "install the CRD (helm install without --skip-crds), then run the hook again")
        time.sleep(1)


def bootstrap(client: kube.Client, values: dict, release: str, timeout: float = 60) -> tuple[dict, list[str]]:
    """Apply the CR for `values`; returns the CR and the notes of `desired`."""
    spec = prune(values, spec_schema(served_crd(client, timeout)))
    labels = {"app.kubernetes.io/name": "metax-operator", "app.kubernetes.io/instance": release,
              "app.kubernetes.io/part-of": "metax-operator"}

    def attempt() -> tuple[dict, list[str]]:
        live = client.get(common.CR_API_VERSION, common.CR_KIND, common.CR_NAME)
        manifest, notes = desired(spec, live, labels)
        if live is not None:  # written against what we read: a concurrent edit makes it re-read
            manifest["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
        return client.apply(manifest, field_manager=FIELD_MANAGER, force=True), notes

    return kube.retry_on_conflict(attempt)


def run(args: argparse.Namespace) -> int:
    cr, notes = bootstrap(kube.Client.from_args(args), common.load_values(args.values), args.release)
    for note in notes:
        print(f"bootstrap: {note}")
    print(f"bootstrap: {common.CR_KIND} {common.CR_NAME} at resourceVersion "
          f"{cr['metadata']['resourceVersion']}")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("bootstrap", help="create/update the cluster-operator CR from values (hook)",
                                   description=__doc__.splitlines()[0])
    common.add_values_argument(parser)
    parser.add_argument("--release", required=True, help="the Helm release name (for labels)")
    common.add_api_arguments(parser, namespace=False)
    parser.set_defaults(func=run)
