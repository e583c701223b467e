"""The driver rollouts of one runner pass: the driver DaemonSet's own and one per driver pool
(`rollout.target`), under one availability budget, and the moves of GPU nodes between them
(`rollout.membership`).

Each rollout is a `RolloutPass` on the shared watch caches and node writes. They decide one after
another; with pools, each sees the GPU nodes out of service anywhere but among its own nodes
(`Cluster.elsewhere`): those not serving as the caches show them (no Ready driver pod, cordoned)
and those the rollouts decided so far take out in this pass, so that no pool's wave exceeds the budget the others
left. Then the moves are decided on what the rollouts left. The pass writes every rollout's
status in the CR's one status write (`status_fields`), then each acts, the nodes' state labels
are written once for all of them, and the moves last.

Without pools (and no node labelled for one) there is one rollout and nothing of this costs a
thing: no node nor pod is read for the budget across rollouts, no move is decided.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from metax_operator.chart import pools, upgrade_policy
from metax_operator.chart.upgrade_policy import Policy
from metax_operator.conditions import Condition, CrCondition
from metax_operator.jsonlog import event
from metax_operator.rollout import membership
from metax_operator.rollout.membership import Moves
from metax_operator.rollout.target import DRIVER, Target
from metax_operator.runtime.kube import Client
from metax_operator.runtime.metrics import Metrics
from metax_operator.runtime.object_cache import Reader
from metax_operator.runtime.pool_nodes import PoolNodes
from metax_operator.runtime.rollout_observe import Watches
from metax_operator.runtime.rollout_pass import RolloutPass
from metax_operator.runtime.rollout_plan import GiveBack, Plan

log = logging.getLogger(__name__)

Plans = dict[Target, "Plan | GiveBack | None"]


class Rollouts:
    """Every driver rollout of the runner; `decide`, then (once the pass wrote the status) `act`."""

    def __init__(
        self,
        api: Client,
        namespace: str,
        guard: Callable[[], bool],
        identity: str,
        clock: Callable[[], float] = time.time,
        watches: Watches | None = None,
        metrics: Metrics | None = None,
        reader: Reader | None = None,
    ):
        make = lambda target, nodes=None: RolloutPass(  # noqa: E731
            api, namespace, guard, identity, clock, watches, metrics, reader, target=target, nodes=nodes
        )
        self.driver = make(DRIVER)
        self.watches, self.nodes = self.driver.watches, self.driver.nodes
        self.pool_nodes = PoolNodes(api, self.watches.resync)
        self._make = lambda target: make(target, self.nodes)
        self.passes: dict[Target, RolloutPass] = {DRIVER: self.driver}
        self.moves = Moves()
        self.pooled = False  # whether the last pass had pools (or nodes labelled for one)

    def close(self) -> None:
        self.driver.close()  # the watch caches, which every rollout shares
        self.pool_nodes.stop()

    def decide(self, cr: dict, specs: dict[Target, dict], policy: Policy | None) -> Plans:
        """Each target's plan (`RolloutPass.decide`) on the spec it acts on and its policy (the
        driver's as the pass validated it, None when the spec is invalid; a pool's read from its
        spec: the pool's keys over the driver's, validated with the spec), the driver's first,
        then the moves."""
        policies = {t: policy if t == DRIVER or policy is None else pool_policy(t, cr.get("spec") or {}, specs[t]) for t in specs}
        self.passes = {t: self.passes.get(t) or self._make(t) for t in specs}
        for rollout in self.passes.values():
            rollout.every_state = self._every_state
        self.pooled = len(specs) > 1 or bool(self.watches.pooled.snapshot())
        self.moves = Moves()
        if not self.pooled:
            return {DRIVER: self.driver.decide(cr, specs[DRIVER], policies[DRIVER])}
        nodes = {name: state.labels for name, state in self.watches.nodes.snapshot().items()}
        pods = ((p.pod.node, p.pod.ready and p.pod.deleting is None) for p in self.watches.driver_pods.snapshot().values())
        swapping = frozenset(self.watches.cordoned.snapshot())  # the runner's own cordons
        serving, out = membership.serving(nodes, pods, self.watches.nodes.cordoned(), swapping)
        plans: Plans = {}
        for target, rollout in self.passes.items():
            plan = rollout.decide(cr, specs[target], policies[target], out)
            plans[target] = plan
            if isinstance(plan, Plan):  # what its actions take out of service in this pass
                out |= frozenset(ref.node for ref in plan.decision.delete) | frozenset(plan.decision.cordon)
        # A wave's nodes stay in `resume.wave` once back: those still out of service are being swapped.
        waves = out & frozenset(n for p in plans.values() if isinstance(p, Plan) for n in p.decision.status.resume.wave)
        busy = frozenset(p.node for p in self.watches.gpu_pods.snapshot().values() if p.node and p.workload)
        selected = self.pool_nodes.selected(pools.pools_of((cr.get("spec") or {}).get("driver")))
        decided = lambda t: policies.get(t) if isinstance(plans.get(t), Plan) else None  # noqa: E731
        if selected is not None and all(plan is not None for plan in plans.values()):  # no node unseen
            self.moves = membership.decide(nodes, selected, serving, busy, waves, out, decided)
            if self.moves.waiting:
                event(
                    log,
                    "rollout-moves-waiting",
                    logging.DEBUG,
                    **{reason.replace(" ", "_"): nodes for reason, nodes in self.moves.waiting.items()},
                )
        return plans

    def _every_state(self) -> tuple[dict, set[str]]:
        """The nodes' states of every rollout, and the nodes whose retry label is done."""
        rollouts = self.passes.values()
        states = {node: state for rollout in rollouts for node, state in rollout.states.items()}
        return states, set().union(*(rollout.retry_done for rollout in rollouts))

    def condition(self, cr: dict) -> Condition | None:
        """DriverPoolsDisjoint, in a pass with pools (or once set: True again without them)."""
        had = any(c.get("type") == CrCondition.POOLS_DISJOINT for c in (cr.get("status") or {}).get("conditions") or ())
        return membership.condition(self.moves) if self.pooled or had else None

    def status_fields(self, cr: dict, plans: Plans) -> dict | None:
        """The CR status fields every rollout's plan writes (`Target.status_fields`): the driver's
        `upgradeStatus`, the pools' `pools` (a pool no longer in the spec loses its entry)."""
        status = dict(cr.get("status") or {})
        fields: dict = {}
        for target, plan in plans.items():
            if plan is not None and plan.upgrade_status is not None:
                fields.update(target.status_fields({**status, **fields}, plan.upgrade_status))
        known = {t.pool for t in self.passes}
        entries = fields.get("pools", status.get("pools"))
        if isinstance(entries, list) and any(e.get("name") not in known for e in entries if isinstance(e, dict)):
            fields["pools"] = [e for e in entries if isinstance(e, dict) and e.get("name") in known]
        return fields or None

    def act(self, cr: dict, plans: Plans) -> int:
        """Each rollout's actions (the state labels of every rollout's nodes with them), then the
        moves; the number of writes. A refusal of one rollout's actions is raised once the others
        acted."""
        writes, refused = 0, None
        for target, plan in plans.items():
            if plan is None:
                continue
            try:
                writes += self.passes[target].act(cr, plan)
            except Exception as err:  # noqa: BLE001 - raised below, once every rollout acted
                refused = refused or err
        self.nodes.begin()
        writes += self.nodes.move(self.moves.label, self.moves.cordon)
        if refused is not None:
            raise refused
        if self.nodes.refused:
            raise self.nodes.refused[0]
        return writes

    def without_cr(self) -> int:
        return self.driver.without_cr()


def pool_policy(target: Target, cr_spec: dict, spec: dict) -> Policy:
    """A driver pool's upgrade policy, from the spec it acts on (`Target.spec`), named where the
    pool is in the CR's spec."""
    return upgrade_policy.build(((spec.get("driver") or {}).get("upgradePolicy")) or {}, target.policy_field(cr_spec))
