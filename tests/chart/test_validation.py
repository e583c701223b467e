"""The Python rules (validation.py) and `metax-operator validate`'s use of Helm, unit by unit.

The same rules under Helm are tested case by case in test_bad_values.py; here each rule's edges,
the CR-spec variant the runner uses, and the parsers of the two ConfigMaps.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from metax_operator import cli
from metax_operator.chart import validation
from metax_operator.chart.problems import regex_problem
from metax_operator.chart.validate import merged_values
from metax_operator.contract import PREREQUISITES
from metax_operator.errors import UserErrors
from tests.chart.test_schema import CHART_ONLY
from tests.helm import BIN, overlay, render_chart

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = yaml.safe_load((ROOT / "values.yaml").read_text())


def values(**changes) -> dict:
    """The default values with a registry and a driver version, plus `changes` merged in."""
    base = overlay(DEFAULTS, {"registry": "cr.example.com/metax", "driver": {"payload": {"version": "2.32.0.6"}}})
    return overlay(base, changes)


def problems(vals: dict) -> list[str]:
    return [str(e) for e in validation.values_problems(vals)]


def fields(vals: dict) -> list[str]:
    return [e.field for e in validation.values_problems(vals)]


def test_defaults_with_registry_and_version_are_valid():
    validation.validate_values(values())


def test_all_problems_are_raised_at_once():
    bad = values(registry="", gpuLabel={"deploy": False})
    with pytest.raises(UserErrors) as raised:
        validation.validate_values(bad)
    assert [e.field for e in raised.value.errors] == [
        "registry",
        "runtime.deploy",
        "driver.deploy",
        "maca.deploy",
        "gpuDevice.deploy",
        "vfioManager.deploy",
    ]


@pytest.mark.parametrize("component, prerequisite", [(c, p) for c, ps in PREREQUISITES.items() for p in ps])
def test_each_prerequisite(component, prerequisite):
    vals = values(**{component: {"deploy": True}, prerequisite: {"deploy": False}})
    assert str(validation.dependency_problem(component, prerequisite)) in problems(vals)
    vals = values(**{component: {"deploy": False}, prerequisite: {"deploy": False}})
    assert f"{component}.deploy" not in fields(vals)


def test_payload_version_required_unless_never_or_driver_off():
    assert "driver.payload.version" in fields(values(driver={"payload": {"version": ""}}))
    assert fields(values(driver={"payload": {"version": ""}, "deployPolicy": "Never"})) == []
    assert fields(values(driver={"payload": {"version": ""}, "deploy": False}, exporter={"deploy": False})) == []


def test_upgrade_policy_problems_come_from_policy_module():
    vals = values(
        driver={
            "upgradePolicy": {"enableRollout": True, "upgradeSteps": [{"replicas": 5}, {"replicas": 2}, {"replicas": "100%"}]}
        }
    )
    assert fields(vals) == ["driver.upgradePolicy.upgradeSteps[1].replicas"]


def test_seed_rollout_policy_with_pause_steps_is_valid():
    policy = {
        "enableRollout": True,
        "upgradeSteps": [
            {"replicas": 2, "pause": None},
            {"replicas": 5, "pauseDuration": 10000},
            {"replicas": 8, "pauseDuration": 10000},
            {"replicas": "100%", "pause": None},
        ],
        "maxParallel": "50%",
        "maxFailureThreshold": 3,
    }
    assert problems(values(driver={"upgradePolicy": policy})) == []


@pytest.mark.parametrize("pattern", [r"worknode\d+", r"\pL+", r"[[:alpha:]]+-\d", "gpu-(a|b)", "node1"])
def test_re2_patterns_accepted(pattern):
    assert regex_problem(pattern) is None


@pytest.mark.parametrize(
    "pattern, why",
    [
        ("worknode(", "missing )"),
        (r"node(?=1)", "invalid perl operator"),  # lookahead: Python's re accepts it, Go does not
        (r"(?<!x)node", "invalid perl operator"),  # lookbehind
        (r"(a)\1", "invalid escape sequence"),  # backreference
        ("*node", "no argument for repetition operator"),
    ],
)
def test_regexes_go_refuses_are_refused(pattern, why):
    assert why in regex_problem(pattern)


def test_vfio_gpus_duplicates_named_in_order():
    vals = values(vfioManager={"vfioConfig": [{"nodeName": "n1", "gpus": "3,1,3,1,2"}]})
    assert problems(vals) == ["vfioManager.vfioConfig[0].gpus: lists GPU 3, 1 more than once; list each GPU index once"]


@given(st.lists(st.integers(min_value=0, max_value=15), min_size=1, max_size=12))
def test_gpu_list_is_valid_exactly_when_no_index_repeats(gpus):
    entry = [{"nodeName": "worknode1", "gpus": ",".join(map(str, gpus))}]
    assert (validation.vfio_config_problems(entry, "v") == []) == (len(set(gpus)) == len(gpus))


@pytest.mark.parametrize(
    "service, field",
    [
        ({"type": "ClusterIP", "port": 9400}, "exporter.service.port"),
        ({"type": "ExternalName"}, "exporter.service.externalName"),
        ({"type": "LoadBalancer", "externalName": "x.example.com"}, "exporter.service.externalName"),
    ],
)
def test_service_rules(service, field):
    assert fields(values(exporter={"deploy": True, "service": service})) == [field]


@pytest.mark.parametrize(
    "service",
    [
        {"type": "NodePort", "port": 30400},
        {"type": "LoadBalancer", "port": 9400},
        {"type": "ExternalName", "externalName": "metrics.example.com"},
        {"type": "ClusterIP"},
    ],
)
def test_service_accepted(service):
    assert fields(values(exporter={"deploy": True, "service": service})) == []


SEED_TOLERATIONS_FILE = """tolerations:
  - key: "key1"
    operator: "Equal"
    value: "value1"
    effect: "NoSchedule"
  - key: "key2"
    operator: "Equal"
    value: "value1"
    effect: "NoExecute"
"""


@pytest.mark.parametrize("text", [SEED_TOLERATIONS_FILE, "- {key: a, operator: Exists}\n", ""])
def test_deprecated_tolerations_file_shapes_accepted(text):
    assert problems(values(tolerations=text)) == []


@pytest.mark.parametrize(
    "text, field",
    [
        ("other: [1]\n", "tolerations"),
        ("tolerations: [{key: a, operator: Matches}]\n", "tolerations[0].operator"),
        ("- key: a\n  effect: Never\n", "tolerations[0].effect"),
        ("- [not, a, mapping]\n", "tolerations[0]"),
    ],
)
def test_deprecated_tolerations_file_problems(text, field):
    assert fields(values(tolerations=text)) == [field]


def test_driver_config_checked_like_the_configmap():
    config = {
        "nodeVfnums": {"node-a": {"vfnum": 0}},
        "moduleParams": {"xcore_page_size": "10"},
        "nodeModuleParams": {"Node_B": {"gpu_model": "x"}},
    }
    assert sorted(fields(values(driver={"config": config}))) == [
        "driver.config.moduleParams.xcore_page_size",
        "driver.config.nodeModuleParams.Node_B",
        "driver.config.nodeVfnums.node-a.vfnum",
    ]


# --- the CR spec, as the runner checks it ---------------------------------------------------------


def cr_spec(**changes) -> dict:
    spec = {k: copy.deepcopy(v) for k, v in values(**changes).items() if k not in CHART_ONLY}
    for component in ("gpuLabel", "runtime", "driver", "maca", "gpuDevice", "exporter", "vfioManager"):
        spec[component].pop("image"), spec[component].pop("resources")
    spec["exporter"].pop("serviceMonitor")
    spec["exporter"]["service"].pop("port")  # null: the API server prunes it
    return spec


def test_cr_spec_valid_and_problems_named_under_spec():
    validation.validate_cr_spec(cr_spec())
    spec = cr_spec(gpuLabel={"deploy": False}, vfioManager={"vfioConfig": [{"nodeName": "a(?=b)", "gpus": "1"}]})
    names = [e.field for e in validation.cr_spec_problems(spec)]
    assert "spec.runtime.deploy" in names and "spec.vfioManager.vfioConfig[0].nodeName" in names
    assert all(name.startswith("spec.") for name in names)


# --- the two ConfigMaps ---------------------------------------------------------------------------


def test_parse_seed_driver_config():
    assert validation.parse_node_vfnums(
        "nodes:\n  sample-node:\n    vfnum: 4\n  sample-node2:\n    vfnum: 2\n  foo:\n    vfnum: 2\n"
    ) == {"sample-node": 4, "sample-node2": 2, "foo": 2}
    assert validation.parse_module_params("xcore_page_size: 10\n") == {"xcore_page_size": 10}
    assert validation.parse_node_module_params("sample-node1:\n  xcore_page_size: 12\n") == {
        "sample-node1": {"xcore_page_size": 12}
    }
    assert validation.parse_node_vfnums("") == {} and validation.parse_module_params(None) == {}


@pytest.mark.parametrize(
    "parse, text, field",
    [
        (validation.parse_node_vfnums, "nodes:\n  n1:\n    vfnum: 17\n", "configmap/driver-config[node-vfnums].nodes.n1.vfnum"),
        (validation.parse_node_vfnums, "n1:\n  vfnum: 2\n", "configmap/driver-config[node-vfnums]"),
        (validation.parse_node_vfnums, "nodes: [", "configmap/driver-config[node-vfnums]"),
        (validation.parse_module_params, "xcore_page_size: -1\n", "configmap/driver-config[module-params].xcore_page_size"),
        (validation.parse_module_params, "page_size: 4\n", "configmap/driver-config[module-params].page_size"),
        (
            validation.parse_node_module_params,
            "n1:\n  gpu_model: 3\n",
            "configmap/driver-config[node-module-params].n1.gpu_model",
        ),
        (validation.parse_vfio_config, "- nodeName: 'a('\n  gpus: all\n", "configmap/metax-vfio-config[0].nodeName"),
        (validation.parse_vfio_config, "- nodeName: a\n  gpus: '1,1'\n", "configmap/metax-vfio-config[0].gpus"),
    ],
)
def test_configmap_problems_name_the_key(parse, text, field):
    with pytest.raises(UserErrors) as raised:
        parse(text)
    assert [e.field for e in raised.value.errors] == [field]


def test_a_vfnum_of_0_in_driver_config_says_how_to_stop_virtualising():
    """Seed §3.2.6 edits driver-config in place and gives no range; its label's "0" means no VFs."""
    with pytest.raises(UserErrors) as raised:
        validation.parse_node_vfnums("nodes:\n  foo:\n    vfnum: 0\n")
    assert [str(e) for e in raised.value.errors] == [
        "configmap/driver-config[node-vfnums].nodes.foo.vfnum: 0 is out of range; use an integer from 1 to 16,"
        " or remove the node's entry to stop virtualising it"
    ]


def test_rendered_configmaps_parse_back_to_the_values():
    """What the chart renders into driver-config and metax-vfio-config is what the parsers read."""
    config = {
        "nodeVfnums": {"sample-node": {"vfnum": 4}},
        "moduleParams": {"xcore_page_size": 10},
        "nodeModuleParams": {"sample-node1": {"xcore_page_size": 12}},
    }
    vfio = [{"nodeName": "worknode1", "gpus": "0,1,2"}, {"nodeName": r"worknode\d+", "gpus": "all"}]
    objects = render_chart(
        {
            "registry": "r.example/metax",
            "driver": {"payload": {"version": "1.0.0"}, "config": config},
            "vfioManager": {"vfioConfig": vfio},
        }
    )
    maps = {o["metadata"]["name"]: o["data"] for o in objects if o["kind"] == "ConfigMap"}
    driver = maps["driver-config"]
    assert validation.parse_node_vfnums(driver["node-vfnums"]) == {"sample-node": 4}
    assert validation.parse_module_params(driver["module-params"]) == {"xcore_page_size": 10}
    assert validation.parse_node_module_params(driver["node-module-params"]) == {"sample-node1": {"xcore_page_size": 12}}
    assert validation.parse_vfio_config(maps["metax-vfio-config"]["config"]) == vfio


# --- Helm merges the values for `validate` ------------------------------------------------------

HELM = str(BIN / "helm3")


def test_helm_merges_files_and_every_set_flag_in_its_own_order(tmp_path):
    first = tmp_path / "a.yaml"
    first.write_text("registry: one\ndriver:\n  payload:\n    version: '1'\npriorityClassName: null\n")
    second = tmp_path / "b.yaml"
    second.write_text("registry: two\n")
    tolerations = tmp_path / "t.yaml"
    tolerations.write_text(SEED_TOLERATIONS_FILE)
    merged = merged_values(
        ROOT,
        [
            "--values",
            str(first),
            "--values",
            str(second),
            "--set",
            "vfioManager.vfioConfig[1].gpus=all",
            "--set-string",
            "driver.payload.version=2.32",
            "--set-json",
            'driver.upgradePolicy.upgradeSteps=[{"replicas": "100%"}]',
            "--set-literal",
            "commonAnnotations.note=a,b\\c",
            "--set-file",
            f"tolerations={tolerations}",
        ],
        HELM,
    )
    assert merged["registry"] == "two"
    assert merged["driver"]["payload"] == {"name": "driver-image", "version": "2.32", "registry": "", "digest": ""}
    assert merged["driver"]["upgradePolicy"]["upgradeSteps"] == [{"replicas": "100%"}]
    assert merged["commonAnnotations"] == {"note": "a,b\\c"}
    assert "priorityClassName" not in merged
    assert merged["vfioManager"]["vfioConfig"] == [None, {"gpus": "all"}]
    assert merged["tolerations"] == SEED_TOLERATIONS_FILE


def test_an_index_helm_refuses_is_refused_at_once(capsys):
    """Regression: validate's own --set parser built a list of 100 million items (1.6 GB) for
    `a[99999999]=1`; Helm refuses indexes over 65536."""
    assert cli.main(["validate", "--helm", HELM, "--set", "a[99999999]=1"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: helm: failed parsing --set data: index of 99999999 is greater than maximum supported index "
        "of 65536; fix the values or flags Helm names"
    ]


def test_without_helm_validate_says_how_to_get_it(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("HELM_BIN", raising=False)
    assert cli.main(["validate"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: helm: is not on PATH; install Helm 3 (3.18 or later) or Helm 4, or pass --helm PATH (or set $HELM_BIN)"
    ]
    monkeypatch.setenv("HELM_BIN", str(tmp_path / "helm"))
    assert cli.main(["validate"]) == 1
    assert capsys.readouterr().err.startswith(f"error: $HELM_BIN: {tmp_path / 'helm'} is not an executable file")


def test_helm_bin_is_the_helm_validate_runs(capsys, monkeypatch):
    monkeypatch.setenv("HELM_BIN", str(BIN / "helm4"))
    assert (
        cli.main(["validate", "--set", "registry=cr.example.com/metax", "--set-string", "driver.payload.version=2.32.0.6"]) == 0
    )
    assert capsys.readouterr().out == "values are valid\n"


@pytest.mark.parametrize("helm", ["helm3", "helm4"])
def test_helm_refusals_become_one_line_each_naming_the_field(helm, tmp_path):
    """What `validate` shows when the chart's render refuses values the Python checks let through:
    Helm's real output, its schema lines with the field in our spelling, the chart's rules as they are."""
    from metax_operator.chart.validate import helm_problems

    def stderr(*flags: str) -> str:
        result = subprocess.run([BIN / helm, "template", "metax", ROOT, *flags], capture_output=True, text=True)
        assert result.returncode == 1
        return result.stderr

    schema = helm_problems(
        stderr("--set", "driver.deployPolicy=Sometimes", "--set", "driver.upgradePolicy.upgradeSteps[0].replicas=abc")
    )
    assert {e.field for e in schema} >= {"driver.deployPolicy", "driver.upgradePolicy.upgradeSteps[0].replicas"}
    rules = helm_problems(stderr("--set", "driver.payload.version=v1", "--set", "gpuLabel.deploy=false"))
    assert sorted(str(e) for e in rules) == sorted(
        ["registry: is required; set it to DOMAIN/PROJECT, e.g. --set registry=cr.example.com/metax"]
        + [
            str(validation.dependency_problem(c, "gpuLabel"))
            for c, ps in PREREQUISITES.items()
            if "gpuLabel" in ps and c != "exporter"
        ]
    )  # the exporter is off by default
    [other] = helm_problems(stderr("--set", "a[99999999]=1"))
    assert other.field == "helm" and "greater than maximum supported index" in other.problem
