"""Every field of the CR acts at run time, or is reported, or is listed here as not acting yet.

Walks every leaf field of the CRD's spec (the same walk and samples as the bootstrap's merge
matrix), sets it to its sample run-time edit in the CR the bootstrap writes from the defaults, and
asks the runner's reconcile core (`reconcile.decide`, on the DaemonSets the real chart renders) what
it does: apply something to a DaemonSet, or report `HelmUpgradeRequired` naming the field. The
upgrade policy acts through the rollout engine (tests/rollout/).
"""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from metax_operator import contract
from metax_operator.conditions import CrCondition
from metax_operator.hooks.bootstrap import prune, spec_schema
from metax_operator.runtime import reconcile
from metax_operator.runtime.reconcile import Observed
from tests.helm import CHART, render_chart
from tests.hooks.test_bootstrap_merge import fields, get, put, sample
from tests.runtime.test_reconcile import VALUES, deep_update

CRD = yaml.load((CHART / "crds" / "clusteroperators.gpu.metax-tech.com.yaml").read_text(), Loader=yaml.CSafeLoader)
SCHEMA = spec_schema(CRD)
ROLLOUT = "driver.upgradePolicy."
#: Fields with no object of their own to act on: inputs of the validation only.
VALIDATION_ONLY = {"exporter.service.nodePortRange"}  # the cluster's range a NodePort is checked against
#: The product manual's spellings of fields: admitted only where they agree with the chart's key,
#: which acts (tests/chart/test_seed_spellings.py).
SEED_SPELLINGS = tuple(".".join(seed) for seed in contract.SEED_SPELLINGS)


EVERY_COMPONENT = deep_update(copy.deepcopy(VALUES), {"exporter": {"deploy": True}})


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    """The chart's objects, every component on."""
    return render_chart(EVERY_COMPONENT)


def seen(objects: list[dict], spec: dict, recorded: dict) -> Observed:
    """A pass's view: the rendered DaemonSets, ConfigMaps (recording the defaults' CR values, as
    the runner's first pass does) and exporter Service."""
    configmaps = {}
    for name in contract.CONFIGMAPS:
        cm = copy.deepcopy(next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name))
        if recorded[name] is not None:
            cm["metadata"].setdefault("annotations", {})[contract.CR_APPLIED_ANNOTATION] = json.dumps(recorded[name])
        configmaps[name] = cm
    daemonsets = {o["metadata"]["annotations"]["gpu.metax-tech.com/component"]: o for o in objects if o["kind"] == "DaemonSet"}
    service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == contract.EXPORTER_SERVICE)
    cr = {"metadata": {"name": "cluster-operator", "generation": 1, "resourceVersion": "1", "uid": "u"}, "spec": spec}
    return Observed("metax-operator", cr, copy.deepcopy(daemonsets), configmaps, service)


def _spec() -> dict:
    values = deep_update(yaml.safe_load((CHART / "values.yaml").read_text()), copy.deepcopy(EVERY_COMPONENT))
    return prune(values, SCHEMA)


def test_each_crd_field_acts_is_reported_or_is_listed(rendered):
    base = _spec()
    first = reconcile.reconcile_configmaps(seen(rendered, base, dict.fromkeys(contract.CONFIGMAPS)))
    recorded = {
        a.body["metadata"]["name"]: json.loads(a.body["metadata"]["annotations"][contract.CR_APPLIED_ANNOTATION])
        for a in first.applies
    }
    assert all("data" not in a.body for a in first.applies)  # the first pass only records
    silent = set()
    for field, node in fields(SCHEMA).items():
        if field.startswith(ROLLOUT) or field.startswith(SEED_SPELLINGS):
            continue
        case = sample(field, node)
        spec = base
        for key, value in case["base"].items():
            spec = put(spec, key, value)
        edit = not get(spec, field) if node.get("type") == "boolean" else case["edit"]  # (exporter is on here)
        before = reconcile.decide(seen(rendered, spec, recorded))
        edited = put(spec, field, edit)
        after = reconcile.decide(seen(rendered, edited, recorded))
        writes = [a.body for a in after.applies] != [a.body for a in before.applies]
        reported = [
            c
            for c in after.conditions
            if c.status == "True" and c.type == CrCondition.HELM_UPGRADE and f"spec.{field}" in c.message
        ]
        refused = [c for c in after.conditions if c.type == CrCondition.SPEC_VALID and c.status == "False"]
        assert not refused, (field, refused)
        if not (writes or reported):
            silent.add(field)
    assert silent == VALIDATION_ONLY


def test_the_runner_keeps_the_configmaps_in_step_with_the_cr_and_leaves_an_admins_edit(control_plane, rendered):
    """On the real API server: the first pass only records; an admin's edit of a ConfigMap stays
    while the CR field is unchanged; a CR change is written in the chart's format (the parsers
    driver-manager's and vfio-manager's contract uses read it back); a second pass writes nothing."""
    import uuid

    from metax_operator import cli
    from metax_operator.chart import validation
    from metax_operator.hooks import bootstrap
    from metax_operator.runtime import kube

    api = kube.Client.connect(str(control_plane.kubeconfig))
    namespace = f"cm-{uuid.uuid4().hex[:8]}"
    api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}, field_manager="test")
    assert (
        cli.main(
            [
                "upgrade-crds",
                "--crd",
                str(CHART / "crds" / f"{contract.CRD_NAME}.yaml"),
                "--kubeconfig",
                str(control_plane.kubeconfig),
            ]
        )
        == 0
    )
    try:
        for obj in rendered:
            if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] in contract.CONFIGMAPS:
                api.apply({**obj, "metadata": {**obj["metadata"], "namespace": namespace}}, field_manager="helm")
        values = deep_update(yaml.safe_load((CHART / "values.yaml").read_text()), copy.deepcopy(EVERY_COMPONENT))
        bootstrap.bootstrap(api, values, "metax")

        def one_pass() -> int:
            observed = reconcile.observe(api, namespace)
            outcome = reconcile.Outcome()
            outcome.extend(reconcile.reconcile_configmaps(observed))
            return reconcile.apply(api, observed, outcome, lambda: True, lambda: 1_767_225_600.0)

        def data(name: str, key: str) -> str:
            return api.get("v1", "ConfigMap", name, namespace)["data"][key]

        one_pass()  # records what the CR holds
        assert data("metax-vfio-config", "config").strip() == "[]"
        edited = "- nodeName: gpu-node-1\n  gpus: '0'\n"  # the admin edits the ConfigMap itself
        api.patch(
            "v1",
            "ConfigMap",
            "metax-vfio-config",
            {"data": {"config": edited}},
            namespace=namespace,
            field_manager="kubectl-edit",
        )
        one_pass()
        assert data("metax-vfio-config", "config") == edited
        entries = [{"nodeName": "gpu-node-\\d+", "gpus": "0,1"}]
        api.patch(
            *CR,
            {"spec": {"vfioManager": {"vfioConfig": entries}, "driver": {"config": {"moduleParams": {"xcore_page_size": 2}}}}},
            field_manager="kubectl-edit",
        )
        one_pass()
        assert validation.parse_vfio_config(data("metax-vfio-config", "config")) == entries
        assert validation.parse_module_params(data("driver-config", "module-params")) == {"xcore_page_size": 2}
        assert data("metax-vfio-config", "config") != edited
        assert one_pass() == 0  # in step: nothing to write
    finally:
        api.delete("v1", "Namespace", namespace)
        api.delete(*CR)
        api.wait_deleted(*CR, timeout=60)


CR = ("gpu.metax-tech.com/v1", "ClusterOperator", "cluster-operator")
