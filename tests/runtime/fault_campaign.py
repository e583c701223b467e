"""The fault campaign: a hypothesis state machine over the whole runner (`runtime.run.Runner`: its
Helm hold, freeze, reconcile, rollout engine and executor, on the real client) in the fake cluster
of tests/runtime/cluster.py (the chart's real DaemonSets on the fake API server, the DaemonSet
controller, the kubelet, GPU work, Helm, the admin). Its steps are what happens to a fleet during
a driver rollout, in any order:

- the policy, drawn once: steps with and without pauses and tolerations, `maxParallel`,
  `maxUnavailable`, `maxFailureThreshold`, `fallback` pause or rollback, `allowGpuWorkloads`,
  `cordon`, `drain` and `waitForCompletion` with their timeouts, `onTimeout` hold or fail,
  `validation` on or off, `healthGate` on or off;
- the fleet: nodes added, deleted, relabelled out of the DaemonSet, cordoned by an admin,
  going NotReady and Ready again, labelled skip; driver pods deleted by someone else, failing (a crash loop), slow (the kubelet
  or the DaemonSet controller not run), stuck Terminating; validations (`validation` drawn on or
  off) that fail, hang or pass again, a validation pod deleted by someone; GPU jobs (owned by a Job, or bare), a
  DaemonSet's GPU pod and pods the policy waits for started and ending, some guarded by a
  PodDisruptionBudget that refuses their eviction;
- the API server: watches answered `410 Gone`, a LIST answered 500 (the caches failing), the
  next write of a kind answered 409, 422, 500 or 403, writes failing until cleared;
- the runner: passes; restarted with fresh caches; killed at its k-th write of a pass (that write
  and every later one lost, then restarted), k drawn up to `MOST_WRITES` so that every write of
  any pass is reachable; its lease lost between passes or lapsing mid-batch; a change landing
  between its reads and its k-th write (a skip label, a GPU job, a pod to wait for, an admin's
  cordon or pause);
- Helm: `helm upgrade` (with a new version or not) whose bootstrap hook writes the CR and holds
  the runner until Helm applies the release, which it may never do (the hold then ends);
- the administrator: `pause`, `enableRollout` and `maxParallel` edited at any step; a new driver
  version set by `kubectl patch` of `spec.driver.payload.version`; the CR deleted, and created
  again by the next `helm upgrade`'s bootstrap; the clock moves on.

`Checks` holds the invariants, checked after every pass (and every step where they say so). The
state the cluster must never be in:

- while the rollout is enabled, no pass leaves more nodes being swapped (their driver deleted by
  the runner, the new one not Ready, neither failing nor past the readiness timeout) than
  `maxParallel` (the largest it was since the rollout last idled: an edit mid-rollout is held);
- no driver pod is deleted while its node runs a GPU workload pod (unless GPU work is allowed)
  or a pod matching `waitForCompletion.podSelector`, or while the pod is Ready at the template's
  revision (a node replaced twice);
- while the rollout is enabled, no pass takes GPU nodes still serving (a Ready driver pod, not
  cordoned by someone else) beyond `maxParallel` plus `maxUnavailable` less the nodes not serving
  as it began: those being swapped, and those an admin cordoned whose driver is Ready (g);
- a node that left the DaemonSet never fails a step;
- while Helm holds the runner (a DaemonSet behind the CR's release revision, within the hold's
  time) the runner writes nothing;

and the decisions the runner must never make:

- (a) a failed node is retried exactly as `maxFailureThreshold` says: each retry counted deletes
  every node of its queue again (the failed nodes then, as `resume.failedNodes` names them)
  before the step's next retry, fallback or end, unless the node stopped failing or left; no
  more retries than the threshold, the fallback only after all of them, and neither with no
  failed node named;
- (b) no node is counted failed (newly named in `resume.failedNodes` or `retryQueue`) before `readinessTimeout` has passed
  since its own driver pod's deletion (or its new pod's creation), but a node whose wait or
  drain timed out under `onTimeout: fail`;
- (c) a rollback (Terminating or Disabling) that ends (Idling or Disabled) leaves the CR's
  `spec.driver.payload.version` at the restored revision's version, and after it no driver pod
  is created at the abandoned revision nor the template set back to it, until someone sets a
  version again;
- (d) a node labelled skip, as the API server has it when the deletion arrives, never has its
  driver pod deleted;
- (e) with `validation` on, no node the runner gives back has a driver pod whose validation
  failed, timed out or still runs;
- (f) with `healthGate` on, a paused step promotes only while the nodes at the rollout's
  revision are NotReady in no greater share than the others, as the cluster was when the pass
  began.

At the end (`settle`) the faults stop, the nodes and the drivers heal, the work ends, Helm applies its release,
a deleted CR is created again, the admin uncordons the nodes they cordoned (each must still be
cordoned, never taken for the runner's) and resumes (and retries the nodes whose validation
failed): the rollout must finish with every
selected, unskipped node Ready at the template's revision, the template at the CR's version,
and no node left cordoned. A pass may fail on a fault (an API answer, a lost
lease, a cache not listed); any other exception fails the campaign.
tests/runtime/test_fault_campaign.py replays a fixed set and plants a mutation under each
invariant to show the campaign finds it; `make bench` (tests/bench/bench_fault_campaign.py)
explores new sequences.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from unittest import mock

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from metax_operator import workloads
from metax_operator.conditions import parse_time
from metax_operator.contract import (
    CORDONED_LABEL,
    GPU_NODE_LABEL,
    RETRY_LABEL,
    SKIP_LABEL,
    VALIDATES_LABEL,
    VALIDATION_ANNOTATION,
    VALIDATION_FAILED_PREFIX,
)
from metax_operator.runtime import kube
from tests.runtime.cluster import (
    CR,
    DAEMONSETS,
    DRIVER,
    JOBS,
    NODES,
    PODS,
    REVISION_LABEL,
    VERSIONS,
    WAIT_SELECTOR,
    Cluster,
    Pass,
    labels,
    template_hash,
)
from tests.waiting import eventually

READINESS_TIMEOUT = 300
VALIDATION_TIMEOUT = 200
MAX_NODES = 8
#: More writes than one pass of these fleets sends (the bench reports the most it saw): the kill
#: rule's position is drawn up to it, so that every write of any pass is reachable.
MOST_WRITES = 32
STEP_SHAPES = (
    [{"replicas": "100%", "pauseDuration": 0}],
    [{"replicas": "50%", "pauseDuration": 0, "toleration": 1}, {"replicas": "100%", "pauseDuration": 0}],
    [{"replicas": 1}, {"replicas": "100%", "pauseDuration": "30s"}],  # a manual pause, then a timed one
)
POLICIES = st.fixed_dictionaries(
    {
        "enableRollout": st.just(True),
        "pause": st.just(False),
        "readinessTimeout": st.just(f"{READINESS_TIMEOUT}s"),
        "upgradeSteps": st.sampled_from(STEP_SHAPES),
        "maxParallel": st.integers(1, 3),
        "maxUnavailable": st.integers(0, 1),
        "maxFailureThreshold": st.integers(0, 2),
        "fallback": st.sampled_from(["pause", "rollback"]),
        "allowGpuWorkloads": st.booleans(),
        "cordon": st.booleans(),
        "drain": st.fixed_dictionaries({"enable": st.booleans(), "timeout": st.sampled_from(["120s", "600s"])}),
        "waitForCompletion": st.sampled_from(
            [{}, {"podSelector": WAIT_SELECTOR}, {"podSelector": WAIT_SELECTOR, "timeout": "200s"}]
        ),
        "onTimeout": st.sampled_from(["hold", "fail"]),
        "validation": st.sampled_from([{"enable": False}, {"enable": True, "timeoutSeconds": VALIDATION_TIMEOUT}]),
        "healthGate": st.sampled_from([{"enable": False}, {"enable": True}]),
    }
)
#: What each example starts from (`Campaign.start`): a test may draw some of it narrower.
START = {
    "nodes": st.integers(2, 6),
    "policy": POLICIES,
    "version": st.sampled_from(VERSIONS[1:]),
    "failing": st.sets(st.integers(0, 5), max_size=2),
    "skipped": st.sets(st.integers(0, 5), max_size=1),
    "waited": st.sets(st.integers(0, 5), max_size=1),
}
#: The runner's writes a fault refuses, as (method, path): `{node}`, `{pod}` filled in by the rule.
WRITES = (
    ("PUT", CR + "/status"),
    ("PATCH", CR),
    ("PATCH", DRIVER),
    ("PATCH", NODES + "/{node}"),
    ("DELETE", PODS + "/{pod}"),
    ("POST", JOBS + "/{work}/eviction"),
    ("POST", "/api/v1/namespaces/default/events"),
)
ROLLING_BACK, SETTLED = ("Terminating", "Disabling"), ("Idling", "Disabled")


@dataclass
class Figures:
    """What a campaign explored: for `make bench` and the test's summary."""

    examples: int = 0
    steps: int = 0
    passes: int = 0
    deletions: int = 0  # driver pods the runner deleted
    kills: int = 0  # kill rules whose write the pass reached
    kill_positions: set = field(default_factory=set)  # the positions those were at
    most_writes: int = 0  # the most writes one pass sent
    rollbacks: int = 0  # rollbacks that ended (invariant c checked)
    retries: int = 0  # retries counted (invariant a checked)
    sequences: set = field(default_factory=set)  # the distinct sequences of rule names


FIGURES = Figures()


@dataclass(frozen=True)
class Deletion:
    """A deletion of a driver pod the runner asked for, with what the API server had when it
    arrived."""

    node: str
    path: str
    uid: str
    ready: bool
    revision: str
    template: str  # the driver template's revision hash then
    skipped: bool  # the node labelled skip
    gpu_work: tuple[str, ...]  # the GPU workload pods on the node (a DaemonSet's not counted)
    waited: tuple[str, ...]  # the pods on the node matching the wait selector
    invalid: bool  # its validation failed (or timed out), as recorded on it or its validation pod says
    cordoned_by_other: bool  # the node unschedulable without the runner's label


@dataclass
class Retry:
    """A retry counted: its queue (the step's failed nodes then) must all be deleted again before
    the step retries again, falls back or ends, unless excused (no longer failed, or left)."""

    key: tuple
    queue: set[str]
    done: set[str] = field(default_factory=set)


@dataclass
class Rollback:
    began: tuple  # the status key it began with
    edited: bool = False  # someone set a version since it began
    restored: bool = False  # the template has left the abandoned revision since it began


class Checks:
    """The invariants (the module's docstring) and what they remember between passes."""

    def __init__(self, cluster: Cluster, policy: dict):
        self.cluster, self.policy = cluster, policy
        self.deletions: list[Deletion] = []  # of the pass in progress
        self.deleted_at: dict[str, float] = {}  # node -> when its driver pod's last deletion was asked, by anyone
        self.swapping: dict[str, float] = {}  # node -> when the runner deleted its driver, until it is back
        self.parallel = {policy["maxParallel"]}  # maxParallel's values since the rollout last idled
        self.status: dict = {}  # the upgradeStatus after the last pass
        self.retry: Retry | None = None
        self.rollback: Rollback | None = None
        self.abandoned: tuple[str, set[str]] | None = None  # a rolled-back revision, and the pods then
        cluster.api.interceptors.append(self.intercept)

    # -- what the API server had when a deletion arrived ------------------------------------

    def intercept(self, request) -> None:
        """Record each of the runner's driver pod deletions with the cluster as it is then."""
        if request.method != "DELETE" or not request.path.startswith(PODS + "/metax-driver-"):
            return None
        api = self.cluster.api
        pod = api.objects.get(request.path)
        uid = ((request.body or {}).get("preconditions") or {}).get("uid")
        if pod is None or pod["metadata"].get("deletionTimestamp") or uid not in (None, pod["metadata"]["uid"]):
            return None  # nothing to delete
        node = pod["spec"]["nodeName"]
        work = [p for path, p in api.objects.items() if path.startswith(JOBS + "/") and p["spec"].get("nodeName") == node]
        key, value = WAIT_SELECTOR.split("=")
        self.deletions.append(
            Deletion(
                node,
                request.path,
                pod["metadata"]["uid"],
                workloads.ready(pod),
                labels(pod)[REVISION_LABEL],
                template_hash(api.objects[DRIVER]["spec"]["template"]),
                labels(api.objects.get(f"{NODES}/{node}") or {}).get(SKIP_LABEL) == "true",
                tuple(p["metadata"]["name"] for p in work if gpu_workload(p)),
                tuple(p["metadata"]["name"] for p in work if labels(p).get(key) == value),
                validation_failed(api, pod, self.cluster.now),
                cordoned_by_other(api.objects.get(f"{NODES}/{node}") or {}),
            )
        )
        return None

    # -- after each pass ----------------------------------------------------------------------

    def after_pass(self, done: Pass, before: dict) -> None:
        """`done` ran on the cluster `before` describes (`snapshot`)."""
        cluster, now = self.cluster, self.cluster.now
        FIGURES.passes += 1
        FIGURES.most_writes = max(FIGURES.most_writes, len(done.writes))
        if before["held"]:
            assert not done.writes, f"the runner wrote while Helm held it: {[(r.method, r.path) for r in done.writes]}"
        deleted = [d for d in self.deletions if taken(cluster.api.get(d.path), d.uid)]
        self.deletions = []
        for d in deleted:
            self.check_deletion(d, before["policy"])
            self.deleted_at[d.node] = self.swapping[d.node] = now
        FIGURES.deletions += len(deleted)
        self.forget_settled()
        if deleted and before["policy"].get("enableRollout"):
            bound = max(self.parallel)
            healthy = sorted(self.swapping)
            assert len(healthy) <= bound, f"{healthy} being swapped at once, maxParallel {bound}"
            self.check_availability(deleted, before, bound)
        self.check_uncordons(before)
        status = cluster.upgrade_status()
        if status != self.status:  # this pass wrote it
            self.check_status(self.status, status, before, {d.node for d in deleted})
        self.status = status
        cr = cluster.cr()
        if cr is not None and not status.get("upgrading"):
            self.parallel = {cr["spec"]["driver"]["upgradePolicy"]["maxParallel"]}
        self.check_abandoned()

    def check_uncordons(self, before: dict) -> None:
        """(e) A node the runner gave back in this pass has no driver pod whose validation failed
        or still runs: it returns to service only once its GPUs proved healthy."""
        cluster, pods = self.cluster, live_pods(self.cluster)
        nodes = cluster.nodes()
        for node in sorted(before["cordoned"]):
            if node not in nodes or CORDONED_LABEL in labels(nodes[node]) or node not in pods:
                continue
            pod = pods[node]
            assert not validation_failed(cluster.api, pod, cluster.now), f"(e) {node} uncordoned, its validation failed: {pod}"
            check = validation_of(cluster.api, pod)
            if check is not None and (before["policy"].get("validation") or {}).get("enable"):
                phase = (check.get("status") or {}).get("phase", "Pending")
                assert phase == "Succeeded", f"(e) {node} uncordoned while its validation pod is {phase}"

    def check_deletion(self, d: Deletion, policy: dict) -> None:
        assert not d.skipped, f"(d) {d.node}'s driver pod deleted although the node is labelled {SKIP_LABEL}"
        if not policy.get("allowGpuWorkloads"):
            assert not d.gpu_work, f"{d.node}'s driver pod deleted under the GPU workload pods {d.gpu_work}"
        if (policy.get("waitForCompletion") or {}).get("podSelector"):
            assert not d.waited, f"{d.node}'s driver pod deleted under the pods to wait for {d.waited}"
        assert not (d.ready and d.revision == d.template and not d.invalid), (
            f"{d.node}'s Ready driver pod at the template's revision deleted, its validation not failed"
        )

    def check_availability(self, deleted: list[Deletion], before: dict, bound: int) -> None:
        """(g) The nodes still serving the pass took (a Ready driver pod, its validation not
        failed, not cordoned by someone else, not counted out already) fit within `maxParallel`
        plus `maxUnavailable` less the nodes not serving as it began."""
        allowance = before["policy"].get("maxUnavailable", 0)  # an int in the campaign
        out = before["not_serving"]
        serving = sorted(d.node for d in deleted if d.ready and not d.invalid and not d.cordoned_by_other and d.node not in out)
        room = max(bound + allowance - len(out), 0)
        assert len(serving) <= room, (
            f"(g) {serving} taken while {sorted(out)} were not serving: maxParallel {bound} plus maxUnavailable {allowance}"
        )

    def not_serving(self) -> set[str]:
        """(g) The eligible nodes not serving now, as the availability bound counts them at least:
        those being swapped, and those cordoned by someone else whose driver pod is Ready and
        validated (a node whose driver is not Ready may be a failed node, which the bound leaves
        to the toleration)."""
        cluster, pods = self.cluster, live_pods(self.cluster)
        eligible = cluster.controller.selected() - cluster.skipped()
        cordoned = {n for n, obj in cluster.nodes().items() if n in eligible and cordoned_by_other(obj)}
        ready = {
            n
            for n in cordoned
            if n in pods and workloads.ready(pods[n]) and not validation_failed(cluster.api, pods[n], cluster.now)
        }
        return set(self.unsettled()) | ready

    def forget_settled(self) -> None:
        self.swapping = self.unsettled()

    def unsettled(self) -> dict[str, float]:
        """The nodes still being swapped: not back (a Ready driver pod), not left, not failing (no
        slot), not past the readiness timeout since their deletion or their new pod's creation
        (failed)."""
        cluster, now = self.cluster, self.cluster.now
        selected, pods = cluster.controller.selected(), live_pods(cluster)
        return {
            node: at
            for node, at in self.swapping.items()
            if node in selected
            and node not in cluster.kubelet.failing
            and now - at < READINESS_TIMEOUT
            and not (node in pods and (workloads.ready(pods[node]) or now - created(pods[node]) >= READINESS_TIMEOUT))
        }

    def check_status(self, old: dict, new: dict, before: dict, deleted: set[str]) -> None:
        """What a pass decided, from the status it wrote (`new`; `old` the one before)."""
        failed = set(failed_nodes(new))
        left = failed - set(failed_nodes(old)) - before["selected"]
        assert not left, f"{sorted(left)} left the DaemonSet and failed the step"
        self.check_failed_in_time(old, new, before)
        self.check_retries(old, new, deleted, before)
        self.check_rollback(old, new)
        self.check_promotion(old, new, before)

    def check_promotion(self, old: dict, new: dict, before: dict) -> None:
        """(f) With the health gate on, a step paused promotes only while the nodes at the rollout's
        revision (its failed ones aside) are NotReady in no greater share than the nodes at
        another revision, as the cluster was when the pass began (the pass reads its snapshot
        then)."""
        gate = before["policy"].get("healthGate") or {}
        was, now = old.get("status") or {}, new.get("status") or {}
        promoted = (
            old.get("phase") == new.get("phase") == "Progressing"
            and was.get("currentStepState") == "StepPaused"
            and now.get("currentStepIndex", 0) > was.get("currentStepIndex", 0)
            and now.get("upgradingPodSpecRevision") == was.get("upgradingPodSpecRevision")
        )
        if not (gate.get("enable") and promoted):
            return
        revision, failed = was.get("upgradingPodSpecRevision"), set(failed_nodes(new))
        eligible = before["selected"] - before["skipped"] - failed
        pods = {n: p for n, p in before["pods"].items() if n in eligible}
        upgraded = {n for n, p in pods.items() if labels(p)[REVISION_LABEL] == revision}
        others = set(pods) - upgraded
        if upgraded and others:
            share = lambda nodes: len(nodes & before["not_ready"]) / len(nodes)  # noqa: E731
            assert share(upgraded) <= share(others), (
                f"(f) step {was.get('currentStepIndex')} promoted with {sorted(upgraded & before['not_ready'])} of "
                f"{sorted(upgraded)} upgraded NotReady against {sorted(others & before['not_ready'])} of {sorted(others)}"
            )

    def check_failed_in_time(self, old: dict, new: dict, before: dict) -> None:
        """(b) Every node the pass counted failed (newly named in `resume.failedNodes` or
        `resume.retryQueue`) has a reason the readiness timeout gives it, from its own deletion
        or its new pod's creation, as the pass saw it, or a Ready driver pod whose validation
        failed or timed out. (A rollback keeps the list of the step that failed as it was.)"""
        now, timed_out = self.cluster.now, set(new.get("resume", {}).get("timedOutNodes") or [])
        for node in sorted(counted_failed(new) - counted_failed(old)):
            if self.policy["onTimeout"] == "fail" and node in timed_out:
                continue  # its wait or drain timed out: failed before its swap
            pod = before["pods"].get(node)
            if pod is not None and workloads.ready(pod):
                assert validation_failed(self.cluster.api, pod, now), (
                    f"(b) {node} counted failed with a Ready driver pod whose validation did not fail: {why(new, pod)}"
                )
            elif pod is not None:
                restarts = max((c.get("restartCount", 0) for c in pod["status"].get("containerStatuses") or []), default=0)
                assert not workloads.ready(pod) and (
                    restarts >= 3 or pod["status"].get("phase") == "Failed" or now - created(pod) >= READINESS_TIMEOUT
                ), f"(b) {node} counted failed with a driver pod neither failed nor {READINESS_TIMEOUT} s old: {why(new, pod)}"
            else:
                since = before["deleted_at"].get(node)
                assert since is not None and now - since >= READINESS_TIMEOUT, (
                    f"(b) {node} counted failed {now - since if since is not None else '?'} s after its driver pod's "
                    f"deletion, before readinessTimeout ({READINESS_TIMEOUT} s): {why(new, None)}"
                )

    def check_retries(self, old: dict, new: dict, deleted: set[str], before: dict) -> None:
        """(a) Each retry deletes its whole queue again; the threshold is kept exactly."""
        threshold = self.policy["maxFailureThreshold"]
        retries, retries_before = step(new).get("currentFailureRetry", 0), step(old).get("currentFailureRetry", 0)
        assert retries <= threshold, f"(a) {retries} retries counted, maxFailureThreshold {threshold}"
        key, open_retry = step_key(new), self.retry
        in_step = old.get("phase") == "Progressing" and step_key(old)[1:] == key[1:]  # the same step of the same rollout
        counted = in_step and new.get("phase") == "Progressing" and retries > retries_before
        fell_back = in_step and failed_step(new) and not failed_step(old)
        ended = in_step and bool(new.get("resume", {}).get("stepReadyTime")) and not old.get("resume", {}).get("stepReadyTime")
        completed = in_step and new.get("phase") == "Idling"
        if open_retry is not None and open_retry.key[1:] == key[1:] and (counted or fell_back or ended or completed):
            missed = open_retry.queue - open_retry.done
            assert not missed, f"(a) the retry of {sorted(open_retry.queue)} never deleted {sorted(missed)} again"
        if fell_back:
            assert retries == threshold, f"(a) the step fell back after {retries} retries, maxFailureThreshold {threshold}"
            assert failed_nodes(new), "(a) the step fell back with no failed node named"
        if counted:
            FIGURES.retries += 1
            assert failed_nodes(new), "(a) a retry counted with no failed node named"
            self.retry = Retry(key, set(failed_nodes(new)))
        elif open_retry is not None and (
            open_retry.key[1:] != key[1:] or new.get("phase") != "Progressing" or retries < retries_before
        ):
            self.retry = None  # the course changed (a new revision, a rollback, edited steps, resumed after a failure)
        if self.retry is not None:
            queue, selected = self.retry.queue, self.cluster.controller.selected()
            self.retry.done |= (
                (deleted & queue)  # deleted again
                | (queue - set(failed_nodes(new)))  # no longer failing
                | (queue - set(before["pods"]))  # no pod to delete: its retry is the wait for one
                | (queue - selected)  # left
                | (queue & self.cluster.skipped())
            )

    def excuse(self, node: str) -> None:
        """Someone else deleted `node`'s driver pod: its retry is not the runner's to do any more."""
        if self.retry is not None:
            self.retry.done.add(node)

    def check_rollback(self, old: dict, new: dict) -> None:
        """(c) A rollback that ends leaves the CR at the restored revision's version; once it has
        restored the template, nothing sets it back to the abandoned revision."""
        if new.get("phase") in ROLLING_BACK and old.get("phase") not in ROLLING_BACK:
            self.rollback = Rollback(step_key(new))
        elif self.rollback is not None and old.get("phase") in ROLLING_BACK and new.get("phase") in SETTLED:
            FIGURES.rollbacks += 1
            restored = new["resume"]["stableRevision"]
            abandoned = new["resume"].get("abandonedRevision")
            if not self.rollback.edited:
                want = self.cluster.revision_versions().get(restored)
                assert self.cluster.cr_version() == want, (
                    f"(c) the rollback to {restored} ended with the CR at version {self.cluster.cr_version()}, not {want}"
                )
                if abandoned and abandoned != restored:
                    self.abandoned = (abandoned, set(all_driver_pods(self.cluster)))
            self.rollback = None
        elif self.rollback is not None and new.get("phase") not in ROLLING_BACK:
            self.rollback = None  # replaced by a new rollout
        if self.rollback is not None and not self.rollback.edited and new.get("phase") in ROLLING_BACK:
            abandoned = (new.get("resume") or {}).get("abandonedRevision")
            if abandoned and self.cluster.controller.current() != abandoned:
                self.rollback.restored = True
            assert not (abandoned and self.rollback.restored and self.cluster.controller.current() == abandoned), (
                f"(c) the template was set back to the abandoned revision {abandoned} during the rollback"
            )

    def check_abandoned(self) -> None:
        """(c) After a rollback, nothing brings the abandoned revision back unasked."""
        if self.abandoned is None or self.cluster.cr() is None:
            return
        revision, before = self.abandoned
        assert self.cluster.controller.current() != revision, (
            f"(c) the template was set back to the abandoned revision {revision}"
        )
        again = [
            name
            for name, pod in all_driver_pods(self.cluster).items()
            if name not in before and labels(pod).get(REVISION_LABEL) == revision
        ]
        assert not again, f"(c) driver pods {again} created at the abandoned revision {revision} after the rollback"

    def version_set(self) -> None:
        """Someone set a driver version (the admin, Helm, a CR created again): a rollback's
        version and its abandoned revision are theirs to bring back."""
        if self.rollback is not None:
            self.rollback.edited = True
        self.abandoned = None

    def snapshot(self, held: bool) -> dict:
        """What the checks of a pass compare with: the cluster before it."""
        cr = self.cluster.cr() or {}
        return {
            "held": held,
            "policy": copy.deepcopy(cr.get("spec", {}).get("driver", {}).get("upgradePolicy", {})),
            "selected": self.cluster.controller.selected() & set(self.cluster.nodes()),
            "pods": live_pods(self.cluster),
            "deleted_at": dict(self.deleted_at),
            "cordoned": {n for n, obj in self.cluster.nodes().items() if CORDONED_LABEL in labels(obj)},
            "not_ready": self.cluster.not_ready(),
            "not_serving": self.not_serving(),
            "skipped": self.cluster.skipped(),
        }


# -- reading the cluster --------------------------------------------------------------------------


def why(status: dict, pod: dict | None) -> str:
    """What a violation message shows of the status a pass wrote and the node's driver pod."""
    resume = status.get("resume") or {}
    shown = {k: resume.get(k) for k in ("wave", "waveKind", "waveStartTime", "deletedAt", "stableRevision", "abandonedRevision")}
    seen = pod and {"revision": labels(pod).get(REVISION_LABEL), "created": pod["metadata"]["creationTimestamp"], **pod["status"]}
    return f"phase {status.get('phase')}, {status.get('message')!r}, {shown}, its pod {seen}"


def cordoned_by_other(node: dict) -> bool:
    """A node unschedulable without the runner's label: an admin's cordon."""
    return bool((node.get("spec") or {}).get("unschedulable")) and CORDONED_LABEL not in labels(node)


def gpu_workload(pod: dict) -> bool:
    """A pod requesting a MetaX resource that no DaemonSet owns."""
    gpu = any(
        name.startswith("metax-tech.com/")
        for c in pod["spec"].get("containers") or []
        for section in ("requests", "limits")
        for name in (c.get("resources") or {}).get(section) or {}
    )
    return gpu and not any(o.get("kind") == "DaemonSet" for o in pod["metadata"].get("ownerReferences") or [])


def taken(pod: dict | None, uid: str) -> bool:
    """Whether a deletion of the pod `uid` took effect: gone, or terminating."""
    return pod is None or pod["metadata"]["uid"] != uid or bool(pod["metadata"].get("deletionTimestamp"))


def all_driver_pods(cluster: Cluster) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for pods in cluster.controller.driver_pods().values() for p in pods}


def live_pods(cluster: Cluster) -> dict[str, dict]:
    """node -> its driver pod not being deleted."""
    out = {}
    for node, pods in cluster.controller.driver_pods().items():
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        if live:
            out[node] = copy.deepcopy(live[-1])
    return out


def created(pod: dict) -> float:
    return parse_time(pod["metadata"]["creationTimestamp"])


def validation_of(api, pod: dict) -> dict | None:
    """The validation pod of the driver pod `pod`, if any."""
    uid = pod["metadata"]["uid"]
    return next(
        (v for path, v in api.objects.items() if path.startswith(PODS + "/") and labels(v).get(VALIDATES_LABEL) == uid), None
    )


def validation_failed(api, pod: dict, now: float) -> bool:
    """Whether the driver pod's validation failed: so recorded on it, or its validation pod Failed
    or running past the timeout."""
    if ((pod["metadata"].get("annotations") or {}).get(VALIDATION_ANNOTATION) or "").startswith(VALIDATION_FAILED_PREFIX):
        return True
    check = validation_of(api, pod)
    if check is None:
        return False
    phase = (check.get("status") or {}).get("phase", "Pending")
    return phase == "Failed" or (phase != "Succeeded" and now - created(check) >= VALIDATION_TIMEOUT)


def step(status: dict) -> dict:
    return status.get("status") or {}


def step_key(status: dict) -> tuple:
    """The step of the rollout a status is at: phase, revision, step."""
    return status.get("phase"), step(status).get("upgradingPodSpecRevision"), step(status).get("currentStepIndex")


def failed_nodes(status: dict) -> list[str]:
    return (status.get("resume") or {}).get("failedNodes") or []


def counted_failed(status: dict) -> set[str]:
    """The nodes a status counts failed: named failed, or queued for a retry."""
    return set(failed_nodes(status)) | set((status.get("resume") or {}).get("retryQueue") or [])


def failed_step(status: dict) -> bool:
    """Whether the status says a step failed beyond its retries (condition Failed, StepFailed)."""
    return any(
        c.get("type") == "Failed" and c.get("status") == "True" and c.get("reason") == "StepFailed"
        for c in status.get("condition") or []
    )


# -- the state machine ----------------------------------------------------------------------------


class Campaign(RuleBasedStateMachine):
    """See the module's docstring."""

    def __init__(self):
        super().__init__()
        self.cluster: Cluster | None = None
        self.trace: list[str] = []
        self.pending: list = []  # what the next pass meets mid-pass (`kill_at`, `mid_pass`)
        self.admin_cordoned: set[str] = set()
        self.relists = 0  # LIST faults since the runner started (each backs a cache off longer)
        self.passed = False  # the step ran a pass of its own
        self.coalesce = False  # the next change comes before the runner's next pass
        self.one_at_a_time = mock.patch.object(kube, "PARALLEL_REQUESTS", 1)  # writes in one order: k-th is k-th
        FIGURES.examples += 1

    @initialize(**START)
    def start(self, nodes: int, policy: dict, version: str, failing: set[int], skipped: set[int], waited: set[int]) -> None:
        """The chart installed on `nodes` GPU nodes with `policy`, the runner's first passes, then
        the admin sets a new driver `version`: the rollout begins; on the `failing` nodes the new
        driver will not come up; the `skipped` ones are labelled skip; the `waited` ones run a pod
        matching the wait selector (no GPU)."""
        self.one_at_a_time.start()
        self.policy = policy
        self.cluster = Cluster(nodes=nodes, policy=policy)
        self.checks = Checks(self.cluster, policy)
        self.cluster.kubelet.failing.update(f"n{i}" for i in failing)
        for node in sorted(f"n{i}" for i in skipped if i < nodes):
            self.cluster.edit_node(node, {"metadata": {"labels": {SKIP_LABEL: "true"}}})
        for node in sorted(f"n{i}" for i in waited if i < nodes):
            self.cluster.workloads.start(node, gpu=False, waited=True)
        self.step("install")
        for _ in range(2):
            self.run_pass()
            self.cluster.sync()
        self.cluster.set_version(version)
        self.checks.version_set()

    def teardown(self) -> None:
        try:
            if self.cluster is not None:
                self.settle()
        finally:
            FIGURES.sequences.add(tuple(self.trace))
            if self.cluster is not None:
                self.cluster.close()
            self.one_at_a_time.stop()

    # -- the runner ---------------------------------------------------------------------------

    @rule(passes=st.lists(st.sampled_from(["pass", "sync", "time"]), min_size=1, max_size=4))
    def runner_passes(self, passes: list[str]) -> None:
        """Passes of the runner, each right away (`pass`), after the cluster caught up (`sync`: the
        DaemonSet controller and the kubelets), or after 30 s more of it (`time`)."""
        for kind in passes:
            self.step(kind)
            if kind == "time":
                self.cluster.tick(30)
            if kind != "pass":
                self.cluster.sync()
            self.run_pass()

    @rule()
    def restart_runner(self) -> None:
        self.step("restart")
        self.cluster.restart_runner()
        self.relists = 0

    @rule(k=st.one_of(st.integers(1, 4), st.integers(1, MOST_WRITES)))
    def killed_at_write(self, k: int) -> None:
        """The runner dies at its k-th write of a pass: that write and every later one are lost;
        then it starts again with fresh caches. The kill waits for a pass that makes k writes (up
        to four passes, the cluster catching up between them)."""
        self.step(f"kill-at-{k}")
        for _ in range(4):
            if self.kill_at(k):
                break
            self.cluster.sync()
        self.cluster.restart_runner()
        self.relists = 0

    @rule(k=st.integers(1, 12), change=st.sampled_from(["skip", "gpu-job", "wait-pod", "cordon", "pause"]), data=st.data())
    def change_lands_mid_pass(self, k: int, change: str, data) -> None:
        """Between the runner's reads and its k-th write of the next pass, something changes."""
        node = self.pick(data)
        if node is None:
            return
        self.step(f"mid-pass-{change}-at-{k}")
        api, writes = self.cluster.api, [0]

        def land(request):
            if request.method == "GET":
                return None
            writes[0] += 1
            if writes[0] == k:
                self.change_now(change, node)
            return None

        api.interceptors.insert(0, land)
        try:
            self.run_pass()
        finally:
            api.interceptors.remove(land)

    def change_now(self, change: str, node: str) -> None:
        """`change` on `node`, written straight into the store (the server is answering the runner)."""
        api = self.cluster.api
        if change == "pause":
            cr = api.get(CR)
            if cr is not None and not cr["spec"]["driver"]["upgradePolicy"].get("pause"):
                cr["spec"]["driver"]["upgradePolicy"]["pause"] = True
                cr["metadata"]["generation"] += 1
                api.put(CR, cr)
            return
        obj = api.get(f"{NODES}/{node}")
        if obj is None:
            return
        if change in ("gpu-job", "wait-pod"):
            name = f"mid-{node}-{len(self.trace)}"
            pod = {
                "metadata": {"name": name, "namespace": "ml", "labels": {"app": "training"} if change == "wait-pod" else {}},
                "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"limits": {"metax-tech.com/gpu": "1"}}}]},
                "status": {"phase": "Running"},
            }
            api.put(f"{JOBS}/{name}", pod)
            return
        if change == "skip":
            obj["metadata"].setdefault("labels", {})[SKIP_LABEL] = "true"
        elif not obj["spec"].get("unschedulable"):
            obj["spec"]["unschedulable"] = True
            self.admin_cordoned.add(node)
        api.put(f"{NODES}/{node}", obj)

    @rule(held=st.booleans())
    def lease_changes(self, held: bool) -> None:
        self.step(f"lease-{held}")
        self.cluster.lease.update(held=held, checks_left=None)

    @rule(checks=st.integers(0, 6))
    def lease_lapses_mid_pass(self, checks: int) -> None:
        """The lease is lost after the runner's next `checks` lease checks: mid-batch."""
        self.step("lease-lapses")
        self.cluster.lapse_after(checks)
        self.run_pass()

    # -- the fleet ----------------------------------------------------------------------------

    @rule()
    def daemonset_controller(self) -> None:
        self.step("controller")
        self.cluster.controller.sync()
        self.checks.check_abandoned()

    @rule(data=st.data())
    def kubelet(self, data) -> None:
        """Every node's kubelet catches up, or one node's (the others slow)."""
        node = data.draw(st.one_of(st.none(), st.sampled_from(sorted(self.cluster.nodes()) or ["n0"])))
        self.step("kubelet")
        self.cluster.kubelet.sync(node)

    @rule(seconds=st.sampled_from([30, 120, READINESS_TIMEOUT + 1]))
    def time_passes(self, seconds: int) -> None:
        self.step(f"time-{seconds}")
        self.cluster.tick(seconds)

    @precondition(lambda self: len(self.cluster.nodes()) < MAX_NODES)
    @rule()
    def add_node(self) -> None:
        self.step("add-node")
        self.cluster.add_node()

    @rule(data=st.data())
    def delete_node(self, data) -> None:
        node = self.pick(data)
        if node:
            self.step("delete-node")
            self.cluster.kubectl.delete("v1", "Node", node)

    @rule(data=st.data(), selected=st.booleans())
    def relabel_node(self, data, selected: bool) -> None:
        """The node loses (no GPU any more) or gets back the label the DaemonSet selects on."""
        node = self.pick(data)
        if node:
            self.step(f"gpu-label-{selected}")
            self.cluster.edit_node(node, {"metadata": {"labels": {GPU_NODE_LABEL: "true" if selected else None}}})

    @rule(data=st.data())
    def admin_cordons(self, data) -> None:
        node = self.pick(data)
        if node and not self.cluster.nodes()[node]["spec"].get("unschedulable"):
            self.step("admin-cordon")
            self.admin_cordoned.add(node)
            self.cluster.edit_node(node, {"spec": {"unschedulable": True}})

    @rule(data=st.data(), skip=st.booleans())
    def label_skip(self, data, skip: bool) -> None:
        node = self.pick(data)
        if node:
            self.step(f"skip-{skip}")
            self.cluster.edit_node(node, {"metadata": {"labels": {SKIP_LABEL: "true" if skip else None}}})

    @rule(data=st.data())
    def someone_deletes_a_driver_pod(self, data) -> None:
        pods = live_pods(self.cluster)
        if pods:
            node = data.draw(st.sampled_from(sorted(pods)))
            self.step("pod-deleted")
            self.cluster.kubectl.delete("v1", "Pod", pods[node]["metadata"]["name"], "metax-operator")
            self.checks.deleted_at[node] = self.cluster.now
            self.checks.swapping.pop(node, None)  # not the runner's doing any more
            self.checks.excuse(node)

    @rule(data=st.data(), fails=st.booleans())
    def driver_fails(self, data, fails: bool) -> None:
        """The node's new driver never gets Ready (a crash loop), or is fixed."""
        node = self.pick(data)
        if node:
            self.step(f"driver-fails-{fails}")
            (self.cluster.kubelet.failing.add if fails else self.cluster.kubelet.failing.discard)(node)

    @rule(data=st.data(), how=st.sampled_from(["fails", "hangs", "passes"]))
    def validation_goes(self, data, how: str) -> None:
        """The node's next validations fail (the driver leaves no GPU), hang, or pass again."""
        node = self.pick(data)
        if node:
            self.step(f"validation-{how}")
            kubelet = self.cluster.kubelet
            kubelet.invalid.discard(node)
            kubelet.hanging.discard(node)
            {"fails": kubelet.invalid, "hangs": kubelet.hanging}.get(how, set()).add(node)

    @rule(data=st.data(), ready=st.booleans())
    def node_readiness(self, data, ready: bool) -> None:
        """The node goes NotReady (its kubelet stops reporting), or is Ready again."""
        node = self.pick(data)
        if node:
            self.step(f"node-ready-{ready}")
            self.cluster.set_node_ready(node, ready)

    @rule(data=st.data())
    def someone_deletes_a_validation_pod(self, data) -> None:
        objects = self.cluster.api.objects
        found = sorted(p for p, v in objects.items() if p.startswith(PODS + "/") and VALIDATES_LABEL in labels(v))
        if found:
            self.step("validation-pod-deleted")
            self.cluster.kubectl.delete("v1", "Pod", data.draw(st.sampled_from(found)).rsplit("/", 1)[1], "metax-operator")

    @rule(
        data=st.data(),
        kind=st.sampled_from(["job", "bare", "daemonset", "waited-gpu", "waited"]),
        guarded=st.booleans(),
    )
    def work_starts(self, data, kind: str, guarded: bool) -> None:
        """A pod lands on a node: a GPU job (of a Job, or bare), a DaemonSet's GPU pod, a pod the
        policy waits for (with a GPU or without); its eviction maybe refused by a budget."""
        node = self.pick(data)
        if node:
            self.step(f"work-{kind}")
            owner = {"job": "Job", "waited-gpu": "Job", "waited": "Job", "bare": "", "daemonset": "DaemonSet"}[kind]
            gpu, waited = kind != "waited", kind.startswith("waited")
            self.cluster.workloads.start(node, gpu=gpu, waited=waited, owner=owner, guarded=guarded)

    @rule(data=st.data())
    def work_ends(self, data) -> None:
        running = sorted(self.cluster.workloads.running())
        if running:
            self.step("work-ends")
            self.cluster.workloads.end(data.draw(st.sampled_from(running)))

    # -- the API server -----------------------------------------------------------------------

    @rule()
    def watches_expire(self) -> None:
        self.step("watches-expire")
        self.cluster.api.expire_watches()

    @precondition(lambda self: self.cluster.runner.watches.started and self.relists < 2)
    @rule(collection=st.sampled_from([NODES, "/api/v1/pods", PODS, DAEMONSETS]))
    def relist_fails(self, collection: str) -> None:
        """The watches expire and the caches' LISTs of `collection` answer 500 during the next
        pass: the rollout takes no node and writes nothing then."""
        self.step("relist-fails")
        self.relists += 1
        api = self.cluster.api
        api.fail("GET", collection, 500, times=10_000)
        caches = [i for i in self.cluster.runner.caches() if i.path == collection and i.state != "stopped"]

        def failing() -> bool:
            # Expired again until each cache fails: one whose LIST had just succeeded when the
            # fault came opens its watch after the expiry and would follow it undisturbed. A
            # cache may be waiting out an earlier failure's backoff (up to 30 s), then its client
            # retries the LIST for up to 8 s before the cache says failing.
            if all(i.state == "failing" for i in caches):
                return True
            api.expire_watches()
            return False

        eventually(failing, 120, f"the caches of {collection} failing", interval=0.5)
        done = self.run_pass(wait=False)
        api.clear_faults()
        taken = [(r.method, r.path) for r in done.writes if r.path.startswith((NODES, PODS, JOBS))]
        assert not taken, f"a pass on a failing cache of {collection} acted on nodes: {taken}"

    @rule(write=st.sampled_from(WRITES), status=st.sampled_from([409, 422, 500, 403]), data=st.data())
    def write_refused(self, write, status: int, data) -> None:
        """The next matching write is refused once."""
        method, path = write
        path = self.fill(path, data)
        if path:
            self.step(f"refuse-{method}-{status}")
            self.cluster.api.fail(method, path, status)

    @rule(write=st.sampled_from(WRITES), data=st.data())
    def writes_fail_until_cleared(self, write, data) -> None:
        """Every matching write fails (500) until `faults_cleared`."""
        method, path = write
        path = self.fill(path, data)
        if path:
            self.step(f"outage-{method}")
            self.cluster.api.fail(method, path, 500, times=10_000)

    @rule()
    def faults_cleared(self) -> None:
        self.step("faults-cleared")
        self.cluster.api.clear_faults()

    # -- the administrator and Helm ------------------------------------------------------------

    @precondition(lambda self: self.cluster.cr() is not None)
    @rule(field=st.sampled_from(["pause", "enableRollout", "maxParallel"]), data=st.data())
    def admin_edits_the_policy(self, field: str, data) -> None:
        value = data.draw(st.integers(1, 3) if field == "maxParallel" else st.booleans())
        self.step(f"edit-{field}")
        self.cluster.set_policy(field, value)
        if field == "maxParallel":
            self.checks.parallel.add(value)

    @precondition(lambda self: self.cluster.cr() is not None)
    @rule(version=st.sampled_from(VERSIONS))
    def admin_sets_a_version(self, version: str) -> None:
        """`kubectl patch` of spec.driver.payload.version: a rollout, or a held edit mid-rollout."""
        self.step("set-version")
        self.cluster.set_version(version)
        self.checks.version_set()

    @precondition(lambda self: self.cluster.cr() is not None)
    @rule(again=st.booleans())
    def cr_deleted(self, again: bool) -> None:
        """`kubectl delete` of the CR (a GitOps prune, an uninstall that failed); `again`: after the
        runner's pass, the next `helm upgrade`'s bootstrap creates it again, with the version it
        had (the admin's `--set driver.payload.version`)."""
        self.step(f"cr-deleted-{again}")
        version = self.cluster.cr_version()
        self.cluster.delete_cr()
        if again:
            self.run_pass()
            self.cluster.helm.upgrade(version)
            self.checks.version_set()
            self.checks.parallel.add(self.policy["maxParallel"])

    @rule(version=st.one_of(st.none(), st.sampled_from(VERSIONS)))
    def helm_upgrade(self, version: str | None) -> None:
        """`helm upgrade` (`--set driver.payload.version=...`): its bootstrap writes the CR (or
        creates it again) and holds the runner until Helm applies the release."""
        self.step("helm-upgrade")
        gone = self.cluster.cr() is None
        if self.cluster.helm.upgrade(version) and (gone or version is not None):
            self.checks.version_set()
            if gone:
                self.checks.parallel.add(self.policy["maxParallel"])

    @rule()
    def helm_applies(self) -> None:
        self.step("helm-applies")
        self.cluster.helm.apply()

    def kill_at(self, k: int) -> list:
        """Run one pass in which the runner dies at its k-th write (that write and every later one
        lost); the requests lost (none if the pass wrote less)."""
        writes, dead = [0], []

        def kill(request):
            if request.method == "GET":
                return None
            writes[0] += 1
            if writes[0] >= k:
                dead.append(request)
                return 500, {"kind": "Status", "code": 500, "message": f"the runner was killed at its write {k}"}
            return None

        self.cluster.api.interceptors.insert(0, kill)
        try:
            self.run_pass()
        finally:
            self.cluster.api.interceptors.remove(kill)
        if dead:
            FIGURES.kills += 1
            FIGURES.kill_positions.add(k)
        return dead

    # -- passes and the end --------------------------------------------------------------------

    def run_pass(self, wait: bool = True) -> Pass:
        """One runner pass, its checks after it."""
        held = self.cluster.helm.holds()
        before = self.checks.snapshot(held)
        done = self.cluster.run_pass(wait=wait)
        self.checks.after_pass(done, before)
        self.passed = True
        return done

    @invariant()
    def runner_reacts(self) -> None:
        """A watch wakes the runner after each change: a pass follows every step, but one that ran
        its own passes or whose change `changes_coalesce` joined to the next one."""
        FIGURES.steps += 1
        if self.passed or self.coalesce:
            self.passed = self.coalesce = False
            return
        self.run_pass()
        self.passed = False

    @rule()
    def changes_coalesce(self) -> None:
        """The next change lands within the runner's coalescing delay of the last: one pass after both."""
        self.step("coalesce")
        self.coalesce = self.passed = True

    def settle(self) -> None:
        """The faults end, drivers heal, work ends, Helm applies, a deleted CR is created again,
        the admin ends the maintenance of the nodes they cordoned (each still cordoned: the runner
        never lifts another's cordon) and resumes: the rollout finishes, and no cordon remains."""
        cluster = self.cluster
        cluster.api.clear_faults()
        nodes = cluster.nodes()
        for node in sorted(self.admin_cordoned & set(nodes)):
            assert cordoned_by_other(nodes[node]), f"the admin's cordon of {node} was lifted or taken for the runner's"
            cluster.edit_node(node, {"spec": {"unschedulable": False}})
        self.admin_cordoned = set()
        cluster.lease.update(held=True, checks_left=None)
        cluster.kubelet.failing.clear()
        cluster.kubelet.invalid.clear()
        cluster.kubelet.hanging.clear()
        for node in cluster.not_ready():
            cluster.set_node_ready(node, True)
        for name in cluster.workloads.running():
            cluster.workloads.end(name)
        if cluster.cr() is None:
            cluster.helm.upgrade()
            self.checks.version_set()
        cluster.helm.apply()
        cluster.set_policy("enableRollout", True)
        cluster.set_policy("pause", False)
        for _ in range(40):
            cluster.sync()
            cluster.tick(60)
            self.run_pass()
            if self.done():
                return
            if (cluster.cr()["spec"]["driver"]["upgradePolicy"]).get("pause"):  # the runner's pause: the admin answers
                cluster.set_policy("pause", False)
            for node, pod in live_pods(cluster).items():  # the admin retries a node whose validation failed
                if validation_failed(cluster.api, pod, cluster.now) and RETRY_LABEL not in labels(cluster.nodes()[node]):
                    cluster.edit_node(node, {"metadata": {"labels": {RETRY_LABEL: "true"}}})
        raise AssertionError(f"the rollout did not settle: {self.unsettled()}; {cluster.upgrade_status().get('message')}")

    def done(self) -> bool:
        return not self.unsettled()

    def unsettled(self) -> str:
        """What keeps the rollout from being done ("" once it is)."""
        cluster = self.cluster
        pods, template = live_pods(cluster), cluster.controller.current()
        behind = [
            n
            for n in sorted(cluster.controller.selected() - cluster.skipped())
            if not (n in pods and workloads.ready(pods[n]) and labels(pods[n])[REVISION_LABEL] == template)
        ]
        cordoned = [
            n
            for n, obj in cluster.nodes().items()
            if CORDONED_LABEL in labels(obj) or (obj["spec"].get("unschedulable") and n not in self.admin_cordoned)
        ]
        versions = (cluster.template_version(), cluster.cr_version())
        return "; ".join(
            [f"nodes not Ready at the template's revision: {behind}"] * bool(behind)
            + [f"nodes left cordoned by the runner: {cordoned}"] * bool(cordoned)
            + [f"template at {versions[0]}, the CR at {versions[1]}"] * (versions[0] != versions[1])
        )

    # -- helpers ------------------------------------------------------------------------------

    def step(self, name: str) -> None:
        self.trace.append(name)

    def pick(self, data) -> str | None:
        nodes = sorted(self.cluster.nodes())
        return data.draw(st.sampled_from(nodes)) if nodes else None

    def fill(self, path: str, data) -> str | None:
        if "{node}" in path:
            node = self.pick(data)
            return path.format(node=node) if node else None
        if "{pod}" in path:
            pods = all_driver_pods(self.cluster)
            return path.format(pod=data.draw(st.sampled_from(sorted(pods)))) if pods else None
        if "{work}" in path:
            work = sorted(self.cluster.workloads.running())
            return path.format(work=data.draw(st.sampled_from(work))) if work else None
        return path


#: The example `killed_at_every_write` sweeps: a wave of three on six nodes, cordoned and drained,
#: with GPU jobs on four of them (`GPU_JOBS_ON`: the wave takes the two free nodes and drains a
#: third), so that its first wave pass writes the status, three cordons, two driver pod
#: deletions, Events and six state labels.
SWEPT = {
    "nodes": 6,
    "policy": {
        "enableRollout": True,
        "pause": False,
        "readinessTimeout": f"{READINESS_TIMEOUT}s",
        "upgradeSteps": STEP_SHAPES[0],
        "maxParallel": 3,
        "maxUnavailable": 0,
        "maxFailureThreshold": 1,
        "fallback": "rollback",
        "allowGpuWorkloads": False,
        "cordon": True,
        "drain": {"enable": True, "timeout": "600s"},
        "waitForCompletion": {},
        "onTimeout": "fail",
    },
    "version": VERSIONS[1],
    "failing": set(),
    "skipped": set(),
    "waited": set(),
}
GPU_JOBS_ON = ("n0", "n1", "n2", "n3")
SWEPT_PASSES = 6  # the passes after the version is set, among which the one writing most is swept


def killed_at(start: dict, at_pass: int | None, k: int) -> list[int]:
    """An example of `start` with GPU jobs on `GPU_JOBS_ON`: passes, the cluster syncing between
    them; at pass `at_pass` the runner dies at its k-th write and starts again; then the end
    (`settle`) with every check. The writes of each pass before the kill (all, with no kill)."""
    campaign, writes = Campaign(), []
    try:
        campaign.start(**start)
        for node in GPU_JOBS_ON:
            campaign.cluster.workloads.start(node)
        for index in range(SWEPT_PASSES):
            if index == at_pass:
                assert campaign.kill_at(k), f"pass {index} wrote fewer than {k} times this time: no kill"
                campaign.cluster.restart_runner()
                break
            writes.append(len(campaign.run_pass().writes))
            campaign.cluster.sync()
    finally:
        campaign.teardown()
    return writes


def killed_at_every_write(start: dict = SWEPT) -> tuple[int, int]:
    """Find the pass of `start` that writes most, then kill the runner at each of its writes in
    turn, each in a fresh example that must end as `settle` says with no invariant broken; the
    pass's index and its number of writes."""
    writes = killed_at(start, None, 0)
    most = max(writes)
    at_pass = writes.index(most)
    for k in range(1, most + 1):
        killed_at(start, at_pass, k)
    return at_pass, most
