"""When the runner skips a pass: the last pass decided and wrote nothing (`Settled`), no cache it
reads has changed since that pass began (each cache's state and count of `changes`), and the
time its decision said it must run again by (`Decision.wake_at`: a pause running out, a
readiness or drain timeout) has not come.

The rollout's decision is a function of what the caches hold and of that time (the dry run,
`rollout.simulate`, steps time the same way), and the reconcile's of what the caches hold, so
the skipped pass would have decided the same; at 10,000 nodes it would have cost about a tenth
of a second of CPU. A full pass still runs at least every `FULL_PASS_EVERY` seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from metax_operator.runtime.informer import Informer

#: Seconds an unchanged cluster goes without a full pass at most: the safety net, as a cache's
#: resync is, for a time a decision depends on and did not name.
FULL_PASS_EVERY = 60.0


def inputs(caches: Iterable[Informer]) -> tuple:
    """What the caches hold, as far as a pass can tell it changed: each one's state and count of
    changes."""
    return tuple((id(cache), cache.state, cache.changes) for cache in caches)


@dataclass(frozen=True)
class Settled:
    """A pass that decided and wrote nothing: the `inputs` of the caches when it began, and until
    when its decision holds."""

    inputs: tuple
    until: float

    @classmethod
    def after(cls, inputs: tuple, now: float, wake_at: float | None) -> Settled:
        """Settled by a pass at `now` whose decision runs again by `wake_at` (None: no time)."""
        return cls(inputs, min(now + FULL_PASS_EVERY, wake_at if wake_at is not None else float("inf")))

    def holds(self, inputs: tuple, clock: Callable[[], float]) -> bool:
        """Whether a pass over caches holding `inputs` would decide the same (the clock read only
        when they are unchanged)."""
        return inputs == self.inputs and clock() < self.until
