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
- cordon the wave nodes whose work must end first (`Decision.cordon`) and evict the GPU
  workload pods of those being drained (`Decision.evict`, only once cordoned; the Eviction API
  respects PodDisruptionBudgets; a DaemonSet's pods and static pods are left, as
  `kubectl drain --ignore-daemonsets` does);
- cordon each pod's node (`cordon.py`; unless `upgradePolicy.cordon` is false), then look at the
  node once more, as the API server has it, before the deletion (`Decision.work_check`): the
  engine decided from caches of the pass's start, and a node labelled skip since, a GPU job bound
  since (unless GPU work is allowed), or a pod matching `waitForCompletion.podSelector` started
  since must not lose its driver; such a node keeps its driver pod, and the next pass sees why.
  Then delete the pod with a uid precondition (404 or a failed precondition: already done); a node
  that could not be cordoned keeps its pod until a later pass;
- uncordon the nodes the runner cordoned whose driver is back (`Decision.uncordon`);
- emit the engine's Events on the CR;
- label each node with its upgrade state (`rollout.node_state`, the label
  `metax-tech.com/driver-upgrade.state`) where the label differs, after the deletions so that it
  says which happened, and remove an admin's retry label once the node's retry is done (its pod
  deleted again, or nothing failed to retry). At most `STATE_WRITES_PER_PASS` nodes a pass, those
  in a wave first: a fleet's first labelling never delays a swap.

A pass the rollout cannot decide (an invalid policy, no driver DaemonSet, no CR at all) still
gives back the nodes the runner cordoned whose driver is back (`GiveBack`); without the CR the
rollout is gone, and so are the nodes' state labels.

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
from metax_operator.chart.upgrade_policy import Policy
from metax_operator.conditions import rfc3339
from metax_operator.contract import DRIVER_DAEMONSET, LIVE_PODS, RETRY_LABEL, RUNNER_FIELD_MANAGER, STATE_LABEL
from metax_operator.jsonlog import event
from metax_operator.rollout import engine, node_state
from metax_operator.rollout.decision import Decision, PodRef, WorkCheck
from metax_operator.rollout.node_state import NodeUpgradeState
from metax_operator.rollout.observation import Cluster, driver_back
from metax_operator.rollout.restore import Restore, without_policy
from metax_operator.rollout.status import Resume, UpgradeStatus
from metax_operator.runtime import cordon, cr_status, kube
from metax_operator.runtime.informer import SYNC_TIMEOUT
from metax_operator.runtime.kube import Client
from metax_operator.runtime.metrics import Metrics
from metax_operator.runtime.object_cache import Reader
from metax_operator.runtime.rollout_observe import Watches

log = logging.getLogger(__name__)

#: The most nodes whose labels one pass writes (a 10,000-node fleet's first labelling takes 20 passes).
STATE_WRITES_PER_PASS = 500
#: States a node stays in between waves: when a pass has more labels to write than it may, these wait.
_SETTLED = (NodeUpgradeState.PENDING, NodeUpgradeState.DONE)
#: What became of one pod of `Decision.delete` (`RolloutPass._delete`).
DELETED, GONE = "deleted", "gone"  # by this pass; already, by someone else
REFUSED = "refused"  # the API server refused a write for it
BUSY = "busy"  # its node runs work the pass's snapshot did not show: its pod waits
SKIPPED = "skipped"  # its node is labelled skip since the snapshot: its pod stays


def write_order(changes: dict[str, dict[str, str | None]]) -> list[str]:
    """The nodes whose label `changes` a pass writes, first to last: the wave's nodes and the retry
    labels to drop before the settled states (`_SETTLED`), each group by name."""
    return sorted(changes, key=lambda n: (changes[n].get(STATE_LABEL) in _SETTLED and RETRY_LABEL not in changes[n], n))


@dataclass(frozen=True)
class Plan:
    """The rollout's decision for one pass, and what acting on it needs: the CR's
    `spec.driver.upgradePolicy.pause` as the engine saw it, and the status as stored."""

    decision: Decision
    pause_seen: bool
    stored: dict | None  # status.upgradeStatus as read (None: never written)
    # What the engine decided on, with the policy and the time: what the nodes' state labels are
    # worked out from (`node_state.states`). None in a plan made without an observation.
    observed: Cluster | None = None
    policy: Policy | None = None
    now: float = 0.0

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
        self._refused: list[ApiException] = []  # per-node refusals of this pass's actions
        self._own: cordon.OwnWrites | None = None

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
        snap = self.watches.observe(ds, cr, stored, spec)
        before = UpgradeStatus.from_json(stored) if stored is not None else None
        now = self.clock()
        return Plan(engine.decide(snap.observed, policy, before, now), policy.pause, stored, snap.observed, policy, now)

    def _give_back(self, ds: dict | None, cr: dict, spec: dict, stored: dict | None) -> GiveBack | None:
        """The runner's cordons to lift when the rollout cannot decide: with the DaemonSet, those
        `driver_back` gives for the stored wave (a node whose driver is down or being swapped stays
        cordoned); without it no driver is coming, so every one."""
        if ds is None:
            nodes = set(self.watches.cordoned.snapshot().values())
        else:
            resume = UpgradeStatus.from_json(stored).resume if stored is not None else Resume()
            nodes = driver_back(self.watches.observe(ds, cr, stored, spec).observed, resume, set())
        return GiveBack(sorted(nodes), stored) if nodes else None

    def without_cr(self) -> int:
        """No CR (deleted, or not made yet): the rollout is gone. Give back the nodes the runner
        cordoned whose driver is back and drop the nodes' state labels; the number of writes."""
        if not self._caches_ready():
            return 0
        ds = self.reader.get("apps/v1", "DaemonSet", DRIVER_DAEMONSET, self.namespace)
        give_back = self._give_back(ds, {}, {}, None)
        self._refused = []
        writes = self._uncordon(give_back.nodes if give_back else [])
        writes += self._label({}, frozenset(), set())
        if self._refused:
            raise self._refused[0]
        return writes

    def act(self, cr: dict, plan: Plan | GiveBack) -> int:
        """Carry out `plan` on the CR `cr` as the pass's status write left it: the actions in
        order; the number of writes."""
        if isinstance(plan, GiveBack):
            return self._uncordon(plan.nodes)
        decision, requests = plan.decision, self.api.requests
        if self.metrics is not None:
            before = UpgradeStatus.from_json(plan.stored) if plan.stored is not None else None
            self.metrics.rollout_pass(before, decision.status, self.clock())
        writes = self._act(cr, plan)
        status_written = decision.status.to_json() != plan.stored  # by the pass, just before
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
        decision, writes, self._refused = plan.decision, 0, []
        if decision.set_pause is not None:
            writes += self._set_pause(decision.set_pause, plan.pause_seen, decision.status_once_paused)
        if decision.restore is not None:
            writes += self._restore(cr, decision.restore)
        writes += self._drain(decision.cordon, decision.evict)
        deleted, delete_writes = self._delete(decision.delete, decision.cordon_first, decision.work_check)
        writes += delete_writes + self._uncordon(decision.uncordon)
        for item in decision.events:
            self._check()
            writes += cr_status.emit_event(self.api, cr, item, rfc3339(self.clock()), self.identity)
        if plan.observed is not None and plan.policy is not None:
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

    def _delete(self, pods: list[PodRef], cordon_first: bool, check: WorkCheck) -> tuple[set[str], int]:
        """Cordon each pod's node (when `cordon_first`), look at the node and its pods once more
        (`check`), then delete the pod; the nodes whose pod is gone, and the number of writes."""
        if not pods:
            return set(), 0
        self._check()

        def delete(pod: PodRef) -> tuple[str, str]:
            if cordon_first:
                found, node = cordon.cordon(self.api, pod.node, self._nodes)
            else:
                found, node = "", self._node(pod.node)
            if node is None:
                return found, ""
            if cordon.skipped(node):
                return found, SKIPPED
            if self._runs_work(pod.node, check):
                return found, BUSY
            self._check()  # the lease may have lapsed during the cordon and the checks
            try:
                return found, DELETED if self.api.delete("v1", "Pod", pod.name, self.namespace, uid=pod.uid) else GONE
            except ApiException as err:
                if err.status == 409:  # the uid precondition failed: that pod is already gone
                    return found, GONE
                raise

        outcomes = self._parallel(self._per_node("delete", lambda p: p.node, delete, (REFUSED, "")), pods)
        cordons = [c for c, _ in outcomes]
        by = lambda outcome: [p.node for p, (_, d) in zip(pods, outcomes, strict=True) if d == outcome]  # noqa: E731
        not_now = [p.node for p, c in zip(pods, cordons, strict=True) if c == cordon.NOT_NOW]
        event(
            log,
            "rollout-delete",
            pods=[p.name for p in pods],
            deleted=len(by(DELETED)),
            cordoned=cordons.count(cordon.CORDONED),
            **({"not_cordoned": not_now} if not_now else {}),
            **({"busy": by(BUSY)} if by(BUSY) else {}),
            **({"skipped": by(SKIPPED)} if by(SKIPPED) else {}),
        )
        gone = set(by(DELETED)) | set(by(GONE))
        return gone, len(by(DELETED)) + len(by(GONE)) + cordons.count(cordon.CORDONED)

    def _node(self, name: str) -> cordon.NodeState | None:
        """The node as the API server has it now (None: gone)."""
        found = self.api.get("v1", "Node", name)
        return cordon.node_state(found) if found is not None else None

    def _runs_work(self, node: str, check: WorkCheck) -> bool:
        """Whether `node` runs, now, what must not lose its driver (`check`): a GPU workload pod,
        or a pod matching the wait selector (one LIST of the node's live pods each)."""
        on_node = f"spec.nodeName={node},{LIVE_PODS}"
        if check.gpu:
            pods = self.api.list("v1", "Pod", field_selector=on_node, all_namespaces=True)
            if any((gpu := workloads.gpu_pod(p)) is not None and gpu.workload for p in pods):
                return True
        if check.wait_selector:
            return bool(
                self.api.list("v1", "Pod", field_selector=on_node, label_selector=check.wait_selector, all_namespaces=True)
            )
        return False

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

    def _drain(self, cordons: list[str], drains: list[str]) -> int:
        """Cordon `cordons`, then evict the GPU workload pods on `drains` that are cordoned; the
        number of writes."""
        if not cordons and not drains:
            return 0
        self._check()
        cordon_one = self._per_node("cordon", str, lambda node: cordon.cordon(self.api, node, self._nodes).outcome, REFUSED)
        found = dict(zip(cordons, self._parallel(cordon_one, cordons), strict=True))
        ready = {n for n in drains if found.get(n) not in (cordon.NOT_NOW, REFUSED)}
        pods = self.watches.gpu_pods_on(ready)
        evict = self._per_node("evict", lambda p: p.node, lambda p: cordon.evict(self.api, p.namespace, p.name), REFUSED)
        outcomes = self._parallel(evict, pods)
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
        for node, state in zip(nodes, done, strict=True):  # what the next cordons read
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
        cr_status.check_lease(self.guard)
