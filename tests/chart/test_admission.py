"""The API server refuses what `metax-operator validate` refuses, with the line it prints.

Every case of tests/data/bad_values.yaml, accepted and refused, goes through `validate`'s checks
(`validation.values_problems` on the values Helm merged) and through the real kube-apiserver of
tests/controlplane.py (the CR spec the bootstrap hook would write, created with dry run): the
CRD's CEL rules (admission.py) and, where installed, the chart's ValidatingAdmissionPolicy. Then
generated upgrade policies go through `policy.problems` and the API server. Finally the real
`kubectl patch` of the live CR with each bad policy of the table.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes.client.exceptions import ApiException

from metax_operator import cli, contract
from metax_operator.chart import admission, seed_spellings, validation
from metax_operator.chart import upgrade_policy as policy
from metax_operator.chart.validate import merged_values
from metax_operator.errors import UserError, UserErrors
from metax_operator.hooks import bootstrap
from metax_operator.runtime import kube
from tests.chart.test_bad_values import CASES, DEFAULTS, case_args
from tests.helm import BIN, CHART, UPGRADE_CRDS_ARGS, render_chart
from tests.waiting import eventually

CR_PATH = "/apis/gpu.metax-tech.com/v1/clusteroperators"
# Cases the API server does not refuse, and why (validate and the hook refuse them, the runner
# reports them as a condition).
NOT_ADMITTED = {
    "nodeName that is not a regular expression": "CEL cannot tell whether Go's regexp compiles a pattern",
    "nodeName with a lookahead (Python's re accepts it, Go's regexp does not)": "the same",
    "a GPU listed twice": "a rule over an unbounded list of unbounded strings costs more than CEL may",
    "node-vfnums key that is not a node name": "the keys of a map have no pattern in a structural schema",
    "an MXMACA repository over 255 characters": "the length spans two fields of unbounded lists",
    "deprecated tolerations file with an unknown operator": "the CR holds tolerations as a list",
    "deprecated tolerations file (a plain list) with a misspelt key": "the CR holds tolerations as a list",
    "two driver pools with one node selector": "comparing every pool's selector with every other's costs more than CEL may",
    "driver pools without the runner": "runner.enabled is the chart's, not the CR's",
    "a driver pool turning the staged rollout on without steps": "a pool's policy is the driver's with the pool's keys over it: "
    "the CRD's rules check the driver's alone",
    "driver pool name twice": "the CRD holds the pools as one list, the values' (each pool is a DaemonSet Helm renders)",
}
# `Invalid value: "object": MESSAGE`, a CRD rule's message (a schema error's starts with `spec.`),
# or `... denied request: MESSAGE`, a ValidatingAdmissionPolicy's.
_CAUSE = re.compile(r'(?:Invalid value: "[a-z]+": (?!spec\.)|denied request: )(.*)')


def declared(field: str, schema: dict) -> bool:
    """Whether the CRD's spec schema declares `field` (a.b[0].c); the CR never holds the rest:
    chart settings, and unknown keys, which the bootstrap hook leaves out (and kubectl refuses)."""
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", field):
        if part.startswith("["):
            schema = schema.get("items", {})
        elif part in schema.get("properties", {}):
            schema = schema["properties"][part]
        elif isinstance(schema.get("additionalProperties"), dict):
            schema = schema["additionalProperties"]
        else:
            return False
    return True


@pytest.fixture(scope="module")
def client(control_plane) -> kube.Client:
    """The CRD and the chart's ValidatingAdmissionPolicies installed (removed afterwards: other
    tests on this API server install their own release's)."""
    assert cli.main(["upgrade-crds", *UPGRADE_CRDS_ARGS, "--kubeconfig", str(control_plane.kubeconfig)]) == 0
    api = kube.Client.connect(str(control_plane.kubeconfig))
    objects = render_chart(
        {"registry": "cr.example.com/metax", "driver": {"payload": {"version": "2.32.0.6"}}},
        show_only=[admission.TEMPLATE],
        args=["--api-versions", admission.VAP_API],
    )
    assert sorted(o["kind"] for o in objects) == ["ValidatingAdmissionPolicy"] * 2 + ["ValidatingAdmissionPolicyBinding"] * 2
    for obj in objects:
        api.apply(obj, field_manager="test")
    # A binding takes effect once the API server's policy informer has it: wait until it refuses.
    spec = {
        "registry": "r.example.com/m",
        "driver": {"payload": {"version": "1"}, "upgradePolicy": {"upgradeSteps": [{"replicas": 1, "pauseDuration": "x"}]}},
    }
    eventually(lambda: not admit(api, spec)[0], 30, "the ValidatingAdmissionPolicy in force")
    # The warning policy's binding may come later: wait until a spec it warns about is warned of
    # (the product manual's spelling of enableRollout, agreeing with the chart's).
    seed_spelling = {
        **spec,
        "driver": {"payload": {"version": "1"}, "enableRollout": False, "upgradePolicy": {"enableRollout": False}},
    }
    eventually(lambda: "Warning: " in dry_run_create(control_plane, seed_spelling).stderr, 30, "the warning policy in force")
    api.runner_user = next(
        v["expression"]
        for o in objects
        if o["kind"] == "ValidatingAdmissionPolicy"
        for v in o["spec"].get("variables", [])
        if v["name"] == "runnerUser"
    ).strip("'")
    yield api
    for obj in reversed(objects):
        api.delete(obj["apiVersion"], obj["kind"], obj["metadata"]["name"])


@pytest.fixture(scope="module")
def spec_schema(client) -> dict:
    return bootstrap.spec_schema(client.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", contract.CRD_NAME))


def admit(client: kube.Client, spec: dict) -> tuple[bool, list[str], str]:
    """Create the CR with `spec` in dry run: (admitted, the CEL messages, the whole refusal)."""
    body = {"apiVersion": contract.CR_API_VERSION, "kind": contract.CR_KIND, "metadata": {"name": contract.CR_NAME}, "spec": spec}
    try:
        client.call("POST", CR_PATH, body=body, query={"dryRun": "All", "fieldValidation": "Strict"})
    except ApiException as error:
        if error.status == 409:  # valid; the CR exists already (created by another test)
            return True, [], ""
        assert error.status == 422, error
        causes = json.loads(error.body)["details"].get("causes", [])
        lines = [m.group(1) for c in causes if (m := _CAUSE.search(c.get("message", "")))]
        return False, lines, error.body if isinstance(error.body, str) else error.body.decode()
    return True, [], ""


def case_values(case: dict, tmp_path: Path) -> dict | None:
    try:
        return merged_values(CHART, case_args(case, tmp_path), str(BIN / "helm3"))
    except (UserError, UserErrors):
        return None  # Helm itself refuses the values: nothing reaches the API server


def case_spec(values: dict, schema: dict) -> dict:
    """The spec the bootstrap hook writes for a case's values: the product manual's spellings read
    as the chart's keys, as the chart reads them. Where the two spellings conflict the chart refuses
    the values and no hook runs; the spec is then what an admin typing both into the CR would
    write (a whole component in the seed's spelling, which the CR refuses by itself, left out:
    tests/chart/test_seed_spellings.py)."""
    spelled = seed_spellings.normalise(values, DEFAULTS)
    if spelled.errors:
        return bootstrap.prune({k: v for k, v in values.items() if (k,) not in contract.SEED_SPELLINGS}, schema)
    return bootstrap.prune(spelled.values, schema)


# A case of a values file's own text (a repeated key, several documents) is Helm's to read: no
# CR is written from it, so it has no API-server verdict.
CR_CASES = [case for case in CASES if case["by"] != "file"]


@pytest.mark.parametrize("case", CR_CASES, ids=[case["name"] for case in CR_CASES])
def test_the_api_server_gives_each_case_validates_verdict(case, client, spec_schema, tmp_path):
    values = case_values(case, tmp_path)
    assert values is not None, "Helm refused values that are not a file case: a case for test_bad_values alone"
    said = [str(e) for e in validation.values_problems(values, defaults=DEFAULTS)]
    admitted, lines, refusal = admit(client, case_spec(values, spec_schema))
    if case["by"] == "accept":
        assert said == [] and admitted, refusal
        return
    field = case["field"]
    assert set(lines) <= set(said), f"the API server says what validate does not: {lines} vs {said}"
    if not declared(field, spec_schema) or case["name"] in NOT_ADMITTED:
        return
    assert not admitted, f"validate refuses it ({said}) but the API server admits it"
    if case["by"] == "rule":
        assert case["expect"] in lines, refusal
    else:  # the schema's own words, or validate's line where a policy checks what the CRD cannot
        assert f"spec.{field}" in refusal or (lines and lines[0].startswith(f"{field}: ")), refusal


# --- generated policies --------------------------------------------------------------------------

_int = st.integers(min_value=1, max_value=30)
_percent = st.integers(min_value=1, max_value=100).map(lambda n: f"{n}%")
_step = st.fixed_dictionaries(
    {"replicas": st.one_of(_int, _percent)}, optional={"pauseDuration": st.sampled_from([10000, "10s", {}]), "pause": st.just({})}
)
_policy = st.fixed_dictionaries(
    {},
    optional={
        "enableRollout": st.booleans(),
        "upgradeSteps": st.lists(_step, max_size=6),
        "maxParallel": st.one_of(st.integers(0, 5), _percent),
        "fallback": st.sampled_from(["pause", "rollback"]),
    },
)
# A fragment of each rule's line; the CRD's are checked before the policy's (pause), which the
# API server consults only for an object the CRD admits.
_CRD_RULES = ("is below the previous step's", "the last step reaches only", "is empty while")
_POLICY_RULE = "is given together with pauseDuration"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=_policy)
def test_generated_policies_get_the_same_verdict(raw, client):
    """Schema-valid policies: the API server refuses exactly those `policy.problems` refuses,
    with its lines (the first of each rule: a CEL rule gives one message)."""
    said = [str(e) for e in policy.problems(raw, "driver.upgradePolicy")]
    spec = {"registry": "cr.example.com/metax", "driver": {"payload": {"version": "2.32.0.6"}, "upgradePolicy": raw}}
    admitted, lines, refusal = admit(client, spec)
    assert admitted == (said == []), (said, refusal)
    assert set(lines) <= set(said), (lines, said)
    firsts = [next((line for line in said if fragment in line), None) for fragment in _CRD_RULES]
    if not any(firsts):
        firsts = [next((line for line in said if _POLICY_RULE in line), None)]
    assert all(first in lines for first in firsts if first), (firsts, lines)


# --- kubectl patch of the live CR ----------------------------------------------------------------

POLICY_CASES = [
    case for case in CASES if case.get("field", "").startswith("driver.upgradePolicy") and case["by"] in ("rule", "schema")
]


@pytest.fixture(scope="module")
def live_cr(client, spec_schema, tmp_path_factory):
    """The CR as the bootstrap hook writes it from the base values; deleted afterwards."""
    values = case_values({"set": [], "name": "base"}, tmp_path_factory.mktemp("base"))
    cr = bootstrap.bootstrap(client, values, "metax")[0]
    yield cr
    client.delete(contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME)
    client.wait_deleted(contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME, timeout=60)


def kubectl(control_plane, *args: str) -> subprocess.CompletedProcess:
    """The real kubectl, with the HTTP status of each request in its log (-v=6)."""
    return subprocess.run(
        [str(BIN / "kubectl"), "--kubeconfig", str(control_plane.kubeconfig), "-v=6", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def dry_run_create(control_plane, spec: dict) -> subprocess.CompletedProcess:
    """`kubectl create --dry-run=server` of the CR with `spec`: what admission says, nothing kept."""
    body = {"apiVersion": contract.CR_API_VERSION, "kind": contract.CR_KIND, "metadata": {"name": contract.CR_NAME}, "spec": spec}
    return subprocess.run(
        [str(BIN / "kubectl"), "--kubeconfig", str(control_plane.kubeconfig), "create", "--dry-run=server", "-f", "-"],
        input=json.dumps(body),
        capture_output=True,
        text=True,
        timeout=60,
    )


def patch(control_plane, operations: list[dict], *flags: str) -> subprocess.CompletedProcess:
    return kubectl(
        control_plane, "patch", "clusteroperator", contract.CR_NAME, "--type=json", "-p", json.dumps(operations), *flags
    )


@pytest.mark.parametrize("case", POLICY_CASES, ids=[case["name"] for case in POLICY_CASES])
def test_kubectl_patch_with_a_bad_policy_fails_with_422_naming_the_field(case, control_plane, live_cr, spec_schema, tmp_path):
    values = case_values(case, tmp_path)
    said = [str(e) for e in validation.values_problems(values, defaults=DEFAULTS)]
    bad = case_spec(values, spec_schema)["driver"]["upgradePolicy"]
    result = patch(control_plane, [{"op": "replace", "path": "/spec/driver/upgradePolicy", "value": bad}])
    assert result.returncode == 1 and 'status="422 Unprocessable Entity"' in result.stderr, result.stderr
    refusal = result.stderr
    if "is not one of" in case["expect"]:  # an enum: the API server stops at it, in its own words
        assert f"spec.{case['field']}: Unsupported value" in refusal, refusal
        return
    assert any(line in refusal for line in said), (said, refusal)  # the line validate prints
    assert case["expect"] in refusal and case["field"] in refusal


def test_while_a_rollout_is_in_progress_only_pause_and_enable_rollout_change(control_plane, client, live_cr):
    def status(upgrading: bool, phase: str) -> None:
        client.patch(
            contract.CR_API_VERSION,
            contract.CR_KIND,
            contract.CR_NAME,
            {"status": {"upgradeStatus": {"upgrading": upgrading, "phase": phase}}},
            subresource="status",
        )

    version = [{"op": "replace", "path": "/spec/driver/payload/version", "value": "2.33.0.1"}]
    policy = "/spec/driver/upgradePolicy"
    assert (
        patch(
            control_plane,
            [
                {"op": "replace", "path": f"{policy}/upgradeSteps", "value": [{"replicas": "100%"}]},
                {"op": "replace", "path": f"{policy}/enableRollout", "value": True},
            ],
        ).returncode
        == 0
    )
    status(True, "Progressing")
    try:
        result = patch(control_plane, version)
        assert 'status="422 Unprocessable Entity"' in result.stderr
        assert str(admission.frozen_during_rollout("driver.payload", "Progressing")) in result.stderr
        firmware = patch(control_plane, [{"op": "replace", "path": "/spec/driver/fwUpgradePolicy", "value": "PreferCloud"}])
        assert "driver.fwUpgradePolicy: cannot change while a driver rollout is in progress" in firmware.stderr
        for control, value in zip(admission.ROLLOUT_CONTROLS, (True, False), strict=True):  # the admin's switches
            assert (
                patch(
                    control_plane, [{"op": "replace", "path": f"/spec/driver/upgradePolicy/{control}", "value": value}]
                ).returncode
                == 0
            )
        # the runner itself (its rollback writes spec.driver back; its RBAC is not the point here)
        assert patch(control_plane, version, f"--as={client.runner_user}", "--as-group=system:masters").returncode == 0
    finally:
        status(False, "Idling")
    assert patch(control_plane, [{**version[0], "value": "2.33.0.2"}]).returncode == 0  # done: anything goes


def test_firmware_rules(control_plane, client, live_cr):
    """Seed 001 §3.2.3 step 2: on servers that run virtualised firmware, its upgrade is the one patch
    of fwUpgradePolicy PreferCloud and fwEnableVirt true; admitted, with a warning that the
    operator never upgrades non-virtualised firmware to virtualised (seed §3.2.9: the CR cannot
    know which firmware the GPUs run, the admin checks with mx-smi); seed 001: no firmware
    upgrade of GPUs bound to vfio-pci (a warning: the other GPUs are upgraded)."""
    virt = [
        {"op": "replace", "path": "/spec/driver/fwUpgradePolicy", "value": "PreferCloud"},
        {"op": "replace", "path": "/spec/driver/fwEnableVirt", "value": True},
    ]
    result = patch(control_plane, virt)
    assert result.returncode == 0 and "Warning: Validation failed for ValidatingAdmissionPolicy" in result.stderr
    assert str(admission.virt_firmware_warning()) in result.stderr
    again = patch(control_plane, [{"op": "add", "path": "/spec/driver/deployPolicy", "value": "PreferNewer"}], "--dry-run=server")
    assert again.returncode == 0 and str(admission.virt_firmware_warning()) not in again.stderr  # only when turned on
    # a fresh install may ask for virtualised firmware (no old object to compare): no warning either
    spec = {**live_cr["spec"], "driver": {**live_cr["spec"]["driver"], "fwUpgradePolicy": "PreferCloud", "fwEnableVirt": True}}
    client.delete(contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME)
    client.wait_deleted(contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME, timeout=60)
    assert admit(client, spec)[0]
    bootstrap.bootstrap(client, {**spec}, "metax")
    vfio = [
        {"op": "replace", "path": "/spec/vfioManager/deploy", "value": True},
        {"op": "replace", "path": "/spec/vfioManager/vfioConfig", "value": [{"nodeName": "gpu-node-1", "gpus": "all"}]},
    ]
    result = patch(control_plane, vfio)
    assert result.returncode == 0 and "Warning: Validation failed for ValidatingAdmissionPolicy" in result.stderr
    assert str(admission.vfio_firmware_warning()) in result.stderr
