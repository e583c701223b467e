"""The staged rollout of one driver DaemonSet (`rollout.target`: the driver's own, or a driver
pool's), as an imperative shell: its part of every runner pass (`runtime.rollouts`).

`RolloutPass.decide`: on the CR the pass observed, the spec it acts on and the policy it validated,
and the DaemonSet (from `runtime.object_cache`, with the template the pass just applied), snapshot
the watch caches (`rollout_observe`) and let the engine decide (`engine.decide`). The pass writes
the intended rollout status with the rest of the CR's status, once (a PUT carrying the
resourceVersion read: on a conflict the pass stops without acting), then the rollout acts
(`RolloutPass.act`), in order:

- set the target's `upgradePolicy.pause` (a JSON patch whose `test` op checks the value the engine
  saw, so an admin's concurrent edit wins: `rollout.cr_patch`), and once the runner's own pause
  landed, write the status that says so (`Decision.status_once_paused`);
- roll back (`Decision.restore`): first set the CR's spec back to the one that gives the stable
  revision's template, so the reconcile does not re-apply the abandoned version, then patch the
  DaemonSet with the stable ControllerRevision's data, as `kubectl rollout undo`;
- cordon and drain the wave nodes whose work must end first, then delete their driver pods
  (`Decision.cordon`, `.evict`, `.delete`: the batches of `rollout_nodes.NodeActions`);
- at a step's pause under the health gate, read a snapshot of the nodes' health when the last
  decision asked for one (`node_health.read`) and hand the latest to every decision after it;
- create a validation pod for each Ready wave pod the engine names, and record the validations
  that ended on their driver pods (`Decision.validate`, `.verdicts`);
- uncordon the nodes the runner cordoned whose driver is back, emit the engine's Events;
- label each node with its upgrade state (`rollout.node_state`) where the label differs, after the
  deletions, with every rollout's nodes (`every_state`), and remove an admin's retry label once
  the node's retry is done. At most `rollout_nodes.STATE_WRITES_PER_PASS` nodes a pass, those in
  a wave first: a fleet's first labelling never delays a swap.

A rollout at rest (`rollout.rest`) is not decided again while the CR, the DaemonSet and the
caches it reads hold nothing new (`Watches.changes`): the pass reuses its plan, which does nothing.
A pass the rollout cannot decide (an invalid policy, no DaemonSet, no CR) still gives back the
runner's cordons whose driver is back (`GiveBack`); without the CR the state labels go.

The lease is checked before every write (and before each node's of a batch); one node's refusal
does not stop the others, and the pass then fails with the first refusal (RunnerHealthy=False
names it). Every action is safe to repeat: a runner killed between any two of them resumes from
the status it wrote and what the cluster shows. This module decides nothing: what to do is the
engine's `Decision`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from kubernetes.client.exceptions import ApiException

from metax_operator import contract
from metax_operator.chart.upgrade_policy import Policy, validation_asked
from metax_operator.conditions import rfc3339
from metax_operator.contract import RUNNER_FIELD_MANAGER
from metax_operator.jsonlog import event
from metax_operator.rollout import engine, node_state
from metax_operator.rollout.cr_patch import pause_patch, restore_patch
from metax_operator.rollout.health_gate import HealthSnapshot
from metax_operator.rollout.node_state import NodeUpgradeState
from metax_operator.rollout.observation import driver_back
from metax_operator.rollout.rest import at_rest
from metax_operator.rollout.restore import Restore, without_policy
from metax_operator.rollout.status import Resume, UpgradeStatus
from metax_operator.rollout.target import DRIVER, Target
from metax_operator.runtime import cr_status, node_health, validation_pod
from metax_operator.runtime.informer import SYNC_TIMEOUT
from metax_operator.runtime.kube import Client
from metax_operator.runtime.metrics import Metrics
from metax_operator.runtime.object_cache import Reader
from metax_operator.runtime.rollout_nodes import NodeActions
from metax_operator.runtime.rollout_observe import Watches
from metax_operator.runtime.rollout_plan import GiveBack, Plan

log = logging.getLogger(__name__)


class RolloutPass:
    """The rollout's part of every runner pass: `decide`, then, once the pass wrote the status,
    `act`. Keeps its watch caches between passes."""

    def __init__(
        self,
        api: Client,
        namespace: str,
        guard: Callable[[], bool],
        identity: str = "",
        clock: Callable[[], float] = time.time,
        watches: Watches | None = None,
        metrics: Metrics | None = None,
        reader: Reader | None = None,
        target: Target = DRIVER,
        nodes: NodeActions | None = None,
    ):
        self.api, self.namespace, self.guard, self.identity, self.clock = api, namespace, guard, identity, clock
        self.reader: Reader = reader or api  # where the DaemonSet is read (`object_cache`), else live
        self.watches = watches or Watches(api, namespace)
        self.metrics = metrics
        self.target = target
        # The node writes, shared by the rollouts of every driver DaemonSet of the runner.
        self.nodes = nodes or NodeActions(api, namespace, self.watches, self._check)
        # Its nodes' states as its last decision gave them, and the nodes whose admin's retry label
        # the pass is done with; `every_state` gives those of every rollout of the runner (driver
        # pools: `Rollouts`), which the state labels are written from.
        self.states: dict[str, NodeUpgradeState] = {}
        self.retry_done: set[str] = set()
        self.every_state: Callable[[], tuple[dict[str, NodeUpgradeState], set[str]]] = lambda: (self.states, self.retry_done)
        self.health: HealthSnapshot | None = None  # the latest snapshot of the nodes' health (`node_health`)
        self.health_asked = False  # the last decision asked for a new one
        self.at_rest: Plan | None = None  # the last plan, when the rollout is at rest (`rest.at_rest`)

    def close(self) -> None:
        self.watches.stop()

    def _caches_ready(self) -> bool:
        """Whether the watch caches can be decided on (started at the first call): listed, and
        none failing (a GPU job started since a watch broke would not be seen: no node is taken)."""
        self.watches.start()
        if not self.watches.wait_synced(SYNC_TIMEOUT):
            event(log, "rollout-wait-cache", logging.WARNING, msg="the watch caches have not listed yet")
            return False
        failing = self.watches.failing()
        if failing:
            event(
                log,
                "rollout-wait-cache",
                logging.WARNING,
                msg=f"the watch caches {', '.join(failing)} are failing: the rollout waits until they list again",
            )
            return False
        return True

    def decide(
        self, cr: dict, spec: dict, policy: Policy | None, elsewhere: frozenset[str] = frozenset()
    ) -> Plan | GiveBack | None:
        """The engine's decision on `cr` (as stored), acting on `spec` (`freeze.in_force`) and its
        upgrade policy as the pass validated it (None: invalid), with what the watch caches and the
        DaemonSet show now and the GPU nodes out of service in any rollout (`elsewhere`);
        None when there is nothing to decide on yet (caches not listed or failing). An invalid
        policy or no DaemonSet: the runner's cordons that may go (`GiveBack`)."""
        self.retry_done = set()
        if not self._caches_ready():
            return None
        stored = self.target.stored(cr.get("status"))
        ds = self.reader.get("apps/v1", "DaemonSet", self.target.daemonset, self.namespace)
        if policy is None:  # reported as SpecValid=False by the reconcile
            event(log, "rollout-invalid-policy", logging.WARNING, msg="the upgrade policy is invalid: the rollout waits")
            return self._give_back(ds, cr, spec, stored)
        waited = self.watches.wait_for(policy.wait_selector)
        if waited is not None and (not waited.wait_synced(SYNC_TIMEOUT) or waited.state != "synced"):
            event(
                log,
                "rollout-wait-cache",
                logging.WARNING,
                msg=f"the cache of pods matching waitForCompletion.podSelector {policy.wait_selector!r} is {waited.state}",
            )
            return None
        if ds is None:
            event(log, "rollout-no-daemonset", logging.DEBUG, msg=f"no DaemonSet {self.target.daemonset}")
            return self._give_back(ds, cr, spec, stored)
        read = self._read(cr, ds, elsewhere)
        if self.at_rest is not None and read is not None and read == self.at_rest.read:
            return self.at_rest  # nothing new: the same decision, which does nothing
        self.at_rest = None
        observed = self.watches.observe(ds, cr, stored, spec, self.target, elsewhere).observed
        before = UpgradeStatus.from_json(stored) if stored is not None else None
        now = self.clock()
        if policy.health_gate is not None:
            if self.health_asked:
                self.health = node_health.read(self.api, self.namespace, now)
            observed = dataclasses.replace(observed, health=self.health)
        decision = engine.decide(observed, policy, before, now)
        self.health_asked = decision.observe_health
        reusable = read if at_rest(observed, policy, before, decision, now) else None
        return Plan(decision, policy.pause, stored, now, observed, policy, reusable)

    def _read(self, cr: dict, ds: dict, elsewhere: frozenset[str]) -> tuple | None:
        """What a rollout at rest decides on, as versions: the CR (spec, so policy, and status),
        the DaemonSet, the caches, the other rollouts' nodes out of service; None while they may
        miss the runner's writes or the health gate waits."""
        if self.watches.deleted or self.nodes.unseen_writes or self.health_asked:
            return None
        versions = cr["metadata"].get("resourceVersion"), ds["metadata"]["uid"], ds["metadata"].get("resourceVersion")
        return *versions, *self.watches.changes(), elsewhere

    def _give_back(self, ds: dict | None, cr: dict, spec: dict, stored: dict | None) -> GiveBack | None:
        """The runner's cordons to lift when the rollout cannot decide: with the DaemonSet, those
        `driver_back` gives for the stored wave (a node whose driver is down, being swapped or
        validated, as far as the policy can be read, stays cordoned); without it no driver is
        coming, so every one."""
        if ds is None:
            nodes = set(self.watches.cordoned.snapshot().values())
        else:
            resume = UpgradeStatus.from_json(stored).resume if stored is not None else Resume()
            validation = validation_asked(((spec.get("driver") or {}).get("upgradePolicy")))
            observed = self.watches.observe(ds, cr, stored, spec, self.target).observed
            nodes = driver_back(observed, resume, set(), validation, self.clock())
        return GiveBack(sorted(nodes), stored) if nodes else None

    def without_cr(self) -> int:
        """No CR (deleted, or not made yet): the rollout is gone. Give back the nodes the runner
        cordoned whose driver is back and drop the nodes' state labels; the number of writes."""
        if not self._caches_ready():
            return 0
        ds = self.reader.get("apps/v1", "DaemonSet", self.target.daemonset, self.namespace)
        give_back = self._give_back(ds, {}, {}, None)
        self.nodes.begin()
        writes = self.nodes.uncordon(give_back.nodes if give_back else [])
        writes += self.nodes.label({}, set())
        if self.nodes.refused:
            raise self.nodes.refused[0]
        return writes

    def act(self, cr: dict, plan: Plan | GiveBack) -> int:
        """Carry out `plan` on the CR `cr` as the pass's status write left it: the actions in
        order; the number of writes."""
        if isinstance(plan, GiveBack):
            return self.nodes.uncordon(plan.nodes)
        if plan is self.at_rest:
            return 0
        decision, requests = plan.decision, self.api.requests
        if self.metrics is not None:
            before = UpgradeStatus.from_json(plan.stored) if plan.stored is not None else None
            if self.target == DRIVER:
                self.metrics.rollout_pass(before, decision.status, self.clock())
                self.metrics.health_gate(decision.health_compared)
            else:
                self.metrics.pool_rollout(self.target.pool, decision.status)
        writes = self._act(cr, plan)
        status_written = decision.status.to_json() != plan.stored  # by the pass, just before
        if plan.read is not None and not writes and not status_written:
            self.at_rest = plan  # reused while the passes read the same
        step = decision.status.step
        stats = self.watches.stats()
        event(
            log,
            "rollout-pass",
            logging.INFO if writes else logging.DEBUG,
            rollout=str(self.target),
            writes=writes + status_written,
            phase=decision.status.phase,
            step=step.current_step_index,
            state=step.current_step_state,
            upgraded=step.total_upgrade_ready_replicas,
            total=step.total_upgrade_replicas,
            deleted=[p.name for p in decision.delete],
            message=decision.status.message,
            requests=self.api.requests - requests,
            cache_requests=stats.requests,
            cache_bytes=stats.bytes,
            cache_events=stats.events,
        )
        return writes

    def _act(self, cr: dict, plan: Plan) -> int:
        """The decision's actions after its status write, in order; the number of writes. Raises
        the first per-node refusal once every action was tried."""
        decision, writes = plan.decision, 0
        self.nodes.begin()
        if decision.set_pause is not None:
            writes += self._set_pause(cr, decision.set_pause, plan.pause_seen, decision.status_once_paused)
        if decision.restore is not None:
            writes += self._restore(cr, decision.restore)
        writes += self.nodes.drain(decision.cordon, decision.evict)
        deleted, delete_writes = self.nodes.delete(decision.delete, decision.cordon_first, decision.work_check, plan.now)
        writes += delete_writes + self._validate(plan) + self.nodes.record(decision.verdicts)
        states = None
        if plan.observed is not None and plan.policy is not None:
            states = node_state.states(plan.observed, decision, plan.policy, plan.now, deleted)
        writes += self.nodes.uncordon(decision.uncordon, states)
        for item in decision.events:
            self._check()
            if self.target != DRIVER:  # whose rollout: one CR's Events tell every pool's
                item = dataclasses.replace(item, message=f"{self.target}: {item.message}")
            writes += cr_status.emit_event(self.api, cr, item, rfc3339(self.clock()), self.identity)
        if states is not None:
            self.states = states
            self.retry_done = {n for n in plan.observed.retry if n in deleted or states.get(n) != NodeUpgradeState.FAILED}
            every, retry_done = self.every_state()
            if self.metrics is not None:
                self.metrics.node_states(every)
            writes += self.nodes.label(every, retry_done)
        if self.nodes.refused:
            raise self.nodes.refused[0]
        return writes

    def _validate(self, plan: Plan) -> int:
        """Create the validation pods the engine asked for, from the driver DaemonSet's template."""
        validation = plan.policy.validation if plan.policy is not None else None
        if not plan.decision.validate or validation is None or plan.observed is None:
            return 0
        template = plan.observed.daemonset["spec"]["template"]
        return self.nodes.validate(
            [validation_pod.manifest(p, self.namespace, template, validation) for p in plan.decision.validate]
        )

    def _set_pause(self, cr: dict, value: bool, seen: bool, then: UpgradeStatus | None) -> int:
        """JSON patch of the target's upgradePolicy.pause (spec.driver's, or its pool's), only if it
        still holds what the engine saw; once it landed, the status `then` (if any) is written on
        the patched CR."""
        spec = cr.get("spec") or {}
        pointer = self.target.policy_pointer(spec)
        if pointer is None:  # the pool is gone from the CR: nothing to pause
            return 0
        self._check()
        patch = pause_patch(spec, self.target, pointer, seen, value)
        try:
            patched = self.api.patch(
                contract.CR_API_VERSION,
                contract.CR_KIND,
                contract.CR_NAME,
                patch,
                patch_type="json",
                field_manager=RUNNER_FIELD_MANAGER,
            )
        except ApiException as err:
            if err.status not in (409, 422):  # 422: the test failed, an admin changed it meanwhile
                raise
            event(log, "rollout-pause-skipped", msg=f"{pointer}/pause changed meanwhile")
            return 0
        event(log, "rollout-set-pause", pause=value, rollout=str(self.target))
        if then is not None:
            now = rfc3339(self.clock())
            fields = self.target.status_fields(patched.get("status"), then.to_json())
            confirmed = cr_status.write_status(self.api, patched, [], self.guard, now, applied=False, rollout=fields)
            return 1 + confirmed.writes
        return 1

    def _restore(self, cr: dict, restore: Restore) -> int:
        """Set the CR's spec.driver back to the one of the restored revision, then the template.

        The spec comes first: the reconcile of the next pass must find a CR that gives the
        restored template, not the abandoned one. `upgradePolicy` is left as it is live: it
        makes no part of the template, and the write must not undo an admin's `pause` or
        `enableRollout` edit (or the runner's own pause release) made since the pass read the CR.
        """
        writes, revision, spec = 0, restore.revision, cr.get("spec") or {}
        wanted = None if restore.driver_spec is None else without_policy(restore.driver_spec)
        live = without_policy((self.target.spec(spec) or {}).get("driver") or {})
        ops = None if wanted is None else restore_patch(spec, self.target, wanted) if wanted != live else []
        where = "spec.driver" if self.target.pool is None else f"spec.driver.pools[{self.target.pool}]"
        if ops is None:
            event(
                log,
                "rollout-restore-cr-unknown",
                logging.ERROR,
                revision=revision,
                msg=f"no {where} reproduces the restored template: set {where} to the old version yourself",
            )
        elif ops:  # not written yet
            self._check()
            self.api.patch(
                contract.CR_API_VERSION,
                contract.CR_KIND,
                contract.CR_NAME,
                ops,
                patch_type="json",
                field_manager=RUNNER_FIELD_MANAGER,
            )
            event(log, "rollout-restore-cr", revision=revision, msg=f"{where} set back to revision {revision}'s")
            writes += 1
        if restore.revision_missing:
            event(
                log,
                "rollout-revision-missing",
                logging.ERROR,
                revision=revision,
                msg=f"no ControllerRevision with hash {revision}: cannot restore the template",
            )
            return writes
        if restore.template_patch is None:  # the template is back already
            return writes
        self._check()
        self.api.patch(
            "apps/v1",
            "DaemonSet",
            self.target.daemonset,
            restore.template_patch,
            namespace=self.namespace,
            patch_type="strategic",
            field_manager=RUNNER_FIELD_MANAGER,
        )
        event(log, "rollout-restore-template", revision=revision)
        return writes + 1

    def _check(self) -> None:
        cr_status.check_lease(self.guard)
