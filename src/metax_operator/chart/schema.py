"""One schema source, two outputs: values.schema.json and the ClusterOperator CRD.

`schema_source.yaml` (beside this module) holds types, enums and patterns; values.yaml holds
the defaults and, in its helm-docs `# --` comments, the descriptions. Generating from both
means each fact is written once: values.yaml stays the documentation users read, the schema
cannot drift from it (tests/chart/test_schema.py fails when an output is stale), and the CRD's
`kubectl explain` shows the same sentences.

chart/generate.py writes them (with the CRD's CEL rules from admission.py).

Helm 3.18.0 validates values with gojsonschema and Helm 4.1.4 with santhosh-tekuri/jsonschema:
both honour draft-07 and its `format: regex` (Go RE2 syntax), so the values schema sticks to
draft-07 keywords and declares `$schema` explicitly.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from metax_operator import contract
from metax_operator.contract import CR_GROUP, CR_KIND, CR_NAME, CR_PLURAL, CR_SHORT_NAMES, CR_VERSION, CRD_FILE_NAME, CRD_NAME
from metax_operator.errors import UserError

SOURCE = Path(__file__).with_name("schema_source.yaml")
REPO_ROOT = Path(__file__).resolve().parents[3]
VALUES_SCHEMA = "values.schema.json"
CRD_FILE = f"crds/{CRD_FILE_NAME}"  # the portable rules (admission.crd_rules), which Helm installs
FULL_CRD_FILE = f"files/{CRD_FILE_NAME}"  # the whole rules, which the upgrade-crds hook applies where admitted
DRAFT_07 = "http://json-schema.org/draft-07/schema#"
K8S_SCHEMA_VERSION = "v1.34.0-local-strict"

NODE_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


@functools.cache
def source() -> dict:
    """The parsed schema source."""
    return yaml.safe_load(SOURCE.read_text())


def percent_pattern(zero_ok: bool) -> str:
    """The pattern of a percentage string of at most 100% (from 0% or from 1%)."""
    return r"^(100|[1-9]?[0-9])%$" if zero_ok else r"^(100|[1-9][0-9]?)%$"


def cron_schedule_pattern() -> str:
    """A CronJob schedule as Kubernetes parses it (robfig/cron's standard parser): a macro, or
    five fields of comma-separated `*`, `?`, a value or a range, each with an optional `/step`
    of at least 1, every value within its field's range (names for months and weekdays). That a
    range does not run backwards is a rule of validation.py (a pattern cannot compare)."""

    def field(value: str) -> str:
        item = rf"(\*|\?|{value}(-{value})?)(/0*[1-9][0-9]*)?"
        return rf"{item}(,{item})*"

    fields = [
        r"0*([0-9]|[1-5][0-9])",
        r"0*([0-9]|1[0-9]|2[0-3])",
        r"0*([1-9]|[12][0-9]|3[01])",
        r"(0*([1-9]|1[0-2])|(?i:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec))",
        r"(0*[0-6]|(?i:sun|mon|tue|wed|thu|fri|sat))",
    ]
    macros = "@(annually|yearly|monthly|weekly|daily|midnight|hourly)"
    blank = r"[ \t]"
    return rf"^{blank}*({macros}|{(blank + '+').join(field(f) for f in fields)}){blank}*$"


class _Expander:
    """Expands the source's extensions for one target: "values" (draft-07) or "crd" (structural)."""

    def __init__(self, target: str):
        self.target = target
        self.definitions = source()["definitions"]
        self.k8s_used: set[str] = set()

    def node(self, node: Any) -> Any:
        if isinstance(node, list):
            return [self.node(item) for item in node]
        if not isinstance(node, dict):
            return node
        if self.target == "crd" and "x-crd" in node:  # keeps the description
            return self.node({**node["x-crd"], **{k: v for k, v in node.items() if k == "description"}})
        if "$ref" in node:
            name = node["$ref"].removeprefix("#/definitions/")
            merged = {**self.definitions[name], **{k: v for k, v in node.items() if k != "$ref"}}
            return self.node(merged)
        if "x-k8s" in node:
            rest = self.node({k: v for k, v in node.items() if k != "x-k8s"})
            if self.target == "values":  # defined once under `definitions`, referenced locally
                self.k8s_used.add(node["x-k8s"])
                return {"$ref": f"#/definitions/{node['x-k8s']}", **rest}
            shape = k8s_definition(node["x-k8s"], strict=False)
            if shape.get("type") == "object":  # one field, owned by one manager (as a list is)
                shape["x-kubernetes-map-type"] = "atomic"
            return {**shape, **rest}
        if "x-int-or-percent" in node:
            return self.node(
                {**self._int_or_percent(node["x-int-or-percent"]), **{k: v for k, v in node.items() if k != "x-int-or-percent"}}
            )
        if node.get("x-cron-schedule"):
            return self.node(
                {
                    "pattern": cron_schedule_pattern(),
                    "x-hint": "a cron schedule of five fields (minute hour day-of-month month day-of-week) "
                    'such as "*/5 * * * *", or a macro such as @hourly',
                    **{k: v for k, v in node.items() if k != "x-cron-schedule"},
                }
            )
        out = {}
        for key, value in node.items():
            if key == "properties":
                value = self._properties(value)
            elif key == "patternProperties":
                value = {NODE_NAME_PATTERN if k == "$nodeName" else k: v for k, v in value.items()}
            elif key in ("x-crd", "x-chart-only") or (key == "x-hint" and self.target == "crd"):
                continue
            out[key] = self.node(value) if key not in ("enum", "required", "const") else value
        if self.target == "crd":
            out = _structural(out)
        return out

    def _properties(self, properties: dict) -> dict:
        properties = dict(properties)
        if "$merge" in properties:
            properties = {**self.definitions[properties.pop("$merge")], **properties}
        return properties

    def _int_or_percent(self, spec: dict) -> dict:
        minimum, zero_ok = spec["minimum"], spec["percentZero"]
        lowest = 0 if zero_ok else 1
        hint = f'an integer >= {minimum} or a percentage from {lowest}% to 100% such as "50%"'
        if self.target == "crd":
            return {
                "x-kubernetes-int-or-string": True,
                "anyOf": [{"type": "integer"}, {"type": "string"}],
                "minimum": minimum,
                "pattern": percent_pattern(zero_ok),
                "maxLength": len("100%"),
            }
        return {
            "anyOf": [{"type": "integer", "minimum": minimum}, {"type": "string", "pattern": percent_pattern(zero_ok)}],
            "x-hint": hint,
        }


def _structural(node: dict) -> dict:
    """Drop what a structural CRD schema refuses: additionalProperties false, draft-07-only
    keywords, type lists (`[integer, "null"]` becomes `integer`, nullable)."""
    node = {
        k: v
        for k, v in node.items()
        if k not in ("propertyNames", "format")
        or (k == "format" and (v in ("date-time", "int32", "int64") or isinstance(v, dict)))
    }  # a property named `format` (log.format)
    if node.get("additionalProperties") is False:
        del node["additionalProperties"]
    if "patternProperties" in node:  # structural schemas have no patternProperties
        (node["additionalProperties"],) = node.pop("patternProperties").values()
    if isinstance(node.get("additionalProperties"), dict):  # a map: one field, owned by one manager
        node["x-kubernetes-map-type"] = "atomic"
    if isinstance(node.get("type"), list):
        types = [t for t in node.pop("type") if t != "null"]
        if len(types) == 1:
            node["type"] = types[0]
        else:  # several scalar types: keep any value
            node["x-kubernetes-preserve-unknown-fields"] = True
    if "enum" in node and "type" not in node:
        node = {"type": "string", **node}
    if node.get("type") == "string" and "enum" in node:  # bounds the cost of CEL rules that read it
        node["maxLength"] = max(len(value) for value in node["enum"])
    return node


K8S_SHAPES = Path(__file__).with_name("k8s_shapes.json")
K8S_SHAPE_NAMES = ("Affinity", "Toleration", "networking.v1.NetworkPolicyPeer")


@functools.cache
def k8s_shapes() -> dict:
    """The Kubernetes shapes the schemas use, vendored in the package (so that validation at
    run time needs no 77 MB kubernetes-validate) and regenerated from it with the rest."""
    return json.loads(K8S_SHAPES.read_text())


def k8s_definition(name: str, strict: bool) -> dict:
    """A Kubernetes OpenAPI definition (io.k8s.api.core.v1.NAME, or io.k8s.api.NAME when NAME
    has a group and version such as networking.v1.NetworkPolicyPeer), references inlined.

    `strict` (the values schema) refuses unknown keys, so a typo such as `opertor` fails the
    render instead of being dropped silently; the CRD cannot say that (the API server prunes).
    """
    shape = copy.deepcopy(k8s_shapes()[name])
    return shape if strict else _drop_closed(shape)


def _drop_closed(node: Any) -> Any:
    if isinstance(node, list):
        return [_drop_closed(item) for item in node]
    if not isinstance(node, dict):
        return node
    return {key: _drop_closed(value) for key, value in node.items() if not (key == "additionalProperties" and value is False)}


def render_k8s_shapes() -> str:
    """k8s_shapes.json from the kubernetes-validate package (a test extra: only generation needs
    it). Only the top description of each shape is kept: the nested ones (the API reference)
    would make the CRD half a megabyte."""
    import kubernetes_validate

    path = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / K8S_SCHEMA_VERSION / "_definitions.json"
    definitions = json.loads(path.read_text())["$defs"]
    shapes = {}
    for name in K8S_SHAPE_NAMES:
        shape = _inline_k8s(definitions, f"io.k8s.api.{name}" if "." in name else f"io.k8s.api.core.v1.{name}")
        shapes[name] = {**_drop_descriptions(shape), "description": shape["description"]}
    return json.dumps(shapes, indent=1) + "\n"


def _drop_descriptions(node: Any) -> Any:
    if isinstance(node, list):
        return [_drop_descriptions(item) for item in node]
    if not isinstance(node, dict):
        return node
    return {key: _drop_descriptions(value) for key, value in node.items() if key != "description"}


# Enums the Kubernetes OpenAPI states only in prose; the API server enforces them.
_K8S_ENUMS = {
    ("io.k8s.api.core.v1.Toleration", "operator"): ["Exists", "Equal"],
    ("io.k8s.api.core.v1.Toleration", "effect"): ["NoSchedule", "PreferNoSchedule", "NoExecute"],
    ("io.k8s.api.core.v1.NodeSelectorRequirement", "operator"): ["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"],
    ("io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelectorRequirement", "operator"): ["In", "NotIn", "Exists", "DoesNotExist"],
}


def _inline_k8s(definitions: dict, full_name: str) -> dict:
    definition = definitions[full_name]
    out: dict[str, Any] = {}
    if "description" in definition:
        out["description"] = definition["description"]
    out["type"] = _single_type(definition.get("type", "object"))
    if "properties" in definition:
        out["properties"] = {
            key: _k8s_property(definitions, full_name, key, prop) for key, prop in definition["properties"].items()
        }
        out["additionalProperties"] = False
    if definition.get("required"):
        out["required"] = definition["required"]
    return out


def _k8s_property(definitions: dict, owner: str, key: str, prop: dict) -> dict:
    if "$ref" in prop:
        return _inline_k8s(definitions, prop["$ref"].rsplit("/", 1)[-1])
    out: dict[str, Any] = {"type": _single_type(prop["type"])}
    if out["type"] == "array":
        out["items"] = _k8s_property(definitions, owner, "", prop["items"])
    elif out["type"] == "object" and "additionalProperties" in prop:
        out["additionalProperties"] = _k8s_property(definitions, owner, "", prop["additionalProperties"])
    if (owner, key) in _K8S_ENUMS:
        out["enum"] = _K8S_ENUMS[(owner, key)]
    return out


def _single_type(types: str | list) -> str:
    """`["string", "null"]` (the OpenAPI's nullable) → "string"."""
    return next(t for t in ([types] if isinstance(types, str) else types) if t != "null")


# --- values.yaml: descriptions and defaults --------------------------------------------------

_KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_]+):(\s|$)")


def values_descriptions(text: str) -> dict[tuple[str, ...], str]:
    """Descriptions of values.yaml keys by path, from the comment block right above each key.

    A helm-docs `# -- text` block gives the description (continuation lines appended); a plain
    comment block (a section heading such as `# driver: the kernel-mode driver ...`) describes
    the mapping below it.
    """
    out: dict[tuple[str, ...], str] = {}
    stack: list[tuple[int, str]] = []
    block: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("#").strip())
            continue
        match = _KEY_LINE.match(line)
        if match:
            indent = len(match["indent"])
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, match["key"]))
            description = _description(block)
            if description:
                out[tuple(key for _, key in stack)] = description
        block = []
    return out


def _description(block: list[str]) -> str:
    lines = [line for line in block if not line.startswith("@")]
    for i, line in enumerate(lines):
        if line.startswith("--"):
            lines = [line[2:].strip()] + lines[i + 1 :]
            break
    return " ".join(line for line in lines if line)


# --- the two outputs -----------------------------------------------------------------------


def build_values_schema(values_text: str) -> dict:
    """values.schema.json: the source's `values` tree for draft-07, with descriptions."""
    expander = _Expander("values")
    schema = expander.node(source()["values"])
    _describe(schema, values_descriptions(values_text), ())
    definitions = {name: k8s_definition(name, strict=True) for name in sorted(expander.k8s_used)}
    schema = readable_patterns(schema, None, "values")
    return {"$schema": DRAFT_07, "title": "metax-operator values", **schema, "definitions": definitions}


def readable_patterns(node: Any, hint: str | None, field: str, key_of: str = "") -> Any:
    """The schema with each `pattern` said in words where Helm prints it.

    Helm prints a failed `pattern` as the regular expression itself (Helm 3: `Does not match
    pattern '^$|^[A-Za-z0-9]...'`), a failed `not` as `Must not validate the schema (not)`, and
    Helm 4 names no field for a bad map key (`at ''`). So the pattern, `allOf` of patterns and
    `not: {enum}` of a node become one test, `if: TEST, else: {const: S, not: {const: S}}`, S the
    node's x-hint (a map key's starts `a key of MAP: `): Helm 3 then says `registry does not match:
    "S"`, Helm 4 `value must be 'S'`. The `not` refuses S itself, so the schema accepts exactly what
    the test accepts; the `else` carries the x-hint, so `validate` (which names the field) says
    `'DOMAIN/PROJECT' is not valid; use <x-hint>`.
    """
    if isinstance(node, list):
        return [readable_patterns(item, hint, field) for item in node]
    if not isinstance(node, dict):
        return node
    hint = node.get("x-hint", hint)
    tests = _tests(node)
    out = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {k: readable_patterns(v, None, f"{field}.{k}".removeprefix("values.")) for k, v in value.items()}
        elif key == "propertyNames":
            out[key] = readable_patterns(value, None, field, key_of=field)
        elif key in tests:
            continue
        elif key in ("enum", "const", "required", "x-hint", "description"):
            out[key] = value
        else:
            out[key] = readable_patterns(value, hint if key in ("anyOf", "oneOf", "allOf") else None, field)
    if tests:
        words = "; ".join(dict.fromkeys(filter(None, [*(item.get("x-hint") for item in tests.get("allOf", [])), hint])))
        if not words:
            raise ValueError(f"schema_source.yaml: {field} has a pattern and no x-hint to say it in words")
        said = f"a key of {key_of}: {words}" if key_of else words
        parts = [{"pattern": node["pattern"]}] if "pattern" in tests else []
        parts += [{"pattern": item["pattern"]} for item in tests.get("allOf", [])] + tests.get("not", [])
        test = parts[0] if len(parts) == 1 else {"allOf": parts}
        out.update({"if": test, "else": {"const": said, "not": {"const": said}, "x-hint": words}})
    return out


def _tests(node: dict) -> dict[str, list]:
    """What `readable_patterns` folds into one test, by keyword: the node's `pattern`, its `allOf`
    when made only of patterns (their items), its `not` of an enum."""
    tests: dict[str, list] = {}
    if "pattern" in node:
        tests["pattern"] = [node["pattern"]]
    items = node.get("allOf")
    if isinstance(items, list) and items and all(isinstance(i, dict) and set(i) <= {"pattern", "x-hint"} for i in items):
        tests["allOf"] = items
    if tests and isinstance(node.get("not"), dict) and set(node["not"]) == {"enum"}:
        tests["not"] = [{"not": node["not"]}]
    return tests


def _describe(node: dict, descriptions: dict, path: tuple[str, ...]) -> None:
    if path in descriptions:
        node["description"] = descriptions[path]
    for key, child in node.get("properties", {}).items():
        _describe(child, descriptions, path + (key,))


def build_crd(values_text: str, rules: Callable[[dict], dict[tuple[str, ...], list[dict]]]) -> dict:
    """The ClusterOperator CRD: the values tree less chart-only keys as `spec`, with the
    values.yaml defaults, the cross-field rules `rules(spec)` gives (CEL, by the spec path of the
    node carrying them: admission.crd_rules) and the status of seed table 3.16."""
    spec_source = _cr_spec_source(source()["values"])
    spec = _Expander("crd").node(spec_source)
    spec.pop("additionalProperties", None)
    _describe(spec, values_descriptions(values_text), ())
    driver = spec["properties"]["driver"]["properties"]
    _borrow_descriptions(driver["upgradePolicy"], driver["pools"]["items"]["properties"]["upgradePolicy"])
    _default(spec, yaml.safe_load(values_text), top=True)
    _default_objects(spec)
    for path in contract.UNDEFAULTED:
        _undefault(spec, path)
    spec["description"] = (
        "Desired state of the MetaX GPU stack: the chart values of seed tables "
        "3.1-3.15. The bootstrap hook writes it from the values at every "
        "install/upgrade; edits take effect through the runner."
    )
    for path, node_rules in rules(spec).items():
        node = spec
        for key in path:
            node = node["properties"][key]
        node["x-kubernetes-validations"] = node_rules
    status = _Expander("crd").node(source()["status"])
    root = {
        "type": "object",
        "description": (f"The MetaX GPU operator's configuration and rollout state: one object named {CR_NAME}."),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion of this object."},
            "kind": {"type": "string", "description": "Kind of this object."},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "x-kubernetes-validations": [
            {
                "rule": f"self.metadata.name == '{CR_NAME}'",
                "message": f"there is one ClusterOperator and it is named {CR_NAME}",
            }
        ],
    }
    column = lambda name, kind, path, desc: {  # noqa: E731
        "name": name,
        "type": kind,
        "jsonPath": path,
        "description": desc,
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        # Argo CD applies the CRD in sync wave -2: after the preflight Job (-3), before the
        # bootstrap Job (-1) that creates the CR (templates/hooks/_hooks.tpl, docs/gitops.md).
        "metadata": {"name": CRD_NAME, "annotations": {"argocd.argoproj.io/sync-wave": "-2"}},
        "spec": {
            "group": CR_GROUP,
            "names": {
                "kind": CR_KIND,
                "listKind": f"{CR_KIND}List",
                "plural": CR_PLURAL,
                "singular": CR_KIND.lower(),
                "shortNames": list(CR_SHORT_NAMES),
            },
            "scope": "Cluster",
            "versions": [
                {
                    "name": CR_VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        column("Phase", "string", ".status.upgradeStatus.phase", "Driver rollout phase"),
                        column("Step", "integer", ".status.upgradeStatus.status.currentStepIndex", "Current rollout step"),
                        column(
                            "Upgraded",
                            "integer",
                            ".status.upgradeStatus.status.totalUpgradeReadyReplicas",
                            "Driver pods upgraded and Ready",
                        ),
                        column(
                            "Total",
                            "integer",
                            ".status.upgradeStatus.status.totalUpgradeReplicas",
                            "Driver pods this rollout upgrades",
                        ),
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                }
            ],
        },
    }


def _borrow_descriptions(source_node: dict, node: dict) -> None:
    """Give `node`'s fields without a description those of the same fields of `source_node` (a
    driver pool's upgradePolicy says what the driver's says, written once in values.yaml)."""
    for key, child in node.get("properties", {}).items():
        twin = source_node.get("properties", {}).get(key, {})
        if "description" not in child and "description" in twin:
            child["description"] = twin["description"]
        _borrow_descriptions(twin, child)
    if isinstance(node.get("items"), dict) and isinstance(source_node.get("items"), dict):
        _borrow_descriptions(source_node["items"], node["items"])


def _cr_spec_source(node: dict) -> dict:
    """The source tree without its `x-chart-only` keys (resolving $ref/$merge to see them)."""
    definitions = source()["definitions"]

    def chart_only(child: dict) -> bool:
        while "$ref" in child and not child.get("x-chart-only"):
            child = definitions[child["$ref"].removeprefix("#/definitions/")]
        return bool(child.get("x-chart-only"))

    if "$ref" in node and "x-crd" not in node:  # a definition's properties may be chart-only
        node = {**definitions[node["$ref"].removeprefix("#/definitions/")], **{k: v for k, v in node.items() if k != "$ref"}}
    out = dict(node)
    if "properties" in node:
        properties = dict(node["properties"])
        if "$merge" in properties:
            properties = {**definitions[properties.pop("$merge")], **properties}
        out["properties"] = {key: _cr_spec_source(child) for key, child in properties.items() if not chart_only(child)}
    return out


def _undefault(spec: dict, path: tuple[str, ...]) -> None:
    """No default at `path` nor below it."""
    node = spec
    for key in path:
        node = node["properties"][key]
    stack = [node]
    while stack:
        node = stack.pop()
        node.pop("default", None)
        stack.extend(node.get("properties", {}).values())


def _default_objects(node: dict) -> None:
    """Every object of our own below `node` defaults to {}: server-side apply can leave an object
    whose last field another manager removed as null, which the API server then prunes and
    defaults instead of refusing it."""
    for child in node.get("properties", {}).values():
        if child.get("properties") and child.get("x-kubernetes-map-type") != "atomic":
            child.setdefault("default", {})
            _default_objects(child)


def _default(node: dict, value: Any, top: bool = False) -> None:
    """Set the values.yaml defaults on the CRD schema; objects default to {} so that the API
    server fills their fields in too."""
    if value is None:
        return
    if "properties" in node and isinstance(value, dict):
        if not top:
            node["default"] = {}
        for key, child in node["properties"].items():
            _default(child, value.get(key))
    elif not node.get("x-kubernetes-preserve-unknown-fields"):
        node["default"] = value


# --- fragments for the Python validation -------------------------------------------------------


@functools.cache
def fragment(*path: str) -> dict:
    """The draft-07 schema of one values subtree, e.g. fragment("driver", "config", "moduleParams"):
    used to check ConfigMap contents the same way the values schema checks values. Worked out
    once per process (it expands the whole values schema; the runner checks the ConfigMaps at
    every pass): the same dict at every call, which no caller changes."""
    expander = _Expander("values")
    node = expander.node(source()["values"])
    for key in path:
        node = node["properties"][key] if "properties" in node else next(iter(node["patternProperties"].values()))
    return {**node, "definitions": {name: k8s_definition(name, strict=True) for name in sorted(expander.k8s_used)}}


def load_values_schema(chart: Path = REPO_ROOT) -> dict:
    path = chart / VALUES_SCHEMA
    if not path.exists():
        raise UserError(
            str(path), "not found", "pass --chart with the chart's directory, or run `python -m metax_operator.chart.generate`"
        )
    return json.loads(path.read_text())


def load_values_defaults(chart: Path = REPO_ROOT) -> dict:
    """The chart's values.yaml: the defaults Helm merges under every user's values."""
    path = chart / "values.yaml"
    if not path.exists():
        raise UserError(str(path), "not found", "pass --chart with the chart's directory")
    return yaml.safe_load(path.read_text()) or {}
