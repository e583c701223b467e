"""Whether the rollout is at rest: a pass over the same observation would decide the same at any
later time, whatever GPU work starts or ends meanwhile.

The runner then leaves the rollout out of a pass whose caches hold nothing new since
(`runtime.rollout_pass`): at 10,000 nodes the rollout's part is most of a pass, and an idle
fleet's passes are most of the runner's CPU.

At rest: the engine's decision does nothing (no action, no event, no time to run again, the
status as it was read), the DaemonSet controller has caught up, no rollout is under way, no pod
is being deleted, no node waits for a retry, and every eligible node runs a driver pod of the
current revision that is Ready and validated, or has failed for good (a readiness timeout
already past stays past). The clock and GPU work are read only by rules for pods still to swap
or coming up, validations running and rollouts under way: none is left then. The last wave's
nodes stay in the status as a record; they change nothing then.
tests/rollout/test_rest.py checks this over every state the engine's simulations reach.
"""

from __future__ import annotations

from metax_operator.chart.upgrade_policy import Policy
from metax_operator.rollout.decision import Decision
from metax_operator.rollout.observation import Cluster, ValidationOutcome, failed, validation_outcome
from metax_operator.rollout.status import UpgradeStatus


def at_rest(observed: Cluster, policy: Policy, before: UpgradeStatus | None, decision: Decision, now: float) -> bool:
    """Whether `decision`, made at `now` on `observed` with the stored status `before`, is the
    decision of a rollout at rest."""
    status = decision.status
    if (
        decision.set_pause is not None
        or decision.status_once_paused is not None
        or decision.restore is not None
        or decision.cordon
        or decision.evict
        or decision.delete
        or decision.uncordon
        or decision.validate
        or decision.verdicts
        or decision.events
        or decision.observe_health
        or decision.wake_at is not None
    ):
        return False
    if before is None or status != before or status.upgrading:
        return False
    if not observed.caught_up or observed.retry or any(p.deleting is not None for p in observed.pods):
        return False
    live, timeout, wave = observed.node_pods.live, policy.readiness_timeout_ms / 1000, set(status.resume.wave)
    for node in observed.nodes:
        pod = live.get(node)
        if pod is None or pod.revision != observed.current_revision:
            return False
        if pod.ready:
            if validation_outcome(pod, node in wave, policy.validation, now)[0] is ValidationOutcome.VALIDATING:
                return False
        elif not failed(pod, now, timeout):
            return False
    return True
