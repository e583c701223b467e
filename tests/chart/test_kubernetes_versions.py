"""The chart on every class of Kubernetes version it supports (scripts/controlplane/versions/matrix).

Each matrix version's API server runs alone (etcd and kube-apiserver of that release, built by
`make setup`). On it the chart is installed as Helm 3 installs it, without the hook Jobs (no
nodes run them here): `crds/` created as Helm creates it, every object validated by Helm against
that server's OpenAPI and accepted, the ValidatingAdmissionPolicy where Helm's capabilities show
it; then the upgrade-crds hook's command applies the CRD in the form that server takes.

Then every case of tests/data/bad_values.yaml and generated upgrade policies go to that server and
to the default version's (tests/chart/test_admission.py's, which agrees with `validate`): each is
refused on the older server exactly where the default refuses it by a means the older server has
(the structural schema everywhere, CRD rules from 1.25, the policy where it is served), with the
same line (before 1.27, the rule's static message, `…` for the values).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

import pytest
import yaml
from hypothesis import HealthCheck, given, settings

from metax_operator import cli, contract
from metax_operator.chart import admission, schema
from metax_operator.hooks import bootstrap
from metax_operator.runtime import kube
from tests import controlplane
from tests.chart.test_admission import CR_CASES, _policy, admit, case_values, client  # noqa: F401 (fixture)
from tests.helm import BIN, CHART, NAMESPACE, RELEASE

VERSIONS = [v for v in controlplane.matrix() if v.runs == "admission"]
CEL_RULES_MINOR = 25  # CRD validation rules enforced (beta, on by default); 1.23-1.24 drop them
BASE_VALUES = {"registry": "cr.example.com/metax", "driver": {"payload": {"version": "2.32.0.6"}}}


@dataclass
class Server:
    version: controlplane.MatrixVersion
    control_plane: controlplane.ControlPlane
    client: kube.Client
    install: str  # what `helm install` printed

    @property
    def rules(self) -> bool:
        return self.version.minor >= CEL_RULES_MINOR

    @property
    def message_expressions(self) -> bool:
        return self.version.minor >= admission.MESSAGE_EXPRESSION_MINOR

    @property
    def policy(self) -> bool:
        """Whether the server serves the ValidatingAdmissionPolicy API the chart renders."""
        try:
            self.client.resource(*admission.VAP_API.rsplit("/", 1))
        except kube.NotServed:
            return False
        return True


def test_kube_version_is_the_oldest_the_matrix_proves():
    """Chart.yaml's kubeVersion starts at the oldest version the tests run on, and names no upper
    bound (docs/control-plane.md, "Kubernetes versions": an upper bound would stop `helm upgrade`
    on a cluster upgraded past the newest release tested)."""
    oldest = min([controlplane.minor(controlplane.K8S_VERSION)] + [v.minor for v in controlplane.matrix()])
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"] == f">=1.{oldest}.0-0"


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
        crd = str(CHART / schema.FULL_CRD_FILE)
        assert cli.main(["upgrade-crds", "--crd", crd, "--if-exists", "--kubeconfig", str(cp.kubeconfig)]) == 0
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


@pytest.mark.e2e
@pytest.mark.helm
def test_the_chart_installs_and_the_crd_takes_the_form_the_server_enforces(server):
    """The CRD is accepted (Established) with its rules where the server has CEL, with their
    messageExpressions where it has those; the policy is installed where it is served."""
    assert "STATUS: deployed" in server.install, server.install
    live = rules_of(server.client.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", contract.CRD_NAME)["spec"])
    chart = rules_of(yaml.safe_load((CHART / schema.FULL_CRD_FILE).read_text())["spec"])
    policies = (
        [o for o in server.client.list(*admission.VAP_API.rsplit("/", 1)) if o["metadata"]["name"].startswith(f"{RELEASE}-")]
        if server.policy
        else []
    )
    assert len(policies) == (2 if server.policy else 0)
    if not server.rules:
        assert live == [], "an API server without CEL validation rules drops them"
        return
    assert [r["rule"] for r in live] == [r["rule"] for r in chart]
    assert all(r.get("message") for r in live), "every rule has a static message"
    want = chart if server.message_expressions else admission.portable({"rules": chart})["rules"]
    assert live == want


def _causes(refusal: str) -> set[str]:
    """The means by which the default server refused (its 422 body's causes)."""
    kinds = set()
    if "denied request" in refusal:
        kinds.add("policy")
    for message in re.findall(r'"message":"((?:[^"\\]|\\.)*)"', refusal):
        if re.search(r'Invalid value: \\?"[a-z]+\\?": (?!spec\.)', message):
            kinds.add("rule")
        elif message.startswith("spec."):
            kinds.add("schema")
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
        assert line in lines if server.message_expressions else _said(line, lines), (line, lines)


@pytest.mark.e2e
@pytest.mark.helm
@pytest.mark.parametrize("case", CR_CASES, ids=[case["name"] for case in CR_CASES])
def test_each_case_gets_the_default_servers_verdict(case, server, client, tmp_path):
    values = case_values(case, tmp_path)
    schema_of_spec = bootstrap.spec_schema(client.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", contract.CRD_NAME))
    assert_same_verdict(server, client, bootstrap.prune(values, schema_of_spec))


@pytest.mark.e2e
@pytest.mark.helm
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=_policy)
def test_generated_policies_get_the_default_servers_verdict(raw, server, client):
    assert_same_verdict(server, client, {**BASE_VALUES, "driver": {**BASE_VALUES["driver"], "upgradePolicy": raw}})
