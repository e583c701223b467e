"""The fault campaign of tests/runtime/fault_campaign.py, short and replayed (`make bench` runs it
long and explores), and under a planted mutation of the engine or the executor for each decision
invariant, to show the campaign finds it: a check that cannot fail would prove nothing.

Each mutation is a one-line change of the code's source (`plant`) or a patched function, the
fault a careless edit would make; each run is seeded (derandomized) and draws the example's start
narrower where the fault needs it (failing nodes, a policy that retries or rolls back), so that
the campaign meets it within a few examples.
"""

from __future__ import annotations

import inspect
import textwrap
from contextlib import contextmanager
from dataclasses import replace
from unittest import mock

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from metax_operator.contract import REVISION_LABEL
from metax_operator.rollout import restore as restore_module
from metax_operator.rollout import rollback
from metax_operator.rollout.budget import Budget
from metax_operator.rollout.progress import Progress
from metax_operator.rollout.waves import Waves
from metax_operator.runtime import rollout_nodes, rollout_observe
from tests.runtime import fault_campaign
from tests.runtime.cluster import labels
from tests.runtime.fault_campaign import POLICIES, START, Campaign

# Derandomized: `make test` replays the same sequences every run; `make bench` explores new ones.
SHORT = settings(
    max_examples=6,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def test_the_whole_runner_stays_within_the_policy_whatever_happens_to_the_fleet():
    figures = fault_campaign.FIGURES
    deletions, sequences = figures.deletions, set(figures.sequences)
    run(Campaign, SHORT)
    assert figures.deletions > deletions and len(figures.sequences - sequences) > 1, figures


# -- each decision invariant can fail ------------------------------------------------------------


def plant(owner, name: str, old: str, new: str):
    """A patch of `owner.name` (a function or method) with its source's `old` replaced by `new`,
    compiled in its module: the mutation, which must change the code."""
    function = getattr(owner, name)
    source = textwrap.dedent(inspect.getsource(function))
    assert source.count(old) == 1, f"{owner.__name__}.{name} no longer reads {old!r}: plant the mutation anew"
    namespace: dict = {}
    exec(compile(source.replace(old, new), inspect.getsourcefile(function), "exec"), vars(inspect.getmodule(function)), namespace)
    return mock.patch.object(owner, name, namespace[name])


def focused(rules: set[str], **draws) -> type[Campaign]:
    """The campaign with only its `rules` (by name) and some of an example's start (`START`)
    drawn narrower: the steps the planted fault needs, not diluted among all the others."""
    others = {r.function.__name__ for r in Campaign.setup_state().rules} - rules
    assert rules <= {r.function.__name__ for r in Campaign.setup_state().rules}, rules

    class Focused(Campaign):
        @initialize(**{**START, **draws})
        def start(self, **start) -> None:
            Campaign.start(self, **start)

    for name in others:
        setattr(Focused, name, None)
    return Focused


#: The fleet's own course: passes, the clock, the kubelets and the DaemonSet controller.
COURSE = {"runner_passes", "time_passes", "kubelet", "daemonset_controller"}


def policy(**fixed):
    """The campaign's policies with `fixed` fields."""
    return POLICIES.map(lambda drawn: {**drawn, **fixed})


def run(campaign: type[Campaign], how: settings) -> None:
    campaign.TestCase.settings = how
    campaign.TestCase().runTest()


@contextmanager
def finds(mark: str, examples: int):
    """The campaign run inside (seeded, `examples` at most, not shrunk) stops on a violation of
    the invariant `mark` names."""
    found = []
    try:
        yield settings(SHORT, max_examples=examples, phases=[Phase.explicit, Phase.generate])
    except BaseException as err:
        found = [m for m in messages(err) if m.startswith(mark)]
        if not found:
            raise
    assert found, f"the campaign did not find the planted fault: no {mark} violation in {examples} examples"


def messages(err: BaseException) -> list[str]:
    """The messages of `err` and of the errors it groups or was raised from."""
    out = [str(err)]
    for inner in [*getattr(err, "exceptions", ()), err.__cause__, err.__context__]:
        if inner is not None and inner is not err:
            out += messages(inner)
    return out


FAILING = st.just({0, 1})  # two nodes whose new driver never gets Ready
NONE = st.just(set())


def test_a_retry_that_drops_the_failed_nodes_beyond_its_first_wave_is_found():
    """(a) The retry queue's rest dropped (the nodes the budget left for a later wave never
    retried)."""
    kept = "wave, resume.retry_queue = budget.take(queue, node=str)"
    mutation = plant(Progress, "upgrade", kept, "wave, resume.retry_queue = budget.take(queue, node=str)[0], []")
    one_step = [{"replicas": "100%", "pauseDuration": 0, "toleration": 1}]  # two failed nodes fail the step
    retries = policy(maxParallel=1, maxFailureThreshold=2, maxUnavailable=1, upgradeSteps=one_step, fallback="pause")
    campaign = focused(COURSE, nodes=st.integers(3, 4), failing=FAILING, skipped=NONE, waited=NONE, policy=retries)
    with mutation, finds("(a)", examples=8) as how:
        run(campaign, how)


def test_a_readiness_timeout_counted_from_the_wave_s_start_is_found():
    """(b) A node's readiness deadline from its wave's start, not from its own pod's deletion
    (a node whose work ended first is failed too early). The search meets this one rarely (it
    needs the work to end mid-wave and no kubelet for minutes after), so the campaign's own steps
    play it in that order: the wave starts with n0's pod to wait for, the work ends 90 s later,
    the kubelets are slow, the clock moves on in 90 s steps."""
    mutation = plant(Waves, "busy", "(parse_time(resume.deleted_at.get(node)) or start) + ctx.timeout", "start + ctx.timeout")
    waits = {
        **SCRIPTED,
        "waitForCompletion": {"podSelector": fault_campaign.WAIT_SELECTOR},
        "maxParallel": 3,
        "maxFailureThreshold": 0,
        "fallback": "pause",
    }
    campaign = Campaign()
    with mutation, finds("(b)", examples=1):
        try:
            campaign.start(nodes=3, policy=waits, version=fault_campaign.VERSIONS[1], failing=set(), skipped=set(), waited={0})
            for step in ("pass", "controller", "controller", "tick", "work ends", "tick", "tick", "tick", "tick"):
                if step == "controller":
                    campaign.daemonset_controller()
                elif step == "tick":
                    campaign.cluster.tick(90)
                elif step == "work ends":
                    campaign.cluster.workloads.end(sorted(campaign.cluster.workloads.running())[0])
                campaign.run_pass()
        finally:
            campaign.cluster.close()
            campaign.one_at_a_time.stop()


#: The policy a scripted sequence starts from (no wait, no drain, the fallback a pause).
SCRIPTED = {
    "enableRollout": True,
    "pause": False,
    "readinessTimeout": f"{fault_campaign.READINESS_TIMEOUT}s",
    "upgradeSteps": [{"replicas": "100%", "pauseDuration": 0}],
    "maxParallel": 1,
    "maxUnavailable": 1,
    "maxFailureThreshold": 0,
    "fallback": "pause",
    "allowGpuWorkloads": True,
    "cordon": True,
    "drain": {"enable": False, "timeout": "120s"},
    "waitForCompletion": {},
    "onTimeout": "hold",
}


def test_a_rollback_that_never_writes_the_cr_back_is_found():
    """(c) The restore's write of the CR's spec.driver dropped: the abandoned version stays in
    the CR, and the reconcile brings it back."""
    planned = restore_module.plan
    mutation = mock.patch.object(rollback.restore, "plan", lambda *a: replace(planned(*a), driver_spec=None))
    rolls_back = policy(fallback="rollback", maxFailureThreshold=0, upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    campaign = focused(COURSE, nodes=st.integers(3, 4), failing=FAILING, skipped=NONE, waited=NONE, policy=rolls_back)
    with mutation, finds("(c)", examples=8) as how:
        run(campaign, how)


def test_a_runner_that_ignores_the_skip_label_is_found():
    """(d) The skip label ignored: by the observation (the node counted among those to upgrade)
    and by the executor's look at the node before the deletion."""
    build = rollout_observe.build
    mutations = (
        mock.patch.object(rollout_nodes.cordon, "skipped", lambda node: False),
        mock.patch.object(rollout_observe, "build", lambda *a, **kw: build(*a, **{**kw, "skipped": ()})),
    )
    with mutations[0], mutations[1], finds("(d)", examples=8) as how:
        run(focused(COURSE | {"label_skip"}, nodes=st.integers(3, 5), skipped=st.just({0})), how)


def test_a_runner_that_counts_no_node_out_of_service_is_found():
    """(g) The availability bound ignored: the waves take nodes still serving up to
    `maxParallel` whatever an admin cordoned."""
    mutation = plant(Budget, "take", "serving = self.availability", "serving = self.room")
    bounded = policy(maxParallel=2, maxUnavailable=0, upgradeSteps=[{"replicas": "100%", "pauseDuration": 0}])
    fleet = {"nodes": st.integers(4, 6), "failing": NONE, "skipped": NONE, "waited": NONE}
    campaign = focused(COURSE | {"admin_cordons"}, **fleet, policy=bounded)
    with mutation, finds("(g)", examples=12) as how:
        run(campaign, how)


def test_a_health_gate_that_lets_a_regression_promote_is_found():
    """(f) The gate's comparison ignored: a step whose upgraded node went NotReady during its
    pause promotes all the same. Scripted, as (b): step 0 swaps one node and pauses 30 s, that
    node goes NotReady, the pause runs out."""
    mutation = plant(Progress, "health_gate", "if any(c.regressed for c in comparisons):", "if False:")
    gated = {
        **SCRIPTED,
        "upgradeSteps": [{"replicas": 1, "pauseDuration": "30s"}, {"replicas": "100%", "pauseDuration": 0}],
        "healthGate": {"enable": True},
    }
    with mutation, finds("(f)", examples=1):
        pauses_with_its_upgraded_node_not_ready(gated)


def test_the_health_gate_holds_the_step_the_scripted_regression_reaches():
    """The script of the test above, without the mutation: the step fails at its pause, and (f)
    holds (the script reaches the gate, so the mutation is what the campaign finds)."""
    gated = {
        **SCRIPTED,
        "upgradeSteps": [{"replicas": 1, "pauseDuration": "30s"}, {"replicas": "100%", "pauseDuration": 0}],
        "healthGate": {"enable": True},
    }
    status = pauses_with_its_upgraded_node_not_ready(gated)
    failed = next(c for c in status["condition"] if c["type"] == "Failed")
    assert (failed["status"], failed["reason"], status["status"]["currentStepIndex"]) == ("True", "UnhealthyStep", 0)


def pauses_with_its_upgraded_node_not_ready(gated: dict) -> dict:
    """The campaign's own steps: the rollout until step 0 is paused, its upgraded node NotReady,
    the pause over, two passes; the status then."""
    campaign = Campaign()
    try:
        campaign.start(nodes=3, policy=gated, version=fault_campaign.VERSIONS[1], failing=set(), skipped=set(), waited=set())
        cluster = campaign.cluster
        for _ in range(12):
            campaign.daemonset_controller()
            cluster.kubelet.sync(None)
            campaign.run_pass()
            if (cluster.upgrade_status().get("status") or {}).get("currentStepState") == "StepPaused":
                break
        revision = cluster.upgrade_status()["status"]["upgradingPodSpecRevision"]
        (upgraded,) = [n for n, p in fault_campaign.live_pods(cluster).items() if labels(p)[REVISION_LABEL] == revision]
        cluster.set_node_ready(upgraded, False)
        cluster.tick(60)
        for _ in range(3):
            campaign.run_pass()
        return cluster.upgrade_status()
    finally:
        campaign.cluster.close()
        campaign.one_at_a_time.stop()


@pytest.fixture(autouse=True)
def _restore_settings():
    """Each run sets its class's settings; the base campaign's are the short ones again after."""
    yield
    Campaign.TestCase.settings = SHORT
