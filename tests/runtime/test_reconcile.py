"""The runner's reconcile core without a cluster: on DaemonSets rendered by the real chart (helm3).

What the runner would apply for a CR, when it must write and when it must not, what it reports.
The same functions run against a real API server in tests/e2e/test_runner.py.
"""

from __future__ import annotations

import copy
import json

import pytest
import urllib3
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes.client.exceptions import ApiException

from metax_operator.chart import daemonset, images
from metax_operator.chart.daemonset import desired_daemonset
from metax_operator.conditions import HEALTHY, Condition, Event, EventType
from metax_operator.contract import COMPONENT_UPDATE_STRATEGY, PAYLOAD_IMAGE_ENV, RUNNER_FIELD_MANAGER
from metax_operator.errors import UserError, UserErrors
from metax_operator.hooks.bootstrap import prune, spec_schema
from metax_operator.rollout import observation
from metax_operator.runtime import cr_status, reconcile
from metax_operator.runtime.cr_status import merge_conditions, transition_events
from metax_operator.runtime.field_ownership import needs_write, owned_fields
from metax_operator.runtime.reconcile import Observed, decide
from tests.helm import CHART, render_chart

T_PASS = 1_767_225_600.0  # 2026-01-01T00:00:00Z: the clock of the passes below

BASE_TOLERATION = {"key": "metax-tech.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
GENERAL = {"key": "node-type", "operator": "Equal", "value": "general", "effect": "NoSchedule"}
GPU = {"key": "node-type", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}
VALUES = {
    "registry": "r.example/metax",
    "driver": {"payload": {"name": "driver-image", "version": "2.32.0.6"}},
    "maca": {"payload": {"images": ["maca-c500:2.18.0.3-ubuntu18.04-amd64"]}},
}


def chart_daemonsets(values: dict) -> dict[str, dict]:
    """The chart's DaemonSets for `values`, by component key, as `helm template` renders them."""
    objects = render_chart(values)
    return {ds["metadata"]["annotations"]["gpu.metax-tech.com/component"]: ds for ds in objects if ds["kind"] == "DaemonSet"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict]:
    """The chart's DaemonSets for VALUES once installed (rendered once): with the components'
    updateStrategy, which the chart leaves to the runner and its first pass sets."""
    daemonsets = chart_daemonsets(VALUES)
    for ds in daemonsets.values():
        ds["spec"].setdefault("updateStrategy", copy.deepcopy(COMPONENT_UPDATE_STRATEGY))
    return daemonsets


def deep_update(tree: dict, changes: dict) -> dict:
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            deep_update(tree[key], value)
        else:
            tree[key] = copy.deepcopy(value)
    return tree


@pytest.fixture(scope="module")
def defaults() -> dict:
    """The CR spec the bootstrap hook writes for VALUES: values.yaml + VALUES, cut to the CRD's spec."""
    values = deep_update(yaml.safe_load((CHART / "values.yaml").read_text()), VALUES)
    crd = yaml.safe_load((CHART / "crds" / "clusteroperators.gpu.metax-tech.com.yaml").read_text())
    return prune(values, spec_schema(crd))


@pytest.fixture(scope="module")
def cr_spec(defaults):
    """cr_spec(**changes): the bootstrap's spec with `changes` merged in (maps deep, lists replaced)."""
    return lambda **changes: deep_update(copy.deepcopy(defaults), changes)


def observed(rendered, spec, daemonsets=None, configmaps=None) -> Observed:
    cr = {"metadata": {"name": "cluster-operator", "generation": 3, "resourceVersion": "10", "uid": "u"}, "spec": spec}
    return Observed("metax-operator", cr, copy.deepcopy(daemonsets if daemonsets is not None else rendered), configmaps or {})


def applied(live: dict, desired: dict) -> dict:
    """`live` after the API server applied `desired` as the runner (values + managedFields)."""
    result = copy.deepcopy(live)
    pod, want = result["spec"]["template"]["spec"], desired["spec"]["template"]["spec"]
    for name, value in want.items():
        if name in ("containers", "initContainers"):
            for item in value:
                target = next(c for c in pod[name] if c["name"] == item["name"])
                for key, sub in item.items():
                    if key == "env":
                        for var in sub:
                            next(e for e in target["env"] if e["name"] == var["name"])["value"] = var["value"]
                    else:
                        target[key] = sub
        else:
            pod[name] = value
    result["metadata"]["managedFields"] = [
        {"manager": RUNNER_FIELD_MANAGER, "operation": "Apply", "fieldsV1": fields_v1(desired)}
    ]
    return result


def fields_v1(obj) -> dict:
    """The fieldsV1 set an apply of `obj` owns (atomic lists and nodeSelector whole, as the API does)."""
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            if key in ("apiVersion", "kind", "metadata"):
                continue
            if isinstance(value, list) and value and all(isinstance(i, dict) and "name" in i for i in value):
                out[f"f:{key}"] = {f'k:{{"name":{json.dumps(i["name"])}}}': {".": {}, **fields_v1(i)} for i in value}
            elif isinstance(value, dict) and key != "nodeSelector":
                out[f"f:{key}"] = fields_v1(value)
            else:
                out[f"f:{key}"] = {}
        return out
    return {}


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


# -- the seed's example (§3.2.5.2) ---------------------------------------------------------------


def test_seed_example_maca_gets_its_own_tolerations_and_driver_the_global_ones(rendered, cr_spec):
    spec = cr_spec(
        podTemplateSpec={"spec": {"tolerations": [GENERAL]}},
        maca={**VALUES["maca"], "podTemplateSpec": {"spec": {"tolerations": [GPU]}}},
    )
    maca, _ = desired_daemonset("maca", rendered["maca"], spec)
    driver, _ = desired_daemonset("driver", rendered["driver"], spec)
    assert pod_spec(maca)["tolerations"] == [BASE_TOLERATION, GPU]
    assert pod_spec(driver)["tolerations"] == [BASE_TOLERATION, GENERAL]
    assert pod_spec(driver)["nodeSelector"] == {"metax-tech.com/gpu.installed": "true"}


def test_deprecated_global_tolerations_apply_to_every_component_without_its_own(rendered, cr_spec):
    old = {"key": "key1", "operator": "Equal", "value": "value1", "effect": "NoSchedule"}
    out = decide(observed(rendered, cr_spec(tolerations=[old])))
    tolerations = {a.body["metadata"]["name"]: pod_spec(a.body)["tolerations"] for a in out.applies}
    assert set(tolerations) == {
        "metax-gpu-label",
        "metax-container-runtime",
        "metax-driver",
        "metax-maca",
        "metax-gpu-device",
        "metax-vfio-manager",
    }
    assert all(t == [BASE_TOLERATION, old] for t in tolerations.values())


# -- when to write ---------------------------------------------------------------------------------


def test_a_cr_equal_to_the_values_needs_no_write(rendered, cr_spec):
    assert decide(observed(rendered, cr_spec())).applies == []


def test_after_a_post_rendered_install_the_first_pass_writes_nothing(rendered, cr_spec):
    spec = cr_spec(podTemplateSpec={"spec": {"tolerations": [GENERAL]}})
    post_rendered = copy.deepcopy(rendered)
    for ds in post_rendered.values():
        pod_spec(ds)["tolerations"] = [BASE_TOLERATION, GENERAL]
    assert decide(observed(rendered, spec, post_rendered)).applies == []


def test_a_second_pass_after_the_apply_writes_nothing(rendered, cr_spec):
    spec = cr_spec(podTemplateSpec={"spec": {"tolerations": [GENERAL], "nodeSelector": {"zone": "a"}}})
    first = decide(observed(rendered, spec))
    assert len(first.applies) == 6
    after = {
        key: applied(ds, next(a.body for a in first.applies if a.body["metadata"]["name"] == ds["metadata"]["name"]))
        if ds["metadata"]["name"] in {a.body["metadata"]["name"] for a in first.applies}
        else ds
        for key, ds in rendered.items()
    }
    assert decide(observed(rendered, spec, after)).applies == []


def test_removing_a_cr_toleration_the_runner_applied_is_written(rendered, cr_spec):
    spec = cr_spec(podTemplateSpec={"spec": {"tolerations": [GENERAL]}})
    desired, _ = desired_daemonset("driver", rendered["driver"], spec)
    live = applied(rendered["driver"], desired)
    back, _ = desired_daemonset("driver", live, cr_spec())
    assert pod_spec(back)["tolerations"] == [BASE_TOLERATION]
    assert needs_write(back, live)


def test_a_node_selector_key_removed_from_the_cr_is_written_even_when_helm_owns_it(rendered, cr_spec):
    """nodeSelector is an atomic map: the live value must equal the desired one, not contain it."""
    live = copy.deepcopy(rendered["driver"])
    pod_spec(live)["nodeSelector"] = {"metax-tech.com/gpu.installed": "true", "zone": "a"}  # post-rendered
    desired, _ = desired_daemonset("driver", live, cr_spec())
    assert needs_write(desired, live)


def test_an_affinity_the_runner_applied_and_the_cr_dropped_is_written(rendered, cr_spec):
    """affinity merges key by key, so the live object still "contains" what is wanted: the write
    is needed because the runner owns a field it no longer wants (the API server then drops it)."""
    affinity = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"a": "b"}}}
            ]
        }
    }
    desired, _ = desired_daemonset("driver", rendered["driver"], cr_spec(podTemplateSpec={"spec": {"affinity": affinity}}))
    live = applied(rendered["driver"], desired)
    back, _ = desired_daemonset("driver", live, cr_spec())
    assert "affinity" not in pod_spec(back)
    assert needs_write(back, live)


@settings(max_examples=60, deadline=None)
@given(
    tolerations=st.lists(
        st.fixed_dictionaries(
            {
                "key": st.sampled_from(["a", "b", "node-type"]),
                "operator": st.just("Equal"),
                "value": st.sampled_from(["x", "y"]),
                "effect": st.sampled_from(["NoSchedule", "NoExecute"]),
            }
        ),
        max_size=4,
    ),
    selector=st.dictionaries(st.sampled_from(["zone", "rack"]), st.sampled_from(["1", "2"]), max_size=2),
    level=st.sampled_from(["debug", "info", "warn", "error"]),
)
def test_applying_what_the_runner_wants_makes_the_next_pass_write_nothing(rendered, tolerations, selector, level, cr_spec):
    spec = cr_spec(
        podTemplateSpec={"spec": {"tolerations": tolerations, "nodeSelector": selector}},
        driver={**VALUES["driver"], "log": {"level": level, "format": "json"}},
    )
    desired, _ = desired_daemonset("driver", rendered["driver"], spec)
    live = applied(rendered["driver"], desired)
    again, _ = desired_daemonset("driver", live, spec)
    assert again == desired and not needs_write(again, live)


# -- a rollback's spec.driver: the inverse of the driver mapping --------------------------------------


def at_template(ds: dict, template: dict) -> dict:
    """`ds` with its pod template set to `template` (what the rollback's strategic patch does)."""
    return {**ds, "spec": {**ds["spec"], "template": copy.deepcopy(template)}}


def test_a_rollback_from_pods_first_met_at_an_older_revision_converges(rendered, cr_spec):
    """Regression: a runner whose first pass finds the pods at an older revision records no
    lastCoDriverSpec for it; a forced rollback then left the CR at the new version, and each pass
    the reconcile re-applied it (re-creating the abandoned revision) and the rollout restored the
    template again, for ever. The CR is now set back to a spec that gives the old template."""
    from metax_operator.chart.upgrade_policy import validate as policy
    from metax_operator.rollout import engine
    from metax_operator.runtime.rollout_observe import canonical

    old_spec, new_spec = cr_spec(), cr_spec(driver={"payload": {"version": "2.33.0.1"}})
    stable = applied(rendered["driver"], desired_daemonset("driver", rendered["driver"], old_spec)[0])
    abandoned = applied(stable, desired_daemonset("driver", stable, new_spec)[0])
    nodes = frozenset({"n0", "n1", "n2"})
    pods = tuple(observation.Pod(f"p-{n}", f"u-{n}", n, "r-old", True, "Running") for n in sorted(nodes))
    revision_data = {"spec": {"template": {**stable["spec"]["template"], "$patch": "replace"}}}
    observed_pass = observation.Cluster(
        "r-new",
        True,
        nodes,
        pods,
        template=canonical(abandoned["spec"]["template"]),
        driver_spec=canonical(new_spec["driver"]),
        revisions={"r-old": revision_data},
        daemonset=abandoned,
        cr_spec=new_spec,
    )
    steps = [{"replicas": "100%", "pauseDuration": 0}]
    started = engine.decide(observed_pass, policy({"enableRollout": True, "upgradeSteps": steps}), None, 1e9).status
    assert started.phase == "Progressing" and started.last_co_driver_spec == ""  # nothing recorded r-old's spec
    forced = engine.decide(observed_pass, policy({"enableRollout": False, "upgradeSteps": steps}), started, 1e9 + 5)
    assert forced.restore.revision == "r-old" and forced.status.phase == "Disabling"
    assert forced.restore.template_patch == revision_data

    # Left as it was, the CR would make the reconcile turn the restored template back into r-new's:
    back = at_template(abandoned, stable["spec"]["template"])
    assert "initContainers" in desired_daemonset("driver", back, new_spec)[1]
    driver = forced.restore.driver_spec  # what the runner writes back to spec.driver first
    assert driver == daemonset.restored_driver_spec(
        abandoned, stable["spec"]["template"], new_spec, forced.status.last_co_driver_spec
    )
    assert driver["payload"]["version"] == "2.32.0.6"
    assert driver["upgradePolicy"] == new_spec["driver"]["upgradePolicy"]
    _, changed = desired_daemonset("driver", back, {**new_spec, "driver": driver})
    assert set(changed) <= {"updateStrategy"}, "the reconcile would change the restored template"


def test_a_recorded_spec_that_no_longer_gives_the_template_is_not_restored(rendered, cr_spec):
    """A lastCoDriverSpec left from before a change made while no runner ran would restore a
    version the stable revision never ran: the template decides."""
    stable_spec, stale = cr_spec(driver={"payload": {"version": "2.32.0.7"}}), cr_spec()
    stable = applied(rendered["driver"], desired_daemonset("driver", rendered["driver"], stable_spec)[0])
    new_spec = cr_spec(driver={"payload": {"version": "2.33.0.1"}})
    driver = daemonset.restored_driver_spec(stable, stable["spec"]["template"], new_spec, json.dumps(stale["driver"]))
    assert driver["payload"]["version"] == "2.32.0.7"
    recorded = daemonset.restored_driver_spec(stable, stable["spec"]["template"], new_spec, json.dumps(stable_spec["driver"]))
    assert recorded == {**stable_spec["driver"], "upgradePolicy": new_spec["driver"]["upgradePolicy"]}


TOLERATION = st.fixed_dictionaries(
    {
        "key": st.sampled_from(["a", "node-type"]),
        "operator": st.just("Equal"),
        "value": st.sampled_from(["x", "y"]),
        "effect": st.just("NoSchedule"),
    }
)
DRIVER_FIELDS = st.fixed_dictionaries(
    {
        "deployPolicy": st.sampled_from(["PreferCloud", "PreferHost", "PreferNewer"]),
        "fwUpgradePolicy": st.sampled_from(["PreferCloud", "Never"]),
        "fwEnableVirt": st.booleans(),
        "log": st.fixed_dictionaries({"level": st.sampled_from(["debug", "info"]), "format": st.sampled_from(["text", "json"])}),
        "payload": st.fixed_dictionaries(
            {
                "name": st.sampled_from(["driver-image", "metax/driver"]),
                "version": st.from_regex(r"\A[A-Za-z0-9_][A-Za-z0-9_.-]{0,12}\Z"),
                "registry": st.sampled_from(["", "own.example:5000/x", "r.example/metax"]),
                "digest": st.sampled_from(["", "sha256:" + "a" * 64]),
            }
        ),
        "podTemplateSpec": st.one_of(
            st.just({}), st.builds(lambda t: {"spec": {"tolerations": t}}, st.lists(TOLERATION, max_size=2))
        ),
    }
)


@settings(max_examples=60, deadline=None)
@given(old=DRIVER_FIELDS, new=DRIVER_FIELDS, global_tolerations=st.lists(TOLERATION, max_size=2))
def test_the_spec_read_back_from_any_rendered_template_gives_that_template(rendered, cr_spec, old, new, global_tolerations):
    """The inverse of the driver mapping, whatever changed between the two revisions (inside
    spec.driver or, for the global podTemplateSpec, outside it)."""
    old_spec = cr_spec(driver=old)
    new_spec = cr_spec(driver=new, podTemplateSpec={"spec": {"tolerations": global_tolerations}})
    stable = applied(rendered["driver"], desired_daemonset("driver", rendered["driver"], old_spec)[0])
    abandoned = applied(stable, desired_daemonset("driver", stable, new_spec)[0])
    driver = daemonset.restored_driver_spec(abandoned, stable["spec"]["template"], new_spec)
    assert driver is not None
    back = at_template(abandoned, stable["spec"]["template"])
    _, changed = desired_daemonset("driver", back, {**new_spec, "driver": driver})
    assert set(changed) <= {"updateStrategy"}
    effective = lambda d: (  # noqa: E731
        images.reference(
            d["payload"].get("registry") or "r.example/metax",
            d["payload"]["name"],
            d["payload"]["version"],
            d["payload"].get("digest"),
        ),
        d["log"],
        d["deployPolicy"],
        d["fwUpgradePolicy"],
        d["fwEnableVirt"],
    )
    assert effective(driver) == effective({**old_spec["driver"], **old})


# -- what the CR governs besides scheduling ---------------------------------------------------------


def test_log_settings_driver_options_and_payload_follow_the_cr(rendered, cr_spec):
    spec = cr_spec(
        registry="mirror.example/metax",
        driver={
            "deployPolicy": "PreferNewer",
            "fwUpgradePolicy": "PreferCloud",
            "fwEnableVirt": True,
            "payload": {"name": "driver-image", "version": "2.33.0.1"},
            "log": {"level": "debug", "format": "json"},
        },
    )
    desired, changed = desired_daemonset("driver", rendered["driver"], spec)
    env = {e["name"]: e["value"] for e in pod_spec(desired)["containers"][0]["env"]}
    assert env == {
        "LOG_LEVEL": "debug",
        "LOG_FORMAT": "json",
        "DEPLOY_POLICY": "PreferNewer",
        "FW_UPGRADE_POLICY": "PreferCloud",
        "FW_ENABLE_VIRT": "true",
    }
    image = "mirror.example/metax/driver-image:2.33.0.1"
    assert pod_spec(desired)["initContainers"] == [
        {"name": "payload", "image": image, "env": [{"name": PAYLOAD_IMAGE_ENV, "value": image}]}
    ]
    assert set(changed) == {"containers", "initContainers"}


def test_payload_registry_wins_over_the_global_registry(rendered, cr_spec):
    spec = cr_spec(driver={"payload": {"name": "driver-image", "version": "2.32.0.6", "registry": "own.example/x"}})
    desired, _ = desired_daemonset("driver", rendered["driver"], spec)
    assert pod_spec(desired)["initContainers"][0]["image"] == "own.example/x/driver-image:2.32.0.6"


def test_healthy_interval_and_maca_images_follow_the_cr(rendered, cr_spec):
    spec = cr_spec(gpuDevice={"healthyInterval": 0}, maca={"payload": {"images": ["maca-c500:2.19.0.1"]}})
    device, _ = desired_daemonset("gpuDevice", rendered["gpuDevice"], spec)
    maca, _ = desired_daemonset("maca", rendered["maca"], spec)
    assert {"name": "HEALTHY_INTERVAL", "value": "0"} in pod_spec(device)["containers"][0]["env"]
    image = "r.example/metax/maca-c500:2.19.0.1"
    assert pod_spec(maca)["initContainers"] == [
        {"name": "payload-0", "image": image, "env": [{"name": PAYLOAD_IMAGE_ENV, "value": image}]}
    ]
    assert {"name": "PAYLOAD_IMAGES", "value": "maca-c500:2.19.0.1"} in pod_spec(maca)["containers"][0]["env"]


def test_every_env_var_the_runner_governs_is_one_the_chart_renders(rendered):
    for key, variables in daemonset.ENV.items():
        if key not in rendered:
            continue
        names = {e["name"] for c in pod_spec(rendered[key])["containers"] for e in c.get("env", [])}
        assert set(variables) <= names, f"{key}: the chart does not render {set(variables) - names}"


def test_the_runner_applies_only_what_differs_or_what_it_already_owns(rendered, cr_spec):
    """So Helm stays the only owner of what the CR does not change (no server-side conflicts)."""
    spec = cr_spec(podTemplateSpec={"spec": {"tolerations": [GENERAL]}})
    body = next(a.body for a in decide(observed(rendered, spec)).applies if a.body["metadata"]["name"] == "metax-driver")
    assert pod_spec(body) == {"tolerations": [BASE_TOLERATION, GENERAL]}
    live = applied(rendered["driver"], body)
    spec = cr_spec(podTemplateSpec={"spec": {"tolerations": [GENERAL]}}, driver={"log": {"level": "debug"}})
    body = next(
        a.body
        for a in decide(observed(rendered, spec, {**rendered, "driver": live})).applies
        if a.body["metadata"]["name"] == "metax-driver"
    )
    assert pod_spec(body) == {
        "tolerations": [BASE_TOLERATION, GENERAL],  # owned: kept, or it would be removed
        "containers": [{"name": "driver-manager", "env": [{"name": "LOG_LEVEL", "value": "debug"}]}],
    }


def test_the_partial_object_holds_only_what_the_cr_governs(rendered, cr_spec):
    desired, _ = desired_daemonset("driver", rendered["driver"], cr_spec())
    assert set(desired) == {"apiVersion", "kind", "metadata", "spec"}
    assert desired["metadata"] == {"name": "metax-driver", "namespace": "metax-operator"}
    assert set(desired["spec"]) == {"template", "updateStrategy"} and set(desired["spec"]["template"]) == {"spec"}
    assert set(pod_spec(desired)) <= {"nodeSelector", "affinity", "tolerations", "containers", "initContainers"}
    for container in pod_spec(desired)["containers"]:
        assert set(container) == {"name", "env"}
    maca, _ = desired_daemonset("maca", rendered["maca"], cr_spec())
    assert set(maca["spec"]) == {"template", "updateStrategy"}


# -- the driver's update strategy: OnDelete whatever the policy -------------------------------------


def test_the_driver_strategy_the_runner_wants_is_what_the_chart_renders_for_the_same_values(rendered, cr_spec):
    for enabled in (False, True):
        policy = {"enableRollout": enabled, "upgradeSteps": [{"replicas": "100%"}]}
        chart = render_chart(
            {**VALUES, "driver": {**VALUES["driver"], "upgradePolicy": policy}}, show_only=["templates/driver/daemonset.yaml"]
        )[0]
        spec = cr_spec(driver={"upgradePolicy": policy})
        desired, changed = desired_daemonset("driver", chart, spec)
        assert chart["spec"]["updateStrategy"] == desired["spec"]["updateStrategy"] == {"type": "OnDelete"}
        assert "updateStrategy" not in changed
        assert not needs_write(desired, chart), "after an install with the same values nothing is written"


def test_toggling_the_rollout_in_the_cr_leaves_the_driver_strategy_alone(rendered, cr_spec):
    for enabled in (True, False):
        policy = {"enableRollout": enabled, "upgradeSteps": [{"replicas": 2}, {"replicas": "100%"}]}
        out = decide(observed(rendered, cr_spec(driver={"upgradePolicy": policy})))
        assert all("updateStrategy" not in a.fields for a in out.applies), enabled


def test_the_first_pass_after_an_install_sets_the_components_strategy_and_nothing_else(cr_spec):
    # The chart leaves it out of every release (helm rollback must not write it); the API server
    # defaults it to one pod at a time.
    installed = chart_daemonsets(VALUES)
    for key, ds in installed.items():
        assert ("updateStrategy" in ds["spec"]) is (key == "driver"), key
        if key != "driver":
            ds["spec"]["updateStrategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
    out = decide(observed(installed, cr_spec()))
    assert sorted(a.body["metadata"]["name"] for a in out.applies) == sorted(
        ds["metadata"]["name"] for key, ds in installed.items() if key != "driver"
    )
    for apply in out.applies:
        assert apply.fields == ("updateStrategy",)
        assert apply.body["spec"] == {"template": {"spec": {}}, "updateStrategy": COMPONENT_UPDATE_STRATEGY}


def test_the_rolling_update_is_put_back_with_the_cr_fields_in_one_write(rendered, cr_spec):
    # After the pre-rollback hook's OnDelete: Helm wrote an older log level, the CR holds debug.
    live = copy.deepcopy(rendered["gpuDevice"])
    live["spec"]["updateStrategy"] = {"type": "OnDelete"}
    out = decide(observed(rendered, cr_spec(gpuDevice={"log": {"level": "debug"}}), {**rendered, "gpuDevice": live}))
    (apply,) = out.applies
    assert set(apply.fields) == {"containers", "updateStrategy"}
    assert apply.body["spec"]["updateStrategy"] == COMPONENT_UPDATE_STRATEGY
    assert pod_spec(apply.body)["containers"] == [{"name": "gpu-device", "env": [{"name": "LOG_LEVEL", "value": "debug"}]}]


def test_a_strategy_another_writer_rendered_is_put_back_to_on_delete(rendered, cr_spec):
    # An older chart's release restored by `helm rollback` rendered RollingUpdate without the
    # staged rollout: the DaemonSet controller would replace every driver pod itself.
    live = copy.deepcopy(rendered["driver"])
    live["spec"]["updateStrategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "100%"}}
    desired, changed = desired_daemonset("driver", live, cr_spec(driver={"upgradePolicy": {"enableRollout": False}}))
    assert desired["spec"]["updateStrategy"] == {"type": "OnDelete"} and "updateStrategy" in changed


# -- what the runner reports -------------------------------------------------------------------------


def conditions(outcome) -> dict[str, Condition]:
    return {c.type: c for c in outcome.conditions}


def test_an_invalid_spec_is_not_applied_and_the_condition_names_the_field(rendered, cr_spec):
    spec = cr_spec(podTemplateSpec={"spec": {"tolerations": [GENERAL], "hostNetwork": True}})
    out = decide(observed(rendered, spec))
    assert out.applies == []
    assert conditions(out)["SpecValid"].status == "False"
    assert "spec.podTemplateSpec.spec.hostNetwork" in conditions(out)["SpecValid"].message
    assert conditions(out)["Reconciled"].reason == "InvalidSpec"


def test_the_shared_validation_rules_apply_to_the_cr(rendered, cr_spec):
    spec = cr_spec(driver={"deployPolicy": "PreferCloud", "payload": {"name": "driver-image", "version": ""}})
    out = decide(observed(rendered, spec))
    assert out.applies == [] and "spec.driver.payload.version" in conditions(out)["SpecValid"].message


def test_a_deploy_switch_flipped_in_the_cr_asks_for_helm_upgrade(rendered, cr_spec):
    spec = cr_spec(exporter={"deploy": True}, vfioManager={"deploy": False})
    message = conditions(decide(observed(rendered, spec)))["HelmUpgradeRequired"].message
    assert conditions(decide(observed(rendered, spec)))["HelmUpgradeRequired"].status == "True"
    assert "spec.exporter.deploy is true but DaemonSet metax-data-exporter does not exist" in message
    assert "--set exporter.deploy=true" in message
    assert "spec.vfioManager.deploy is false but DaemonSet metax-vfio-manager exists" in message


def test_changes_of_the_pod_structure_ask_for_helm_upgrade_and_are_not_applied(rendered, cr_spec):
    spec = cr_spec(driver={"deployPolicy": "Never"}, maca={"payload": {"images": ["a:1", "b:2"]}})
    out = decide(observed(rendered, spec))
    message = conditions(out)["HelmUpgradeRequired"].message
    assert "spec.driver.deployPolicy is Never but DaemonSet metax-driver has payload init container" in message
    assert "spec.maca.payload.images lists 2 images but DaemonSet metax-maca has 1 payload init containers" in message
    maca = next(a.body for a in out.applies if a.body["metadata"]["name"] == "metax-maca")
    assert "initContainers" not in pod_spec(maca)


def test_in_sync_deploy_switches_need_no_helm_upgrade(rendered, cr_spec):
    assert conditions(decide(observed(rendered, cr_spec())))["HelmUpgradeRequired"].status == "False"


def test_a_broken_driver_config_edit_is_reported(rendered, cr_spec):
    configmaps = {
        "driver-config": {
            "data": {"node-vfnums": "nodes:\n  foo:\n    vfnum: 99\n", "module-params": "", "node-module-params": ""}
        }
    }
    condition = conditions(decide(observed(rendered, cr_spec(), configmaps=configmaps)))["ConfigMapsValid"]
    assert condition.status == "False" and "configmap/driver-config[node-vfnums].nodes.foo.vfnum" in condition.message
    assert "vfnum" in condition.message


def test_a_condition_keeps_its_transition_time_while_its_status_stays():
    existing = [
        {
            "type": "SpecValid",
            "status": "True",
            "reason": "Valid",
            "message": "ok",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
            "observedGeneration": 1,
        },
        {
            "type": "Progressing",
            "status": "True",
            "reason": "Other",
            "message": "kept",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        },
    ]
    result, changed = merge_conditions(existing, [Condition("SpecValid", "True", "Valid", "ok")], 2, "2026-02-02T00:00:00Z")
    assert result[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z" and result[0]["observedGeneration"] == 2
    assert result[1] == existing[1] and changed == []
    result, changed = merge_conditions(result, [Condition("SpecValid", "False", "InvalidSpec", "bad")], 3, "2026-03-03T00:00:00Z")
    assert result[0]["lastTransitionTime"] == "2026-03-03T00:00:00Z" and [c.status for c in changed] == ["False"]


def test_events_for_conditions_going_bad_and_recovering_but_not_for_a_healthy_start():
    bad = Condition("SpecValid", "False", "InvalidSpec", "spec.x: bad")
    good = Condition("SpecValid", "True", "Valid", "ok")
    assert transition_events([bad], {"SpecValid"}) == [Event(EventType.WARNING, "InvalidSpec", "SpecValid=False: spec.x: bad")]
    assert transition_events([good], {"SpecValid"}) == []
    assert transition_events([good], set()) == [Event(EventType.NORMAL, "Valid", "SpecValid=True: ok")]


def test_owned_fields_projects_keyed_lists_and_atomic_fields():
    obj = {
        "metadata": {
            "managedFields": [
                {"manager": "helm", "operation": "Update", "fieldsV1": {"f:spec": {}}},
                {
                    "manager": RUNNER_FIELD_MANAGER,
                    "operation": "Apply",
                    "fieldsV1": {
                        "f:spec": {
                            "f:template": {
                                "f:spec": {
                                    "f:tolerations": {},
                                    "f:containers": {
                                        'k:{"name":"a"}': {
                                            ".": {},
                                            "f:name": {},
                                            "f:env": {'k:{"name":"LOG_LEVEL"}': {".": {}, "f:name": {}, "f:value": {}}},
                                        }
                                    },
                                }
                            }
                        }
                    },
                },
            ]
        },
        "spec": {
            "template": {
                "spec": {
                    "tolerations": [GPU],
                    "nodeSelector": {"x": "y"},
                    "containers": [
                        {"name": "a", "image": "i", "env": [{"name": "LOG_LEVEL", "value": "info"}, {"name": "O", "value": "1"}]},
                        {"name": "b", "image": "j"},
                    ],
                }
            }
        },
    }
    assert owned_fields(obj, RUNNER_FIELD_MANAGER) == {
        "spec": {
            "template": {
                "spec": {"tolerations": [GPU], "containers": [{"name": "a", "env": [{"name": "LOG_LEVEL", "value": "info"}]}]}
            }
        }
    }
    assert owned_fields(obj, "nobody") == {}


# -- the runner's options and its lease lock (no cluster) ------------------------------------------


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--lease-duration", "10", "--renew-deadline", "10"], "--lease-duration: must exceed --renew-deadline"),
        (["--renew-deadline", "2", "--retry-period", "2"], "--renew-deadline: must exceed 1.2 x --retry-period"),
        (["--interval", "0"], "argument --interval: 0 is not a number from 0.1 to 3600"),
    ],
)
def test_bad_runner_options_name_the_option(capsys, argv, fragment):
    from metax_operator import cli

    assert cli.main(["run", "--namespace", "ns", "--kubeconfig", "/nonexistent", *argv]) == 1
    assert fragment in capsys.readouterr().err


def test_the_runner_needs_a_namespace(capsys, monkeypatch):
    from metax_operator import cli

    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    assert cli.main(["run", "--kubeconfig", "/nonexistent"]) == 1
    assert "--namespace: is not set; pass --namespace NS or set $POD_NAMESPACE" in capsys.readouterr().err


def test_lease_times_round_trip_between_the_library_and_the_lease():
    """The library keeps what it read and writes it back: a read-write-read must not drift."""
    import datetime as dt

    from metax_operator.runtime.leader import _from_record_time, _to_record_time

    stamp = dt.datetime(2026, 11, 29, 21, 30, 1, 123456, tzinfo=dt.timezone.utc)
    text = _to_record_time(stamp)
    assert _from_record_time(text) == stamp and _to_record_time(_from_record_time(text)) == text
    library = str(dt.datetime.fromtimestamp(stamp.timestamp()))  # what LeaderElection writes
    assert _from_record_time(library) == stamp


@pytest.mark.parametrize("mode", ["deployment", "cronjob"])
def test_the_chart_s_runner_command_is_accepted_by_this_cli(mode):
    from metax_operator import cli

    objects = render_chart({**VALUES, "runner": {"mode": mode, "interval": 7}})
    workload = next(
        o for o in objects if o["kind"] in ("Deployment", "CronJob") and o["metadata"]["name"] == "metax-operator-runner"
    )
    pod = (
        workload["spec"]["template"]["spec"]
        if mode == "deployment"
        else workload["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    )
    command = next(c for c in pod["containers"]).get("command")
    args = cli.build_parser().parse_args(command[1:])
    assert args.func.__module__ == "metax_operator.runtime.run" and args.namespace == "metax-operator"
    assert (args.once, args.interval) == ((False, 7.0) if mode == "deployment" else (True, 5.0))


def test_a_leader_that_has_not_renewed_within_the_renew_deadline_stops_acting():
    """Before its lease can expire (and another runner take over), not after."""
    import time

    from kubernetes import client

    from metax_operator.runtime.leader import Elector, LeaseLock

    lock = LeaseLock("lease", "ns", "me", client.ApiClient())
    elector = Elector(lock, lease_duration=15, renew_deadline=10, retry_period=2)
    elector._started()  # what the library calls once it holds the lease
    lock.renewed_at = time.monotonic()
    assert elector.is_leader()
    lock.renewed_at = time.monotonic() - 10.5  # renewals failing for longer than the deadline
    assert not elector.is_leader()
    lock.renewed_at = time.monotonic()
    elector._stopped()  # the library gave up renewing
    assert not elector.is_leader()


# -- the shell's status write, against a fake API ----------------------------------------------------


class ConflictOnceApi:
    """What `apply` calls, recorded; the first status write fails with 409 as the API server
    answers when the CR changed since it was read (the CR now at generation 4)."""

    def __init__(self, cr_after: dict):
        self.cr_after, self.status_writes, self.conflicts = cr_after, [], 1

    def apply(self, body, **_):
        return body

    def get(self, *args, **kwargs):
        return copy.deepcopy(self.cr_after)

    def resource(self, *args):
        class Resource:
            @staticmethod
            def path(name=None, namespace=None, subresource=""):
                return (
                    f"/apis/gpu.metax-tech.com/v1/clusteroperators/{name}/status"
                    if subresource
                    else "/api/v1/namespaces/default/events"
                )

        return Resource

    def call(self, method, path, body=None, **_):
        from kubernetes.client.exceptions import ApiException

        if not path.endswith("/status"):
            return {}
        assert method == "PUT"
        if self.conflicts:
            self.conflicts -= 1
            raise ApiException(status=409, reason="Conflict")
        self.status_writes.append(body)
        return body


def test_a_conflict_on_the_status_write_never_stamps_a_generation_the_pass_did_not_plan(rendered, cr_spec):
    """Regression: on a 409 the shell re-read the CR and wrote its NEW generation as observed with
    the conditions planned from the OLD spec: the rollout's `caught_up` then trusted a spec the
    reconcile never applied. Now the pass stops; the next one plans from the new CR."""
    seen = observed(rendered, cr_spec())
    edited = copy.deepcopy(seen.cr)
    edited["metadata"].update(generation=4, resourceVersion="11")
    edited["spec"]["vfioManager"]["vfioConfig"] = [{"nodeName": "worknode(", "gpus": "all"}]
    api = ConflictOnceApi(edited)
    reconcile.apply(api, seen, decide(seen), lambda: True, lambda: T_PASS)
    assert api.status_writes == []  # nothing written for a spec this pass did not plan from

    again = Observed(seen.namespace, edited, seen.daemonsets, {})
    reconcile.apply(api, again, decide(again), lambda: True, lambda: T_PASS + 5)
    [written] = api.status_writes
    assert written["status"]["observedGeneration"] == 4
    spec_valid = next(c for c in written["status"]["conditions"] if c["type"] == "SpecValid")
    assert spec_valid["status"] == "False" and "vfioConfig[0].nodeName" in spec_valid["message"]


# -- RunnerHealthy: how a pass ended --------------------------------------------------------------


def test_a_forbidden_pass_names_the_permission_and_the_fix_in_one_line():
    denied = ApiException(status=403, reason="Forbidden")
    denied.body = json.dumps(
        {
            "message": 'pods "metax-driver-x" is forbidden: User "system:serviceaccount:metax-operator:'
            'metax-operator-runner" cannot delete resource "pods" in API group "" in the namespace "metax-operator"'
        }
    )
    condition = cr_status.pass_condition(denied)
    assert (condition.type, condition.status, condition.reason) == ("RunnerHealthy", "False", "Forbidden")
    assert 'cannot delete resource "pods"' in condition.message and "\n" not in condition.message
    assert "helm upgrade renders its RBAC" in condition.message and "retries" in condition.message


def test_other_failures_are_named_by_kind_and_a_success_is_healthy():
    unreachable = cr_status.pass_condition(urllib3.exceptions.MaxRetryError(None, "/", "connection refused"))
    assert unreachable.reason == "APIError" and "cannot be reached" in unreachable.message
    bug = cr_status.pass_condition(KeyError("spec"))
    assert bug.reason == "PassFailed" and bug.message.startswith("KeyError: 'spec'")
    several = cr_status.pass_condition(UserErrors([UserError("a", "one"), UserError("b", "two")]))
    assert "\n" not in several.message and "a: one" in several.message and "b: two" in several.message
    healthy = cr_status.pass_condition(None)
    assert (healthy.status, healthy.reason) == ("True", "PassSucceeded")
    assert HEALTHY["RunnerHealthy"] == "True"


def test_a_condition_alone_leaves_the_observed_generation_as_it_was(rendered, cr_spec):
    """A failed pass's report must not claim the CR's generation as applied: only the full pass
    (`applied`) moves `status.observedGeneration`."""
    seen = observed(rendered, cr_spec())
    seen.cr["metadata"].update(generation=5, resourceVersion="12")
    seen.cr["status"] = {"observedGeneration": 4, "conditions": []}
    api = ConflictOnceApi(seen.cr)
    api.conflicts = 0
    failed = cr_status.pass_condition(KeyError("spec"))
    reconcile.apply(api, seen, reconcile.Outcome(conditions=[failed]), lambda: True, lambda: T_PASS, applied=False)
    [written] = api.status_writes
    assert written["status"]["observedGeneration"] == 4
    assert [c["type"] for c in written["status"]["conditions"]] == ["RunnerHealthy"]
    seen.cr["status"]["conditions"] = written["status"]["conditions"]
    reconcile.apply(api, seen, reconcile.Outcome(conditions=[failed]), lambda: True, lambda: T_PASS, applied=False)
    assert len(api.status_writes) == 1, "the same failure again writes nothing"
