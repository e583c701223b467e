"""The podTemplateSpec merge against the acceptance cases (seed 000 §3.2.4-3.2.5) and its errors."""

import pytest

from metax_operator.chart.merge import SchedulingInputs, inputs_from_annotations, merge_scheduling
from metax_operator.contract import (
    COMPONENT_ANNOTATION,
    GPU_NODE_LABEL,
    POOL_LABEL,
    SCHEDULING_BASE_ANNOTATION,
    SCHEDULING_INPUTS_ANNOTATION,
)
from metax_operator.errors import UserError, UserErrors
from tests.cases import MERGE_CASES

CASES = MERGE_CASES


def inputs(case: dict, component: str = "maca") -> SchedulingInputs:
    return SchedulingInputs(
        component=component,
        base=case["base"],
        global_pts=case.get("global"),
        component_pts=case.get("component"),
        deprecated_tolerations=case.get("deprecatedTolerations"),
    )


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_acceptance_case(case):
    result, _ = merge_scheduling(inputs(case))
    assert result == case["expect"]


def test_seed_example_both_components():
    global_pts = {
        "spec": {"tolerations": [{"key": "node-type", "operator": "Equal", "value": "general", "effect": "NoSchedule"}]}
    }
    maca_pts = {"spec": {"tolerations": [{"key": "node-type", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}]}}
    role = lambda value, effect: {  # noqa: E731
        "tolerations": [
            {
                "key": "node-role",
                "operator": "Equal",
                "value": value,
                "effect": effect,
            }
        ]
    }
    maca, _ = merge_scheduling(SchedulingInputs("maca", role("maca", "NoSchedule"), global_pts, maca_pts))
    driver, _ = merge_scheduling(SchedulingInputs("driver", role("driver", "NoExecute"), global_pts, None))
    assert [(t["key"], t["value"]) for t in maca["tolerations"]] == [("node-role", "maca"), ("node-type", "gpu")]
    assert [(t["key"], t["value"]) for t in driver["tolerations"]] == [("node-role", "driver"), ("node-type", "general")]


def test_empty_component_podtemplatespec_does_not_replace_the_global_one():
    # values.yaml defaults every component's podTemplateSpec to {}: that must not mean "defined".
    result, _ = merge_scheduling(SchedulingInputs("driver", {}, {"spec": {"nodeSelector": {"zone": "a"}}}, {}))
    assert result == {"nodeSelector": {"zone": "a"}}


def test_deprecated_tolerations_fill_in_with_a_notice_naming_the_replacement():
    _, notices = merge_scheduling(SchedulingInputs("driver", {}, None, None, [{"key": "k", "operator": "Exists"}]))
    assert len(notices) == 1 and "tolerations is deprecated" in notices[0]
    assert "podTemplateSpec.spec.tolerations" in notices[0]


def test_deprecated_tolerations_ignored_with_a_notice_when_custom_sets_tolerations():
    custom = {"spec": {"tolerations": [{"key": "a", "operator": "Exists"}]}}
    result, notices = merge_scheduling(
        SchedulingInputs("maca", {}, None, custom, [{"key": "b", "operator": "Exists"}]), prefix="spec."
    )
    assert result == {"tolerations": [{"key": "a", "operator": "Exists"}]}
    assert "ignored for maca" in notices[0] and "spec.maca.podTemplateSpec.spec.tolerations win" in notices[0]


def test_affinity_maps_merge_deeply_and_lists_inside_append():
    term = lambda key: {"matchExpressions": [{"key": key, "operator": "Exists"}]}  # noqa: E731
    base = {
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term("gpu")]}}}
    }
    custom = {
        "spec": {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term("gpu"), term("zone")]}
                },
                "podAntiAffinity": {"x": "y"},
            }
        }
    }
    result, _ = merge_scheduling(SchedulingInputs("maca", base, custom))
    terms = result["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [term("gpu"), term("zone")]
    assert result["affinity"]["podAntiAffinity"] == {"x": "y"}


@pytest.mark.parametrize(
    "pts, field",
    [
        ({"spec": {"containers": []}}, "maca.podTemplateSpec.spec.containers"),
        ({"metadata": {"labels": {"a": "b"}}}, "maca.podTemplateSpec.metadata"),
        ({"spec": {"nodeSelector": {"n": 1}}}, "maca.podTemplateSpec.spec.nodeSelector"),
        ({"spec": {"tolerations": {"key": "a"}}}, "maca.podTemplateSpec.spec.tolerations"),
        ({"spec": {"affinity": ["x"]}}, "maca.podTemplateSpec.spec.affinity"),
        ({"spec": "nodeSelector"}, "maca.podTemplateSpec.spec"),
        ("yes", "maca.podTemplateSpec"),
    ],
)
def test_malformed_component_podtemplatespec_is_refused_naming_the_field(pts, field):
    with pytest.raises(UserError) as err:
        merge_scheduling(SchedulingInputs("maca", {}, None, pts))
    assert err.value.field == field and err.value.fix


def test_every_malformed_input_is_reported_at_once_with_the_cr_prefix():
    with pytest.raises(UserErrors) as err:
        merge_scheduling(
            SchedulingInputs("driver", {}, {"spec": {"hostNetwork": True}}, {"spec": {"nodeName": "n1"}}, {"key": "a"}),
            prefix="spec.",
        )
    assert [e.field for e in err.value.errors] == [
        "spec.podTemplateSpec.spec.hostNetwork",
        "spec.driver.podTemplateSpec.spec.nodeName",
        "spec.tolerations",
    ]


def test_inputs_read_from_daemonset_annotations():
    annotations = {
        COMPONENT_ANNOTATION: "maca",
        SCHEDULING_BASE_ANNOTATION: '{"tolerations":[{"key":"a"}]}',
        SCHEDULING_INPUTS_ANNOTATION: '{"global":{"spec":{}},"component":null,"tolerations":[{"key":"b"}]}',
    }
    assert inputs_from_annotations(annotations) == SchedulingInputs(
        "maca", {"tolerations": [{"key": "a"}]}, {"spec": {}}, None, [{"key": "b"}]
    )


@pytest.mark.parametrize(
    "change, field",
    [
        ({SCHEDULING_INPUTS_ANNOTATION: "{not json"}, f'metadata.annotations["{SCHEDULING_INPUTS_ANNOTATION}"]'),
        ({SCHEDULING_BASE_ANNOTATION: "[]"}, f'metadata.annotations["{SCHEDULING_BASE_ANNOTATION}"]'),
        ({COMPONENT_ANNOTATION: "gpu"}, f'metadata.annotations["{COMPONENT_ANNOTATION}"]'),
    ],
)
def test_bad_annotation_is_refused_naming_it(change, field):
    annotations = {COMPONENT_ANNOTATION: "maca", SCHEDULING_BASE_ANNOTATION: "{}", SCHEDULING_INPUTS_ANNOTATION: "{}", **change}
    with pytest.raises(UserError) as err:
        inputs_from_annotations(annotations)
    assert err.value.field == field


POOL_TERM = {"matchExpressions": [{"key": POOL_LABEL, "operator": "DoesNotExist"}]}
POOLED_BASE = {
    "nodeSelector": {GPU_NODE_LABEL: "true"},
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [POOL_TERM]}}},
}


def test_the_bases_required_node_affinity_term_holds_in_every_term_the_custom_adds():
    """The driver DaemonSet beside driver pools requires nodes no pool has: a custom term appended
    as an alternative would let it run on a pool's nodes too."""
    zone = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
    named = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}
    custom = {
        "spec": {
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [zone, named]}}}
        }
    }
    merged, _ = merge_scheduling(SchedulingInputs("driver", POOLED_BASE, None, custom, None))
    terms = merged["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [
        {"matchExpressions": POOL_TERM["matchExpressions"] + zone["matchExpressions"]},
        {**named, "matchExpressions": POOL_TERM["matchExpressions"]},
    ]
    again, _ = merge_scheduling(SchedulingInputs("driver", POOLED_BASE, None, {"spec": merged}, None))
    assert again == merged
    alone, _ = merge_scheduling(SchedulingInputs("driver", POOLED_BASE, None, None, None))
    assert alone == POOLED_BASE


def test_the_runners_pool_label_in_a_node_selector_is_refused_by_name():
    custom = {"spec": {"nodeSelector": {POOL_LABEL: "c500"}}}
    with pytest.raises(UserError) as err:
        merge_scheduling(SchedulingInputs("driver", POOLED_BASE, None, custom, None), prefix="spec.")
    assert str(err.value).startswith(
        f"spec.driver.podTemplateSpec.spec.nodeSelector.{POOL_LABEL}: is the runner's own node label"
    )
