"""Driver pools, rule by rule: the pool's values over the driver's (`chart/pools.py`), where each
rollout's status and spec are (`rollout.target`), what a pool's rollout holds (`rollout.freeze`),
its writes to the CR (`rollout.cr_patch`) and the moves of nodes between pools
(`rollout.membership`). On the API server: tests/e2e/test_driver_pools.py."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metax_operator.chart import pools
from metax_operator.chart.upgrade_policy import validate
from metax_operator.contract import GPU_NODE_LABEL, POOL_LABEL, SKIP_LABEL
from metax_operator.rollout import freeze, membership
from metax_operator.rollout.cr_patch import pause_patch, restore_patch
from metax_operator.rollout.status import PROGRESSING, UpgradeStatus
from metax_operator.rollout.target import DRIVER, Target, targets
from tests.fakeapi import PatchTestFailed, json_patch

C500 = {"name": "c500", "nodeSelector": {"metax-tech.com/gpu.product": "C500"}, "payload": {"version": "2.33.0.1"}}
C550 = {"name": "c550", "nodeSelector": {"metax-tech.com/gpu.product": "C550"}, "upgradePolicy": {"pause": True}}
DRIVER_SPEC = {
    "payload": {"name": "driver-image", "version": "2.32.0.6", "digest": "", "registry": ""},
    "fwEnableVirt": True,
    "upgradePolicy": {
        "enableRollout": True,
        "upgradeSteps": [{"replicas": "100%"}],
        "maxParallel": 2,
        "drain": {"enable": True, "timeout": 1000},
    },
    "pools": [C500, C550],
}
SPEC = {"registry": "cr.example.com/metax", "driver": DRIVER_SPEC}


def test_a_pools_driver_is_the_drivers_with_its_own_keys_over_it():
    own = {
        **C500,
        "fwEnableVirt": False,
        "upgradePolicy": {"drain": {"enable": False}, "upgradeSteps": [{"replicas": 1}, {"replicas": "100%"}]},
    }
    driver = pools.pool_driver(DRIVER_SPEC, own)
    assert "pools" not in driver
    assert driver["payload"] == {**DRIVER_SPEC["payload"], "version": "2.33.0.1"}
    assert driver["fwEnableVirt"] is False
    assert driver["upgradePolicy"]["drain"] == {"enable": False, "timeout": 1000}  # key by key
    assert driver["upgradePolicy"]["upgradeSteps"] == own["upgradePolicy"]["upgradeSteps"]  # a list whole
    assert driver["upgradePolicy"]["maxParallel"] == 2
    empty = pools.pool_driver(DRIVER_SPEC, {"name": "x", "nodeSelector": {"a": "b"}, "payload": {"version": ""}})
    assert empty["payload"]["version"] == "2.32.0.6"  # empty: the driver's


def test_each_rollout_has_its_daemonset_status_and_spec():
    assert targets(SPEC) == [DRIVER, Target("c500"), Target("c550")]
    assert [t.daemonset for t in targets(SPEC)] == ["metax-driver", "metax-driver-pool-c500", "metax-driver-pool-c550"]
    status = {"upgradeStatus": {"phase": "Idling"}}
    status.update(Target("c550").status_fields(status, {"phase": "Progressing"}))
    status.update(Target("c500").status_fields(status, {"phase": "Idling"}))
    status.update(Target("c550").status_fields(status, {"phase": "Disabled"}))
    assert status["pools"] == [
        {"name": "c500", "upgradeStatus": {"phase": "Idling"}},
        {"name": "c550", "upgradeStatus": {"phase": "Disabled"}},
    ]
    assert DRIVER.stored(status) == {"phase": "Idling"} and Target("c550").stored(status) == {"phase": "Disabled"}
    assert Target("gone").stored(status) is None and Target("gone").spec(SPEC) is None
    assert Target("c550").spec(SPEC)["driver"]["upgradePolicy"]["pause"] is True
    assert Target("c550").owns({POOL_LABEL: "c550"}) and DRIVER.owns({}) and not DRIVER.owns({POOL_LABEL: "c500"})


def rolling(target: Target, spec: dict) -> dict:
    """A CR whose `target` rollout is in progress, started on `spec`."""
    acting = target.spec(spec)
    status = UpgradeStatus(phase=PROGRESSING, upgrading=True)
    status.resume.spec = freeze.record(acting)
    return {"spec": json.loads(json.dumps(spec)), "status": target.status_fields({}, status.to_json())}


def test_a_pools_rollout_holds_its_own_edits_and_no_one_elses():
    cr = rolling(Target("c500"), SPEC)
    cr["spec"]["driver"]["pools"][0]["payload"]["version"] = "2.34.0.1"  # its own: held
    cr["spec"]["driver"]["pools"][0]["upgradePolicy"] = {"pause": True}  # a control: in force
    cr["spec"]["driver"]["pools"][1]["payload"] = {"version": "2.35.0.1"}  # another pool's: in force
    held = freeze.in_force(cr, Target("c500"))
    assert held.held == ("driver.payload (pool c500)",)
    assert held.spec["driver"]["payload"]["version"] == "2.33.0.1" and held.spec["driver"]["upgradePolicy"]["pause"] is True
    assert freeze.in_force(cr, Target("c550")).held == ()
    assert freeze.in_force(cr, Target("c550")).spec["driver"]["payload"]["version"] == "2.35.0.1"
    assert freeze.in_force(cr, DRIVER).held == ()


def test_the_drivers_rollout_holds_its_edits_but_not_the_pools():
    cr = rolling(DRIVER, SPEC)
    cr["spec"]["driver"]["payload"]["version"] = "2.34.0.1"
    cr["spec"]["driver"]["pools"] = [C500]  # a pool removed: not the driver's to hold
    held = freeze.in_force(cr, DRIVER)
    assert held.held == ("driver.payload",)
    assert held.spec["driver"]["payload"]["version"] == "2.32.0.6" and held.spec["driver"]["pools"] == [C500]


@pytest.mark.parametrize("own", [None, {}, {"pause": False}], ids=["no policy", "no pause", "its pause"])
def test_the_runners_pause_of_a_pool_is_the_pools_own(own):
    spec = json.loads(json.dumps(SPEC))
    if own is not None:
        spec["driver"]["pools"][0]["upgradePolicy"] = own
    pointer = Target("c500").policy_pointer(spec)
    patched = json_patch({"spec": spec}, pause_patch(spec, Target("c500"), pointer, False, True))
    assert patched["spec"]["driver"]["pools"][0]["upgradePolicy"]["pause"] is True
    assert patched["spec"]["driver"]["upgradePolicy"] == spec["driver"]["upgradePolicy"]
    moved = {"spec": {**spec, "driver": {**spec["driver"], "pools": [C550, *spec["driver"]["pools"]]}}}
    with pytest.raises(PatchTestFailed):  # the list changed: the pool is not at its index
        json_patch(moved, pause_patch(spec, Target("c500"), pointer, False, True))


def test_a_pools_rollback_writes_the_pools_fields_back():
    wanted = pools.pool_driver(DRIVER_SPEC, {**C500, "payload": {"version": "2.31.0.9"}})
    ops = restore_patch(SPEC, Target("c500"), {k: v for k, v in wanted.items() if k != "upgradePolicy"})
    patched = json_patch({"spec": SPEC}, ops)
    assert patched["spec"]["driver"]["pools"][0]["payload"] == {"version": "2.31.0.9", "digest": ""}
    assert patched["spec"]["driver"]["payload"] == DRIVER_SPEC["payload"]
    other_image = {**{k: v for k, v in wanted.items() if k != "upgradePolicy"}, "image": {"name": "other"}}
    assert restore_patch(SPEC, Target("c500"), other_image) is None  # no pool field gives it


# -- moves between pools ---------------------------------------------------------------------------


def node(product: str, pool: str | None = None, **extra: str) -> frozenset:
    labels = {GPU_NODE_LABEL: "true", "metax-tech.com/gpu.product": product, **extra}
    if pool:
        labels[POOL_LABEL] = pool
    return frozenset(labels.items())


def policy(**raw):
    return validate({"enableRollout": True, "upgradeSteps": [{"replicas": "100%"}], **raw})


def selected(nodes, spec_pools) -> dict[str, frozenset[str]]:
    """What each pool's node watch holds: the nodes its selector selects."""
    return {
        p["name"]: frozenset(n for n, labels in nodes.items() if p["nodeSelector"].items() <= dict(labels).items())
        for p in spec_pools
    }


def decide(nodes, serving, policies, busy=(), waves=(), out=()):
    return membership.decide(
        nodes,
        selected(nodes, [C500, C550]),
        frozenset(serving),
        frozenset(busy),
        frozenset(waves),
        frozenset(out),
        lambda t: policies.get(t),
    )


def test_nodes_without_a_serving_driver_move_at_once_and_serving_ones_within_the_budget():
    nodes = {f"n{i}": node("C500") for i in range(4)}
    moves = decide(nodes, {"n0", "n1", "n2"}, {Target("c500"): policy(maxParallel=1)})
    assert moves.label == {"n3": "c500", "n0": "c500"}  # n3 serves nothing; one serving node at a time
    assert moves.cordon == ["n0"] and moves.waiting == {"no room in the budget": ["n1", "n2"]}
    held = decide(nodes, {"n0", "n1", "n2"}, {Target("c500"): policy(maxParallel=1)}, out={"m9"})
    assert held.label == {"n3": "c500"}  # another node out of service leaves no availability
    allowed = decide(nodes, {"n0", "n1", "n2"}, {Target("c500"): policy(maxParallel=1, maxUnavailable=1)}, out={"m9"})
    assert allowed.label == {"n3": "c500", "n0": "c500"}


def test_serving_nodes_wait_for_a_paused_pool_and_gpu_work_and_move_at_once_without_a_staged_rollout():
    nodes = {"a": node("C550"), "b": node("C500"), "c": node("C500"), "d": node("C500")}
    policies = {Target("c550"): policy(pause=True), Target("c500"): policy(enableRollout=False, upgradeSteps=[], cordon=False)}
    moves = decide(nodes, {"a", "b", "c", "d"}, policies, busy={"d"})
    assert moves.label == {"b": "c500", "c": "c500"} and moves.cordon == []
    assert moves.waiting == {"paused": ["a"], "running GPU work": ["d"]}


def test_nodes_leave_a_pool_that_is_gone_and_nodes_two_pools_select_stay_where_they_are():
    both = frozenset({**dict(node("C500", "c500")), "metax-tech.com/gpu.product": "C550"}.items())
    nodes = {"left": node("C900", "old"), "both": both, "skipped": node("C500", None, **{SKIP_LABEL: "true"}), "cpu": frozenset()}
    moves = decide(nodes, {"left", "both", "skipped"}, {DRIVER: policy(), Target("c550"): policy()})
    assert moves.label == {"left": None}  # the driver's own takes it back; then no room is left for c550
    assert moves.overlaps == {} and moves.waiting == {"swapping or skipped": ["skipped"], "no room in the budget": ["both"]}
    overlapping = [
        C500,
        {**C550, "nodeSelector": {"metax-tech.com/gpu.product": "C550"}},
        {"name": "all", "nodeSelector": {GPU_NODE_LABEL: "true"}},
    ]
    moves = membership.decide(
        nodes, selected(nodes, overlapping), frozenset(), frozenset(), frozenset(), frozenset(), lambda t: policy()
    )
    assert moves.overlaps == {"both": ["c550", "all"], "skipped": ["c500", "all"]}
    assert moves.label == {"left": "all"}  # no pod is touched on a node two pools select
    condition = membership.condition(moves)
    assert condition.status == "False" and "both by c550, all" in condition.message


def test_a_node_in_a_wave_waits_for_its_swap_and_an_invalid_destination_takes_none():
    nodes = {"a": node("C500"), "b": node("C500")}
    moves = decide(nodes, {"a", "b"}, {}, waves={"a"})
    assert moves.label == {} and moves.waiting == {"swapping or skipped": ["a"], "no valid policy or DaemonSet": ["b"]}


def test_the_moves_into_one_pool_count_in_the_budget_of_the_next():
    nodes = {"a1": node("C500"), "a2": node("C500"), "b1": node("C550"), "b2": node("C550")}
    policies = {Target("c500"): policy(maxParallel=1), Target("c550"): policy(maxParallel=1)}
    moves = decide(nodes, set(nodes), policies)
    assert moves.label == {"a1": "c500"} and moves.waiting == {"no room in the budget": ["a2", "b1", "b2"]}
    allowance = {Target("c500"): policy(maxParallel=1), Target("c550"): policy(maxParallel=1, maxUnavailable=1)}
    assert decide(nodes, set(nodes), allowance).label == {"a1": "c500", "b1": "c550"}


@given(
    layout=st.lists(st.sampled_from(["C500", "C550", "C900"]), min_size=1, max_size=12),
    serving=st.lists(st.booleans(), min_size=12, max_size=12),
    out=st.integers(0, 4),
    caps=st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 2), st.integers(0, 2)),
)
def test_the_serving_nodes_moved_in_one_pass_stay_within_the_budget(layout, serving, out, caps):
    """Whatever the fleet and the nodes out of service, the serving nodes a pass moves into each
    pool are at most its `maxParallel`, and all of them together leave no more nodes out of
    service than the pools' budgets allow one after the other."""
    nodes = {f"n{i:02d}": node(product) for i, product in enumerate(layout)}
    up = {n for n, s in zip(sorted(nodes), serving, strict=False) if s}
    down = frozenset(f"elsewhere-{i}" for i in range(out))
    policies = {
        Target("c500"): policy(maxParallel=caps[0], maxUnavailable=caps[2]),
        Target("c550"): policy(maxParallel=caps[1], maxUnavailable=caps[3]),
    }
    moves = decide(nodes, up, policies, out=down)
    moved_serving = {pool: [n for n, p in moves.label.items() if p == pool and n in up] for pool in ("c500", "c550")}
    assert not set(moves.label) - {
        n for n, labels in nodes.items() if dict(labels)["metax-tech.com/gpu.product"] in ("C500", "C550")
    }
    assert all(n not in up for n, p in moves.label.items() if p is None)
    taken = len(down)
    for pool, (cap, allowance) in (("c500", (caps[0], caps[2])), ("c550", (caps[1], caps[3]))):
        total = sum(1 for labels in nodes.values() if dict(labels)["metax-tech.com/gpu.product"] == pool.upper())
        limit = cap or total  # maxParallel 0: no limit
        assert len(moved_serving[pool]) <= min(limit, max(0, limit + allowance - taken))
        taken += len(moved_serving[pool])


def test_a_gpu_node_no_driver_daemonset_runs_on_is_out_of_no_rollouts_service():
    """Only the GPU nodes with a driver pod, or the runner's cordon (a node between two
    DaemonSets), count as out of service: a GPU node none runs on (a taint the driver does not
    tolerate) would have cut every pool's budget for good."""
    nodes = {"up": node("C500"), "down": node("C500"), "moving": node("C500"), "untolerated": node("C500")}
    pods = [("up", True), ("down", False)]
    serving, out = membership.serving(nodes, pods, frozenset(), frozenset({"moving"}))
    assert serving == {"up"} and out == {"down", "moving"}
