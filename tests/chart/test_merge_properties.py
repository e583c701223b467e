"""Properties of the podTemplateSpec merge over generated inputs (hypothesis)."""

from hypothesis import given
from hypothesis import strategies as st

from metax_operator.chart.merge import SchedulingInputs, merge_scheduling, merge_values

small_text = st.sampled_from(["a", "b", "gpu", "node-role", "node-type", "zone", ""])
tolerations = st.lists(
    st.fixed_dictionaries(
        {"key": small_text},
        optional={
            "operator": st.sampled_from(["Equal", "Exists"]),
            "value": small_text,
            "effect": st.sampled_from(["NoSchedule", "NoExecute"]),
            "tolerationSeconds": st.integers(0, 3),
        },
    ),
    max_size=4,
)
node_selector = st.dictionaries(small_text, small_text, max_size=4)
json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2) | small_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(small_text, inner, max_size=3),
    max_leaves=12,
)
affinity = st.dictionaries(st.sampled_from(["nodeAffinity", "podAffinity", "podAntiAffinity"]), json_value, max_size=2)
scheduling = st.fixed_dictionaries({}, optional={"nodeSelector": node_selector, "affinity": affinity, "tolerations": tolerations})
pod_template_spec = st.none() | st.builds(lambda spec: {"spec": spec}, scheduling)
component = st.sampled_from(["gpuLabel", "runtime", "driver", "maca", "gpuDevice", "exporter", "vfioManager"])
all_inputs = st.builds(SchedulingInputs, component, scheduling, pod_template_spec, pod_template_spec, st.none() | tolerations)


def custom_spec(inputs: SchedulingInputs) -> dict:
    """What the rules say custom is: the component's spec if non-empty, else the global one."""
    chosen = inputs.component_pts if inputs.component_pts and inputs.component_pts["spec"] else inputs.global_pts
    return (chosen or {}).get("spec", {})


@given(all_inputs)
def test_merging_the_result_again_changes_nothing(inputs):
    result, _ = merge_scheduling(inputs)
    again, _ = merge_scheduling(inputs._replace(base=result))
    assert again == result


@given(json_value, json_value)
def test_merge_values_is_idempotent_on_any_json(base, custom):
    once = merge_values(base, custom)
    assert merge_values(once, custom) == once


@given(all_inputs, pod_template_spec)
def test_a_component_podtemplatespec_replaces_the_global_one_wholly(inputs, other_global):
    if not (inputs.component_pts and inputs.component_pts["spec"]):
        inputs = inputs._replace(component_pts={"spec": {"nodeSelector": {"pool": "gpu"}}})
    assert merge_scheduling(inputs)[0] == merge_scheduling(inputs._replace(global_pts=other_global))[0]


@given(all_inputs)
def test_no_toleration_is_lost(inputs):
    result, _ = merge_scheduling(inputs)
    custom = custom_spec(inputs).get("tolerations")
    wanted = inputs.base.get("tolerations", []) + (custom if custom is not None else inputs.deprecated_tolerations or [])
    assert all(item in result.get("tolerations", []) for item in wanted)


@given(all_inputs)
def test_base_list_is_kept_in_order_and_nothing_equal_is_appended(inputs):
    result, _ = merge_scheduling(inputs)
    base = inputs.base.get("tolerations", [])
    merged = result.get("tolerations", [])
    appended = merged[len(base) :]
    assert merged[: len(base)] == base
    assert all(item not in base for item in appended)
    assert all(item not in appended[:i] for i, item in enumerate(appended))


@given(all_inputs)
def test_map_keys_of_custom_win_and_other_base_keys_stay(inputs):
    result, _ = merge_scheduling(inputs)
    custom = custom_spec(inputs).get("nodeSelector") or {}
    base = inputs.base.get("nodeSelector") or {}
    got = result.get("nodeSelector", {})
    assert all(got[key] == value for key, value in custom.items())
    assert all(got[key] == value for key, value in base.items() if key not in custom)
    assert set(got) == set(base) | set(custom)
