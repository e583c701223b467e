"""`metax-operator bootstrap`: create or update the `cluster-operator` CR from the values.

Runs as a post-install, pre-upgrade and pre-rollback hook, and on every Argo CD sync: it must be
safe to repeat.
The spec is the values restricted to what the CRD's spec schema declares (chart-only keys such as
`image`, `resources`, `runner` are dropped; the schema the API server serves is the authority).
It is written by server-side apply with the field manager `metax-operator-bootstrap` and `force`;
applying the same values again changes nothing (same resourceVersion, same managedFields).

A three-way merge, as Helm's own for the objects it manages: the CR records, in the annotation
`gpu.metax-tech.com/bootstrap-applied`, the spec the last bootstrap applied. Each field (a leaf
of the spec; lists are leaves) is then
- applied from the values where they changed it since that record (or there is no record): the
  values win; where the live CR held an edit of its own, the override is reported (an Event on
  the CR and a line of the hook's log: field, old and new value);
- left out of the apply where the values did not change it and the live CR holds something else
  (an admin's `kubectl edit`/`patch` at run time): the edit stays;
- sent unchanged otherwise, so the bootstrap keeps owning it.

Why leaving a field out does not delete the admin's value: server-side apply removes a field an
applier stops sending only if no other manager owns it, and an edit (an Update) that changes a
field takes its ownership from the bootstrap manager.

With `--release-revision N` (the chart passes `.Release.Revision`) the CR also records N in the
annotation `gpu.metax-tech.com/release-revision`. Bootstrap runs pre-upgrade (and pre-rollback),
before Helm applies the release: until Helm has, the DaemonSets carry another revision, and the
runner, seeing them differ from the CR, writes nothing (`runtime/helm_hold.py`). Otherwise the
runner would act on this CR write at once (roll back for `enableRollout: false`, apply a new
version) and Helm would then apply the values' DaemonSets over it: a field conflict under Helm
4's server-side apply, a template written twice under Helm 3.

The merged spec is checked (`validation.cr_spec_problems`) before it is written: a kept edit that
does not fit the new values (steps set at run time removed, say, while the values turn
`enableRollout` on) fails the hook with the problem and the kept edits named, before Helm changes
anything else (bootstrap runs pre-upgrade and pre-rollback). The API server's rules refuse it
too. So is a change of anything but `pause` and `enableRollout` while a driver rollout is in
progress (`refuse_frozen_edits`), which the chart's policy refuses only where it is served (1.30
and later).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import dataclass, field

from metax_operator import contract
from metax_operator.chart import seed_spellings, validation
from metax_operator.chart.admission import frozen_changes, frozen_during_rollout
from metax_operator.cli import bounded
from metax_operator.conditions import CrReason, Event, EventType, rfc3339
from metax_operator.contract import (
    BOOTSTRAP_APPLIED_ANNOTATION,
    BOOTSTRAP_CONTROLS_ANNOTATION,
    BOOTSTRAP_FIELD_MANAGER,
    PART_OF,
    PART_OF_LABEL,
    RELEASE_REVISION_ANNOTATION,
)
from metax_operator.errors import UserError, UserErrors
from metax_operator.hooks import common
from metax_operator.lookup import lookup
from metax_operator.runtime import api_failures, cr_status, kube

_MISSING = object()


def prune(value: object, schema: dict) -> object:
    """`value` restricted to the fields `schema` (structural OpenAPI v3) declares; nulls dropped."""
    if isinstance(value, dict):
        properties = schema.get("properties")
        if properties is not None:
            return {k: prune(v, properties[k]) for k, v in value.items() if k in properties and v is not None}
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


def leaves(tree: dict, schema: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    """Every field of a spec by path, as server-side apply owns them: objects of the schema with
    `properties` are walked (an empty one says nothing); scalars, lists, maps and Kubernetes
    shapes such as an affinity (atomic in the CRD: each is replaced whole) are leaves."""
    out: dict[tuple[str, ...], object] = {}
    properties = schema.get("properties") or {}
    for key, value in tree.items():
        child = properties.get(key, {})
        if isinstance(value, dict) and child.get("properties") and child.get("x-kubernetes-map-type") != "atomic":
            out.update(leaves(value, properties[key], prefix + (key,)))
        else:
            out[prefix + (key,)] = value
    return out


def _tree(flat: dict[tuple[str, ...], object]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def _recorded(live: dict | None, schema: dict) -> dict[tuple[str, ...], object] | None:
    """What the last bootstrap applied, by path; None when nothing says (a CR created otherwise)."""
    annotations = (live or {}).get("metadata", {}).get("annotations") or {}
    try:
        if BOOTSTRAP_APPLIED_ANNOTATION in annotations:
            return leaves(json.loads(annotations[BOOTSTRAP_APPLIED_ANNOTATION]), schema)
        if BOOTSTRAP_CONTROLS_ANNOTATION in annotations:  # an older chart's record: the controls only
            return {
                tuple(name.split(".")): value for name, value in json.loads(annotations[BOOTSTRAP_CONTROLS_ANNOTATION]).items()
            }
    except (ValueError, AttributeError):
        pass
    return None


@dataclass(frozen=True)
class Change:
    """A field the merge decided on: kept at the live value, or overridden by the values."""

    path: tuple[str, ...]
    live: object
    values: object

    @property
    def field(self) -> str:
        return "spec." + ".".join(self.path)

    def kept(self) -> str:
        return f"{self.field} kept at {_show(self.live)} (changed at run time; the values did not change it)"

    def overridden(self) -> str:
        return f"{self.field} set from {_show(self.live)} to {_show(self.values)} by the values (a run-time edit overridden)"


def _show(value: object) -> str:
    return "unset" if value is _MISSING else json.dumps(value, sort_keys=True)


@dataclass
class Merge:
    """The apply manifest and what the merge kept and overrode."""

    manifest: dict
    kept: list[Change] = field(default_factory=list)
    overridden: list[Change] = field(default_factory=list)


def desired(spec: dict, live: dict | None, labels: dict[str, str], schema: dict, revision: int | None = None) -> Merge:
    """The three-way merge of the values `spec`, the record of the last bootstrap and the `live`
    CR (None: not there yet), field by field of the CRD's spec `schema`; pure. `revision`: the
    release revision to record (the runner's hold until Helm applies it)."""
    wanted = leaves(spec, schema)
    recorded = _recorded(live, schema) if live is not None else None
    current = leaves((live or {}).get("spec") or {}, schema)
    merge = Merge(manifest={})
    sent = {}
    for path, value in wanted.items():
        before, now = (recorded or {}).get(path, _MISSING), current.get(path, _MISSING)
        if before is _MISSING or value != before:  # new, or changed by the values: they win
            sent[path] = value
            if live is not None and now not in (value, before):
                merge.overridden.append(Change(path, now, value))
        elif now == before:
            sent[path] = value
        else:
            merge.kept.append(Change(path, now, value))
    merge.manifest = {
        "apiVersion": contract.CR_API_VERSION,
        "kind": contract.CR_KIND,
        "metadata": {
            "name": contract.CR_NAME,
            "labels": labels,
            "annotations": {
                BOOTSTRAP_APPLIED_ANNOTATION: json.dumps(spec, sort_keys=True, separators=(",", ":")),
                **({RELEASE_REVISION_ANNOTATION: str(revision)} if revision is not None else {}),
            },
        },
        "spec": _tree(sent),
    }
    return merge


def merged_spec(merge: Merge, live: dict | None, schema: dict) -> dict:
    """The spec the CR will have: the live one with the sent fields written over it."""
    flat = leaves((live or {}).get("spec") or {}, schema)
    flat.update(leaves(merge.manifest["spec"], schema))
    return _tree(flat)


def refuse_frozen_edits(live: dict, spec: dict, schema: dict) -> None:
    """Raise the policy's refusal when a driver rollout is in progress (as the live CR's status
    says) and `spec` changes a field other than `pause` and `enableRollout`. The chart's
    ValidatingAdmissionPolicy refuses that write from 1.30; checked here too, so that on older API
    servers `helm upgrade` and `helm rollback` fail before Helm applies anything, as they do
    there, instead of the runner holding the values until the rollout ends."""
    status = lookup(live, "status", "upgradeStatus") or {}
    if status.get("upgrading") is not True:
        return
    changed = frozen_changes(_tree(leaves(live.get("spec") or {}, schema)), spec)
    if changed:
        raise frozen_during_rollout(", ".join(changed), str(status.get("phase") or ""))


def served_crd(client: kube.Client, timeout: float) -> dict:
    """The CRD once the API server serves the CR kind (the CRD may be seconds old)."""
    deadline = time.monotonic() + timeout
    while True:
        crd = client.get(common.CRD_API_VERSION, "CustomResourceDefinition", contract.CRD_NAME)
        try:
            if crd is not None:
                client.resource(contract.CR_API_VERSION, contract.CR_KIND)
                return crd
        except LookupError:
            client.forget(contract.CR_API_VERSION)
        if time.monotonic() > deadline:
            raise UserError(
                contract.CRD_NAME,
                f"is not served by the API server after {timeout:g}s",
                "install the CRD (helm install without --skip-crds), then run the hook again",
            )
        time.sleep(1)


def spec_from_values(values: dict, schema: dict) -> dict:
    """The spec the release's `values` give: the product manual's spellings read as the chart's
    keys (the chart's render has done so in the values it hands the hooks; a conflict is refused),
    restricted to what the CRD's spec `schema` declares."""
    spelled = seed_spellings.normalise(values)
    if spelled.errors:
        raise UserErrors(spelled.errors)
    return without_unused_new_blocks(prune(spelled.values, schema))


def without_unused_new_blocks(spec: dict) -> dict:
    """`spec` less each block newer than the release before (`contract.UNDEFAULTED`) that the
    values leave off (`enable` not true): a CR that never turned it on stays one that release's
    bootstrap and runner read, should a `helm rollback` bring it back. Turned on, the block goes
    in, and a rollback refuses it by name until it is removed."""
    out = copy.deepcopy(spec)
    for *parents, key in contract.UNDEFAULTED:
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(key), dict) and node[key].get("enable") is not True:
            del node[key]
    return out


def bootstrap(
    client: kube.Client, values: dict, release: str, timeout: float = 60, revision: int | None = None
) -> tuple[dict, Merge]:
    """Apply the CR for `values`; returns the CR and the merge. Raises `UserErrors` when the
    merge with the kept run-time edits would be invalid (nothing written then)."""
    schema = spec_schema(served_crd(client, timeout))
    spec = spec_from_values(values, schema)
    labels = {"app.kubernetes.io/name": "metax-operator", "app.kubernetes.io/instance": release, PART_OF_LABEL: PART_OF}

    def attempt() -> tuple[dict, Merge]:
        live = client.get(contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME)
        merge = desired(spec, live, labels, schema, revision)
        merged = merged_spec(merge, live, schema)
        problems = validation.cr_spec_problems(merged) if merge.kept else []
        if problems:
            kept = ", ".join(change.field for change in merge.kept)
            raise UserErrors(
                [
                    UserError(
                        p.field,
                        p.problem,
                        f"{p.fix} (this upgrade keeps the run-time edits of "
                        f"{kept}: set them in the values, or change them with kubectl first)",
                    )
                    for p in problems
                ]
            )
        if live is not None:
            refuse_frozen_edits(live, merged, schema)
            # written against what we read: a concurrent edit makes it re-read
            merge.manifest["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
        return client.apply(merge.manifest, field_manager=BOOTSTRAP_FIELD_MANAGER, force=True), merge

    cr, merge = api_failures.retry_on_conflict(attempt)
    for change in merge.overridden:
        cr_status.emit_event(
            client,
            cr,
            Event(EventType.NORMAL, CrReason.VALUES_OVERRODE_EDIT, change.overridden()),
            rfc3339(time.time()),
            component=BOOTSTRAP_FIELD_MANAGER,
        )
    return cr, merge


def run(args: argparse.Namespace) -> int:
    values = common.load_values(args.values)
    for notice in seed_spellings.normalise(values).notices:
        print(f"bootstrap: {notice}")
    cr, merge = bootstrap(kube.Client.from_args(args), values, args.release, revision=args.release_revision)
    for change in merge.kept:
        print(f"bootstrap: {change.kept()}")
    for change in merge.overridden:
        print(f"bootstrap: {change.overridden()}")
    print(f"bootstrap: {contract.CR_KIND} {contract.CR_NAME} at resourceVersion {cr['metadata']['resourceVersion']}")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bootstrap", help="create/update the cluster-operator CR from values (hook)", description=__doc__.splitlines()[0]
    )
    common.add_values_argument(parser)
    parser.add_argument("--release", required=True, help="the Helm release name (for labels)")
    parser.add_argument(
        "--release-revision",
        type=bounded(int, 1, 2**31 - 1),
        metavar="N",
        help="the Helm release revision being applied: the runner writes nothing until Helm has applied it",
    )
    common.add_api_arguments(parser, namespace=False)
    parser.set_defaults(func=run)
