"""The driver pools' fault campaign (tests/runtime/pool_campaign.py), short and replayed, and under
planted faults (a rollout blind to the nodes the other rollouts have out of service, moves outside
the budget), to show it finds each: a check that cannot fail would prove nothing."""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import Phase, settings

from metax_operator.rollout import membership
from metax_operator.runtime.rollout_pass import RolloutPass
from tests.runtime.pool_campaign import PoolCampaign
from tests.runtime.test_fault_campaign import SHORT
from tests.runtime.test_fault_campaign import run as fault_campaign_run


def run(how: settings) -> None:
    fault_campaign_run(PoolCampaign, how)


def test_one_budget_holds_across_the_driver_and_its_pools_whatever_happens_to_the_fleet():
    run(SHORT)


def test_a_rollout_blind_to_the_other_rollouts_nodes_out_of_service_is_found():
    """Planted: each rollout decides as if the others had nothing out of service (no `elsewhere`)."""
    decide = RolloutPass.decide

    def blind(self, cr, spec, policy, elsewhere=frozenset()):
        return decide(self, cr, spec, policy, frozenset())

    with mock.patch.object(RolloutPass, "decide", blind), pytest.raises(AssertionError, match="taken while"):
        run(settings(SHORT, max_examples=40, phases=[Phase.explicit, Phase.generate]))


def test_moves_outside_the_budget_are_found():
    """Planted: every serving node whose pool changed moves at once, whatever the budget."""

    def unbounded(policy, candidates, total, busy, out_of_service, waiting):
        return [] if policy is None or policy.pause else list(candidates)

    with mock.patch.object(membership, "_taken", unbounded), pytest.raises(AssertionError, match="taken while"):
        run(settings(SHORT, max_examples=40, phases=[Phase.explicit, Phase.generate]))
