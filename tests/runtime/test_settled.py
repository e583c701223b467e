"""The runner skips a pass over caches unchanged since a pass that wrote nothing
(`runtime/settled.py`), and only then: a change of what a cache holds, the time the last decision
named (a timed pause running out) and `FULL_PASS_EVERY` each bring the full pass back. On the
whole runner and the fake cluster (tests/runtime/cluster.py); a pass is counted when the
rollout decides."""

from __future__ import annotations

import pytest

from metax_operator.contract import GPU_RESOURCE, SKIP_LABEL
from metax_operator.runtime import settled
from metax_operator.workloads import MACA_VERSION_ENV
from tests.runtime.cluster import JOBS, VERSIONS, WORK, Cluster

PAUSE = 600  # seconds: the first step's pauseDuration
POLICY = {
    "enableRollout": True,
    "maxParallel": 1,
    "readinessTimeout": "10m",
    "upgradeSteps": [{"replicas": 1, "pauseDuration": "10m"}, {"replicas": "100%", "pauseDuration": 0}],
}


@pytest.fixture
def cluster():
    world = Cluster(nodes=3, policy=POLICY)
    yield world
    world.close()


def counting(cluster: Cluster) -> list:
    """The rollout's decisions from now on, one entry each."""
    decided, decide = [], cluster.runner.rollout.decide
    cluster.runner.rollout.decide = lambda *args: decided.append(cluster.now) or decide(*args)
    return decided


def quiet(cluster: Cluster) -> None:
    """Passes until one writes nothing."""
    for _ in range(10):
        cluster.sync()
        if not cluster.run_pass().writes:
            return
    raise AssertionError("the runner kept writing")


def test_an_unchanged_pass_is_skipped_until_a_cache_changes_or_a_minute_has_passed(cluster):
    quiet(cluster)
    decided = counting(cluster)
    cluster.tick(settled.FULL_PASS_EVERY - 1)
    skipped = cluster.run_pass()
    assert decided == [] and skipped.requests == [] and skipped.error is None
    cluster.edit_node("n1", {"metadata": {"labels": {SKIP_LABEL: "true"}}})  # a change a decision reads
    cluster.run_pass()
    assert len(decided) == 1
    quiet(cluster)
    decided.clear()
    cluster.run_pass()
    assert decided == []
    cluster.tick(settled.FULL_PASS_EVERY)
    cluster.run_pass()
    assert len(decided) == 1


def test_a_timed_pause_ends_on_time_with_nothing_else_changing(cluster, monkeypatch):
    """The pass at the pause's end is the decision's own wake time (`Decision.wake_at`), not a
    change: with the minute's full pass out of the way, it still comes, and not before."""
    monkeypatch.setattr(settled, "FULL_PASS_EVERY", 10 * PAUSE)
    quiet(cluster)
    cluster.set_version(VERSIONS[1])
    quiet(cluster)  # the first step, one node, then its pause: the clock stands still meanwhile
    assert sorted(cluster.driver_versions().values()) == [VERSIONS[0], VERSIONS[0], VERSIONS[1]]
    decided = counting(cluster)
    cluster.tick(PAUSE - 1)
    assert not cluster.run_pass().requests and decided == []
    cluster.tick(2)
    next_step = cluster.run_pass()
    assert len(decided) == 1 and next_step.writes, cluster.upgrade_status()
    quiet(cluster)
    assert set(cluster.driver_versions().values()) == {VERSIONS[1]}


def test_a_job_replaced_on_its_node_is_no_change_a_node_freed_and_a_bad_maca_version_are(cluster):
    """The GPU pods' cache changes with every job; a pass reads of it the nodes running GPU work
    and the workload check's problems (`settled.Inputs`): a job replaced by the next on its node
    changes neither and is skipped, a node whose GPU work ended and a pod with a MXMACA version the
    runtime refuses are changes, the latter reported in WorkloadsValid."""
    job = cluster.workloads.start("n1")
    quiet(cluster)
    decided = counting(cluster)
    cluster.workloads.end(job)
    job = cluster.workloads.start("n1")
    assert not cluster.run_pass().requests and decided == []
    cluster.workloads.end(job)
    cluster.run_pass()
    assert len(decided) == 1
    cluster.workloads.start("n2")  # n2 runs GPU work before the bad pod comes: no node changes then
    quiet(cluster)
    decided.clear()
    env = [{"name": MACA_VERSION_ENV, "value": "maca"}]
    pod = {
        "metadata": {"name": "bad-maca", "namespace": WORK},
        "spec": {"nodeName": "n2", "containers": [{"name": "c", "resources": {"limits": {GPU_RESOURCE: "1"}}, "env": env}]},
        "status": {"phase": "Running"},
    }
    cluster.kubectl.call("POST", JOBS, body=pod)
    cluster.run_pass()
    valid = next(c for c in cluster.cr()["status"]["conditions"] if c["type"] == "WorkloadsValid")
    assert len(decided) == 1 and valid["status"] == "False" and "bad-maca" in valid["message"], valid
