"""The one schema source and its outputs: values.schema.json, the ClusterOperator CRD, docs/values.md.

Fails when an output is stale, when values.yaml and the schema disagree on a key (as Apache
Airflow's chart test does), when values.yaml or an example does not validate, and when the CRD
is not one a real API server accepts with the rules it is meant to enforce.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from metax_operator import contract
from metax_operator.chart import admission, alerts, generate, problems, schema, validation
from tests.helm import overlay
from tests.rollout.test_engine import TABLE_3_16, TABLE_3_16_STATUS

ROOT = Path(__file__).resolve().parents[2]
VALUES = yaml.load((ROOT / "values.yaml").read_text(), Loader=yaml.CSafeLoader)
VALUES_SCHEMA = json.loads((ROOT / "values.schema.json").read_text())
CRD = yaml.load((ROOT / schema.CRD_FILE).read_text(), Loader=yaml.CSafeLoader)
CR_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
HELM_DOCS = Path(os.environ.get("METAX_CACHE", Path.home() / ".cache" / "metax-operator")) / "bin" / "helm-docs"
#: The product manual's spellings, as the schema tests name paths (`driver.enableRollout`).
SEED_SPELLINGS = {".".join(seed) for seed in contract.SEED_SPELLINGS}
CHART_ONLY = {
    "global",
    "imagePullPolicy",
    "imagePullSecrets",
    "commonLabels",
    "commonAnnotations",
    "priorityClassName",
    "tools",
    "runner",
    "hooks",
    "crds",
    "tests",
    "networkPolicy",
    "nodeWritePolicy",
}


def test_generated_files_are_up_to_date():
    stale = [str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p) for p in generate.stale()]
    assert not stale, f"stale: {stale}; run `.venv/bin/python -m metax_operator.chart.generate` and commit"


GENERATED = (
    "values.schema.json",
    schema.CRD_FILE,
    schema.FULL_CRD_FILE,
    admission.TEMPLATE,
    generate.CONTRACT_TEMPLATE,
    alerts.RULES_FILE,
)


def test_an_edited_comment_makes_every_schema_output_stale(tmp_path):
    """The staleness check above can fail: a description changed in values.yaml alone."""
    for name in GENERATED:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text((ROOT / name).read_text())
    text = (ROOT / "values.yaml").read_text()
    (tmp_path / "values.yaml").write_text(text.replace("# -- Pause the rollout", "# -- Halt the rollout"))
    assert generate.stale(tmp_path) == [
        tmp_path / "values.schema.json",
        tmp_path / schema.CRD_FILE,
        tmp_path / schema.FULL_CRD_FILE,
    ]


def test_a_hand_edited_alert_rule_makes_the_rules_file_stale(tmp_path):
    for name in (*GENERATED, "values.yaml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text((ROOT / name).read_text())
    assert generate.stale(tmp_path) == []
    rules = tmp_path / alerts.RULES_FILE
    rules.write_text(rules.read_text().replace("for: 10m", "for: 1h"))
    assert generate.stale(tmp_path) == [rules]


def test_values_reference_is_up_to_date():
    assert HELM_DOCS.exists(), f"{HELM_DOCS} is missing: run 'make test'"
    result = subprocess.run(
        [
            HELM_DOCS,
            "--chart-search-root",
            ".",
            "--chart-to-generate",
            ".",
            "--dry-run",
            "--template-files",
            "docs/values.md.gotmpl",
            "--sort-values-order",
            "file",
            "--skip-version-footer",
            "--log-level",
            "error",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == (ROOT / "docs" / "values.md").read_text().strip(), (
        "docs/values.md is stale: run `$METAX_CACHE/bin/helm-docs -g . --template-files "
        "docs/values.md.gotmpl --output-file docs/values.md --sort-values-order file --skip-version-footer`"
    )


# --- values.schema.json -------------------------------------------------------------------------


def test_values_schema_is_draft_07_and_self_contained():
    assert VALUES_SCHEMA["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(VALUES_SCHEMA)
    refs = [v for v in _walk_values(VALUES_SCHEMA, "$ref")]
    assert refs and all(ref.startswith("#/definitions/") for ref in refs)
    assert VALUES_SCHEMA["properties"]["global"]["type"] == "object"


def test_every_object_of_ours_refuses_unknown_keys():
    def check(node, path):
        if "properties" in node:
            assert node.get("additionalProperties") is False, path
        for key, child in node.get("properties", {}).items():
            if key != "global":
                check(child, f"{path}.{key}")

    check(VALUES_SCHEMA, "values")
    for name, definition in VALUES_SCHEMA["definitions"].items():
        check(definition, name)


def _schema_at(node: dict) -> dict:
    if "$ref" in node:
        return VALUES_SCHEMA["definitions"][node["$ref"].removeprefix("#/definitions/")]
    return node


def test_every_values_key_is_in_the_schema_and_back():
    """Airflow's test: a key in values.yaml but not in the schema, or the other way round."""
    problems = []

    def compare(values: dict, node: dict, path: str):
        node = _schema_at(node)
        properties = node.get("properties")
        if properties is None:
            return  # a map (nodeSelector, labels, nodeVfnums): any key
        for key in values:
            if key not in properties:
                problems.append(f"{path}{key}: in values.yaml, not in the schema")
            elif isinstance(values[key], dict):
                compare(values[key], properties[key], f"{path}{key}.")
        if values:  # an object left empty by default ({}) may omit its optional fields
            for key in properties:
                if key not in values and key != "global" and f"{path}{key}" not in SEED_SPELLINGS:
                    problems.append(f"{path}{key}: in the schema, not in values.yaml")

    compare(VALUES, VALUES_SCHEMA, "")
    assert not problems, "\n".join(problems)


def test_every_values_key_has_a_description():
    missing = []

    def check(node, path):
        node_described = "description" in node
        if not node_described and path:
            missing.append(path)
        if path in SEED_SPELLINGS:  # another spelling of a described key
            return
        for key, child in node.get("properties", {}).items():
            check(child, f"{path}.{key}" if path else key)

    check(VALUES_SCHEMA, "")
    assert not missing, missing


def _examples() -> dict[str, dict]:
    """values.yaml, the test values files, and the seed's documented values (seed 000 §3.2.5,
    §3.2.6.1, §3.2.8 and the worked rollout policies)."""
    examples = {"values.yaml": VALUES}
    for path in sorted((ROOT / "tests" / "data").glob("values-*.yaml")):
        examples[path.name] = yaml.safe_load(path.read_text())
    examples["seed §3.2.5 podTemplateSpec"] = {
        "podTemplateSpec": {
            "spec": {"tolerations": [{"key": "node-type", "operator": "Equal", "value": "general", "effect": "NoSchedule"}]}
        },
        "maca": {
            "podTemplateSpec": {
                "spec": {"tolerations": [{"key": "node-type", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}]}
            }
        },
    }
    examples["seed §3.2.6.1 vfioConfig"] = {
        "vfioManager": {"vfioConfig": [{"nodeName": "worknode1", "gpus": "0,1,2"}, {"nodeName": r"worknode\d+", "gpus": "0,1,2"}]}
    }
    examples["seed §3.2.8 policy (steps written `pause:`)"] = {
        "driver": {
            "upgradePolicy": {
                "enableRollout": True,
                "upgradeSteps": [
                    {"replicas": 2, "pause": None},
                    {"replicas": 5, "pauseDuration": 10000},
                    {"replicas": 8, "pauseDuration": 10000},
                    {"replicas": "100%", "pause": None},
                ],
                "pause": False,
                "maxParallel": "50%",
                "maxUnavailable": 0,
                "maxFailureThreshold": 3,
                "fallback": "pause",
            }
        }
    }
    cases = ROOT / "tests" / "data" / "rollout-worked-examples.yaml"
    for case in yaml.safe_load(cases.read_text())["cases"]:
        examples[f"worked example: {case['name']}"] = {"driver": {"upgradePolicy": case["policy"]}}
    return examples


EXAMPLES = _examples()


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_is_valid(name):
    values = overlay(VALUES, EXAMPLES[name])
    assert problems.schema_problems(values, VALUES_SCHEMA) == []
    values = overlay(values, {"registry": "cr.example.com/metax", "driver": {"payload": {"version": "2.32.0.6"}}})
    validation.validate_values(values)


@given(st.integers(min_value=-1000, max_value=1000))
def test_percent_patterns_accept_exactly_0_to_100(n):
    text = f"{n}%"
    assert jsonschema.Draft7Validator({"pattern": schema.percent_pattern(True)}).is_valid(text) == (0 <= n <= 100)
    assert jsonschema.Draft7Validator({"pattern": schema.percent_pattern(False)}).is_valid(text) == (1 <= n <= 100)


@pytest.mark.parametrize("text", ["150%", "abc", "-5%", "101%", "05%", "5 %", "%", "1.5%"])
def test_percent_patterns_refuse(text):
    assert not jsonschema.Draft7Validator({"pattern": schema.percent_pattern(True)}).is_valid(text)


def test_descriptions_come_from_values_comments():
    text = (
        "# heading of a section\nsection:\n  # -- What it does,\n  # and more.\n  key: 1\n"
        "  # a plain note\n\n  other: 2\n  # @default -- x\n  # -- Described.\n  third: 3\n"
    )
    assert schema.values_descriptions(text) == {
        ("section",): "heading of a section",
        ("section", "key"): "What it does, and more.",
        ("section", "third"): "Described.",
    }


# --- the CRD ------------------------------------------------------------------------------------


def test_crd_names_scope_and_columns():
    spec = CRD["spec"]
    assert CRD["metadata"]["name"] == "clusteroperators.gpu.metax-tech.com"
    assert spec["group"] == "gpu.metax-tech.com" and spec["scope"] == "Cluster"
    assert spec["names"] == {
        "kind": "ClusterOperator",
        "listKind": "ClusterOperatorList",
        "plural": "clusteroperators",
        "singular": "clusteroperator",
        "shortNames": ["mxco"],
    }
    (version,) = spec["versions"]
    assert version["name"] == "v1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {
        "Phase": ".status.upgradeStatus.phase",
        "Step": ".status.upgradeStatus.status.currentStepIndex",
        "Upgraded": ".status.upgradeStatus.status.totalUpgradeReadyReplicas",
        "Total": ".status.upgradeStatus.status.totalUpgradeReplicas",
        "Age": ".metadata.creationTimestamp",
    }


def test_cr_spec_is_the_values_less_chart_settings():
    spec = CR_SCHEMA["properties"]["spec"]["properties"]
    assert set(spec) == set(VALUES) - CHART_ONLY | {seed[0] for seed in contract.SEED_SPELLINGS if len(seed) == 1}
    for component in contract.COMPONENTS:
        assert not {"image", "resources", "serviceMonitor"} & set(spec[component]["properties"])
    assert set(spec["driver"]["properties"]["upgradePolicy"]["properties"]) == set(VALUES["driver"]["upgradePolicy"])


def test_status_has_the_seed_table_3_16_shape():
    upgrade = CR_SCHEMA["properties"]["status"]["properties"]["upgradeStatus"]["properties"]
    assert set(upgrade) == TABLE_3_16 | {"resume"}
    assert set(upgrade["condition"]["items"]["properties"]) == {"type", "status", "lastTransitionTime", "reason", "message"}
    assert set(upgrade["status"]["properties"]) == TABLE_3_16_STATUS | {"recheckTime"}
    assert upgrade["phase"]["enum"] == ["Idling", "Progressing", "Terminating", "Disabled", "Disabling"]
    assert upgrade["status"]["properties"]["currentStepState"]["enum"] == [
        "StepUpgradeInit",
        "StepUpgrade",
        "StepPaused",
        "StepReady",
        "Completed",
    ]


def test_crd_schema_is_structural_and_described():
    problems = []

    def check(node, path, in_metadata=False):
        """Kubernetes' own types (affinity, tolerations) keep only their top description:
        their fields are documented by `kubectl explain pod.spec.affinity`, and eight copies
        of the API reference would push the CRD past the 256 KiB `kubectl apply` can annotate."""
        if not (node.get("type") or node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")):
            problems.append(f"{path}: no type")
        if node.get("additionalProperties") is False or "$ref" in node or "patternProperties" in node:
            problems.append(f"{path}: not structural")
        if "description" not in node and not in_metadata and path.count(".") > 0 and not path.endswith("[]"):
            problems.append(f"{path}: no description")
        if path.endswith((".affinity", ".tolerations[]")):
            return
        for key, child in node.get("properties", {}).items():
            check(child, f"{path}.{key}", key == "metadata" or in_metadata)
        if isinstance(node.get("items"), dict):
            check(node["items"], f"{path}[]", in_metadata)
        if isinstance(node.get("additionalProperties"), dict):
            check(node["additionalProperties"], f"{path}{{}}", True)

    check(CR_SCHEMA, "")
    assert not problems, "\n".join(problems)


# What a schema node may hold: the fields of Kubernetes' JSONSchemaProps (the API server drops
# any other key of a CRD schema without a word) and the draft-07 keywords (+ our `x-hint`) of
# values.schema.json. A stray key is a YAML slip in schema_source.yaml, e.g. an unquoted comma
# in a flow-style description (`{description: Why, for humans.}` made a key "for humans.").
CRD_SCHEMA_FIELDS = {
    "$schema",
    "$ref",
    "id",
    "description",
    "type",
    "format",
    "title",
    "default",
    "maximum",
    "exclusiveMaximum",
    "minimum",
    "exclusiveMinimum",
    "maxLength",
    "minLength",
    "pattern",
    "maxItems",
    "minItems",
    "uniqueItems",
    "multipleOf",
    "enum",
    "maxProperties",
    "minProperties",
    "required",
    "items",
    "allOf",
    "oneOf",
    "anyOf",
    "not",
    "properties",
    "additionalProperties",
    "patternProperties",
    "dependencies",
    "additionalItems",
    "definitions",
    "externalDocs",
    "example",
    "nullable",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-embedded-resource",
    "x-kubernetes-int-or-string",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-list-type",
    "x-kubernetes-map-type",
    "x-kubernetes-validations",
}
DRAFT_07_KEYWORDS = CRD_SCHEMA_FIELDS - {"id", "nullable"} - {k for k in CRD_SCHEMA_FIELDS if k.startswith("x-")} | {
    "$id",
    "$comment",
    "const",
    "contains",
    "propertyNames",
    "if",
    "then",
    "else",
    "readOnly",
    "writeOnly",
    "contentMediaType",
    "contentEncoding",
    "examples",
    "x-hint",
}


def stray_keys(node, allowed: set, path: str = "") -> list[str]:
    """Keys of schema nodes (under `node`) that are not in `allowed`, as paths."""
    if not isinstance(node, dict):
        return [f"{path}: not a schema object ({node!r})"] if node not in (True, False) else []
    found = [f"{path}: {key!r}" for key in node if key not in allowed]
    for key in ("properties", "definitions", "patternProperties"):
        for name, child in (node.get(key) or {}).items():
            found += stray_keys(child, allowed, f"{path}.{name}")
    for key in ("items", "additionalProperties", "not", "if", "then", "else", "contains"):
        if key in node and not isinstance(node[key], list):
            found += stray_keys(node[key], allowed, f"{path}.{key}")
    for key in ("allOf", "anyOf", "oneOf", "items"):
        if isinstance(node.get(key), list):
            for i, child in enumerate(node[key]):
                found += stray_keys(child, allowed, f"{path}.{key}[{i}]")
    return found


def test_every_schema_key_is_a_schema_keyword():
    assert stray_keys(CR_SCHEMA, CRD_SCHEMA_FIELDS) == []
    assert stray_keys(VALUES_SCHEMA, DRAFT_07_KEYWORDS) == []


def test_crd_defaults_are_the_values_defaults():
    spec = CR_SCHEMA["properties"]["spec"]["properties"]
    assert spec["driver"]["properties"]["deployPolicy"]["default"] == "PreferCloud"
    assert spec["driver"]["properties"]["upgradePolicy"]["properties"]["maxParallel"]["default"] == "100%"
    assert spec["exporter"]["properties"]["deploy"]["default"] is False
    assert spec["gpuDevice"]["properties"]["healthyInterval"]["default"] == 5
    assert "default" not in spec["exporter"]["properties"]["service"]["properties"]["port"]


def test_crd_accepts_the_default_values_as_a_spec():
    """The CR the bootstrap hook writes from default values (plus the required two) fits the
    CRD's schema (checked with jsonschema; the API server test below checks the real thing)."""
    spec = _without_nulls({k: v for k, v in VALUES.items() if k not in CHART_ONLY})  # pruned
    assert list(jsonschema.Draft7Validator(CR_SCHEMA["properties"]["spec"]).iter_errors(spec)) == []


# --- the CRD on a real API server ----------------------------------------------------------------


def _valid_spec() -> dict:
    return {"registry": "cr.example.com/metax", "driver": {"payload": {"version": "2.32.0.6"}}}


def test_api_server_accepts_the_crd_and_enforces_its_rules(control_plane):
    """Structural schema, defaults, CEL rules (within the cost budget) and the one-name rule,
    as kube-apiserver 1.34 applies them: the CRD as the upgrade-crds hook applies it there (the
    whole one; tests/chart/test_kubernetes_versions.py checks the portable one on older servers)."""
    from kubernetes import client, dynamic

    from metax_operator.hooks import upgrade_crds
    from metax_operator.runtime import kube

    api = control_plane.api()
    portable, full = (upgrade_crds.load_crd(ROOT / name) for name in (schema.CRD_FILE, schema.FULL_CRD_FILE))
    assert upgrade_crds.upgrade(kube.Client.connect(str(control_plane.kubeconfig)), portable, full, if_exists=False)
    ext = client.ApiextensionsV1Api(api)
    for _ in range(100):
        crd = ext.read_custom_resource_definition("clusteroperators.gpu.metax-tech.com")
        if any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or []):
            break
    resource = dynamic.DynamicClient(api).resources.get(api_version="gpu.metax-tech.com/v1", kind="ClusterOperator")

    def create(name: str, spec: dict):
        body = {"apiVersion": "gpu.metax-tech.com/v1", "kind": "ClusterOperator", "metadata": {"name": name}, "spec": spec}
        return resource.create(body=body, dry_run="All")

    created = create("cluster-operator", _valid_spec())
    assert created.spec.gpuDevice.healthyInterval == 5  # defaults applied
    assert created.spec.driver.upgradePolicy.maxParallel == "100%"

    def refused(name: str, spec: dict) -> str:
        with pytest.raises(client.exceptions.ApiException) as error:
            create(name, spec)
        assert error.value.status == 422
        body = error.value.body
        return body.decode() if isinstance(body, bytes) else body

    assert "named cluster-operator" in refused("other", _valid_spec())
    spec = _valid_spec() | {"gpuLabel": {"deploy": False}}
    assert str(validation.dependency_problem("runtime", "gpuLabel")) in refused("cluster-operator", spec)
    spec = {"registry": "cr.example.com/metax"}
    assert str(validation.payload_version_missing()) in refused("cluster-operator", spec)
    spec = _valid_spec() | {"exporter": {"service": {"type": "ClusterIP", "port": 9400}}}
    assert str(validation.port_with_type("ClusterIP")) in refused("cluster-operator", spec)
    spec = _valid_spec()
    spec["driver"]["upgradePolicy"] = {"maxParallel": "150%"}
    assert "maxParallel" in refused("cluster-operator", spec)
    spec = _valid_spec() | {"tolerations": [{"key": "a", "operator": "Matches"}]}
    assert "tolerations[0].operator" in refused("cluster-operator", spec)


def _without_nulls(node):
    if isinstance(node, dict):
        return {k: _without_nulls(v) for k, v in node.items() if v is not None}
    return node


def _walk_values(node, key):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            else:
                yield from _walk_values(v, key)
    elif isinstance(node, list):
        for item in node:
            yield from _walk_values(item, key)
