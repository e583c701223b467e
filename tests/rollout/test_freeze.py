"""The spec a driver rollout acts on (`rollout.freeze`): what is held mid-rollout, what passes, and
what the engine records (`resume.spec`). The same rule on a real API server, where the policy
refuses the edit the runner would hold: tests/chart/test_admission.py; on every Kubernetes
version, where the older ones store it: tests/chart/test_kubernetes_versions.py."""

from __future__ import annotations

import copy
import json

from hypothesis import given
from hypothesis import strategies as st

from metax_operator.chart.admission import frozen_changes
from metax_operator.rollout import freeze
from metax_operator.rollout.restore import Restore

SPEC = {
    "registry": "cr.example.com/metax",
    "driver": {
        "payload": {"name": "driver-image", "version": "2.33.0.1"},
        "upgradePolicy": {"enableRollout": True, "pause": False, "maxParallel": 1},
    },
    "gpuDevice": {"deploy": True},
}


def cr(spec: dict, upgrading: bool = True, recorded: dict | None = SPEC) -> dict:
    resume = {} if recorded is None else {"spec": freeze.record(recorded)}
    return {"spec": spec, "status": {"upgradeStatus": {"upgrading": upgrading, "phase": "Progressing", "resume": resume}}}


def edited(**changes) -> dict:
    spec = copy.deepcopy(SPEC)
    for path, value in changes.items():
        *parents, last = path.split("__")
        node = spec
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(last)
        else:
            node[last] = value
    return spec


def test_the_record_leaves_out_the_rollout_s_controls_only():
    recorded = json.loads(freeze.record(SPEC))
    assert recorded["driver"]["upgradePolicy"] == {"maxParallel": 1}
    assert recorded["driver"]["payload"] == SPEC["driver"]["payload"] and recorded["gpuDevice"] == SPEC["gpuDevice"]
    assert SPEC["driver"]["upgradePolicy"]["pause"] is False, "the spec itself is left as it is"


def test_a_rollback_records_the_driver_it_writes_back():
    stable = {"payload": {"name": "driver-image", "version": "2.32.0.6"}, "upgradePolicy": {"pause": True, "maxParallel": 1}}
    recorded = json.loads(freeze.record(SPEC, Restore("r1", stable, None)))
    assert recorded["driver"] == {"payload": stable["payload"], "upgradePolicy": {"maxParallel": 1}}
    assert json.loads(freeze.record(SPEC, Restore("r1", None, None))) == json.loads(freeze.record(SPEC))


def test_an_edit_of_another_field_mid_rollout_is_held_with_the_policy_s_line():
    spec = edited(driver__payload__version="2.34.0.1", gpuDevice__deploy=False)
    held = freeze.in_force(cr(spec))
    assert held.held == ("gpuDevice", "driver.payload")
    assert held.spec == SPEC, "the pass acts on the spec the rollout started with"
    condition = held.condition()
    assert (condition.type, condition.status, condition.reason) == ("SpecHeld", "True", "EditDuringRollout")
    assert condition.message.startswith(
        "gpuDevice, driver.payload: cannot change while a driver rollout is in progress (phase Progressing): the edit is held"
    )


def test_the_controls_of_a_held_spec_are_the_cr_s():
    spec = edited(
        driver__payload__version="2.34.0.1", driver__upgradePolicy__pause=True, driver__upgradePolicy__enableRollout=False
    )
    held = freeze.in_force(cr(spec))
    assert held.held == ("driver.payload",)
    assert held.spec["driver"]["upgradePolicy"] == {"maxParallel": 1, "pause": True, "enableRollout": False}
    assert held.spec["driver"]["payload"]["version"] == "2.33.0.1"
    without = edited(driver__payload__version="2.34.0.1", driver__upgradePolicy=None)
    assert "upgradePolicy" not in freeze.in_force(cr(without, recorded=edited(driver__upgradePolicy=None))).spec["driver"]


def test_nothing_is_held_for_the_controls_a_reverted_edit_without_a_rollout_or_without_a_record():
    controls = edited(driver__upgradePolicy__pause=True, driver__upgradePolicy__enableRollout=False)
    version = edited(driver__payload__version="2.34.0.1")
    for case in (
        cr(controls),  # only the controls changed
        cr(copy.deepcopy(SPEC)),  # reverted: the record again
        cr(version, upgrading=False),  # no rollout in progress: the edit takes effect
        cr(version, recorded=None),  # a status an older runner wrote: the rollout adopts the spec
        {**cr(version), "status": {"upgradeStatus": {"upgrading": True, "resume": {"spec": "not json"}}}},
    ):
        held = freeze.in_force(case)
        assert held.held == () and held.spec == case["spec"]
        assert held.condition().status == "False"


_value = st.one_of(st.none(), st.booleans(), st.integers(0, 3), st.sampled_from(["a", "b"]))
_level = st.dictionaries(st.sampled_from(["x", "y", "pause", "enableRollout"]), _value, max_size=3)
_spec = st.fixed_dictionaries(
    {},
    optional={
        "registry": _value,
        "gpuDevice": _level,
        "driver": st.fixed_dictionaries({}, optional={"payload": _level, "upgradePolicy": _level}),
    },
)


@given(old=_spec, new=_spec)
def test_the_held_spec_differs_from_the_record_in_no_frozen_field_and_keeps_the_cr_s_controls(old, new):
    held = freeze.in_force(cr(new, recorded=old))
    assert sorted(frozen_changes(old, new)) == sorted(held.held)
    assert frozen_changes(old, held.spec) == []
    policy = (held.spec.get("driver") or {}).get("upgradePolicy") or {}
    wanted = ((new.get("driver") or {}).get("upgradePolicy") or {}) if isinstance(new.get("driver"), dict) else {}
    for key in ("pause", "enableRollout"):
        assert policy.get(key) == wanted.get(key)
