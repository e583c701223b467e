"""The driver pools' fault campaign of tests/runtime/pool_campaign.py run long: the whole runner in
the fake cluster with the driver's DaemonSet and two pools', under random sequences of passes,
restarts, controllers and kubelets catching up or not, nodes added, moved between racks, NotReady
and cordoned, versions and pauses per rollout; the one budget across them checked after every
pass, every node in its rack's pool at its pool's revision at the end. Prints the examples, runner
passes, driver pods deleted, pool moves written, violations and the time.

`python -m tests.bench pool_campaign`; environment: METAX_BENCH_CAMPAIGN_EXAMPLES (default 100),
METAX_BENCH_CAMPAIGN_STEPS (steps per example, default 40), METAX_BENCH_CAMPAIGN_SEED (default
random, printed). A violation ends its seed's run, printed (not shrunk); the campaign goes on
with the next seed.
"""

from __future__ import annotations

import time

from tests.bench.bench_fault_campaign import end, explore, from_environment
from tests.runtime.pool_campaign import FIGURES, PoolCampaign


def main() -> None:
    examples, steps, seed = from_environment(100)
    started = time.perf_counter()
    violations = explore(PoolCampaign, examples, steps, seed, lambda: FIGURES.examples)
    took = time.perf_counter() - started
    print(f"examples (sequences run)          {FIGURES.examples}")
    print(f"runner passes                     {FIGURES.passes}")
    print(f"driver pods deleted by the runner {FIGURES.deletions}")
    print(f"pool moves written                {FIGURES.moves}")
    print(f"time                              {took:.0f} s ({1000 * took / max(FIGURES.passes, 1):.0f} ms per pass)")
    end(violations)
