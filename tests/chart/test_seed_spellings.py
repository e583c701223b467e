"""The product manual's spellings of two options (seed table 3.1 `vfio-manager`, §3.1
`driver.enableRollout`): the chart renders exactly what the chart's keys render, under Helm 3 and 4;
`seed_spellings.normalise` (validate, the hooks) reads them the same way; the ClusterOperator admits
the seed's enableRollout only where it agrees and refuses a whole component in the seed's spelling,
with validate's lines (the API server's half: tests/chart/test_admission.py, which runs the cases of
tests/data/bad_values.yaml).
"""

from __future__ import annotations

import json
import re

import pytest

from metax_operator.chart import seed_spellings, validation
from metax_operator.chart.schema import load_values_defaults
from metax_operator.contract import HOOK_VALUES_KEY, SEED_SPELLINGS
from tests.chart.test_admission import client, live_cr, patch, spec_schema  # noqa: F401 - fixtures used by name
from tests.helm import (
    CHART,
    helm_bin,  # noqa: F401 - fixture
    render_chart,
)

BASE = {"registry": "cr.example.com/metax", "driver": {"payload": {"version": "2.32.0.6"}}}
STEPS = {"upgradeSteps": [{"replicas": 1, "pauseDuration": {}}, {"replicas": "100%"}]}
INCLUDE = '{{- include "metax-operator.seedSpellings" . -}}'
COMMENT = re.compile(r"\A\{\{- /\*.*?\*/\}\}\n", re.S)  # a generated template's heading
# Each pair: the seed's spelling and the chart's, over BASE.
PAIRS = {
    "vfio-manager off": ({"vfio-manager": {"deploy": False}}, {"vfioManager": {"deploy": False}}),
    "vfio-manager's vfioConfig and log": (
        {"vfio-manager": {"vfioConfig": [{"nodeName": "worknode\\d+", "gpus": "0,1,2"}], "log": {"level": "debug"}}},
        {"vfioManager": {"vfioConfig": [{"nodeName": "worknode\\d+", "gpus": "0,1,2"}], "log": {"level": "debug"}}},
    ),
    "driver.enableRollout": (
        {"driver": {"enableRollout": True, "upgradePolicy": STEPS}},
        {"driver": {"upgradePolicy": {"enableRollout": True, **STEPS}}},
    ),
}


def merged(*trees: dict) -> dict:
    out: dict = {}
    for tree in trees:
        for key, value in tree.items():
            out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def hook_values(objects: list[dict]) -> dict:
    """The values the chart hands its hooks (the hook values ConfigMap)."""
    (configmap,) = [o for o in objects if o["kind"] == "ConfigMap" and HOOK_VALUES_KEY in (o.get("data") or {})]
    return json.loads(configmap["data"][HOOK_VALUES_KEY])


@pytest.mark.parametrize("pair", PAIRS, ids=list(PAIRS))
def test_the_seed_spelling_renders_what_the_chart_key_renders(pair, helm_bin):
    seed, ours = PAIRS[pair]
    with_seed = render_chart(merged(BASE, seed), helm=helm_bin)
    with_ours = render_chart(merged(BASE, ours), helm=helm_bin)
    given = hook_values(with_seed)
    assert seed_spellings.normalise(given).values == seed_spellings.normalise(hook_values(with_ours)).values
    assert [notice.field for notice in seed_spellings.normalise(given).notices] == [
        ".".join(path) for path in SEED_SPELLINGS if any(path[0] == key for key in seed)
    ]
    others = [o for o in with_seed if HOOK_VALUES_KEY not in (o.get("data") or {})]
    assert others == [o for o in with_ours if HOOK_VALUES_KEY not in (o.get("data") or {})]


def test_every_template_reads_the_seed_spellings_first():
    """Helm renders the templates in an order of its own over one .Values: each template begins
    with the normalisation, so whichever comes first sees the chart's keys."""
    templates = [p for p in (CHART / "templates").rglob("*") if p.is_file() and not p.name.startswith("_")]
    assert templates
    late = [p for p in templates if INCLUDE not in "\n".join(COMMENT.sub("", p.read_text()).splitlines(keepends=True)[:1])]
    assert [str(p.relative_to(CHART)) for p in late] == []


# --- seed_spellings.normalise and cr_problems ----------------------------------------------------

DEFAULTS = load_values_defaults(CHART)


def values(*trees: dict) -> dict:
    """Values as Helm merges them: the chart's values.yaml under `trees`."""
    return merged(DEFAULTS, BASE, *trees)


def test_a_seed_leaf_over_a_default_is_read_as_the_chart_key():
    spelled = seed_spellings.normalise(values({"vfio-manager": {"deploy": False, "log": {"level": "debug"}}}), DEFAULTS)
    assert spelled.errors == []
    assert "vfio-manager" not in spelled.values
    assert spelled.values["vfioManager"]["deploy"] is False
    assert spelled.values["vfioManager"]["log"] == {"level": "debug", "format": "text"}
    assert [str(n) for n in spelled.notices] == [
        "vfio-manager: is the product manual's spelling of vfioManager and is read as it; write vfioManager"
    ]


def test_both_spellings_with_different_given_values_are_refused_naming_both():
    spelled = seed_spellings.normalise(
        values({"driver": {"enableRollout": False, "upgradePolicy": {"enableRollout": True}}}), DEFAULTS
    )
    assert [str(e) for e in spelled.errors] == [
        "driver.enableRollout: is false but driver.upgradePolicy.enableRollout is true; they are one option "
        "(driver.enableRollout is the product manual's spelling of driver.upgradePolicy.enableRollout): "
        "set only driver.upgradePolicy.enableRollout"
    ]


def test_without_defaults_every_value_of_the_chart_key_counts_as_given():
    """The hooks read values the chart has normalised already: the two spellings agree there."""
    given = values({"vfio-manager": {"deploy": False}})
    assert [e.field for e in seed_spellings.normalise(given).errors] == ["vfio-manager.deploy"]
    agreeing = values({"vfio-manager": {"deploy": False}, "vfioManager": {"deploy": False}})
    assert seed_spellings.normalise(agreeing).errors == []


def test_values_without_the_seed_spellings_are_left_as_they_are():
    spelled = seed_spellings.normalise(values(), DEFAULTS)
    assert (spelled.values, spelled.notices, spelled.errors) == (values(), [], [])


@pytest.mark.parametrize(
    "spec, expected",
    [
        ({"driver": {"enableRollout": True, "upgradePolicy": {"enableRollout": True}}}, []),
        (
            {"driver": {"enableRollout": True, "upgradePolicy": {"enableRollout": False}}},
            [
                "driver.enableRollout: is true but driver.upgradePolicy.enableRollout is false; they are one option "
                "(driver.enableRollout is the product manual's spelling of driver.upgradePolicy.enableRollout): "
                "set only driver.upgradePolicy.enableRollout"
            ],
        ),
        (
            {"vfio-manager": {"deploy": False}, "vfioManager": {"deploy": False}},
            [
                "vfio-manager: is the product manual's spelling of vfioManager, which this spec holds already; "
                "write its fields under vfioManager (kubectl edit clusteroperators cluster-operator)"
            ],
        ),
    ],
)
def test_the_cr_admits_the_seed_spelling_only_where_it_agrees(spec, expected):
    assert [str(e) for e in seed_spellings.cr_problems(spec)] == expected


def test_the_runner_reports_the_cr_s_seed_spellings_under_spec():
    spec = merged(BASE, {"driver": {"enableRollout": True, "upgradePolicy": {"enableRollout": False}}})
    fields = [e.field for e in validation.cr_spec_problems(spec)]
    assert fields[0] == "spec.driver.enableRollout"


# --- the API server: the CRD's rules and the warn policy ----------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize(
    "operations, answer",
    [
        (
            [{"op": "add", "path": "/spec/driver/enableRollout", "value": True}],
            "driver.enableRollout: is true but driver.upgradePolicy.enableRollout is false; they are one option "
            "(driver.enableRollout is the product manual's spelling of driver.upgradePolicy.enableRollout): "
            "set only driver.upgradePolicy.enableRollout",
        ),
        (
            [{"op": "add", "path": "/spec/vfio-manager", "value": {"deploy": False}}],
            "vfio-manager: is the product manual's spelling of vfioManager, which this spec holds already; "
            "write its fields under vfioManager (kubectl edit clusteroperators cluster-operator)",
        ),
    ],
    ids=["enableRollout disagreeing", "vfio-manager"],
)
def test_the_api_server_refuses_the_seed_spelling_naming_the_chart_key(operations, answer, control_plane, client, live_cr):
    result = patch(control_plane, operations)
    assert result.returncode == 1 and 'status="422 Unprocessable Entity"' in result.stderr, result.stderr
    assert answer in result.stderr


@pytest.mark.e2e
def test_the_api_server_admits_an_agreeing_seed_spelling_with_a_warning(control_plane, client, live_cr):
    value = live_cr["spec"]["driver"]["upgradePolicy"]["enableRollout"]
    result = patch(control_plane, [{"op": "add", "path": "/spec/driver/enableRollout", "value": value}])
    try:
        assert result.returncode == 0, result.stderr
        warnings = [line for line in result.stderr.splitlines() if line.startswith("Warning: ")]
        assert [w.split("-warnings': ")[-1] for w in warnings] == [
            "driver.enableRollout: is the product manual's spelling of driver.upgradePolicy.enableRollout, "
            "which decides; write driver.upgradePolicy.enableRollout"
        ], result.stderr
    finally:
        patch(control_plane, [{"op": "remove", "path": "/spec/driver/enableRollout"}])
