"""The fault campaign: a hypothesis state machine over the real rollout engine and the real
executor (`runtime.rollout_pass.RolloutPass` on the real client), against the fake API server of
tests/fakeapi.py, whose steps are what happens to a fleet during a driver rollout:

- the fleet: nodes added, deleted, relabelled out of the DaemonSet, cordoned by an admin, labelled
  skip; driver pods deleted by someone else, failing (never Ready), slow (Ready only when the
  kubelet step says so); GPU jobs bound and finished at any moment;
- the API server: watches answered 410 Gone (the caches list again), a LIST answered 500 (the
  caches failing), the next write of a kind answered 409, 422, 500 or 403, writes failing until
  cleared (the runner killed between two writes);
- the runner: passes, restarted with fresh caches, its lease lost between passes or mid-batch;
- the template: a next driver version landing mid-rollout;
- the administrator: pause, enableRollout and maxParallel edited at any step; the clock moves on.

`Fleet` plays the DaemonSet controller (OnDelete: a node without a driver pod gets one at the
template's revision, a node that left loses its pod) and the kubelet. Checked after every pass:

- no pass leaves more nodes being swapped (their driver pod deleted by the runner, the new one
  not Ready yet, the driver not failing) than `maxParallel`, while the rollout is enabled;
- no driver pod is deleted under a GPU job;
- no Ready driver pod already at the template's revision is deleted (no node replaced twice);
- a node that left (deleted, relabelled) never fails a step (a node whose driver failed, or was
  not Ready within the readiness timeout, may), and never blocks one (the end, below).

At the end the faults stop, the drivers heal, the admin resumes: the rollout must finish with
every selected, unskipped node on the template's revision and no node left cordoned by the
runner. `tests/runtime/test_fault_campaign.py` runs it short, `make bench` long.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kubernetes.client.exceptions import ApiException

from metax_operator.conditions import rfc3339
from metax_operator.contract import CORDONED_LABEL, GPU_NODE_LABEL, SKIP_LABEL
from metax_operator.rollout.status import UpgradeStatus
from metax_operator.runtime.cr_status import LostLeadership
from metax_operator.runtime.rollout_pass import RolloutPass
from tests.fakeapi import FakeApi
from tests.runtime.test_rollout_observe import daemonset, revision
from tests.runtime.test_rollout_pass import CR, DS, NS, PODS, cluster_operator, run_pass
from tests.runtime.test_runner_trace import driver_pod
from tests.waiting import eventually

JOBS = "/api/v1/namespaces/ml/pods"
NODES = "/api/v1/nodes"
SELECTOR = {GPU_NODE_LABEL: "true"}
OLD_TEMPLATE = {"spec": {"nodeSelector": SELECTOR, "containers": [{"name": "driver-manager", "image": "driver:1"}]}}
NEW_TEMPLATE = {"spec": {"nodeSelector": SELECTOR, "containers": [{"name": "driver-manager", "image": "driver:2"}]}}
NEXT_TEMPLATE = {"spec": {"nodeSelector": SELECTOR, "containers": [{"name": "driver-manager", "image": "driver:3"}]}}
#: The driver's pod templates by the hash of their ControllerRevision.
TEMPLATES = {"old": OLD_TEMPLATE, "new": NEW_TEMPLATE, "next": NEXT_TEMPLATE}
REVISIONS = f"/apis/apps/v1/namespaces/{NS}/controllerrevisions"
READINESS_TIMEOUT = 300
T0 = 1_800_000_000.0
# Every write the executor makes, as (method, path pattern): `{node}`/`{pod}` filled in by the rule.
WRITES = (
    ("PUT", CR + "/status"),
    ("PATCH", CR),
    ("PATCH", NODES + "/{node}"),
    ("DELETE", PODS + "/{pod}"),
    ("POST", "/api/v1/namespaces/default/events"),
)


@dataclass
class Figures:
    """What a campaign explored: for `make bench` and the test's summary."""

    examples: int = 0
    steps: int = 0
    passes: int = 0
    deletions: int = 0
    sequences: set = field(default_factory=set)  # the distinct sequences of rule names


FIGURES = Figures()


def gpu_job(node: str) -> dict:
    return {
        "metadata": {"name": f"job-{node}", "namespace": "ml"},
        "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"limits": {"metax-tech.com/gpu": "1"}}}]},
        "status": {"phase": "Running"},
    }


class Fleet:
    """The DaemonSet controller and the kubelet, on the fake API server's objects."""

    def __init__(self, api: FakeApi, clock):
        self.api, self.clock = api, clock
        self.serial = itertools.count()
        self.failing: set[str] = set()  # nodes whose new driver never gets Ready

    def nodes(self) -> dict[str, dict]:
        return {path.rsplit("/", 1)[1]: obj for path, obj in self.api.objects.items() if path.startswith(NODES + "/")}

    def selected(self) -> set[str]:
        return {n for n, obj in self.nodes().items() if (obj["metadata"].get("labels") or {}).get(GPU_NODE_LABEL) == "true"}

    def driver_pods(self) -> dict[str, dict]:
        """node -> its driver pod."""
        return {obj["spec"]["nodeName"]: obj for path, obj in self.api.objects.items() if path.startswith(PODS + "/driver-")}

    def template_revision(self) -> str:
        template = self.api.get(DS)["spec"]["template"]
        return next(h for h, t in TEMPLATES.items() if t == {k: v for k, v in template.items() if k != "$patch"})

    def revisions(self) -> dict[str, dict]:
        return {path.rsplit("-", 1)[1]: obj for path, obj in self.api.objects.items() if path.startswith(REVISIONS + "/")}

    def record_revision(self) -> None:
        """As the DaemonSet controller does on a template change: the ControllerRevision holding
        the template becomes the newest (created, or an older one's number raised). A rollback's
        strategic merge patch (`$patch: replace`, which this server merges) is normalised."""
        ds = self.api.get(DS)
        current = self.template_revision()
        if "$patch" in ds["spec"]["template"]:
            ds["spec"]["template"] = TEMPLATES[current]
            self.api.put(DS, ds)
        revisions = self.revisions()
        newest = max(r["revision"] for r in revisions.values())
        if current not in revisions:
            self.api.put(f"{REVISIONS}/metax-driver-{current}", revision(current, newest + 1, template=TEMPLATES[current]))
        elif revisions[current]["revision"] != newest:
            raised = {**revisions[current], "revision": newest + 1}
            self.api.put(f"{REVISIONS}/metax-driver-{current}", raised)

    def add_pod(self, node: str, rev: str, ready: bool) -> None:
        name = f"driver-{node}-{next(self.serial)}"
        owner = daemonset()["metadata"]["uid"]
        self.api.put(f"{PODS}/{name}", driver_pod(name, NS, node, rev, owner, rfc3339(self.clock()), ready))

    def controller(self) -> None:
        """OnDelete: a selected node without a driver pod gets one at the template's revision;
        a pod whose node left is deleted."""
        self.record_revision()
        pods, selected = self.driver_pods(), self.selected()
        for node in sorted(selected - set(pods)):
            self.add_pod(node, self.template_revision(), ready=False)
        for node, pod in pods.items():
            if node not in selected:
                self.api.delete(f"{PODS}/{pod['metadata']['name']}")

    def kubelet(self) -> None:
        """Every driver pod not Ready whose driver does not fail gets Ready."""
        for node, pod in self.driver_pods().items():
            if node not in self.failing and not ready(pod):
                pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
                self.api.put(f"{PODS}/{pod['metadata']['name']}", pod)


def ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in pod["status"].get("conditions") or [])


class Campaign(RuleBasedStateMachine):
    """See the module docstring."""

    def __init__(self):
        super().__init__()
        self.api = FakeApi().__enter__()
        self.fleet = Fleet(self.api, lambda: self.now)
        self.now = T0
        self.lease = {"held": True, "checks_left": None}  # see `lease_guard`
        self.runner: RolloutPass | None = None
        self.swapping: set[str] = set()  # nodes whose driver pod the runner deleted, not back yet
        self.failed: set[str] = set()  # the status's failed nodes after the last pass
        self.admin_cordoned: set[str] = set()
        self.names = itertools.count()
        self.trace: list[str] = []
        FIGURES.examples += 1

    # -- the cluster at the start -------------------------------------------------------------

    @initialize(
        nodes=st.integers(2, 6),
        parallel=st.integers(1, 3),
        threshold=st.integers(0, 2),
        fallback=st.sampled_from(["pause", "rollback"]),
    )
    def start(self, nodes: int, parallel: int, threshold: int, fallback: str) -> None:
        ds = daemonset(template=NEW_TEMPLATE)
        self.api.put(DS, {**ds, "metadata": {**ds["metadata"], "namespace": NS}})
        self.api.put(f"{REVISIONS}/metax-driver-old", revision("old", 1, template=OLD_TEMPLATE))
        self.api.put(f"{REVISIONS}/metax-driver-new", revision("new", 2, template=NEW_TEMPLATE))
        for _ in range(nodes):
            self.fleet.add_pod(self.new_node(), "old", ready=True)
        policy = {
            "enableRollout": True,
            "pause": False,
            "maxParallel": parallel,
            "maxFailureThreshold": threshold,
            "fallback": fallback,
            "readinessTimeout": f"{READINESS_TIMEOUT}s",
            "upgradeSteps": [{"replicas": "50%", "pauseDuration": 0}, {"replicas": "100%", "pauseDuration": 0}],
        }
        self.api.put(CR, cluster_operator(policy))
        self.runner = self.new_runner()

    def new_runner(self) -> RolloutPass:
        return RolloutPass(self.api.client(attempts=1), NS, guard=self.lease_guard, clock=lambda: self.now)

    def lease_guard(self) -> bool:
        """The runner's lease check (one before each write): held, unless lost, or lapsing after
        the number of checks `lease_lapses_mid_pass` set."""
        left = self.lease["checks_left"]
        if left is not None:
            self.lease["checks_left"] = left - 1 if left else None
            self.lease["held"] = self.lease["held"] and left > 0
        return self.lease["held"]

    def teardown(self) -> None:
        try:
            if self.runner is not None:
                self.settle()
        finally:
            FIGURES.sequences.add(tuple(self.trace))
            if self.runner is not None:
                self.runner.close()
            self.api.__exit__(None, None, None)

    # -- the runner ---------------------------------------------------------------------------

    @rule()
    def runner_pass(self) -> None:
        self.step("pass")
        self.run_pass()

    @rule()
    def restart_runner(self) -> None:
        """The runner killed (between two writes, when a write fault is pending) and started again."""
        self.step("restart")
        self.runner.close()
        self.runner = self.new_runner()

    @rule(held=st.booleans())
    def lease_changes(self, held: bool) -> None:
        self.step(f"lease-{held}")
        self.lease.update(held=held, checks_left=None)

    @rule(checks=st.integers(0, 4))
    def lease_lapses_mid_pass(self, checks: int) -> None:
        """The lease is lost after the runner's next `checks` lease checks: mid-batch."""
        self.step("lease-lapses")
        self.lease["checks_left"] = checks

    # -- the fleet ----------------------------------------------------------------------------

    @rule()
    def daemonset_controller(self) -> None:
        self.step("controller")
        self.fleet.controller()

    @rule()
    def kubelet(self) -> None:
        self.step("kubelet")
        self.fleet.kubelet()

    @rule(seconds=st.sampled_from([30, 120, READINESS_TIMEOUT + 1]))
    def time_passes(self, seconds: int) -> None:
        self.step("time")
        self.now += seconds

    @precondition(lambda self: len(self.fleet.nodes()) < 8)
    @rule()
    def add_node(self) -> None:
        self.step("add-node")
        self.new_node()

    def new_node(self) -> str:
        """A GPU node the DaemonSet selects; its name."""
        name = f"n{next(self.names)}"
        self.api.put(f"{NODES}/{name}", {"metadata": {"name": name, "labels": dict(SELECTOR)}, "spec": {}})
        return name

    @rule(data=st.data())
    def delete_node(self, data) -> None:
        node = self.pick(data)
        if node:
            self.step("delete-node")
            self.api.delete(f"{NODES}/{node}")
            self.fleet.controller()

    @rule(data=st.data())
    def relabel_node(self, data) -> None:
        """The node no longer carries the label the DaemonSet selects on (no GPU any more)."""
        node = self.pick(data)
        if node:
            self.step("relabel")
            self.edit_node(node, lambda obj: obj["metadata"]["labels"].pop(GPU_NODE_LABEL, None))

    @rule(data=st.data())
    def admin_cordons(self, data) -> None:
        node = self.pick(data)
        if node and not self.fleet.nodes()[node]["spec"].get("unschedulable"):
            self.step("admin-cordon")
            self.admin_cordoned.add(node)
            self.edit_node(node, lambda obj: obj["spec"].update(unschedulable=True))

    @rule(data=st.data())
    def label_skip(self, data) -> None:
        node = self.pick(data)
        if node:
            self.step("skip")
            self.edit_node(node, lambda obj: obj["metadata"]["labels"].update({SKIP_LABEL: "true"}))

    @rule(data=st.data())
    def someone_deletes_a_driver_pod(self, data) -> None:
        pods = self.fleet.driver_pods()
        if pods:
            self.step("pod-deleted")
            node = data.draw(st.sampled_from(sorted(pods)))
            self.api.delete(f"{PODS}/{pods[node]['metadata']['name']}")
            self.swapping.discard(node)  # not the runner's doing any more

    @rule(data=st.data())
    def driver_fails(self, data) -> None:
        node = self.pick(data)
        if node:
            self.step("driver-fails")
            self.fleet.failing.add(node)

    @rule(data=st.data())
    def gpu_job_bound(self, data) -> None:
        node = self.pick(data)
        if node and f"{JOBS}/job-{node}" not in self.api.objects:
            self.step("job-bound")
            self.api.put(f"{JOBS}/job-{node}", gpu_job(node))

    @rule(data=st.data())
    def gpu_job_ends(self, data) -> None:
        jobs = sorted(p for p in self.api.objects if p.startswith(JOBS + "/"))
        if jobs:
            self.step("job-ends")
            self.api.delete(data.draw(st.sampled_from(jobs)))

    # -- the API server -----------------------------------------------------------------------

    @rule()
    def watches_expire(self) -> None:
        self.step("watches-expire")
        self.api.expire_watches()

    @precondition(lambda self: self.runner.watches.started)
    @rule(collection=st.sampled_from([NODES, "/api/v1/pods", PODS]))
    def relist_fails(self, collection: str) -> None:
        """The watches expire and the caches' next LIST of `collection` answers 500: a pass while
        they are failing takes no node and writes nothing; they list again within a second."""
        self.step("relist-fails")
        self.api.fail("GET", collection, 500)
        self.api.expire_watches()
        watches = self.runner.watches
        eventually(lambda: watches.failing(), 10, f"a cache of {collection} failing")
        first = len(self.api.requests)
        self.run_pass(wait=False)
        writes = [r for r in self.api.requests[first:] if r.method != "GET"]
        assert not writes or not watches.failing(), f"a pass on failing caches wrote {writes}"

    @rule(write=st.sampled_from(WRITES), status=st.sampled_from([409, 422, 500, 403]), data=st.data())
    def write_refused(self, write, status: int, data) -> None:
        """The next matching write is refused once."""
        method, path = write
        path = self.fill(path, data)
        if path:
            self.step(f"refuse-{method}-{status}")
            self.api.fail(method, path, status)

    @rule(write=st.sampled_from(WRITES), data=st.data())
    def writes_fail_until_cleared(self, write, data) -> None:
        """Every matching write fails (500) until `faults_cleared`: the runner's passes stop at it."""
        method, path = write
        path = self.fill(path, data)
        if path:
            self.step(f"outage-{method}")
            self.api.fail(method, path, 500, times=10_000)

    @rule()
    def faults_cleared(self) -> None:
        self.step("faults-cleared")
        self.api.clear_faults()

    # -- the administrator --------------------------------------------------------------------

    @rule(field=st.sampled_from(["pause", "enableRollout", "maxParallel"]), data=st.data())
    def admin_edits_the_policy(self, field, data) -> None:
        value = data.draw(st.integers(1, 3) if field == "maxParallel" else st.booleans())
        self.step(f"edit-{field}")
        cr = self.api.get(CR)
        cr["spec"]["driver"]["upgradePolicy"][field] = value
        self.api.put(CR, cr)

    @precondition(lambda self: self.fleet.template_revision() != "next")
    @rule()
    def new_driver_version(self) -> None:
        """A next driver version lands on the template mid-rollout (the runner's reconcile of a
        version the admin set, or a Helm upgrade): a new ControllerRevision."""
        self.step("new-version")
        ds = self.api.get(DS)
        ds["spec"]["template"] = NEXT_TEMPLATE
        self.api.put(DS, ds)
        self.fleet.record_revision()

    # -- the checks ---------------------------------------------------------------------------

    def run_pass(self, wait: bool = True) -> bool:
        """One runner pass (`run_pass`: the rollout's half, as `reconcile.apply` runs it), once its caches hold what the API
        server sent them (unless not to `wait`); the invariants of one pass checked. Whether it
        went through."""
        FIGURES.passes += 1
        runner = self.runner
        if runner.watches.started and wait:
            eventually(
                lambda: runner.watches.synced() and not runner.watches.failing() and self.api.delivered(runner.watches.all),
                30,
                "the caches",
            )
        policy = self.api.get(CR)["spec"]["driver"]["upgradePolicy"]
        before = self.fleet.driver_pods()
        jobs = {p.rsplit("-", 1)[1] for p in self.api.objects if p.startswith(JOBS + "/job-")}
        template = self.fleet.template_revision()
        first = len(self.api.requests)
        went_through = True
        try:
            run_pass(self.api, runner)
        except (ApiException, LostLeadership):
            went_through = False
        deleted = {
            node
            for r in self.api.requests[first:]
            if r.method == "DELETE" and r.path.startswith(PODS + "/driver-")
            for node, pod in before.items()
            if r.path.endswith("/" + pod["metadata"]["name"]) and f"{PODS}/{pod['metadata']['name']}" not in self.api.objects
        }
        FIGURES.deletions += len(deleted)
        template_after = self.fleet.template_revision()  # a rollback changes it within the pass
        for node in deleted:
            pod = before[node]
            assert node not in jobs, f"the runner deleted {node}'s driver under a GPU job"
            at = pod["metadata"]["labels"]["controller-revision-hash"]
            assert not (ready(pod) and at == template == template_after), (
                f"the runner replaced {node}'s Ready driver already at revision {template}"
            )
        self.swapping |= deleted
        self.forget_settled()
        if deleted and policy.get("enableRollout"):
            healthy = self.swapping - self.fleet.failing
            assert len(healthy) <= policy["maxParallel"], (
                f"{sorted(healthy)} being swapped at once, maxParallel is {policy['maxParallel']}: {self.trace}"
            )
        if went_through:
            stored = (self.api.get(CR).get("status") or {}).get("upgradeStatus")
            if stored:
                status = UpgradeStatus.from_json(stored)
                newly_failed = set(status.resume.failed.names) - self.failed
                left = newly_failed - self.fleet.selected()
                assert not left, f"{sorted(left)} left the DaemonSet and failed the step: {self.trace}"
                self.failed = set(status.resume.failed.names)
        return went_through

    def forget_settled(self) -> None:
        """Nodes no longer being swapped: their new driver is Ready, or they left."""
        pods, selected = self.fleet.driver_pods(), self.fleet.selected()
        self.swapping = {n for n in self.swapping if n in selected and not (n in pods and ready(pods[n]))}

    @invariant()
    def counted(self) -> None:
        FIGURES.steps += 1

    def settle(self) -> None:
        """The faults end, failed drivers are fixed, jobs end, the admin resumes: the rollout
        finishes, and only the admin's cordons remain."""
        self.api.clear_faults()
        self.lease.update(held=True, checks_left=None)
        self.fleet.failing.clear()
        for path in [p for p in self.api.objects if p.startswith(JOBS + "/")]:
            self.api.delete(path)
        cr = self.api.get(CR)
        cr["spec"]["driver"]["upgradePolicy"].update(pause=False, enableRollout=True)
        self.api.put(CR, cr)
        for _ in range(60):
            self.fleet.controller()
            self.fleet.kubelet()
            self.now += 60
            self.run_pass()
            if self.done():
                return
            cr = self.api.get(CR)
            if cr["spec"]["driver"]["upgradePolicy"].get("pause"):  # the runner's fallback pause: the admin resumes
                cr["spec"]["driver"]["upgradePolicy"]["pause"] = False
                self.api.put(CR, cr)
        raise AssertionError(f"the rollout did not settle: {self.api.get(CR)['status']}, {self.trace}")

    def done(self) -> bool:
        pods = self.fleet.driver_pods()
        skipped = {n for n, obj in self.fleet.nodes().items() if SKIP_LABEL in (obj["metadata"].get("labels") or {})}
        template = self.fleet.template_revision()
        upgraded = all(
            n in pods and ready(pods[n]) and pods[n]["metadata"]["labels"]["controller-revision-hash"] == template
            for n in self.fleet.selected() - skipped
        )
        left_cordoned = [
            n
            for n, obj in self.fleet.nodes().items()
            if CORDONED_LABEL in (obj["metadata"].get("labels") or {})
            or (obj["spec"].get("unschedulable") and n not in self.admin_cordoned)
        ]
        return upgraded and not left_cordoned

    # -- helpers ------------------------------------------------------------------------------

    def step(self, name: str) -> None:
        self.trace.append(name)

    def pick(self, data) -> str | None:
        nodes = sorted(self.fleet.nodes())
        return data.draw(st.sampled_from(nodes)) if nodes else None

    def fill(self, path: str, data) -> str | None:
        if "{node}" in path:
            node = self.pick(data)
            return path.format(node=node) if node else None
        if "{pod}" in path:
            pods = self.fleet.driver_pods()
            return path.format(pod=pods[data.draw(st.sampled_from(sorted(pods)))]["metadata"]["name"]) if pods else None
        return path

    def edit_node(self, node: str, change) -> None:
        obj = self.api.get(f"{NODES}/{node}")
        obj["metadata"].setdefault("labels", {})
        change(obj)
        self.api.put(f"{NODES}/{node}", obj)
        self.fleet.controller()
