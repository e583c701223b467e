"""contract.py against what states the same facts elsewhere: values.yaml's defaults, the
rendered chart, and the templates' text (which must take the names from templates/_contract.tpl,
generated from contract.py, or state them only in RBAC rules the render checks here)."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from metax_operator import contract
from metax_operator.hooks import cleanup, rollback_hold
from tests.helm import CHART, helm_bin, render_chart  # noqa: F401 (helm_bin: a fixture)

VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
#: Everything the chart can render: every component, the exporter's Service, the kept CRD off.
ALL_ON = {
    "registry": "r.example/metax",
    "driver": {"payload": {"version": "2.32.0.6"}},
    "exporter": {"deploy": True},
    "crds": {"keep": False},
}


def test_deploy_defaults_are_those_of_values_yaml():
    assert {key: VALUES[key]["deploy"] for key in contract.COMPONENTS} == contract.DEFAULT_DEPLOY


def test_the_validation_defaults_the_crd_leaves_out_are_those_of_values_yaml():
    """The CRD gives `validation` no default (contract.UNDEFAULTED): the code's must be values.yaml's."""
    from metax_operator.chart import upgrade_policy

    validation = VALUES["driver"]["upgradePolicy"]["validation"]
    assert validation["timeoutSeconds"] == upgrade_policy.DEFAULT_VALIDATION_TIMEOUT_S
    assert validation["workload"]["resources"] == {"requests": {}, **upgrade_policy.DEFAULT_WORKLOAD_RESOURCES}
    assert upgrade_policy.validate({"validation": {"enable": True}}).validation == upgrade_policy.Validation()


def test_the_health_gate_defaults_the_crd_leaves_out_are_those_of_values_yaml():
    """`healthGate` has no CRD default either: an enabled gate without `maxRegression` is values.yaml's."""
    from metax_operator.chart import upgrade_policy

    gate = VALUES["driver"]["upgradePolicy"]["healthGate"]
    assert gate["enable"] is False
    parsed = upgrade_policy.validate({"healthGate": {"enable": True}}).health_gate
    assert parsed == upgrade_policy.HealthGate()
    assert {signal.value: parsed.allowed(signal) for signal in upgrade_policy.HealthSignal} == gate["maxRegression"]


def test_the_chart_names_its_daemonsets_and_configmaps_as_the_contract_says(helm_bin):
    objects = render_chart(ALL_ON, helm=helm_bin)
    daemonsets = {o["metadata"]["annotations"][contract.COMPONENT_ANNOTATION]: o for o in objects if o["kind"] == "DaemonSet"}
    assert {key: ds["metadata"]["name"] for key, ds in daemonsets.items()} == contract.DAEMONSETS
    for key, ds in daemonsets.items():
        assert ds["spec"]["template"]["metadata"]["labels"][contract.COMPONENT_LABEL] == key
        assert ds["metadata"]["labels"][contract.PART_OF_LABEL] == contract.PART_OF
        assert ds["spec"]["template"]["spec"]["serviceAccountName"] == contract.DAEMONSETS[key]
    configmaps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    for key in contract.CONFIGMAP_KEYS:
        assert key.key in configmaps[key.configmap]["data"], f"{key.configmap} has no key {key.key}"
    assert any(o["kind"] == "Service" and o["metadata"]["name"] == contract.EXPORTER_SERVICE for o in objects)


def _rules(objects: list[dict]) -> list[tuple[str, dict]]:
    return [
        (o["metadata"]["name"], rule) for o in objects if o["kind"] in ("Role", "ClusterRole") for rule in o.get("rules") or []
    ]


def test_rbac_rules_name_the_contracts_objects(helm_bin):
    """The RBAC rules written out in the templates (resourceNames, apiGroups) name the objects
    of contract.py: a renamed DaemonSet, ConfigMap, CR or CRD fails here, not in a cluster."""
    rules = _rules(render_chart(ALL_ON, helm=helm_bin))
    by_resource: dict[str, list[tuple[str, dict]]] = {}
    for role, rule in rules:
        for resource in rule["resources"]:
            by_resource.setdefault(resource, []).append((role, rule))
    for role, rule in by_resource["clusteroperators"] + by_resource["clusteroperators/status"]:
        assert rule["apiGroups"] == [contract.CR_GROUP], role
        assert set(rule.get("resourceNames") or [contract.CR_NAME]) == {contract.CR_NAME}, role
    named_crds = [rule for _, rule in by_resource["customresourcedefinitions"] if rule.get("resourceNames")]
    assert named_crds and all(rule["resourceNames"] == [contract.CRD_NAME] for rule in named_crds)
    named = {
        resource: [(role, rule["resourceNames"]) for role, rule in by_resource[resource] if rule.get("resourceNames")]
        for resource in ("daemonsets", "configmaps", "services")
    }
    test_role = next(role for role, _ in named["daemonsets"] if role.endswith("-test"))
    cleanup_role = next(role for role, _ in named["daemonsets"] if role.endswith("-cleanup"))
    hold_role = next(role for role, _ in named["daemonsets"] if role.endswith("-rollback-hold"))
    assert dict(named["daemonsets"]) == {
        test_role: list(contract.DAEMONSETS.values()),
        cleanup_role: list(cleanup.NODE_WRITERS),
        hold_role: list(rollback_hold.COMPONENTS.values()),
    }
    assert named["configmaps"] and all(names == list(contract.CONFIGMAPS) for _, names in named["configmaps"])
    assert named["services"] and all(names == [contract.EXPORTER_SERVICE] for _, names in named["services"])


#: The contract's string facts a template might spell out (not PART_OF, "metax-operator", which is
#: also the command's name: test_the_chart_names_... checks the label).
FACTS = sorted(
    {
        value
        for name, value in vars(contract).items()
        if name.isupper() and isinstance(value, str) and ("metax" in value or value in contract.CONFIGMAPS) and name != "PART_OF"
    }
    | set(contract.DAEMONSETS.values()),
    key=len,
    reverse=True,
)
#: Lines whose names test_rbac_rules_name_the_contracts_objects checks in the rendered chart, and
#: the names of containers, volumes and variables (a pod's own names).
EXEMPT_LINE = re.compile(r"^\s*((- )?(apiGroups|resourceNames): \[|- name: )")
GENERATED = re.compile(r"\{\{- /\* Generated by ")
COMMENT = re.compile(r"\{\{-?\s*/\*.*?\*/\s*-?\}\}|^\s*#[^\n]*$", re.S | re.M)


@pytest.mark.parametrize(
    "template",
    sorted(
        p.relative_to(CHART).as_posix()
        for p in (CHART / "templates").rglob("*")
        if p.is_file() and not GENERATED.match(p.read_text())
    ),
)
def test_templates_take_the_contracts_names_from_contract_tpl(template):
    text = COMMENT.sub("", (CHART / template).read_text())
    found = []
    for line in text.splitlines():
        if EXEMPT_LINE.match(line):
            continue
        for fact in FACTS:
            if re.search(rf"(?<![-\w./]){re.escape(fact)}(?![-\w.])", line):
                found.append(f"{fact!r} in: {line.strip()}")
                break
    assert not found, (
        f"{template} spells out names of src/metax_operator/contract.py; use the named templates "
        f"of templates/_contract.tpl:\n" + "\n".join(found)
    )


def _labels(node) -> set[str]:
    """Every label key set anywhere in `node` (objects, pod templates, job templates)."""
    if isinstance(node, list):
        return set().union(*map(_labels, node)) if node else set()
    if not isinstance(node, dict):
        return set()
    own = set((node.get("metadata") or {}).get("labels") or {}) if isinstance(node.get("metadata"), dict) else set()
    return own.union(*(_labels(value) for value in node.values()))


def test_the_values_schema_reserves_every_label_key_the_chart_sets(helm_bin):
    """`commonLabels` may not repeat a key the chart sets itself (a duplicate key in the manifest):
    the schema's list of those keys must hold each one the chart renders, contract.py's included."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    # the keys are a `not: {enum}` among the conditions the readable pattern's `if` holds
    conditions = schema["properties"]["commonLabels"]["propertyNames"]["if"]["allOf"]
    (reserved,) = [set(c["not"]["enum"]) for c in conditions if "not" in c]
    rendered = _labels(render_chart({**ALL_ON, "hooks": {"useHelmHooks": False}}, helm=helm_bin))
    assert {contract.HOOK_LABEL, contract.COMPONENT_LABEL, contract.PART_OF_LABEL} <= rendered
    assert rendered <= reserved, f"the chart sets label keys commonLabels may repeat: {rendered - reserved}"
