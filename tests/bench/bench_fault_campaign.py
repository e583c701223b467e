"""The fault campaign of tests/runtime/fault_campaign.py run long: the real engine and executor
against the fake API server, under random sequences of fleet, API-server, runner and admin
faults, every invariant checked after every pass. Prints the examples, steps, passes, driver
pods the runner replaced, distinct fault sequences explored and the time per step.
`python -m tests.bench fault_campaign` (env METAX_BENCH_CAMPAIGN_EXAMPLES, default 150, and
METAX_BENCH_CAMPAIGN_STEPS, default 40 steps per example).
"""

from __future__ import annotations

import logging
import os
import time

from hypothesis import HealthCheck, settings

from tests.runtime import fault_campaign


def main() -> None:
    examples = int(os.environ.get("METAX_BENCH_CAMPAIGN_EXAMPLES", "150"))
    steps = int(os.environ.get("METAX_BENCH_CAMPAIGN_STEPS", "40"))
    fault_campaign.Campaign.TestCase.settings = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    logging.getLogger("metax_operator").setLevel(logging.ERROR)  # the runner's warnings on the faults it meets
    started = time.perf_counter()
    fault_campaign.Campaign.TestCase().runTest()
    took = time.perf_counter() - started
    figures = fault_campaign.FIGURES
    print(f"examples           {figures.examples}")
    print(f"steps              {figures.steps}")
    print(f"runner passes      {figures.passes}")
    print(f"driver pods replaced by the runner  {figures.deletions}")
    print(f"distinct fault sequences  {len(figures.sequences)}")
    print(f"time               {took:.0f} s ({1000 * took / max(figures.steps, 1):.1f} ms per step)")
    print("invariant violations  0 (a violation fails the campaign with its shrunk sequence)")
