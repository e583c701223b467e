"""The podTemplateSpec rules (seed 000 §3.2.4-3.2.5): one pure function.

Both the post-renderer (inputs read from a DaemonSet's annotations, named by their
values keys) and the runner (inputs read from the ClusterOperator CR, named by their
`spec.` paths) call `merge_scheduling`, so the two paths compute the same pod
scheduling fields from the same inputs.

Rules, in order:
1. custom = the component's podTemplateSpec if it defines one (a non-empty `spec`),
   else the global podTemplateSpec: the component's replaces the global wholly.
2. custom `spec.tolerations` win over the deprecated global `tolerations`; when
   custom sets none, the deprecated ones fill in (with a deprecation notice).
3. result = merge(base, custom): scalars replace, maps merge key by key (custom
   wins), lists append each custom item that is not equal to one already there.
   A null in custom sets nothing.
4. one exception to 3: a driver DaemonSet's pool term (the base's one required nodeSelectorTerm,
   on the runner's pool label: `chart/pools.py`) holds whatever custom adds. It is added to every
   term custom gives, since the terms of a list are alternatives: appended, it would let custom's
   terms select a pool's nodes for the driver's own DaemonSet.

Only `nodeSelector`, `affinity` and `tolerations` are managed; any other key in a
podTemplateSpec is refused with a UserError naming it, never dropped silently.

The chart records the inputs on every component DaemonSet (the `*_ANNOTATION` names of contract.py,
`inputs_from_annotations`); the base is the pod template as the chart renders it
before any merge, so applying the merge again to its own output changes nothing.
"""

from __future__ import annotations

import json
from collections import namedtuple

from metax_operator.contract import (
    COMPONENT_ANNOTATION,
    COMPONENTS,
    GPU_NODE_LABEL,
    POOL_LABEL,
    SCHEDULING_BASE_ANNOTATION,
    SCHEDULING_INPUTS_ANNOTATION,
)
from metax_operator.errors import UserError, UserErrors

MANAGED_FIELDS = ("nodeSelector", "affinity", "tolerations")


# What the merge starts from, as plain data (JSON-shaped dicts and lists): the component's
# values key (e.g. "maca"), the base scheduling fields, the global and the component's
# podTemplateSpec and the deprecated global tolerations (each None when not set).
# (A namedtuple, not a dataclass: the post-renderer runs inside every `helm template`, and
# importing dataclasses costs more than the merge.)
SchedulingInputs = namedtuple(
    "SchedulingInputs", "component base global_pts component_pts deprecated_tolerations", defaults=({}, None, None, None)
)


def merge_scheduling(inputs: SchedulingInputs, prefix: str = "") -> tuple[dict, list[str]]:
    """The scheduling fields of the component's pod spec, and notices for the user.

    `prefix` is prepended to field names in errors and notices: "" for Helm values
    (`maca.podTemplateSpec`), "spec." for the CR (`spec.maca.podTemplateSpec`).
    Raises UserError (UserErrors for several) naming each malformed field.
    """
    global_name = f"{prefix}podTemplateSpec"
    component_name = f"{prefix}{inputs.component}.podTemplateSpec"
    tolerations_name = f"{prefix}tolerations"
    errors: list[UserError] = []
    global_spec = _checked_spec(inputs.global_pts, global_name, errors)
    component_spec = _checked_spec(inputs.component_pts, component_name, errors)
    deprecated = inputs.deprecated_tolerations
    if deprecated is not None and not _is_list_of_maps(deprecated):
        errors.append(
            UserError(
                tolerations_name,
                "must be a list of tolerations (mappings)",
                "write it as in seed §3.2.4, e.g. [{key: key1, operator: Equal, value: value1, effect: NoSchedule}]",
            )
        )
    if errors:
        raise errors[0] if len(errors) == 1 else UserErrors(errors)

    if component_spec:
        custom, custom_name = component_spec, component_name
    else:
        custom, custom_name = global_spec or {}, global_name
    notices = []
    if deprecated:
        if custom.get("tolerations") is not None:
            notices.append(
                f"{tolerations_name} is deprecated (removed in 0.11.0) and ignored for {inputs.component}: "
                f"{custom_name}.spec.tolerations win; move your tolerations there"
            )
        else:
            custom = {**custom, "tolerations": deprecated}
            notices.append(
                f"{tolerations_name} is deprecated (removed in 0.11.0) and applied to {inputs.component}; "
                f"move them to {global_name}.spec.tolerations"
            )
    base = {key: inputs.base[key] for key in MANAGED_FIELDS if key in inputs.base}
    return _base_terms_hold(base, merge_values(base, custom)), notices


REQUIRED_TERMS = ("affinity", "nodeAffinity", "requiredDuringSchedulingIgnoredDuringExecution", "nodeSelectorTerms")


def _base_terms_hold(base: dict, merged: dict) -> dict:
    """Rule 4: `merged` with the base's pool term in each of its required nodeSelectorTerms."""
    base_terms, terms = _terms(base), _terms(merged)
    if len(base_terms) != 1 or terms == base_terms or not _pool_term(base_terms[0]):
        return merged
    held = base_terms[0]
    joined = [_joined(held, term) for term in terms if term != held]
    affinity = merged["affinity"]
    node_affinity = affinity["nodeAffinity"]
    required = {**node_affinity[REQUIRED_TERMS[2]], "nodeSelectorTerms": joined}
    return {**merged, "affinity": {**affinity, "nodeAffinity": {**node_affinity, REQUIRED_TERMS[2]: required}}}


def _terms(fields: dict) -> list:
    node: object = fields
    for key in REQUIRED_TERMS:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, list) else []


def _pool_term(term: object) -> bool:
    expressions = term.get("matchExpressions") if isinstance(term, dict) else None
    return (
        bool(expressions)
        and set(term) == {"matchExpressions"}
        and all(isinstance(e, dict) and e.get("key") == POOL_LABEL for e in expressions)
    )


def _joined(held: dict, term: object) -> object:
    """The term with the held term's requirements added (each once)."""
    if not isinstance(term, dict):
        return term
    return {**term, "matchExpressions": merge_values(held["matchExpressions"], term.get("matchExpressions") or [])}


def merge_values(base: object, custom: object) -> object:
    """merge(base, custom): maps key by key, lists append unseen items, scalars replace.

    A field that base lacks merges as if empty, so a custom list never brings duplicates in
    either way; a null in custom sets nothing.
    """
    if custom is None:
        return base
    if isinstance(custom, dict):
        merged = dict(base) if isinstance(base, dict) else {}
        for key, value in custom.items():
            if value is not None:
                merged[key] = merge_values(merged.get(key), value)
        return merged
    if isinstance(custom, list):
        merged = list(base) if isinstance(base, list) else []
        for item in custom:
            if item not in merged:
                merged.append(item)
        return merged
    return custom


def inputs_from_annotations(annotations: dict) -> SchedulingInputs:
    """Read the inputs the chart recorded on a component DaemonSet (the contract above).

    Raises UserError naming the annotation when one is missing or not the JSON the
    contract says.
    """

    def load(key: str, shape: str) -> object:
        where = f'metadata.annotations["{key}"]'
        if key not in annotations:
            raise UserError(where, "is missing", "render the DaemonSet with the metax-operator chart, which sets it")
        try:
            value = json.loads(annotations[key])
        except (TypeError, ValueError) as err:
            raise UserError(
                where,
                f"is not valid JSON ({err})",
                "render the DaemonSet with the metax-operator chart; do not edit this annotation",
            ) from None
        if not isinstance(value, dict):
            raise UserError(
                where,
                f"must be a JSON object ({shape})",
                "render the DaemonSet with the metax-operator chart; do not edit this annotation",
            )
        return value

    component = annotations.get(COMPONENT_ANNOTATION)
    if component not in COMPONENTS:
        problem = "is missing" if component is None else f"is {component!r}, not a component"
        raise UserError(
            f'metadata.annotations["{COMPONENT_ANNOTATION}"]',
            problem,
            f"render the DaemonSet with the metax-operator chart, which sets one of {', '.join(COMPONENTS)}",
        )
    base = load(SCHEDULING_BASE_ANNOTATION, "the pod template's nodeSelector, affinity, tolerations")
    recorded = load(SCHEDULING_INPUTS_ANNOTATION, '{"global": ..., "component": ..., "tolerations": ...}')
    return SchedulingInputs(
        component=component,
        base=base,
        global_pts=recorded.get("global"),
        component_pts=recorded.get("component"),
        deprecated_tolerations=recorded.get("tolerations"),
    )


def _checked_spec(pts: object, name: str, errors: list) -> dict | None:
    """The `spec` of a podTemplateSpec after checking it holds only managed fields."""
    if pts is None:
        return None
    if not isinstance(pts, dict):
        errors.append(
            UserError(
                name,
                f"must be a mapping, not {type(pts).__name__}",
                "write it as {spec: {nodeSelector: ..., affinity: ..., tolerations: [...]}}",
            )
        )
        return None
    for key in pts:
        if key != "spec":
            errors.append(
                UserError(
                    f"{name}.{key}",
                    "is not supported: only spec.nodeSelector, spec.affinity and spec.tolerations are managed (seed table 3.15)",
                    "remove it",
                )
            )
    spec = pts.get("spec")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        errors.append(
            UserError(
                f"{name}.spec",
                f"must be a mapping, not {type(spec).__name__}",
                "write it as {nodeSelector: ..., affinity: ..., tolerations: [...]}",
            )
        )
        return None
    for key, value in spec.items():
        where = f"{name}.spec.{key}"
        if key not in MANAGED_FIELDS:
            errors.append(
                UserError(
                    where,
                    "is not supported: only nodeSelector, affinity and tolerations are managed (seed table 3.15)",
                    "remove it, or set it in the chart's values for that component if it has one",
                )
            )
        elif key == "nodeSelector" and not (
            value is None or isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
        ):
            errors.append(
                UserError(
                    where,
                    "must be a mapping of label names to string values",
                    f'quote numbers and booleans, e.g. {{{GPU_NODE_LABEL}: "true"}}',
                )
            )
        elif key == "nodeSelector" and POOL_LABEL in value:
            errors.append(
                UserError(
                    f"{where}.{POOL_LABEL}",
                    "is the runner's own node label: it says which driver pool's DaemonSet runs on a node",
                    "remove it; select a pool's nodes with driver.pools[].nodeSelector",
                )
            )
        elif key == "affinity" and not (value is None or isinstance(value, dict)):
            errors.append(
                UserError(
                    where,
                    "must be a mapping (a Kubernetes Affinity)",
                    "write it as {nodeAffinity: ..., podAffinity: ..., podAntiAffinity: ...}",
                )
            )
        elif key == "tolerations" and not (value is None or _is_list_of_maps(value)):
            errors.append(
                UserError(
                    where,
                    "must be a list of tolerations (mappings)",
                    "write it as [{key: ..., operator: Equal, value: ..., effect: NoSchedule}]",
                )
            )
    return spec


def _is_list_of_maps(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) for item in value)
