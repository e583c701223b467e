"""The fault campaign of tests/runtime/fault_campaign.py, short: `make bench` runs it long."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from tests.runtime import fault_campaign

# Derandomized: `make test` replays the same sequences every run; `make bench` explores new ones.
SHORT = settings(
    max_examples=6,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def test_the_whole_runner_stays_within_the_policy_whatever_happens_to_the_fleet():
    fault_campaign.Campaign.TestCase.settings = SHORT
    fault_campaign.Campaign.TestCase().runTest()
    figures = fault_campaign.FIGURES
    assert figures.deletions > 0 and len(figures.sequences) > 1, figures
