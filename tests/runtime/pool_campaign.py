"""The fault campaign of driver pools: a hypothesis state machine over the whole runner in the fake
cluster of tests/runtime/cluster.py, with two pools beside the driver's own DaemonSet
(`example.com/rack: a` and `b`), nodes of either rack or none, in any order of:

- the runner's passes, its restart with fresh caches;
- the DaemonSet controller and each kubelet catching up or not, time passing;
- nodes added, relabelled from one rack to another (a move), going NotReady and Ready again,
  cordoned and uncordoned by an admin;
- the admin setting a new version on the driver or on a pool, pausing and resuming either.

The invariant, checked after every pass: the GPU nodes still serving as it began (a Ready driver
pod of any DaemonSet, the node schedulable) that the pass took out of service, by deleting their
driver pod, cordoning them or writing their pool label, are at most `maxParallel` plus
`maxUnavailable` less the GPU nodes not serving as it began (of those with a driver pod or the
runner's cordon: a GPU node no DaemonSet runs on yet is no rollout's; a node whose swap is over
and whose cordon the pass gives back serves): one budget across the driver's rollout, each
pool's and the moves between them. All share the driver's policy (integers), and
no driver pod ever counts failed (the readiness timeout is far beyond the campaign's clock), so
the bound is exact.

At the end (`settle`) the admin uncordons their nodes and resumes everything, the nodes are
Ready, the controllers catch up: every GPU node must end in the pool its rack says, running one
Ready driver pod of that pool's DaemonSet at its template's revision, and no node left cordoned.
tests/runtime/test_pool_campaign.py runs it, and plants faults to show it finds them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from metax_operator import workloads
from metax_operator.contract import CORDONED_LABEL, GPU_NODE_LABEL, POOL_LABEL
from tests.runtime.cluster import NODES, PODS, REVISION_LABEL, Cluster, labels

RACK = "example.com/rack"
POOLS = [{"name": f"rack-{rack}", "nodeSelector": {RACK: rack}} for rack in ("a", "b")]
TARGETS = [None, "rack-a", "rack-b"]  # the driver's own rollout, then each pool's
DAEMONSET = {None: "metax-driver", "rack-a": "metax-driver-pool-rack-a", "rack-b": "metax-driver-pool-rack-b"}
RACKS = st.sampled_from(["a", "b", None])


@dataclass
class Figures:
    """What the campaign explored (`python -m tests.bench pool_campaign`)."""

    examples: int = 0
    passes: int = 0
    deletions: int = 0  # driver pods the runner deleted
    moves: int = 0  # pool labels the runner wrote


FIGURES = Figures()


def is_uncordon(body) -> bool:
    """Whether a node write is the runner's uncordon (a JSON patch setting unschedulable false)."""
    return isinstance(body, list) and {"op": "add", "path": "/spec/unschedulable", "value": False} in body


class PoolCampaign(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cluster: Cluster | None = None
        self.versions = itertools.count(1)

    @initialize(racks=st.lists(RACKS, min_size=3, max_size=7), max_parallel=st.integers(1, 2), allowance=st.integers(0, 1))
    def start(self, racks: list, max_parallel: int, allowance: int) -> None:
        policy = {
            "enableRollout": True,
            "maxParallel": max_parallel,
            "maxUnavailable": allowance,
            "readinessTimeout": "10000h",
            "upgradeSteps": [{"replicas": "50%", "pauseDuration": 0}, {"replicas": "100%", "pauseDuration": 0}],
        }
        self.cluster = Cluster(nodes=0, policy=policy, pools=POOLS)
        for rack in racks:
            self.cluster.add_node({RACK: rack} if rack else None)
        self.cluster.sync()
        self.bound = max_parallel + allowance
        self.admin_cordoned: set[str] = set()

    def teardown(self) -> None:
        FIGURES.examples += 1
        if self.cluster is not None:
            try:
                self.settle()
            finally:
                self.cluster.close()

    # -- the runner -----------------------------------------------------------------------------

    @rule(passes=st.integers(1, 3))
    def runner_passes(self, passes: int) -> None:
        for _ in range(passes):
            self.run_pass()

    @rule()
    def restart_runner(self) -> None:
        self.cluster.restart_runner()

    def run_pass(self) -> None:
        """One pass, and the budget checked on what it sent."""
        serving, gpu, back = self.serving(), self.gpu_nodes(), self.back()
        pods = {
            path: pod["spec"].get("nodeName") for path, pod in self.cluster.api.objects.items() if path.startswith(PODS + "/")
        }
        done = self.cluster.run_pass()
        FIGURES.passes += 1
        taken, given_back = set(), set()
        for request in done.writes:
            node = request.path.rsplit("/", 1)[1]
            if request.method == "DELETE" and request.path in pods:
                taken.add(pods[request.path])
                FIGURES.deletions += 1
            elif request.method == "PATCH" and request.path.startswith(NODES + "/") and isinstance(request.body, dict):
                body = request.body
                moved = POOL_LABEL in ((body.get("metadata") or {}).get("labels") or {})
                if (body.get("spec") or {}).get("unschedulable") or moved:
                    taken.add(node)
                FIGURES.moves += moved
            elif request.method == "PATCH" and request.path.startswith(NODES + "/") and is_uncordon(request.body):
                given_back.add(node)
        taken &= serving
        out = (self.with_driver() & gpu) - serving - (given_back & back)
        room = max(self.bound - len(out), 0)
        assert len(taken) <= room, f"{sorted(taken)} taken while {sorted(out)} were not serving: a budget of {self.bound}"

    def back(self) -> set[str]:
        """The nodes the runner cordoned whose swap is over: Ready, not cordoned by the admin, with a
        Ready driver pod of the DaemonSet their pool label names. The pass that gives one back (its
        uncordon) serves with it: it counts out of service in no wave of that pass, as with one
        DaemonSet."""
        nodes, ready = self.cluster.nodes(), set(self.cluster.nodes()) - self.cluster.not_ready()
        return {
            n
            for n, obj in nodes.items()
            if labels(obj).get(CORDONED_LABEL) == "true"
            and n in ready
            and n not in self.admin_cordoned
            and any(
                not p["metadata"].get("deletionTimestamp") and workloads.ready(p)
                for p in self.cluster.controller.driver_pods(DAEMONSET.get(labels(obj).get(POOL_LABEL), "")).get(n, [])
            )
        }

    def with_driver(self) -> set[str]:
        """The nodes with a driver pod of any driver DaemonSet, or cordoned by the runner (a node
        between two DaemonSets): those a rollout counts; a GPU node no DaemonSet runs on is none's."""
        pods = {
            p["spec"]["nodeName"]
            for ds in DAEMONSET.values()
            for on in self.cluster.controller.driver_pods(ds).values()
            for p in on
        }
        return pods | {n for n, obj in self.cluster.nodes().items() if labels(obj).get(CORDONED_LABEL) == "true"}

    def gpu_nodes(self) -> set[str]:
        return {n for n, obj in self.cluster.nodes().items() if labels(obj).get(GPU_NODE_LABEL) == "true"}

    def serving(self) -> set[str]:
        """The GPU nodes with a live Ready driver pod of any driver DaemonSet, not cordoned."""
        up = {
            pod["spec"]["nodeName"]
            for ds in DAEMONSET.values()
            for on_node in self.cluster.controller.driver_pods(ds).values()
            for pod in on_node
            if not pod["metadata"].get("deletionTimestamp") and workloads.ready(pod)
        }
        cordoned = {n for n, obj in self.cluster.nodes().items() if (obj.get("spec") or {}).get("unschedulable")}
        return (self.gpu_nodes() & up) - cordoned - self.cluster.not_ready()

    # -- the cluster ----------------------------------------------------------------------------

    @rule()
    def daemonset_controller(self) -> None:
        self.cluster.controller.sync()

    @rule(data=st.data())
    def kubelet(self, data) -> None:
        self.cluster.kubelet.sync(data.draw(st.sampled_from([None, *sorted(self.cluster.nodes())])))

    @rule(seconds=st.integers(1, 120))
    def time_passes(self, seconds: int) -> None:
        self.cluster.tick(seconds)

    @precondition(lambda self: len(self.cluster.nodes()) < 9)
    @rule(rack=RACKS)
    def node_added(self, rack) -> None:
        self.cluster.add_node({RACK: rack} if rack else None)

    @rule(data=st.data(), rack=RACKS)
    def node_relabelled(self, data, rack) -> None:
        node = data.draw(st.sampled_from(sorted(self.cluster.nodes())))
        self.cluster.edit_node(node, {"metadata": {"labels": {RACK: rack}}})

    @rule(data=st.data(), ready=st.booleans())
    def node_readiness(self, data, ready: bool) -> None:
        self.cluster.set_node_ready(data.draw(st.sampled_from(sorted(self.cluster.nodes()))), ready)

    @rule(data=st.data())
    def admin_cordons(self, data) -> None:
        """An admin cordons a schedulable node, or uncordons one they cordoned."""
        node = data.draw(st.sampled_from(sorted(self.cluster.nodes())))
        if node in self.admin_cordoned:
            self.cluster.edit_node(node, {"spec": {"unschedulable": None}})
            self.admin_cordoned.discard(node)
        elif not (self.cluster.nodes()[node].get("spec") or {}).get("unschedulable"):
            self.cluster.edit_node(node, {"spec": {"unschedulable": True}})
            self.admin_cordoned.add(node)

    # -- the administrator ----------------------------------------------------------------------

    @rule(rollout=st.sampled_from(TARGETS))
    def admin_sets_a_version(self, rollout) -> None:
        version = f"2.40.0.{next(self.versions)}"
        if rollout is None:
            self.cluster.set_version(version)
        else:
            at = f"/spec/driver/pools/{TARGETS.index(rollout) - 1}/payload"
            self.cluster.kubectl_patch([{"op": "add", "path": at, "value": {"version": version}}])

    @rule(rollout=st.sampled_from(TARGETS), pause=st.booleans())
    def admin_pauses(self, rollout, pause: bool) -> None:
        self.pause(rollout, pause)

    def pause(self, rollout, pause: bool) -> None:
        if rollout is None:
            self.cluster.set_policy("pause", pause)
            return
        index = TARGETS.index(rollout) - 1
        own = (self.cluster.cr()["spec"]["driver"]["pools"][index].get("upgradePolicy")) or {}
        self.cluster.kubectl_patch(
            [{"op": "add", "path": f"/spec/driver/pools/{index}/upgradePolicy", "value": {**own, "pause": pause}}]
        )

    # -- the end --------------------------------------------------------------------------------

    def settle(self) -> None:
        """Everything heals and resumes: every node ends in its rack's pool, at its pool's
        template revision, Ready, and uncordoned."""
        cluster = self.cluster
        for node in sorted(self.admin_cordoned):
            cluster.edit_node(node, {"spec": {"unschedulable": None}})
        self.admin_cordoned.clear()
        for node in sorted(cluster.nodes()):
            cluster.set_node_ready(node, True)
        for target in TARGETS:
            self.pause(target, False)
        for _ in range(80):
            cluster.sync()
            self.run_pass()
            cluster.tick(5)
            if not self.unsettled():
                return
        raise AssertionError(f"the rollouts did not settle: {self.unsettled()}")

    def unsettled(self) -> dict[str, str]:
        """node -> what is not as it should be."""
        cluster, out = self.cluster, {}
        for node, obj in cluster.nodes().items():
            rack = labels(obj).get(RACK)
            pool = f"rack-{rack}" if rack else None
            if labels(obj).get(POOL_LABEL) != pool:
                out[node] = f"pool label {labels(obj).get(POOL_LABEL)!r}, not {pool!r}"
                continue
            if (obj.get("spec") or {}).get("unschedulable"):
                out[node] = "cordoned"
                continue
            ds = DAEMONSET[pool]
            live = [p for p in cluster.controller.driver_pods(ds).get(node, []) if not p["metadata"].get("deletionTimestamp")]
            others = [d for d in DAEMONSET.values() if d != ds and cluster.controller.driver_pods(d).get(node)]
            current = cluster.controller.current(ds)
            if len(live) != 1 or others or labels(live[0]).get(REVISION_LABEL) != current or not workloads.ready(live[0]):
                shown = [(labels(p).get(REVISION_LABEL), workloads.ready(p)) for p in live]
                out[node] = f"pods of {ds}: {shown}, others {others}, template {current}"
        return out
