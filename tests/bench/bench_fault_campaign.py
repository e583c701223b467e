"""The fault campaign of tests/runtime/fault_campaign.py run long: the whole runner (its Helm hold,
freeze, reconcile, engine and executor) in the fake cluster, under random sequences of fleet,
API-server, runner, Helm and admin faults, every invariant checked after every pass. Prints the
examples, steps, runner passes, driver pods the runner replaced, kills and the write positions
they hit, the most writes one pass sent, retries and rollbacks checked, distinct sequences,
violations and the time, and a line of progress every `PROGRESS` examples. Then, in a fixed
example (`fault_campaign.SWEPT`), it kills the runner at each write of the pass that writes most,
one fresh example per write (counted among the examples and kills above).

`python -m tests.bench fault_campaign`; environment: METAX_BENCH_CAMPAIGN_EXAMPLES (default 200),
METAX_BENCH_CAMPAIGN_STEPS (steps per example, default 40), METAX_BENCH_CAMPAIGN_SEED (default
random, printed: the same seed and settings replay the same sequences, threads permitting). A
violation ends its seed's run, printed with its steps (not shrunk: that takes many minutes);
the campaign goes on with the next seed until it has run the examples asked, then lists them.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable

import hypothesis
from hypothesis import HealthCheck, Phase, settings

from tests.runtime import fault_campaign

PROGRESS = 10


class Campaign(fault_campaign.Campaign):
    """The campaign, saying how far it got every `PROGRESS` examples."""

    started = time.perf_counter()

    last: list[str] = []  # the steps of the example running (or that ended last)

    def teardown(self) -> None:
        Campaign.last = list(self.trace)
        super().teardown()
        if fault_campaign.FIGURES.examples % PROGRESS == 0:
            print(summary(fault_campaign.FIGURES, time.perf_counter() - self.started), flush=True)


def from_environment(examples: int) -> tuple[int, int, int]:
    """The examples, steps per example and first seed the environment asks for (`examples` by
    default), printed; the runner's warnings on the faults it meets silenced."""
    examples = int(os.environ.get("METAX_BENCH_CAMPAIGN_EXAMPLES", str(examples)))
    steps = int(os.environ.get("METAX_BENCH_CAMPAIGN_STEPS", "40"))
    seed = int(os.environ.get("METAX_BENCH_CAMPAIGN_SEED") or random.randrange(2**32))
    print(f"seed {seed}, {examples} examples of {steps} steps", flush=True)
    for name in ("metax_operator", "urllib3"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    return examples, steps, seed


def main() -> None:
    examples, steps, seed = from_environment(200)
    figures = fault_campaign.FIGURES
    Campaign.started = time.perf_counter()
    violations = explore(Campaign, examples, steps, seed, lambda: figures.examples, lambda: ", ".join(Campaign.last))
    swept = time.perf_counter()
    try:
        at_pass, writes = fault_campaign.killed_at_every_write()
        sweep = f"pass {at_pass + 1} after the version's change, {writes} writes: killed at each, 0 violations"
    except Exception as err:  # noqa: BLE001 - a violation: listed with the others
        violations.append(f"kill at every write: {first_line(err)}")
        sweep = f"VIOLATION: {first_line(err)}"
    swept = time.perf_counter() - swept
    took = time.perf_counter() - Campaign.started
    print(f"examples (sequences run)          {figures.examples}")
    print(f"distinct sequences                {len(figures.sequences)}")
    print(f"steps                             {figures.steps}")
    print(f"runner passes                     {figures.passes}")
    print(f"driver pods deleted by the runner {figures.deletions}")
    print(f"runner killed mid-pass            {figures.kills} (at writes {compact(figures.kill_positions)})")
    print(f"most writes in one pass           {figures.most_writes}")
    print(f"retries checked (a)               {figures.retries}")
    print(f"rollbacks ended, checked (c)      {figures.rollbacks}")
    print(f"kill at every write of a pass     {sweep} ({swept:.0f} s)")
    print(f"time                              {took:.0f} s ({1000 * took / max(figures.steps, 1):.0f} ms per step)")
    end(violations)


def end(violations: list[str]) -> None:
    """Print the violations found; exit 1 if any."""
    print(f"invariant violations              {len(violations)}")
    for line in violations:
        print(f"  {line}")
    if violations:
        raise SystemExit(1)


def explore(
    case, examples: int, steps: int, seed: int, done: Callable[[], int], steps_of: Callable[[], str] | None = None
) -> list[str]:
    """Run the state machine `case` until `done()` counts `examples`, from `seed` on: a violation
    is printed with its steps (`steps_of()`, else hypothesis's notes of the failing example) and
    ends its seed's run, the next seed goes on. The violations found."""
    violations = []
    while done() < examples:
        case.TestCase.settings = settings(
            max_examples=examples - done(),
            stateful_step_count=steps,
            deadline=None,
            database=None,
            phases=[Phase.generate],  # a violation is printed as found: shrinking it takes many minutes
            suppress_health_check=list(HealthCheck),
        )
        hypothesis.seed(seed)(case)
        try:
            case.TestCase().runTest()
        except Exception as err:  # noqa: BLE001 - a violation: go on with the next seed
            violations.append(f"seed {seed}: {first_line(err)}")
            print(f"VIOLATION (seed {seed}, after {done()} examples): {first_line(err)}", flush=True)
            steps_run = steps_of() if steps_of else "\n".join(getattr(err, "__notes__", ()))
            print(f"  its steps: {steps_run}", flush=True)
        seed += 1
    return violations


def first_line(err: BaseException) -> str:
    """The violation's message (the first of a group's)."""
    while getattr(err, "exceptions", None):
        err = err.exceptions[0]
    line = str(err).splitlines()[0]
    cause = err.__cause__ or err.__context__
    if line.startswith("Inconsistent data generation") and cause is not None:  # its replay drew differently
        return f"{line} (the failure replayed: {first_line(cause)})"
    return line


def summary(figures: fault_campaign.Figures, took: float) -> str:
    return (
        f"{figures.examples} examples, {len(figures.sequences)} distinct, {figures.steps} steps, {figures.passes} passes, "
        f"{figures.deletions} deletions, {figures.kills} kills, {took:.0f} s"
    )


def compact(numbers: set[int]) -> str:
    """1, 2, 3, 5 -> '1-3, 5'."""
    runs, out = sorted(numbers), []
    for n in runs:
        if out and out[-1][1] == n - 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in out) or "none"
