"""Every field of the CR acts at run time, or is reported, or is listed here as not acting yet.

Walks every leaf field of the CRD's spec (the same walk and samples as the bootstrap's merge
matrix), sets it to its sample run-time edit in the CR the bootstrap writes from the defaults, and
asks the runner's reconcile core (`reconcile.plan`, on the DaemonSets the real chart renders) what
it does: apply something to a DaemonSet, or report `HelmUpgradeRequired` naming the field. The
upgrade policy acts through the rollout engine (tests/test_rollout_*.py).
"""
from __future__ import annotations

import copy

import pytest
import yaml

from metax_operator import reconcile
from metax_operator.hooks.bootstrap import prune, spec_schema
from tests.helm import CHART, render_chart
from tests.test_bootstrap_merge import fields, get, put, sample
from tests.test_reconcile import VALUES, deep_update, observed

CRD = yaml.safe_load((CHART / "crds" / "clusteroperators.gpu.metax-tech.com.yaml").read_text())
SCHEMA = spec_schema(CRD)
ROLLOUT = "driver.upgradePolicy."
#: Fields that neither act at run time nor are reported yet: `helm upgrade` applies them.
NOT_ACTING = {
    "exporter.service.type", "exporter.service.port", "exporter.service.nodePortRange",
    "exporter.service.externalName",
    "driver.config.nodeVfnums", "driver.config.moduleParams.xcore_page_size",
    "driver.config.moduleParams.gpu_model", "driver.config.nodeModuleParams",
    "vfioManager.vfioConfig",
}


EVERY_COMPONENT = deep_update(copy.deepcopy(VALUES), {"exporter": {"deploy": True}})


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict]:
    """The chart's DaemonSets, every component on, by component key."""
    return {ds["metadata"]["annotations"]["gpu.metax-tech.com/component"]: ds
            for ds in render_chart(EVERY_COMPONENT) if ds["kind"] == "DaemonSet"}


def _spec() -> dict:
    values = deep_update(yaml.safe_load((CHART / "values.yaml").read_text()), copy.deepcopy(EVERY_COMPONENT))
    return prune(values, SCHEMA)


@pytest.mark.helm
def test_each_crd_field_acts_is_reported_or_is_listed(rendered):
    base = _spec()
    silent = set()
    for field, node in fields(SCHEMA).items():
        if field.startswith(ROLLOUT):
            continue
        case = sample(field, node)
        spec = base
        for key, value in case["base"].items():
            spec = put(spec, key, value)
        edit = not get(spec, field) if node.get("type") == "boolean" else case["edit"]  # (exporter is on here)
        before = reconcile.plan(observed(rendered, spec))
        edited = put(spec, field, edit)
        after = reconcile.plan(observed(rendered, edited))
        writes = [a.body for a in after.applies] != [a.body for a in before.applies]
        reported = [c for c in after.conditions if c.status == "True" and c.type == reconcile.HELM_UPGRADE
                    and f"spec.{field}" in c.message]
        refused = [c for c in after.conditions if c.type == reconcile.SPEC_VALID and c.status == "False"]
        assert not refused, (field, refused)
        if not (writes or reported):
            silent.add(field)
    assert silent == NOT_ACTING
