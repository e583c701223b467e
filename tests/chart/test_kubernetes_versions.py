"""The chart on every class of Kubernetes version it supports (scripts/controlplane/versions/matrix).

Each matrix version's API server runs alone (etcd and kube-apiserver of that release, built by
`make e2e`). On it the chart is installed as Helm 3 installs it, without the hook Jobs (no
nodes run them here): `crds/` created as Helm creates it, every object validated by Helm against
that server's OpenAPI and accepted, the ValidatingAdmissionPolicy where Helm's capabilities show
it; then the upgrade-crds hook's command applies the CRD in the form that server takes.

Then every case of tests/data/bad_values.yaml and generated upgrade policies go to that server and
to the default version's (tests/chart/test_admission.py's, which agrees with `validate`): each is
refused on the older server exactly where the default refuses it by a means the older server has
(the structural schema everywhere, CRD rules from 1.25, the policy where it is served), with the
same line (where the hook applies the portable CRD, the rule's static message, `…` for the
values).
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from kubernetes.client.exceptions import ApiException

from metax_operator import cli, contract
from metax_operator.chart import admission, schema
from metax_operator.conditions import CrCondition
from metax_operator.errors import UserError
from metax_operator.hooks import bootstrap
from metax_operator.rollout import freeze
from metax_operator.runtime import api_failures, cr_status, kube, run
from tests import controlplane
from tests.chart.test_admission import CR_CASES, _policy, admit, case_spec, case_values, client  # noqa: F401 (fixture)
from tests.helm import BIN, CHART, NAMESPACE, RELEASE, UPGRADE_CRDS_ARGS, render_chart

VERSIONS = controlplane.matrix()
CEL_RULES_MINOR = 25  # CRD validation rules enforced (beta, on by default); 1.23-1.24 drop them
BASE_VALUES = {"registry": "cr.example.com/metax", "driver": {"payload": {"version": "2.32.0.6"}}}


@dataclass(repr=False)
class Server:
    version: controlplane.MatrixVersion
    control_plane: controlplane.ControlPlane
    client: kube.Client
    install: str  # what `helm install` printed

    def __repr__(self) -> str:
        return f"Server({self.version.version})"

    @property
    def rules(self) -> bool:
        return self.version.minor >= CEL_RULES_MINOR

    @property
    def full_crd(self) -> bool:
        """Whether the upgrade-crds hook applies the whole CRD here (else the portable one)."""
        return self.version.minor >= admission.FULL_CRD_MINOR

    @property
    def policy_api(self) -> str | None:
        """The ValidatingAdmissionPolicy API the chart renders with here (None: not served)."""
        for api_version in admission.POLICY_API_VERSIONS:
            try:
                self.client.resource(api_version, "ValidatingAdmissionPolicy")
            except api_failures.NotServed:
                continue
            return api_version
        return None

    @property
    def policy(self) -> bool:
        return self.policy_api is not None


def test_kube_version_is_the_oldest_the_matrix_proves():
    """Chart.yaml's kubeVersion starts at the oldest version the tests run on, and names no upper
    bound (docs/control-plane.md, "Kubernetes versions": an upper bound would stop `helm upgrade`
    on a cluster upgraded past the newest release tested)."""
    oldest = min([controlplane.minor(controlplane.K8S_VERSION)] + [v.minor for v in controlplane.matrix()])
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"] == f">=1.{oldest}.0-0"


def test_every_rollout_version_has_a_kubelet_within_the_skew_policy():
    """The user's path runs on each `rollout` version with the real node (test_versions_user_path.py):
    its kubelet is one setup builds, not newer than the API server, at most the skew policy's
    minor versions older (2 before 1.28, 3 from it)."""
    built = {controlplane.K8S_VERSION} | {v.version for v in VERSIONS if "kubelet" in v.binaries}
    for version in (v.version for v in VERSIONS if v.runs == "rollout"):
        node = controlplane.node_version(version)
        skew = controlplane.minor(version) - controlplane.minor(node)
        assert node in built and 0 <= skew <= (3 if controlplane.minor(version) >= 28 else 2), (version, node)


@pytest.fixture(scope="module", params=VERSIONS, ids=[v.version for v in VERSIONS])
def server(request, tmp_path_factory):
    version = request.param
    work = tmp_path_factory.mktemp(f"kubernetes-{version.version}")
    try:
        cp = controlplane.ControlPlane.start(work, kubernetes=version.version, api_only=True)
    except controlplane.ControlPlaneError as error:
        pytest.fail(f"Kubernetes {version.version}: {error}", pytrace=False)
    try:
        values = work / "values.yaml"
        values.write_text(yaml.safe_dump(BASE_VALUES))
        install = subprocess.run(
            [str(BIN / "helm3"), "install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace", "--no-hooks"]
            + ["-f", str(values), "--kubeconfig", str(cp.kubeconfig)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert install.returncode == 0, f"helm install on {version.version}: {install.stderr}"
        assert cli.main(["upgrade-crds", *UPGRADE_CRDS_ARGS, "--if-exists", "--kubeconfig", str(cp.kubeconfig)]) == 0
        yield Server(version, cp, kube.Client.connect(str(cp.kubeconfig)), install.stdout + install.stderr)
    finally:
        cp.stop()


def rules_of(node) -> list[dict]:
    """Every `x-kubernetes-validations` rule below `node`."""
    if isinstance(node, dict):
        return node.get("x-kubernetes-validations", []) + [r for child in node.values() for r in rules_of(child)]
    if isinstance(node, list):
        return [r for child in node for r in rules_of(child)]
    return []


@pytest.mark.matrix
def test_the_chart_installs_and_the_crd_takes_the_form_the_server_enforces(server):
    """The CRD is accepted (Established) with the rules of the form the hook chose where the
    server has CEL rules, none where it drops them; the policy is installed where it is served."""
    assert "STATUS: deployed" in server.install, server.install
    live = rules_of(server.client.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", contract.CRD_NAME)["spec"])
    chosen = CHART / (schema.FULL_CRD_FILE if server.full_crd else schema.CRD_FILE)
    live_policies = set()
    if server.policy:
        live_policies = {p["metadata"]["name"] for p in server.client.list(server.policy_api, "ValidatingAdmissionPolicy")}
    served = ["--api-versions", f"{server.policy_api}/ValidatingAdmissionPolicy"] if server.policy else []
    rendered = render_chart(BASE_VALUES, args=served) if server.policy else []
    assert live_policies == {o["metadata"]["name"] for o in rendered if o["kind"] == "ValidatingAdmissionPolicy"}
    assert {o["apiVersion"] for o in rendered if o["kind"].startswith("ValidatingAdmissionPolicy")} <= {server.policy_api}
    if not server.rules:
        assert live == [], "an API server without CEL validation rules drops them"
        return
    assert live == rules_of(yaml.safe_load(chosen.read_text())["spec"])
    assert all(r.get("message") for r in live), "every rule has a static message"


# Before 1.31 a cause of its own, since in the message: the CRD's rules wait for a schema-valid object.
_NOT_CHECKED = "some validation rules were not checked"


def _causes(refusal: str) -> set[str]:
    """The means by which the API server refused (its 422 body): "policy" (a ValidatingAdmissionPolicy),
    "rule" (a CRD validation rule: `Invalid value: "object": <its message>`), "schema" (the rest)."""
    status = json.loads(refusal)
    kinds = {"policy"} if "denied request" in status.get("message", "") else set()
    for cause in status.get("details", {}).get("causes", []):
        if _NOT_CHECKED in cause.get("message", "") or "denied request" in cause.get("message", ""):
            continue
        kinds.add("rule" if re.match(r'Invalid value: "[a-z]+": (?!spec\.)', cause.get("message", "")) else "schema")
    return kinds


def _said(line: str, lines: list[str]) -> bool:
    """`line` is one of `lines`, or a rule's static message for one (`…` for its values)."""
    return any(line == other or re.fullmatch(re.escape(line).replace("…", ".+"), other) for other in lines)


def assert_same_verdict(server: Server, default, spec: dict) -> None:
    admitted, lines, refusal = admit(default, spec)
    old_admitted, old_lines, old_refusal = admit(server.client, spec)
    enforced = {"schema"} | ({"rule"} if server.rules else set()) | ({"policy"} if server.policy else set())
    refused_by = _causes(refusal) if not admitted else set()
    assert old_admitted == (not refused_by & enforced), (
        f"{server.version.version} admitted={old_admitted}: {old_refusal[:600]}; "
        f"the default refused by {refused_by}: {refusal[:600]}"
    )
    for line in old_lines:
        if line.startswith(_NOT_CHECKED):
            continue
        assert line in lines if server.full_crd else _said(line, lines), (line, lines)


@pytest.mark.matrix
@pytest.mark.parametrize("case", CR_CASES, ids=[case["name"] for case in CR_CASES])
def test_each_case_gets_the_default_servers_verdict(case, server, client, tmp_path):
    values = case_values(case, tmp_path)
    schema_of_spec = bootstrap.spec_schema(client.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", contract.CRD_NAME))
    assert_same_verdict(server, client, case_spec(values, schema_of_spec))


@pytest.mark.matrix
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=_policy)
def test_generated_policies_get_the_default_servers_verdict(raw, server, client):
    assert_same_verdict(server, client, {**BASE_VALUES, "driver": {**BASE_VALUES["driver"], "upgradePolicy": raw}})


def _runner_pass(client: kube.Client) -> None:
    """One pass of the runner, in this process, as the in-cluster runner makes it."""
    runner = run.Runner(client, NAMESPACE, is_leader=lambda: True, identity="runner-test")
    try:
        runner.run_pass()
    finally:
        runner.close()


def _payload_image(client: kube.Client) -> str:
    ds = client.get("apps/v1", "DaemonSet", contract.DRIVER_DAEMONSET, NAMESPACE)
    init = ds["spec"]["template"]["spec"]["initContainers"]
    return next(c["image"] for c in init if c["name"] == contract.DRIVER_PAYLOAD_CONTAINER)


@pytest.mark.matrix
def test_an_edit_during_a_rollout_is_refused_where_the_policy_is_served_and_held_by_the_runner_elsewhere(server):
    """The product's rule on every version: while a driver rollout is in progress only `pause` and
    `enableRollout` change. `helm upgrade`'s bootstrap refuses another change everywhere; `kubectl
    patch` is refused by the policy where it is served, and elsewhere stored, then held by the
    runner: the driver keeps the rollout's version, and SpecHeld and its Event say why."""
    client = server.client
    cr, _ = bootstrap.bootstrap(client, BASE_VALUES, RELEASE)
    status = {"upgradeStatus": {"upgrading": True, "phase": "Progressing", "resume": {"spec": freeze.record(cr["spec"])}}}
    client.patch(contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME, {"status": status}, subresource="status")
    line = str(admission.frozen_during_rollout("driver.payload", "Progressing"))
    try:
        _runner_pass(client)  # the runner applies the CR as it is: the rollout's version
        before = _payload_image(client)
        assert before.endswith(":2.32.0.6"), before
        upgrade = {**BASE_VALUES, "driver": {"payload": {"version": "2.33.0.1"}}}
        with pytest.raises(UserError) as refused:
            bootstrap.bootstrap(client, upgrade, RELEASE)
        assert str(refused.value) == line
        version = [{"op": "replace", "path": "/spec/driver/payload/version", "value": "2.33.0.1"}]
        if server.policy:
            with pytest.raises(ApiException) as denied:
                client.patch(contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME, version, patch_type="json")
            assert denied.value.status == 422 and line in str(denied.value.body), denied.value.body
            return
        client.patch(contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME, version, patch_type="json")
        _runner_pass(client)
        assert _payload_image(client) == before, "the held version reached the driver"
        live = client.get(contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME)
        held = next(c for c in live["status"]["conditions"] if c["type"] == CrCondition.SPEC_HELD)
        assert held["status"] == "True" and held["message"].startswith(line.split(";")[0]), held
        events = client.list("v1", "Event", cr_status.EVENT_NAMESPACE)
        assert any(e["reason"] == "EditDuringRollout" and e["type"] == "Warning" for e in events), events
    finally:
        client.delete(contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME)
        client.wait_deleted(contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME, timeout=60)
