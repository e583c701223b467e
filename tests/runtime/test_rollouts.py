"""The runner's rollouts together (`runtime.rollouts`): where each one's status goes in the CR's
one status write, and the pools' condition. The rollouts on the API server:
tests/e2e/test_driver_pools.py."""

from __future__ import annotations

from metax_operator.conditions import CrCondition
from metax_operator.rollout.target import DRIVER, Target
from metax_operator.runtime.rollout_plan import GiveBack
from metax_operator.runtime.rollouts import Rollouts
from tests.fakeapi import FakeApi

NS = "metax-operator"


def test_each_rollouts_status_has_its_place_and_a_pool_gone_loses_its_entry():
    with FakeApi() as fake:
        rollouts = Rollouts(fake.client(), NS, lambda: True, "runner-0")
        rollouts.passes = {DRIVER: rollouts.driver, Target("rack-a"): rollouts.driver}  # as decide leaves them
        cr = {"status": {"upgradeStatus": {"phase": "Idling"}, "pools": [{"name": "gone", "upgradeStatus": {"phase": "Idling"}}]}}
        plans = {DRIVER: GiveBack([], {"phase": "Disabled"}), Target("rack-a"): GiveBack([], {"phase": "Progressing"})}
        assert rollouts.status_fields(cr, plans) == {
            "upgradeStatus": {"phase": "Disabled"},
            "pools": [{"name": "rack-a", "upgradeStatus": {"phase": "Progressing"}}],
        }
        assert rollouts.status_fields({"status": {}}, {DRIVER: None}) is None  # nothing decided: nothing written


def test_the_pools_condition_is_set_with_pools_and_set_true_again_once_they_are_gone():
    with FakeApi() as fake:
        rollouts = Rollouts(fake.client(), NS, lambda: True, "runner-0")
        assert rollouts.condition({}) is None  # never had pools: no condition at all
        rollouts.moves.overlaps = {"n1": ["a", "b"]}
        rollouts.pooled = True
        assert rollouts.condition({}).status == "False"
        rollouts.pooled, rollouts.moves.overlaps = False, {}
        had = {"status": {"conditions": [{"type": CrCondition.POOLS_DISJOINT, "status": "False"}]}}
        assert rollouts.condition(had).status == "True"
