"""The staged driver rollout's imperative shell: its part of every runner pass.

Each pass (`reconcile.apply`): on the CR the pass observed and the driver DaemonSet (from the
runner's `runtime.object_cache`, with the template the pass just applied), snapshot the watch
caches (`rollout_observe`) and let the engine decide (`RolloutPass.decide`, `engine.decide`);
the pass writes the intended `status.upgradeStatus` with the rest of the CR's status, once (a
PUT of the status subresource carrying the resourceVersion read: a conflict means someone
changed the CR since, and the pass stops without acting; the next pass decides again), then
the rollout acts (`RolloutPass.act`):

- set `spec.driver.upgradePolicy.pause` (a JSON patch whose `test` op checks the value the engine
  saw, so an admin's concurrent edit wins), and once the runner's own pause landed, write the
  status that says so (`Decision.status_once_paused`);
- roll back (`Decision.restore`, planned by `rollout.restore`): first set the CR's `spec.driver`
  back to the one that gives the stable revision's template, so the runner's reconcile does not
  re-apply the abandoned version, then patch the DaemonSet with the stable ControllerRevision's
  data, as `kubectl rollout undo`;
- cordon the wave nodes whose work must end first (`Decision.cordon`) and evict the GPU pods of
  those being drained (`Decision.evict`, only once cordoned; the Eviction API respects
  PodDisruptionBudgets);
- cordon each pod's node (`cordon.py`; unless `upgradePolicy.cordon` is false), then, unless GPU
  work is allowed, list the node's pods once more: the engine decided from the GPU-pod cache of
  the pass's start, and a GPU job bound since (before the cordon landed) must not lose its
  driver; such a node stays cordoned and its driver pod waits for a later pass. Then delete the
  pod with a uid precondition (404 or a failed precondition: already done); a node that could
  not be cordoned keeps its pod until a later pass;
- uncordon the nodes the runner cordoned whose driver is back (`Decision.uncordon`);
- emit the engine's Events on the CR;
- label each node with its upgrade state (`rollout.node_state`, the label
  `metax-tech.com/driver-upgrade.state`) where the label differs, after the deletions so that it
  says which happened, and remove an admin's retry label once the node's retry is done (its pod
  deleted again, or nothing failed to retry). At most `STATE_WRITES_PER_PASS` nodes a pass, those
  in a wave first: a fleet's first labelling never delays a swap.

The lease is checked before every write, also before each node's of a batch (its cordon, then
again before its deletion): a runner whose lease lapses mid-batch sends only the requests already
in flight, at most `kube.PARALLEL_REQUESTS`, and the pass ends with LostLeadership.

One node's refusal does not stop the others: a cordon, eviction, deletion or uncordon the API
server refuses (a policy webhook guarding that node, a PodDisruptionBudget's 500) is logged
naming the node, the batch goes on, the pass does the rest of its actions, and then fails with the
first refusal (RunnerHealthy=False names it; the node's pod is taken again by the next pass).

Every action is safe to repeat: a runner killed between any two of them resumes from the status
it wrote and what the cluster shows. This module decides nothing: what to do is the engine's
`Decision`; here it is done, in order, with the lease checked before every write.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kubernetes.client.exceptions import ApiException

from metax_operator import contract, workloads
from metax_operator.chart import upgrade_policy as policy_mod
from metax_operator.contract import DRIVER_DAEMONSET, LIVE_PODS, RETRY_LABEL, RUNNER_FIELD_MANAGER, STATE_LABEL
from metax_operator.errors import UserError, UserErrors
from metax_operator.jsonlog import event
from metax_operator.rollout import engine, node_state
from metax_operator.rollout.node_state import NodeUpgradeState
from metax_operator.rollout.restore import Restore
from metax_operator.rollout.status import UpgradeStatus, rfc3339
from metax_operator.runtime import cordon, kube, reconcile
from metax_operator.runtime.informer import SYNC_TIMEOUT
from metax_operator.runtime.kube import Client
from metax_operator.runtime.metrics import Metrics
from metax_operator.runtime.object_cache import Reader
from metax_operator.runtime.rollout_observe import Watches

log = logging.getLogger(__name__)

#: A batch item the API server refused (`_per_node`).
REFUSED = "refused"
#: A driver pod not deleted: its node runs GPU work the pass's snapshot did not show.
BUSY = "gpu-busy"
#: The most nodes whose labels one pass writes (a 10,000-node fleet's first labelling takes 20 passes).
STATE_WRITES_PER_PASS = 500
#: States a node stays in between waves: when a pass has more labels to write than it may, these wait.
_SETTLED = (NodeUpgradeState.PENDING, NodeUpgradeState.DONE)


def write_order(changes: dict[str, dict[str, str | None]]) -> list[str]:
    """The nodes whose label `changes` a pass writes, first to last: the wave's nodes and the retry
    labels to drop before the settled states (`_SETTLED`), each group by name."""
    return sorted(changes, key=lambda n: (changes[n].get(STATE_LABEL) in _SETTLED and RETRY_LABEL not in changes[n], n))


@dataclass(frozen=True)
class Plan:
    """The rollout's decision for one pass, and what acting on it needs: the CR's
    `spec.driver.upgradePolicy.pause` as the engine saw it, and the status as stored."""

    decision: engine.Decision
    pause_seen: bool
    stored: dict | None  # status.upgradeStatus as read (None: never written)
    # What the engine decided on, with the policy and the time: what the nodes' state labels are
    # worked out from (`node_state.states`). None in a plan made without an observation.
    observed: engine.Cluster | None = None
    policy: policy_mod.Policy | None = None
    now: float = 0.0


@dataclass
class Release:
    """A pass the rollout cannot decide (an invalid policy, no driver DaemonSet) still gives back
    the nodes the runner cordoned whose driver is back: a frozen rollout holds no capacity it
    does not need. The status stays as stored."""

    nodes: list[str]
    stored: dict | None


def without_policy(driver: dict) -> dict:
    """spec.driver but its upgradePolicy (JSON-pointer-safe keys: the CRD's field names)."""
    return {key: value for key, value in driver.items() if key != "upgradePolicy"}


class RolloutPass:
    """The rollout's part of every runner pass (a `reconcile.RolloutStep`): `decide` on the CR
    the pass observed, then, once the pass wrote the status, `act`. Keeps its watch caches
    between passes."""

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
        self.watches, self.metrics = watches, metrics
        self.requests = 0  # this module's own requests (the caches count theirs)
        self._refused: list[ApiException] = []  # per-node refusals of this pass's actions
        self._own: cordon.OwnWrites | None = None

    def close(self) -> None:
        if self.watches is not None:
            self.watches.stop()

    def decide(self, cr: dict) -> Plan | Release | None:
        """The engine's decision on `cr` and what the watch caches and the DaemonSet show now;
        None when there is nothing to decide on yet (caches not listed or failing). An invalid
        policy or no DaemonSet: the runner's cordons that may go (`Release`), or None."""
        if self.watches is None:
            self.watches = Watches(self.api, self.namespace).start()
        if not self.watches.wait_synced(SYNC_TIMEOUT):
            event(log, "rollout-wait-cache", logging.WARNING, msg="the watch caches have not listed yet")
            return None
        failing = self.watches.failing()
        if failing:  # a GPU job started since the watch broke would not be seen: no node is taken
            event(
                log,
                "rollout-wait-cache",
                logging.WARNING,
                msg=f"the watch caches {', '.join(failing)} are failing: the rollout waits until they list again",
            )
            return None
        stored = (cr.get("status") or {}).get("upgradeStatus") or None
        ds = self.reader.get("apps/v1", "DaemonSet", DRIVER_DAEMONSET, self.namespace)
        raw = ((cr.get("spec") or {}).get("driver") or {}).get("upgradePolicy")
        try:
            policy = policy_mod.validate(raw, field_prefix="spec.driver.upgradePolicy")
        except (UserError, UserErrors) as err:  # reported as SpecValid=False by reconcile
            event(log, "rollout-invalid-policy", logging.WARNING, error=str(err))
            return self._release(ds, cr, stored)
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
            return self._release(ds, cr, stored)
        snap = self.watches.observe(ds, cr, stored)
        before = UpgradeStatus.from_json(stored) if stored is not None else None
        now = self.clock()
        return Plan(engine.decide(snap.observed, policy, before, now), policy.pause, stored, snap.observed, policy, now)

    def _release(self, ds: dict | None, cr: dict, stored: dict | None) -> Release | None:
        """The runner's cordons to lift when the rollout cannot decide: with the DaemonSet, those
        `engine.driver_back` gives for the stored wave (a node whose driver is down or being
        swapped stays cordoned); without it no driver is coming, so every one."""
        if ds is None:
            nodes = set(self.watches.cordoned.snapshot().values())
        else:
            resume = UpgradeStatus.from_json(stored).resume if stored is not None else UpgradeStatus().resume
            nodes = engine.driver_back(self.watches.observe(ds, cr, stored).observed, resume, set())
        return Release(sorted(nodes), stored) if nodes else None

    def upgrade_status(self, plan: Plan | Release) -> dict | None:
        """The `status.upgradeStatus` the pass writes before `act` (a `Release` leaves it)."""
        return plan.stored if isinstance(plan, Release) else plan.decision.status.to_json()

    def act(self, cr: dict, plan: Plan | Release) -> int:
        """Carry out `plan` on the CR `cr` as the pass's status write left it: the actions in
        order; the number of writes."""
        if isinstance(plan, Release):
            return self._uncordon(plan.nodes)
        decision = plan.decision
        if self.metrics is not None:
            before = UpgradeStatus.from_json(plan.stored) if plan.stored is not None else None
            self.metrics.rollout_pass(before, decision.status, self.clock())
        writes = self._act(cr, plan)
        status_written = decision.status.to_json() != plan.stored  # by the pass, just before
        step = decision.status.step
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
            **self._traffic(),
        )
        return writes

    def _act(self, cr: dict, plan: Plan) -> int:
        """The decision's actions after its status write, in order; the number of writes. Raises
        the first per-node refusal once every action was tried."""
        decision, writes, self._refused = plan.decision, 0, []
        if decision.set_pause is not None:
            writes += self._set_pause(decision.set_pause, plan.pause_seen, decision.status_once_paused)
        if decision.restore is not None:
            writes += self._restore(cr, decision.restore)
        writes += self._drain(decision.cordon, decision.evict)
        deleted, delete_writes = self._delete(decision.delete, decision.cordon_first, decision.idle_first)
        writes += delete_writes + self._uncordon(decision.uncordon)
        for item in decision.events:
            self._check()
            self.requests += 1
            writes += reconcile.emit_event(
                self.api, cr, item.type, item.reason, item.message, rfc3339(self.clock()), self.identity
            )
        if self.watches is not None and plan.observed is not None and plan.policy is not None:
            states = node_state.states(plan.observed, decision, plan.policy, plan.now, deleted)
            if self.metrics is not None:
                self.metrics.node_states(states)
            writes += self._label(states, plan.observed.retry, deleted)
        if self._refused:
            raise self._refused[0]
        return writes

    def _per_node(self, action: str, node: Callable[[object], str], fn: Callable, refused):
        """`fn` for one item of a batch; a refusal is logged and recorded, and `refused` returned."""

        def one(item):
            self._check()  # each item, not once per batch: a deposed leader sends no more of it
            try:
                return fn(item)
            except ApiException as err:
                event(log, "rollout-refused", logging.ERROR, refused=action, node=node(item), error=kube.failure_line(err))
                self._refused.append(err)
                return refused

        return one

    def _set_pause(self, value: bool, seen: bool, then: UpgradeStatus | None) -> int:
        """JSON patch of spec.driver.upgradePolicy.pause, only if it still holds what the engine saw;
        once it landed, the status `then` (if any) is written on the patched CR."""
        self._check()
        path = "/spec/driver/upgradePolicy/pause"
        patch = [{"op": "test", "path": path, "value": seen}, {"op": "replace", "path": path, "value": value}]
        self.requests += 1
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
            confirmed = reconcile.write_status(
                self.api, patched, [], self.guard, rfc3339(self.clock()), applied=False, upgrade_status=then.to_json()
            )
            self.requests += 1
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
            self.requests += 1
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
        if restore.template_patch is None:
            event(
                log,
                "rollout-revision-missing",
                logging.ERROR,
                revision=revision,
                msg=f"no ControllerRevision with hash {revision}: cannot restore the template",
            )
            return writes
        self._check()
        self.requests += 1
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

    def _delete(self, pods: list[engine.PodRef], cordon_first: bool, idle_first: bool) -> tuple[set[str], int]:
        """Cordon each pod's node (when `cordon_first`), check it has no GPU pod (when `idle_first`),
        then delete the pod; the nodes whose pod is gone, and the number of writes."""
        if not pods:
            return set(), 0
        self._check()

        def delete(pod: engine.PodRef) -> tuple[str, str]:
            found = cordon.cordon(self.api, pod.node, self._nodes) if cordon_first else ""
            if found == cordon.NOT_NOW:
                return found, ""
            if idle_first and self._gpu_busy(pod.node):
                return found, BUSY
            self._check()  # the lease may have lapsed during the cordon and the check
            try:
                return found, "deleted" if self.api.delete("v1", "Pod", pod.name, self.namespace, uid=pod.uid) else "gone"
            except ApiException as err:
                if err.status == 409:  # the uid precondition failed: that pod is already gone
                    return found, "gone"
                raise

        outcomes = self._parallel(self._per_node("delete", lambda p: p.node, delete, (REFUSED, "")), pods)
        cordons = [c for c, _ in outcomes]
        deletes = sum(1 for _, d in outcomes if d in ("deleted", "gone"))
        checks = sum(1 for c, _ in outcomes if c not in (cordon.NOT_NOW, REFUSED)) if idle_first else 0
        self.requests += deletes + checks + cordons.count(cordon.CORDONED) + cordons.count(cordon.NOT_NOW)
        not_now = [p.node for p, c in zip(pods, cordons, strict=True) if c == cordon.NOT_NOW]
        busy = [p.node for p, (_, d) in zip(pods, outcomes, strict=True) if d == BUSY]
        event(
            log,
            "rollout-delete",
            pods=[p.name for p in pods],
            deleted=sum(d == "deleted" for _, d in outcomes),
            cordoned=cordons.count(cordon.CORDONED),
            **({"not_cordoned": not_now} if not_now else {}),
            **({"gpu_busy": busy} if busy else {}),
        )
        gone = {p.node for p, (_, d) in zip(pods, outcomes, strict=True) if d in ("deleted", "gone")}
        return gone, deletes + cordons.count(cordon.CORDONED)

    def _label(self, states: dict[str, NodeUpgradeState], retry: frozenset[str], deleted: set[str]) -> int:
        """Write each node's state label where it differs, drop it from nodes the rollout no longer
        knows, and drop the retry label of the nodes whose retry is done; the number of writes."""
        nodes, changes = self._nodes, {}
        for node, known in self.watches.nodes.snapshot().items():
            labels = dict((nodes.get(node) or known).labels)
            change = {}
            if labels.get(STATE_LABEL) != states.get(node):
                change[STATE_LABEL] = states.get(node)
            if RETRY_LABEL in labels and node in retry and (node in deleted or states.get(node) != NodeUpgradeState.FAILED):
                change[RETRY_LABEL] = None
            if change:
                changes[node] = change
        if not changes:
            return 0
        self._check()
        order = write_order(changes)
        batch = order[:STATE_WRITES_PER_PASS]
        write = self._per_node("label", str, lambda node: cordon.set_labels(self.api, node, changes[node]), None)
        done = self._parallel(write, batch)
        self.requests += len(batch)
        for node, state in zip(batch, done, strict=True):
            self._nodes.record(node, state)
        retried = sorted(n for n in batch if RETRY_LABEL in changes[n])
        event(
            log,
            "rollout-node-states",
            logging.INFO if retried or len(order) > len(batch) else logging.DEBUG,
            written=sum(1 for state in done if state),
            **({"left_for_next_pass": len(order) - len(batch)} if len(order) > len(batch) else {}),
            **({"retry_done": retried} if retried else {}),
        )
        return sum(1 for state in done if state)

    def _gpu_busy(self, node: str) -> bool:
        """Whether `node` runs a pod requesting a MetaX resource now (one LIST of its live pods)."""
        pods = self.api.list("v1", "Pod", field_selector=f"spec.nodeName={node},{LIVE_PODS}", all_namespaces=True)
        return any(workloads.gpu_pod(p) is not None for p in pods)

    def _drain(self, cordons: list[str], drains: list[str]) -> int:
        """Cordon `cordons`, then evict the GPU pods on `drains` that are cordoned; the number of writes."""
        if not cordons and not drains:
            return 0
        self._check()
        cordon_one = self._per_node("cordon", str, lambda node: cordon.cordon(self.api, node, self._nodes), REFUSED)
        found = dict(zip(cordons, self._parallel(cordon_one, cordons), strict=True))
        self.requests += list(found.values()).count(cordon.CORDONED) + list(found.values()).count(cordon.NOT_NOW)
        ready = {n for n in drains if found.get(n) not in (cordon.NOT_NOW, REFUSED)}
        pods = self.watches.gpu_pods_on(ready)
        evict = self._per_node("evict", lambda p: p.node, lambda p: cordon.evict(self.api, p.namespace, p.name), REFUSED)
        outcomes = self._parallel(evict, pods)
        self.requests += len(pods)
        event(
            log,
            "rollout-drain",
            cordoned=sorted(n for n, c in found.items() if c == cordon.CORDONED),
            evicted=[f"{p.namespace}/{p.name}" for p, o in zip(pods, outcomes, strict=True) if o == cordon.EVICTED],
            blocked=[f"{p.namespace}/{p.name}" for p, o in zip(pods, outcomes, strict=True) if o == cordon.BLOCKED],
            **({"not_cordoned": sorted(set(drains) - ready)} if set(drains) - ready else {}),
        )
        return list(found.values()).count(cordon.CORDONED) + outcomes.count(cordon.EVICTED)

    def _uncordon(self, nodes: list[str]) -> int:
        if not nodes:
            return 0
        self._check()
        done = self._parallel(self._per_node("uncordon", str, lambda node: cordon.uncordon(self.api, node), None), nodes)
        self.requests += len(nodes)
        if self.watches is not None:  # what the next cordons read
            for node, state in zip(nodes, done, strict=True):
                self._nodes.record(node, state)
        uncordoned = sum(1 for state in done if state)
        event(log, "rollout-uncordon", nodes=nodes, uncordoned=uncordoned)
        return uncordoned

    @property
    def _nodes(self) -> cordon.OwnWrites:
        """The node cache the cordons read, with this runner's own uncordons."""
        if self._own is None or self._own.nodes is not self.watches.nodes:
            self._own = cordon.OwnWrites(self.watches.nodes)
        return self._own

    @staticmethod
    def _parallel(fn, items: list) -> list:
        if not items:
            return []
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(kube.PARALLEL_REQUESTS, len(items))) as pool:
            return list(pool.map(fn, items))

    def _check(self) -> None:
        reconcile.check_lease(self.guard)

    def _traffic(self) -> dict:
        stats = self.watches.stats() if self.watches else None
        return {
            "requests": self.requests,
            "cache_requests": stats.requests if stats else 0,
            "cache_bytes": stats.bytes if stats else 0,
            "cache_events": stats.events if stats else 0,
        }
