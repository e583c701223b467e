"""When the runner skips a pass: the last pass decided and wrote nothing (`Settled`), no cache it
reads has changed since that pass began (each cache's state and count of `changes`), and the
time its decision said it must run again by (`Decision.wake_at`: a pause running out, a
readiness or drain timeout) has not come.

The rollout's decision is a function of what the caches hold and of that time (the dry run,
`rollout.simulate`, steps time the same way), and the reconcile's of what the caches hold, so
the skipped pass would have decided the same; at 10,000 nodes it would have cost about a tenth
of a second of CPU. A full pass still runs at least every `FULL_PASS_EVERY` seconds.

The GPU pods' cache changes with every GPU pod that comes or goes, in a busy cluster every pass;
what a pass reads of it is less (`Inputs`): the nodes running GPU work (the rollout) and the
workload check's problems. A training job replaced by the next on its node changes neither.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from metax_operator import contract
from metax_operator.rollout import freeze
from metax_operator.runtime.informer import Informer
from metax_operator.runtime.object_cache import NotReady, ObjectCache
from metax_operator.runtime.rollout_observe import Watches
from metax_operator.runtime.workload_check import WorkloadCheck

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


class Inputs:
    """`inputs` of a runner's caches, the GPU pods' as what a pass reads of them; called with the
    caches a pass reads (the GPU pods' among them, or not started yet)."""

    def __init__(self, watches: Watches, workloads: WorkloadCheck, objects: ObjectCache):
        self.watches, self.workloads, self.objects = watches, workloads, objects
        self.seen: tuple | None = None  # the last GPU work, and the caches' inputs it was worked out from

    def __call__(self, caches: Iterable[Informer]) -> tuple:
        gpu = self.watches.gpu_pods
        others = inputs(c for c in caches if c is not gpu)
        return (*others, self.gpu_work(others))

    def gpu_work(self, others: tuple) -> tuple:
        """The nodes running GPU work and the workload check's problems for the spec in force,
        worked out again only when a cache changed; the cache's own state and count until it and
        the others it needs have listed."""
        gpu = self.watches.gpu_pods
        if not (self.watches.started and self.workloads.started and gpu.state == "synced"):
            return (gpu.state, gpu.changes)
        key = (others, gpu.changes)
        if self.seen is None or self.seen[0] != key:
            try:
                cr = self.objects.get(contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME)
            except NotReady:
                return (gpu.state, gpu.changes)
            spec = freeze.in_force(cr).spec if cr is not None else {}
            self.seen = (key, (self.watches.gpu_busy_nodes(), tuple(map(str, self.workloads.problems(spec)))))
        return self.seen[1]
