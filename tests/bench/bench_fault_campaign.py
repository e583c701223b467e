"""The fault campaign of tests/runtime/fault_campaign.py run long: the whole runner (its Helm hold,
freeze, reconcile, engine and executor) in the fake cluster, under random sequences of fleet,
API-server, runner, Helm and admin faults, every invariant checked after every pass. Prints the
examples, steps, runner passes, driver pods the runner replaced, kills and the write positions
they hit, the most writes one pass sent, retries and rollbacks checked, distinct sequences and
the time per step. `python -m tests.bench fault_campaign` (env METAX_BENCH_CAMPAIGN_EXAMPLES,
default 200, and METAX_BENCH_CAMPAIGN_STEPS, default 40 steps per example); a violation stops it
with the shrunk sequence.
"""

from __future__ import annotations

import logging
import os
import time

from hypothesis import HealthCheck, settings

from tests.runtime import fault_campaign


def main() -> None:
    examples = int(os.environ.get("METAX_BENCH_CAMPAIGN_EXAMPLES", "200"))
    steps = int(os.environ.get("METAX_BENCH_CAMPAIGN_STEPS", "40"))
    fault_campaign.Campaign.TestCase.settings = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    for name in ("metax_operator", "urllib3"):  # the runner's warnings on the faults it meets
        logging.getLogger(name).setLevel(logging.CRITICAL)
    started = time.perf_counter()
    fault_campaign.Campaign.TestCase().runTest()
    took = time.perf_counter() - started
    figures = fault_campaign.FIGURES
    print(f"examples (sequences run)          {figures.examples}")
    print(f"distinct sequences                {len(figures.sequences)}")
    print(f"steps                             {figures.steps}")
    print(f"runner passes                     {figures.passes}")
    print(f"driver pods replaced by the runner  {figures.deletions}")
    print(f"runner killed mid-pass            {figures.kills} (at writes {compact(figures.kill_positions)})")
    print(f"most writes in one pass           {figures.most_writes}")
    print(f"retries checked (a)               {figures.retries}")
    print(f"rollbacks ended, checked (c)      {figures.rollbacks}")
    print(f"time                              {took:.0f} s ({1000 * took / max(figures.steps, 1):.0f} ms per step)")
    print("invariant violations              0 (a violation stops the campaign with its shrunk sequence)")


def compact(numbers: set[int]) -> str:
    """1, 2, 3, 5 -> '1-3, 5'."""
    runs, out = sorted(numbers), []
    for n in runs:
        if out and out[-1][1] == n - 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in out) or "none"
