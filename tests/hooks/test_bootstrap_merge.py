"""The bootstrap hook's three-way merge on the real API server, field by field of the CRD.

For every leaf field of the CRD's spec schema (a new field fails the test until it has a sample
below): the CR bootstrapped from the chart's defaults; an admin's edit of the field at run time;
an upgrade that changes another field (the edit is kept, and said); an upgrade whose values change
the field (the values win, and an override of the edit is reported: an Event on the CR and a line
of the hook's log).
"""

from __future__ import annotations

import copy
import json

import pytest

from metax_operator import cli, contract
from metax_operator.chart.validate import merged_values
from metax_operator.hooks import bootstrap
from metax_operator.runtime import kube
from tests.helm import BIN, CHART

CR = (contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME)
AFFINITY = lambda key: {  # noqa: E731
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": key, "operator": "Exists"}]}]
        }
    }
}
TOLERATIONS = lambda key: [{"key": key, "operator": "Exists", "effect": "NoSchedule"}]  # noqa: E731
# (run-time edit, new values) of the fields whose type says too little; `base` adjusts the
# defaults so that both are valid (a field's prerequisites).
SAMPLES: dict[str, dict] = {
    "registry": {"edit": "mirror.example.com/metax", "values": "cr2.example.com/metax"},
    "tolerations": {"edit": TOLERATIONS("a"), "values": TOLERATIONS("b")},
    "driver.payload.name": {"edit": "driver-image-b", "values": "driver-image-c"},
    "driver.payload.version": {"edit": "2.33.0.1", "values": "2.34.0.1"},
    "driver.payload.digest": {"edit": "sha256:" + "a" * 64, "values": "sha256:" + "b" * 64},
    "driver.payload.registry": {"edit": "mirror.example.com/metax", "values": "cr2.example.com/metax"},
    "driver.config.nodeVfnums": {"edit": {"gpu-node-1": {"vfnum": 2}}, "values": {"gpu-node-1": {"vfnum": 4}}},
    "driver.config.moduleParams.gpu_model": {"edit": "c500", "values": "c550"},
    "driver.config.nodeModuleParams": {
        "edit": {"gpu-node-1": {"xcore_page_size": 2}},
        "values": {"gpu-node-1": {"xcore_page_size": 4}},
    },
    "driver.upgradePolicy.upgradeSteps": {
        "edit": [{"replicas": 5}, {"replicas": "100%"}],
        "values": [{"replicas": "50%"}, {"replicas": "100%"}],
    },
    "driver.upgradePolicy.enableRollout": {"base": {"driver.upgradePolicy.upgradeSteps": [{"replicas": "100%"}]}},
    "driver.pools": {
        "edit": [{"name": "c500", "nodeSelector": {"metax-tech.com/gpu.product": "C500"}, "payload": {"version": "2.33.0.1"}}],
        "values": [{"name": "c550", "nodeSelector": {"metax-tech.com/gpu.product": "C550"}}],
    },
    "driver.upgradePolicy.maxParallel": {"edit": "50%", "values": 3},
    "driver.upgradePolicy.maxUnavailable": {"edit": 1, "values": "10%"},
    "driver.upgradePolicy.readinessTimeout": {"edit": "10m", "values": 5000},
    "driver.upgradePolicy.waitForCompletion.podSelector": {"edit": "app=training", "values": "app=inference"},
    "driver.upgradePolicy.waitForCompletion.timeout": {"edit": "2h", "values": 60000},
    "driver.upgradePolicy.drain.timeout": {"edit": "5m", "values": 600000},
    # validation and healthGate: written into the CR only turned on (contract.UNDEFAULTED); turned
    # off in the values, the block leaves the bootstrap's spec, and the admin's `false` stays,
    # which is what the values say
    **{
        f"driver.upgradePolicy.{block}.{field}": {
            "edit": edit,
            "values": values,
            "base": {f"driver.upgradePolicy.{block}.enable": True},
        }
        for block, field, edit, values in (
            ("validation", "enable", False, False),
            ("validation", "timeoutSeconds", 120, 300),
            ("validation", "workload.image", "cr.example.com/metax/maca-sample:1", "cr.example.com/metax/maca-sample:2"),
            ("validation", "workload.command", ["/sample", "a"], ["/sample", "b"]),
            ("validation", "workload.resources.requests", {"cpu": "1"}, {"cpu": "2"}),
            ("validation", "workload.resources.limits", {"metax-tech.com/gpu": 2}, {"metax-tech.com/gpu": 4}),
            ("healthGate", "enable", False, False),
            *(
                ("healthGate", f"maxRegression.{signal}", 10, 20)
                for signal in ("notReady", "gpusUnavailable", "restarts", "failedGpuPods")
            ),
        )
    },
    "maca.payload.images": {"edit": ["maca-c500:1"], "values": ["maca-c500:2"]},
    "maca.payload.registry": {"edit": "mirror.example.com/metax", "values": "cr2.example.com/metax"},
    "exporter.service.port": {"edit": 30001, "values": 30002, "base": {"exporter.service.type": "NodePort"}},
    "exporter.service.nodePortRange": {"edit": "20000-22767", "values": "31000-32000"},
    "exporter.service.externalName": {
        "edit": "b.example.com",
        "values": "c.example.com",
        "base": {"exporter.service.type": "ExternalName", "exporter.service.externalName": "a.example.com"},
    },
    "vfioManager.vfioConfig": {
        "edit": [{"nodeName": "gpu-node-1", "gpus": "0"}],
        "values": [{"nodeName": "gpu-node-1", "gpus": "1"}],
    },
    # components others need: turned off with their dependents
    "gpuLabel.deploy": {
        "base": {f"{c}.deploy": False for c in ("runtime", "driver", "maca", "gpuDevice", "exporter", "vfioManager")}
    },
    "runtime.deploy": {"base": {f"{c}.deploy": False for c in ("driver", "maca", "gpuDevice", "exporter")}},
    "driver.deploy": {"base": {"exporter.deploy": False}},
    "maca.deploy": {"base": {"gpuDevice.deploy": False}},
}
_SUFFIX_SAMPLES = {  # the same for every component
    "podTemplateSpec.spec.nodeSelector": {"edit": {"pool": "a"}, "values": {"pool": "b"}},
    "podTemplateSpec.spec.affinity": {"edit": AFFINITY("a"), "values": AFFINITY("b")},
    "podTemplateSpec.spec.tolerations": {"edit": TOLERATIONS("a"), "values": TOLERATIONS("b")},
}


def fields(schema: dict, path: tuple[str, ...] = ()) -> dict[str, dict]:
    """The CRD spec's leaf fields (objects with properties are walked; an affinity is one field)."""
    out = {}
    for key, node in schema.get("properties", {}).items():
        here = path + (key,)
        if node.get("properties") and key != "affinity":
            out.update(fields(node, here))
        else:
            out[".".join(here)] = node
    return out


def sample(field: str, node: dict) -> dict:
    """{edit, values, base} for `field`: from the tables, else from its type."""
    given = SAMPLES.get(field) or next((s for suffix, s in _SUFFIX_SAMPLES.items() if field.endswith(suffix)), {})
    default = node.get("default")
    if "edit" in given:
        return {"base": {}, **given}
    if node.get("type") == "boolean":
        return {"base": {}, **given, "edit": not default, "values": not default}
    if "enum" in node:
        others = [v for v in node["enum"] if v != default and v != "ExternalName"]
        return {"base": {}, **given, "edit": others[0], "values": others[-1]}
    if node.get("type") == "integer":
        start = default or node.get("minimum", 0)
        return {"base": {}, **given, "edit": start + 1, "values": start + 2}
    raise AssertionError(f"no sample for spec.{field}: add one to SAMPLES in {__file__}")


def put(tree: dict, field: str, value) -> dict:
    """A copy of `tree` with `field` (a.b.c) set to `value`."""
    out = copy.deepcopy(tree)
    node = out
    *parents, last = field.split(".")
    for key in parents:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[last] = value
    return out


def get(tree: dict, field: str):
    for key in field.split("."):
        tree = (tree or {}).get(key)
    return tree


@pytest.fixture(scope="module")
def client(control_plane):
    crd = CHART / "crds" / f"{contract.CRD_NAME}.yaml"
    assert cli.main(["upgrade-crds", "--crd", str(crd), "--kubeconfig", str(control_plane.kubeconfig)]) == 0
    api = kube.Client.connect(str(control_plane.kubeconfig))
    api.delete(*CR)
    api.wait_deleted(*CR, timeout=60)
    yield api
    api.delete(*CR)
    api.wait_deleted(*CR, timeout=60)


@pytest.fixture(scope="module")
def defaults(tmp_path_factory) -> dict:
    """The values Helm merges from the chart's defaults and the two required settings."""
    return merged_values(
        CHART, ["--set", "registry=cr.example.com/metax", "--set", "driver.payload.version=2.32.0.6"], str(BIN / "helm3")
    )


def test_every_crd_field_survives_an_unrelated_upgrade_and_yields_to_a_values_change(client, defaults, capsys):
    crd = client.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", contract.CRD_NAME)
    schema = bootstrap.spec_schema(crd)
    # The product manual's spellings are the CR's only to refuse or check (tests/chart/test_seed_spellings.py).
    seed = {".".join(path) for path in contract.SEED_SPELLINGS}
    matrix = {field: sample(field, node) for field, node in fields(schema).items() if field not in seed}
    assert len(matrix) > 60  # every component's fields, not a handful

    def run(values: dict) -> bootstrap.Merge:
        return bootstrap.bootstrap(client, values, "metax")[1]

    for field, case in matrix.items():
        base = defaults
        for key, value in case["base"].items():
            base = put(base, key, value)
        other = "gpuDevice.healthyInterval" if field != "gpuDevice.healthyInterval" else "driver.payload.version"
        unrelated = put(base, other, 9 if other.endswith("Interval") else "2.32.0.7")
        run(base)
        client.patch(*CR, {"spec": put({}, field, case["edit"])}, field_manager="kubectl-edit")
        assert get(client.get(*CR)["spec"], field) == case["edit"], field

        merge = run(unrelated)  # an upgrade that leaves the field alone
        live = client.get(*CR)["spec"]
        assert get(live, field) == case["edit"], f"spec.{field}: the run-time edit was lost"
        assert get(live, other) == get(unrelated, other), f"spec.{other}: the values were not applied"
        if get(unrelated, field) not in (None, case["edit"]):
            assert any(c.field.startswith(f"spec.{field}") for c in merge.kept), f"spec.{field}: kept but not said"

        changed = put(unrelated, field, case["values"])  # an upgrade that changes it
        merge = run(changed)
        assert get(client.get(*CR)["spec"], field) == case["values"], f"spec.{field}: the values did not win"
        overridden = [c for c in merge.overridden if c.field.startswith(f"spec.{field}")]
        assert bool(overridden) == (case["edit"] != case["values"]), (field, merge.overridden)

    # each override is an Event on the CR, as `kubectl describe clusteroperator` lists them
    events = client.list("v1", "Event", "default", field_selector=f"involvedObject.name={contract.CR_NAME}")
    said = {e["message"] for e in events if e["reason"] == "ValuesOverrodeEdit"}
    expected = {f for f, c in matrix.items() if c["edit"] != c["values"]}
    assert {f for f in expected if any(m.startswith(f"spec.{f}") for m in said)} == expected


def test_the_hook_says_what_it_kept_and_overrode_and_refuses_an_invalid_merge(client, defaults, control_plane, tmp_path, capsys):
    def hook(values: dict) -> tuple[int, list[str]]:
        path = tmp_path / "values.json"
        path.write_text(json.dumps(values))
        capsys.readouterr()
        code = cli.main(["bootstrap", "--release", "metax", "--values", str(path), "--kubeconfig", str(control_plane.kubeconfig)])
        out, err = capsys.readouterr()
        return code, (out + err).splitlines()

    rollout = put(defaults, "driver.upgradePolicy.upgradeSteps", [{"replicas": "100%"}])
    assert hook(rollout)[0] == 0
    client.patch(*CR, {"spec": {"driver": {"payload": {"version": "2.33.0.1"}}}}, field_manager="kubectl-edit")
    code, lines = hook(put(rollout, "gpuDevice.healthyInterval", 9))
    assert (
        code == 0
        and ('bootstrap: spec.driver.payload.version kept at "2.33.0.1" (changed at run time; the values did not change it)')
        in lines
    )
    code, lines = hook(put(put(rollout, "gpuDevice.healthyInterval", 9), "driver.payload.version", "2.34.0.1"))
    assert (
        code == 0
        and (
            'bootstrap: spec.driver.payload.version set from "2.33.0.1" to "2.34.0.1" by the values (a run-time edit overridden)'
        )
        in lines
    )

    # steps removed at run time, then values that turn the rollout on: refused, nothing written
    client.patch(*CR, {"spec": {"driver": {"upgradePolicy": {"upgradeSteps": []}}}}, field_manager="kubectl-edit")
    before = client.get(*CR)["metadata"]["resourceVersion"]
    code, lines = hook(put(put(rollout, "gpuDevice.healthyInterval", 9), "driver.upgradePolicy.enableRollout", True))
    assert code == 1 and lines == [
        "error: spec.driver.upgradePolicy.upgradeSteps: is empty while enableRollout is true; add at least one step, "
        'the last with replicas: "100%" (this upgrade keeps the run-time edits of spec.driver.upgradePolicy.upgradeSteps: '
        "set them in the values, or change them with kubectl first)"
    ]
    assert client.get(*CR)["metadata"]["resourceVersion"] == before
