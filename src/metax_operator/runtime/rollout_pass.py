"""The staged driver rollout's imperative shell: its part of every runner pass (`run.Runner`).

`RolloutPass.decide`: on the CR the pass observed, the spec it acts on and the upgrade policy it
validated, and the driver DaemonSet (from the runner's `runtime.object_cache`, with the template
the pass just applied), snapshot the watch caches (`rollout_observe`) and let the engine decide
(`engine.decide`). The pass writes the intended `status.upgradeStatus` with the rest of the CR's
status, once (a PUT of the status subresource carrying the resourceVersion read: a conflict
means someone changed the CR since, and the pass stops without acting; the next pass decides
again), then the rollout acts (`RolloutPass.act`):

- set `spec.driver.upgradePolicy.pause` (a JSON patch whose `test` op checks the value the engine
  saw, so an admin's concurrent edit wins), and once the runner's own pause landed, write the
  status that says so (`Decision.status_once_paused`);
- roll back (`Decision.restore`, planned by `rollout.restore`): first set the CR's `spec.driver`
  back to the one that gives the stable revision's template, so the runner's reconcile does not
  re-apply the abandoned version, then patch the DaemonSet with the stable ControllerRevision's
  data, as `kubectl rollout undo` (the engine plans either again until the cluster shows it);
- cordon the wave nodes whose work must end first (`Decision.cordon`) and drain those whose GPU
  pods must go (`Decision.evict`); cordon each pod's node, look at it once more and delete the pod
  (`Decision.delete`): the batches of `rollout_nodes.NodeActions`, which say how;
- at a step's pause under the health gate, read a snapshot of the nodes' health when the last
  decision asked for one (`node_health.read`, `Decision.observe_health`) and hand the latest to
  every decision after it;
- validate: create a validation pod for each Ready wave pod the engine names (`Decision.validate`,
  `validation_pod.manifest`), and record the validations that ended on their driver pods
  (`Decision.verdicts`);
- uncordon the nodes the runner cordoned whose driver is back (`Decision.uncordon`);
- emit the engine's Events on the CR;
- label each node with its upgrade state (`rollout.node_state`, the label
  `metax-tech.com/driver-upgrade.state`) where the label differs, after the deletions so that it
  says which happened, and remove an admin's retry label once the node's retry is done (its pod
  deleted again, or nothing failed to retry). At most `rollout_nodes.STATE_WRITES_PER_PASS`
  nodes a pass, those in a wave first: a fleet's first labelling never delays a swap.

A rollout at rest (`rollout.rest`) is not decided again while the CR, the DaemonSet and the
caches it reads hold nothing new (`Watches.changes`): the pass reuses its plan, which does nothing.

A pass the rollout cannot decide (an invalid policy, no driver DaemonSet, no CR) still gives
back the runner's cordons whose driver is back (`GiveBack`); without the CR the state labels go.

The lease is checked before every write (and before each node's of a batch: `rollout_nodes`);
one node's refusal does not stop the others, the pass does the rest of its actions, and then
fails with the first refusal (RunnerHealthy=False names it; the node's pod is taken again by the
next pass).

Every action is safe to repeat: a runner killed between any two of them resumes from the status
it wrote and what the cluster shows. This module decides nothing: what to do is the engine's
`Decision`; here it is done, in order, with the lease checked before every write.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kubernetes.client.exceptions import ApiException

from metax_operator import contract
from metax_operator.chart.upgrade_policy import Policy, validation_asked
from metax_operator.conditions import rfc3339
from metax_operator.contract import DRIVER_DAEMONSET, RUNNER_FIELD_MANAGER
from metax_operator.jsonlog import event
from metax_operator.rollout import engine, node_state
from metax_operator.rollout.decision import Decision
from metax_operator.rollout.health_gate import HealthSnapshot
from metax_operator.rollout.observation import Cluster, driver_back
from metax_operator.rollout.rest import at_rest
from metax_operator.rollout.restore import Restore, without_policy
from metax_operator.rollout.status import Resume, UpgradeStatus
from metax_operator.runtime import cr_status, node_health, validation_pod
from metax_operator.runtime.informer import SYNC_TIMEOUT
from metax_operator.runtime.kube import Client
from metax_operator.runtime.metrics import Metrics
from metax_operator.runtime.object_cache import Reader
from metax_operator.runtime.rollout_nodes import NodeActions
from metax_operator.runtime.rollout_observe import Watches

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """The rollout's decision for one pass, and what acting on it needs: the CR's
    `spec.driver.upgradePolicy.pause` as the engine saw it, and the status as stored."""

    decision: Decision
    pause_seen: bool
    stored: dict | None  # status.upgradeStatus as read (None: never written)
    now: float  # the time the engine decided at
    # What the engine decided on, with the policy: what the nodes' state labels are worked out
    # from (`node_state.states`). None in a plan made without an observation.
    observed: Cluster | None = None
    policy: Policy | None = None
    read: tuple | None = None  # what the pass read (`RolloutPass._read`), None: not to be reused

    @property
    def upgrade_status(self) -> dict:
        """The `status.upgradeStatus` the pass writes before `act`."""
        return self.decision.status.to_json()


@dataclass(frozen=True)
class GiveBack:
    """A pass the rollout cannot decide gives back the nodes the runner cordoned whose driver is
    back: a frozen rollout holds no capacity it does not need. The status stays as stored."""

    nodes: list[str]
    stored: dict | None

    @property
    def upgrade_status(self) -> dict | None:
        return self.stored


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
    ):
        self.api, self.namespace, self.guard, self.identity, self.clock = api, namespace, guard, identity, clock
        self.reader: Reader = reader or api  # where the DaemonSet is read (`object_cache`), else live
        self.watches = watches or Watches(api, namespace)
        self.metrics = metrics
        self.nodes = NodeActions(api, namespace, self.watches, self._check)
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

    def decide(self, cr: dict, spec: dict, policy: Policy | None) -> Plan | GiveBack | None:
        """The engine's decision on `cr` (as stored), acting on `spec` (`freeze.in_force`) and its
        upgrade policy as the pass validated it (None: invalid), with what the watch caches and the
        DaemonSet show now; None when there is nothing to decide on yet (caches not listed or
        failing). An invalid policy or no DaemonSet: the runner's cordons that may go (`GiveBack`)."""
        if not self._caches_ready():
            return None
        stored = (cr.get("status") or {}).get("upgradeStatus") or None
        ds = self.reader.get("apps/v1", "DaemonSet", DRIVER_DAEMONSET, self.namespace)
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
            event(log, "rollout-no-daemonset", logging.DEBUG, msg=f"no DaemonSet {DRIVER_DAEMONSET}")
            return self._give_back(ds, cr, spec, stored)
        read = self._read(cr, ds)
        if self.at_rest is not None and read is not None and read == self.at_rest.read:
            return self.at_rest  # nothing new: the same decision, which does nothing
        self.at_rest = None
        observed = self.watches.observe(ds, cr, stored, spec).observed
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

    def _read(self, cr: dict, ds: dict) -> tuple | None:
        """What a rollout at rest decides on, as versions: the CR (spec, so policy, and status),
        the DaemonSet, the caches; None while they may miss the runner's writes or the health gate waits."""
        if self.watches.deleted or self.nodes.unseen_writes or self.health_asked:
            return None
        versions = cr["metadata"].get("resourceVersion"), ds["metadata"]["uid"], ds["metadata"].get("resourceVersion")
        return *versions, *self.watches.changes()

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
            observed = self.watches.observe(ds, cr, stored, spec).observed
            nodes = driver_back(observed, resume, set(), validation, self.clock())
        return GiveBack(sorted(nodes), stored) if nodes else None

    def without_cr(self) -> int:
        """No CR (deleted, or not made yet): the rollout is gone. Give back the nodes the runner
        cordoned whose driver is back and drop the nodes' state labels; the number of writes."""
        if not self._caches_ready():
            return 0
        ds = self.reader.get("apps/v1", "DaemonSet", DRIVER_DAEMONSET, self.namespace)
        give_back = self._give_back(ds, {}, {}, None)
        self.nodes.begin()
        writes = self.nodes.uncordon(give_back.nodes if give_back else [])
        writes += self.nodes.label({}, frozenset(), set())
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
            self.metrics.rollout_pass(before, decision.status, self.clock())
            self.metrics.health_gate(decision.health_compared)
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
            writes += self._set_pause(decision.set_pause, plan.pause_seen, decision.status_once_paused)
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
            writes += cr_status.emit_event(self.api, cr, item, rfc3339(self.clock()), self.identity)
        if states is not None:
            if self.metrics is not None:
                self.metrics.node_states(states)
            writes += self.nodes.label(states, plan.observed.retry, deleted)
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

    def _set_pause(self, value: bool, seen: bool, then: UpgradeStatus | None) -> int:
        """JSON patch of spec.driver.upgradePolicy.pause, only if it still holds what the engine saw;
        once it landed, the status `then` (if any) is written on the patched CR."""
        self._check()
        path = "/spec/driver/upgradePolicy/pause"
        patch = [{"op": "test", "path": path, "value": seen}, {"op": "replace", "path": path, "value": value}]
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
            event(log, "rollout-pause-skipped", msg="spec.driver.upgradePolicy.pause changed meanwhile")
            return 0
        event(log, "rollout-set-pause", pause=value)
        if then is not None:
            now = rfc3339(self.clock())
            confirmed = cr_status.write_status(
                self.api, patched, [], self.guard, now, applied=False, upgrade_status=then.to_json()
            )
            return 1 + confirmed.writes
        return 1

    def _restore(self, cr: dict, restore: Restore) -> int:
        """Set the CR's spec.driver back to the one of the restored revision, then the template.

        The spec comes first: the reconcile of the next pass must find a CR that gives the
        restored template, not the abandoned one. `upgradePolicy` is left as it is live: it
        makes no part of the template, and the write must not undo an admin's `pause` or
        `enableRollout` edit (or the runner's own pause release) made since the pass read the CR.
        """
        writes, revision = 0, restore.revision
        wanted = None if restore.driver_spec is None else without_policy(restore.driver_spec)
        live = without_policy((cr.get("spec") or {}).get("driver") or {})
        if wanted is None:
            event(
                log,
                "rollout-restore-cr-unknown",
                logging.ERROR,
                revision=revision,
                msg="no spec.driver reproduces the restored template: set spec.driver to the old version yourself",
            )
        elif wanted != live:  # not written yet
            self._check()
            ops = [{"op": "add", "path": f"/spec/driver/{key}", "value": value} for key, value in sorted(wanted.items())]
            ops += [{"op": "remove", "path": f"/spec/driver/{key}"} for key in sorted(live.keys() - wanted.keys())]
            self.api.patch(
                contract.CR_API_VERSION,
                contract.CR_KIND,
                contract.CR_NAME,
                ops,
                patch_type="json",
                field_manager=RUNNER_FIELD_MANAGER,
            )
            event(log, "rollout-restore-cr", revision=revision, msg=f"spec.driver set back to revision {revision}'s")
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
            DRIVER_DAEMONSET,
            restore.template_patch,
            namespace=self.namespace,
            patch_type="strategic",
            field_manager=RUNNER_FIELD_MANAGER,
        )
        event(log, "rollout-restore-template", revision=revision)
        return writes + 1

    def _check(self) -> None:
        cr_status.check_lease(self.guard)
