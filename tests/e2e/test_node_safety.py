"""Node safety around a driver swap, on the real control plane: `metax-operator run` processes (the
chart's runner ServiceAccount) cordon each node before deleting its driver pod and uncordon it once
the new pod is Ready; an admin's cordon survives; a runner SIGKILLed mid-wave leaves no node
cordoned; a forced rollback neither; nodes labelled `metax-tech.com/driver-upgrade.skip=true` keep
their driver while the rollout completes; the runner's /metrics, scraped during a rollout, follow it.

Evidence: a watch of the nodes and of the driver pods in one thread each, their events ordered by
resourceVersion (one etcd: its revision orders every write), and the runners' JSON logs.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
import urllib.request
from collections import defaultdict

from kubernetes import client, watch
from prometheus_client.parser import text_string_to_metric_families

from metax_operator.contract import CORDONED_LABEL, SKIP_LABEL
from tests.cases import SEED_POLICY
from tests.controlplane import free_port
from tests.e2e.test_rollout_cluster import (  # noqa: F401 - fixtures used by name
    DRIVER_PODS,
    NODES,
    NS,
    QUICK_POLICY,
    Runner,
    all_at,
    api,
    driver_pods,
    idle,
    installed,
    patch_driver,
    revisions,
    start_rollout,
    sub,
    upgrade_status,
)
from tests.e2e.tools import METAX, kubectl, more_passes, ready, run, seed_patch
from tests.waiting import consistently, eventually

CORDONED = "metax-tech.com/driver-upgrade.cordoned"
SKIP = "metax-tech.com/driver-upgrade.skip"
GPU_NODES = [f"gpu-node-{i:04d}" for i in range(NODES)]


class Witness:
    """Every change of the nodes' `spec.unschedulable` and every driver pod deletion, with the
    resourceVersion of the write that made it."""

    def __init__(self, api):
        self.core = client.CoreV1Api(api)
        self.unschedulable: dict[str, list[tuple[int, bool]]] = defaultdict(list)
        self.deleted: dict[str, tuple[int, str]] = {}  # uid -> (resourceVersion, node)
        self.watches = [watch.Watch(), watch.Watch()]
        nodes = self.core.list_node()
        for node in nodes.items:
            self.unschedulable[node.metadata.name].append((0, bool(node.spec.unschedulable)))
        pods = self.core.list_namespaced_pod(NS, label_selector=DRIVER_PODS)
        self.threads = [
            threading.Thread(target=self._follow_nodes, args=(nodes.metadata.resource_version,), daemon=True),
            threading.Thread(target=self._follow_pods, args=(pods.metadata.resource_version,), daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _follow_nodes(self, since: str) -> None:
        try:
            for change in self.watches[0].stream(self.core.list_node, resource_version=since, timeout_seconds=600):
                node = change["object"]
                history = self.unschedulable[node.metadata.name]
                if history[-1][1] != bool(node.spec.unschedulable):
                    history.append((int(node.metadata.resource_version), bool(node.spec.unschedulable)))
        except Exception:  # noqa: BLE001 - the control plane stopping ends the watch
            pass

    def _follow_pods(self, since: str) -> None:
        try:
            for change in self.watches[1].stream(
                self.core.list_namespaced_pod, NS, label_selector=DRIVER_PODS, resource_version=since, timeout_seconds=600
            ):
                pod = change["object"]
                if pod.metadata.deletion_timestamp is not None and pod.metadata.uid not in self.deleted:
                    self.deleted[pod.metadata.uid] = (int(pod.metadata.resource_version), pod.spec.node_name)
        except Exception:  # noqa: BLE001
            pass

    def stop(self) -> None:
        for w in self.watches:
            w.stop()

    def cordoned_at(self, node: str, version: int) -> bool:
        """Whether `node` was unschedulable just before the write at `version`."""
        state = False
        for at, value in self.unschedulable[node]:
            if at >= version:
                break
            state = value
        return state


def nodes(api) -> dict:
    return {n.metadata.name: n for n in client.CoreV1Api(api).list_node().items}


def runner_cordoned(api) -> list[str]:
    return sorted(n.metadata.name for n in client.CoreV1Api(api).list_node(label_selector=f"{CORDONED}=true").items)


def unschedulable(api) -> list[str]:
    return sorted(name for name, n in nodes(api).items() if n.spec.unschedulable)


def no_runner_cordon_left(api) -> bool:
    return runner_cordoned(api) == [] and unschedulable(api) == []


def set_label(api, node: str, key: str, value: str | None) -> None:
    client.CoreV1Api(api).patch_node(node, {"metadata": {"labels": {key: value}}})


def test_each_node_is_cordoned_while_its_driver_is_swapped_and_an_admins_cordon_survives(control_plane, api, idle):
    cp = control_plane
    admins = "gpu-node-0004"
    kubectl(cp, "cordon", admins)
    witness = Witness(api)
    try:
        old, new = start_rollout(cp, api, {**QUICK_POLICY, "maxParallel": 2})
        eventually(lambda: sub(api).get("currentStepState") == "Completed", 120, "Completed")
        eventually(
            lambda: runner_cordoned(api) == [] and unschedulable(api) == [admins],
            30,
            "every node the runner cordoned uncordoned, the admin's cordon kept",
        )
        witness.stop()
        assert all_at(api, new)
        swapped = {node for _, node in witness.deleted.values()}
        assert swapped == set(GPU_NODES)
        for uid, (version, node) in witness.deleted.items():
            assert witness.cordoned_at(node, version), f"{node}'s driver pod {uid} deleted while schedulable"
        for node in set(GPU_NODES) - {admins}:  # cordoned once, uncordoned once
            assert [v for _, v in witness.unschedulable[node]] == [False, True, False], (node, witness.unschedulable[node])
        assert [v for _, v in witness.unschedulable[admins]] == [True], "the admin's cordon was touched"
        assert CORDONED not in (nodes(api)[admins].metadata.labels or {})
        lines = [line for r in idle["runners"] for line in r.lines("rollout-uncordon")]
        assert sorted(n for line in lines for n in line["nodes"]) == sorted(set(GPU_NODES) - {admins})
    finally:
        witness.stop()
        kubectl(cp, "uncordon", admins)


def test_nodes_an_admin_cordoned_take_places_of_the_waves_beyond_max_unavailable(control_plane, api, idle):
    """Two GPU nodes cordoned by an admin, `maxParallel: 2`, `maxUnavailable: 0`: the first wave
    takes those two (out of service already, they cost no availability), then the rollout waits
    and says why; with one uncordoned, the waves take one serving node at a time; with both, the
    rollout completes and the admin's cordons were never the runner's to lift."""
    cp, runner = control_plane, idle["runners"][0]
    out = ["gpu-node-0008", "gpu-node-0009"]
    for node in out:
        kubectl(cp, "cordon", node)
    try:
        _, new = start_rollout(cp, api, {**QUICK_POLICY, "maxParallel": 2, "maxUnavailable": 0})
        waiting = "waiting for GPU nodes to return to service: 2 out of service (gpu-node-0008, gpu-node-0009"
        eventually(lambda: waiting in sub(api).get("message", ""), 120, "the rollout waiting for the cordoned nodes")
        consistently(lambda: at_revision(api, new) == set(out), more_passes(runner, 4), 60, "no serving node taken")
        kubectl(cp, "uncordon", out[1])

        def one_at_a_time() -> bool:
            serving = {p.spec.node_name for p in driver_pods(api) if ready(p) and not p.metadata.deletion_timestamp}
            down = set(GPU_NODES) - serving - {out[0]}
            assert len(down) <= 1, f"{sorted(down)} out of service at once beside the admin's cordon of {out[0]}"
            return len(at_revision(api, new)) >= 5

        eventually(one_at_a_time, 120, "three more nodes swapped, one at a time")
        kubectl(cp, "uncordon", out[0])
        eventually(lambda: sub(api).get("currentStepState") == "Completed", 120, "Completed")
        assert all_at(api, new) and runner_cordoned(api) == [] and unschedulable(api) == []
    finally:
        for node in out:
            kubectl(cp, "uncordon", node)


def at_revision(api, revision: str) -> set[str]:
    """The nodes whose driver pod is at `revision`."""
    return {p.spec.node_name for p in driver_pods(api) if p.metadata.labels.get("controller-revision-hash") == revision}


def test_a_runner_killed_mid_wave_leaves_no_node_cordoned(control_plane, api, idle, faults):
    cp = control_plane
    runners = idle["runners"]
    faults.pods_ready_after(GPU_NODES, 4.0)  # each wave stays in flight long enough to kill the runner
    old, new = start_rollout(cp, api, {**QUICK_POLICY, "maxParallel": 3})
    cordoned = eventually(lambda: runner_cordoned(api), 30, "a wave's nodes cordoned by the runner")
    runners[-1].stop(signal.SIGKILL)
    assert set(cordoned) <= set(unschedulable(api))
    runners.append(Runner(idle["kubeconfig"], idle["tmp"], "runner-after-kill"))
    eventually(lambda: sub(api).get("currentStepState") == "Completed", 180, "Completed by the next leader")
    eventually(lambda: no_runner_cordon_left(api), 30, "no node left cordoned")
    uncordoned = {n for line in runners[-1].lines("rollout-uncordon") for n in line["nodes"]}
    assert set(cordoned) & uncordoned, "the next leader uncordons the nodes its predecessor cordoned"
    assert all_at(api, new)


def test_a_forced_rollback_leaves_no_node_cordoned(control_plane, api, idle, faults):
    cp = control_plane
    faults.pods_ready_after(GPU_NODES, 2.0)
    old, new = start_rollout(cp, api, SEED_POLICY)
    eventually(lambda: runner_cordoned(api), 30, "the first wave cordoned")
    seed_patch(cp, "enableRollout", False)  # mid-wave
    eventually(lambda: upgrade_status(api).get("phase") == "Disabled" and all_at(api, old), 120, "rolled back")
    eventually(lambda: no_runner_cordon_left(api), 30, "no node left cordoned")
    patch_driver(api, {"upgradePolicy": {"enableRollout": True, "pause": False}})


def test_skipped_nodes_keep_their_driver_and_the_rollout_completes(control_plane, api, idle):
    cp = control_plane
    skipped = ["gpu-node-0002", "gpu-node-0007"]
    for node in skipped:
        kubectl(cp, "label", "node", node, f"{SKIP}=true")
    try:
        eventually(
            lambda: upgrade_status(api).get("resume", {}).get("skippedNodes") == skipped,
            30,
            "the skipped nodes listed while idle",
        )
        old, new = start_rollout(cp, api, QUICK_POLICY)
        eventually(lambda: sub(api).get("currentStepState") == "Completed", 120, "Completed")
        at = {p.spec.node_name: p.metadata.labels["controller-revision-hash"] for p in driver_pods(api)}
        assert {n: r for n, r in at.items() if r == old} == {n: old for n in skipped}
        assert sum(r == new for r in at.values()) == NODES - len(skipped)
        status = upgrade_status(api)
        assert status["status"]["totalUpgradeReplicas"] == NODES - len(skipped) == status["status"]["totalUpgradeReadyReplicas"]
        assert status["resume"]["skippedNodeCount"] == len(skipped)
        shown = run(METAX, "rollout", "status", "--kubeconfig", str(cp.kubeconfig))
        assert f"Skipped (label {SKIP}=true): 2: {', '.join(skipped)}" in shown, shown
        assert no_runner_cordon_left(api)
    finally:
        for node in skipped:
            set_label(api, node, SKIP, None)
        # The skipped nodes take the current driver when their pod is replaced: here, by hand.
        for pod in driver_pods(api):
            if pod.spec.node_name in skipped:
                client.CoreV1Api(api).delete_namespaced_pod(pod.metadata.name, NS)
        eventually(lambda: len(revisions(api)) == 1 and len(driver_pods(api)) == NODES, 60, "one revision again")


def scrape(port: int) -> dict[tuple, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def phase_of(sample: dict) -> str:
    return next(
        dict(labels)["metax_operator_rollout_phase"]
        for (name, labels), value in sample.items()
        if name == "metax_operator_rollout_phase" and value == 1
    )


def nodes_in(sample: dict, state: str) -> float:
    return sample[("metax_operator_rollout_nodes", (("state", state),))]


def test_metrics_scraped_during_a_rollout_follow_its_progress(control_plane, api, idle):
    cp = control_plane
    runners = idle["runners"]
    runners[-1].stop()  # SIGTERM: the lease is released at once
    port = free_port()
    runners.append(
        Runner(idle["kubeconfig"], idle["tmp"], "runner-metrics", "--health-port", str(port), "--health-host", "127.0.0.1")
    )

    def leading() -> bool:
        try:
            return scrape(port)[("metax_operator_leader", ())] == 1
        except OSError:  # not serving yet
            return False

    eventually(leading, 30, "the scraped runner serving /metrics and leading")
    before = scrape(port)
    old, new = start_rollout(cp, api, {**QUICK_POLICY, "maxParallel": 2})
    seen = []
    while sub(api).get("currentStepState") != "Completed":
        seen.append(scrape(port))
        assert len(seen) < 600, "no completion within 2 minutes of scrapes"
        time.sleep(0.2)
    last = eventually(lambda: (s := scrape(port)) and phase_of(s) == "Idling" and s, 10, "Idling scraped")
    seen.append(last)
    phases = [phase_of(s) for s in seen]
    assert "Progressing" in phases and phases[-1] == "Idling"
    upgraded = [nodes_in(s, "upgraded") for s in seen if phase_of(s) == "Progressing"]
    assert upgraded == sorted(upgraded) and len(set(upgraded)) >= 3, upgraded  # rises, in several steps
    assert nodes_in(last, "upgraded") == nodes_in(last, "total") == NODES
    assert max(nodes_in(s, "cordoned") for s in seen) >= 1 and max(nodes_in(s, "in_wave") for s in seen) >= 1
    assert last[("metax_operator_rollout_step_state", (("metax_operator_rollout_step_state", "Completed"),))] == 1
    waves = (
        last[("metax_operator_rollout_wave_duration_seconds_count", ())]
        - before[("metax_operator_rollout_wave_duration_seconds_count", ())]
    )
    assert waves >= NODES // 2, waves  # waves of at most 2 nodes
    requests = {
        m: last[("metax_operator_api_requests_total", (("method", m),))]
        - before[("metax_operator_api_requests_total", (("method", m),))]
        for m in ("DELETE", "PATCH", "GET")
    }
    assert requests["DELETE"] >= NODES and requests["PATCH"] >= 2 * NODES and requests["GET"] >= NODES, requests
    assert (
        last[("metax_operator_runner_pass_duration_seconds_count", ())]
        > before[("metax_operator_runner_pass_duration_seconds_count", ())]
    )
    assert last[("metax_operator_nodes_need_reboot", ())] == 0

    # driver-manager reports a firmware upgrade done; the kubelet later reports the reboot.
    node = "gpu-node-0009"
    report_node_event(api, node, "NodeNeedReboot", "firmware upgrade done, need reboot machine to take effect")
    eventually(lambda: scrape(port)[("metax_operator_nodes_need_reboot", ())] == 1, 30, "the metric counts the node")
    assert upgrade_status(api)["resume"]["needRebootNodes"] == [node]
    shown = run(METAX, "rollout", "status", "--kubeconfig", str(cp.kubeconfig))
    assert f"Need a reboot (NodeNeedReboot: firmware upgraded): 1: {node}" in shown, shown
    # Event times have whole seconds: the reboot is reported in a later second than the need.
    next_second = math.floor(time.time()) + 1
    eventually(lambda: time.time() >= next_second, 5, "the next whole second")
    report_node_event(api, node, "Rebooted", f"Node {node} has been rebooted, boot id: 6f1f0c3a")
    eventually(lambda: scrape(port)[("metax_operator_nodes_need_reboot", ())] == 0, 30, "the rebooted node dropped")
    assert upgrade_status(api)["resume"]["needRebootNodes"] == []


def report_node_event(api, node: str, reason: str, message: str) -> None:
    """A Node event in namespace default, as driver-manager (NodeNeedReboot) or the kubelet
    (Rebooted) posts it."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    client.CoreV1Api(api).create_namespaced_event(
        "default",
        {
            "metadata": {"generateName": f"{node}."},
            "type": "Normal",
            "reason": reason,
            "message": message,
            "involvedObject": {"kind": "Node", "name": node, "apiVersion": "v1"},
            "source": {"component": "driver-manager" if reason == "NodeNeedReboot" else "kubelet", "host": node},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        },
    )


def gpu_pod(name: str, node: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {"name": "app", "image": "registry.example/app:1.0", "resources": {"limits": {"metax-tech.com/gpu": "1"}}}
            ],
        },
    }


def pod_state(api, name: str) -> str:
    try:
        pod = client.CoreV1Api(api).read_namespaced_pod(name, "default")
    except client.ApiException as err:
        if err.status == 404:
            return "gone"
        raise
    return "terminating" if pod.metadata.deletion_timestamp else pod.status.phase


def test_drain_evicts_gpu_pods_respects_a_disruption_budget_and_holds_the_node_on_timeout(control_plane, api, idle):
    cp, core, policy = control_plane, client.CoreV1Api(api), client.PolicyV1Api(api)
    free, guarded = ("gpu-node-0001", "train-free"), ("gpu-node-0002", "train-guarded")
    for node, name in (free, guarded):
        core.create_namespaced_pod("default", gpu_pod(name, node))
    policy.create_namespaced_pod_disruption_budget(
        "default",
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "train-guarded"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "train-guarded"}}},
        },
    )
    try:
        eventually(
            lambda: pod_state(api, "train-free") == pod_state(api, "train-guarded") == "Running", 30, "both GPU pods running"
        )
        eventually(
            lambda: (
                (s := policy.read_namespaced_pod_disruption_budget("train-guarded", "default").status) and s.current_healthy == 1
            ),
            30,
            "the disruption controller counts the guarded pod",
        )
        old, new = start_rollout(
            cp, api, {**QUICK_POLICY, "maxParallel": 3, "onTimeout": "hold", "drain": {"enable": True, "timeout": "15s"}}
        )
        eventually(lambda: pod_state(api, "train-free") in ("gone", "terminating"), 60, "the free GPU pod evicted")
        held = eventually(
            lambda: guarded[0] in upgrade_status(api).get("resume", {}).get("heldNodes", []),
            90,
            "the guarded node held back after its drain timed out",
        )
        assert held and pod_state(api, "train-guarded") == "Running", "the budget must keep the guarded pod"
        events = (
            client.CoreV1Api(api)
            .list_namespaced_event("default", field_selector="involvedObject.name=cluster-operator,reason=DrainTimeout")
            .items
        )
        assert any(guarded[0] in e.message and "held back" in e.message for e in events)
        eventually(lambda: guarded[0] not in unschedulable(api), 30, "the held node uncordoned")
        eventually(lambda: revisions(api)[new] == NODES - 1, 90, "every other node upgraded")
        at = {p.spec.node_name: p.metadata.labels["controller-revision-hash"] for p in driver_pods(api)}
        assert at[guarded[0]] == old and at[free[0]] == new
        assert sub(api).get("currentStepState") != "Completed"
        lines = [line for r in idle["runners"] for line in r.lines("rollout-drain")]
        assert any("default/train-free" in line.get("evicted", []) for line in lines), lines
        assert any("default/train-guarded" in line.get("blocked", []) for line in lines), lines
        core.delete_namespaced_pod("train-guarded", "default", grace_period_seconds=0)  # the job ends
        eventually(lambda: sub(api).get("currentStepState") == "Completed", 90, "Completed once the node is free")
        assert all_at(api, new)
        eventually(lambda: no_runner_cordon_left(api), 30, "no node left cordoned")
    finally:
        for _, name in (free, guarded):
            if pod_state(api, name) != "gone":
                core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
        policy.delete_namespaced_pod_disruption_budget("train-guarded", "default")
        patch_driver(api, {"upgradePolicy": {"drain": {"enable": False}, "onTimeout": "hold"}})
        eventually(lambda: pod_state(api, "train-free") == pod_state(api, "train-guarded") == "gone", 30, "the GPU pods gone")


# -- node writes of the components' ServiceAccounts --------------------------------------------


def token_client(cp, token: str):
    configuration = client.Configuration(host=cp.server, api_key={"authorization": f"Bearer {token}"})
    configuration.ssl_ca_cert = str(cp.ca)
    return client.CoreV1Api(client.ApiClient(configuration))


def refusal(call) -> str:
    """The API server's message refusing `call`; an AssertionError when it is accepted."""
    try:
        call()
    except client.ApiException as err:
        assert err.status in (403, 422), err
        return json.loads(err.body)["message"]
    raise AssertionError("the request was accepted")


def test_a_component_token_patches_only_its_own_node_and_only_metax_keys(control_plane, api, installed):
    cp = control_plane
    policies = client.AdmissionregistrationV1Api(api).list_validating_admission_policy().items
    assert [p.metadata.name for p in policies if p.metadata.name.endswith(f"{NS}-node-writes")], (
        "helm install on a 1.30+ cluster renders the policy"
    )
    pod = next(p for p in driver_pods(api) if p.spec.node_name == "gpu-node-0003")
    token = kubectl(
        cp,
        "create",
        "token",
        "metax-driver",
        "-n",
        NS,
        "--duration",
        "10m",
        "--bound-object-kind",
        "Pod",
        "--bound-object-name",
        pod.metadata.name,
        "--bound-object-uid",
        pod.metadata.uid,
    ).strip()
    driver = token_client(cp, token)
    own, other = "gpu-node-0003", "gpu-node-0004"
    try:
        # The policy's binding takes effect within a moment of its creation: its own node's
        # metax-tech.com/ keys pass, another node is refused.
        eventually(
            lambda: (
                "may change only the node its pod runs on (gpu-node-0003), not gpu-node-0004"
                in refusal(lambda: driver.patch_node(other, {"metadata": {"annotations": {"metax-tech.com/driver": "ready"}}}))
            ),
            30,
            "another node refused",
        )
        driver.patch_node(
            own,
            {
                "metadata": {
                    "annotations": {"metax-tech.com/driver": "ready"},
                    "labels": {"metax-tech.com/driver.version": "2.33"},
                }
            },
        )
        assert nodes(api)[own].metadata.annotations["metax-tech.com/driver"] == "ready"
        message = refusal(lambda: driver.patch_node(own, {"metadata": {"labels": {"team": "ml"}}}))
        assert "may change only labels and annotations under metax-tech.com/ on its node, not team" in message
        assert "may not change its node's spec" in refusal(lambda: driver.patch_node(own, {"spec": {"unschedulable": True}}))
        # The rollout's keys: the cordon mark would make the runner lift an admin's cordon; skip
        # would keep the node's old driver. Both under metax-tech.com/, both refused.
        for key in (CORDONED_LABEL, SKIP_LABEL):
            message = refusal(lambda key=key: driver.patch_node(own, {"metadata": {"labels": {key: "true"}}}))
            assert f"may not change the staged rollout's node keys ({key}): only the runner and administrators" in message
        unbound = token_client(cp, kubectl(cp, "create", "token", "metax-driver", "-n", NS, "--duration", "10m").strip())
        assert "its token names no node" in refusal(
            lambda: unbound.patch_node(own, {"metadata": {"labels": {"metax-tech.com/x": "1"}}})
        )
        client.CoreV1Api(api).patch_node(other, {"metadata": {"labels": {"team": "ml"}}})  # an admin: not matched
    finally:
        client.CoreV1Api(api).patch_node(
            own, {"metadata": {"annotations": {"metax-tech.com/driver": None}, "labels": {"metax-tech.com/driver.version": None}}}
        )
        client.CoreV1Api(api).patch_node(other, {"metadata": {"labels": {"team": None}}})


def test_a_wave_node_waits_cordoned_for_its_pods_matching_the_wait_selector(control_plane, api, idle):
    cp, core = control_plane, client.CoreV1Api(api)
    node = "gpu-node-0004"
    training = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "training", "labels": {"app": "training"}},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "app", "image": "registry.example/app:1.0"}],
        },
    }  # no GPU: not held
    core.create_namespaced_pod("default", training)
    try:
        eventually(lambda: pod_state(api, "training") == "Running", 30, "the training pod running")
        old, new = start_rollout(
            cp, api, {**QUICK_POLICY, "maxParallel": 0, "waitForCompletion": {"podSelector": "app=training"}}
        )
        eventually(lambda: revisions(api)[new] == NODES - 1, 90, "every other node upgraded")
        assert node in runner_cordoned(api) and node in unschedulable(api)
        at = lambda: {p.spec.node_name: p.metadata.labels["controller-revision-hash"] for p in driver_pods(api)}  # noqa: E731
        runner = idle["runners"][-1]
        passes = len(runner.lines("rollout-pass"))
        consistently(
            lambda: at()[node] == old and node in unschedulable(api),
            lambda: len(runner.lines("rollout-pass")) >= passes + 3,
            30,
            "the waiting node cordoned with its old driver while the job runs",
        )
        assert "waiting for their work to end" in upgrade_status(api)["message"]
        core.delete_namespaced_pod("training", "default", grace_period_seconds=0)  # the job ends
        eventually(lambda: sub(api).get("currentStepState") == "Completed", 90, "Completed once the job ended")
        assert all_at(api, new)
        eventually(lambda: no_runner_cordon_left(api), 30, "no node left cordoned")
    finally:
        if pod_state(api, "training") != "gone":
            core.delete_namespaced_pod("training", "default", grace_period_seconds=0)
        patch_driver(api, {"upgradePolicy": {"waitForCompletion": {"podSelector": ""}}})


def test_the_runner_token_changes_only_the_cordon_and_the_rollout_s_keys_of_a_node(control_plane, api, installed):
    """The runner's own node policy: its cordon (spec.unschedulable and its mark) passes on any
    node; a taint, another label or annotation does not. The cordon tests above run the runner
    with this same ServiceAccount, so its real cordons and uncordons pass the policy too."""
    cp = control_plane
    policies = client.AdmissionregistrationV1Api(api).list_validating_admission_policy().items
    assert any(p.metadata.name.endswith(f"{NS}-runner-node-writes") for p in policies)
    runner = token_client(cp, kubectl(cp, "create", "token", "metax-operator-runner", "-n", NS, "--duration", "10m").strip())
    node = "gpu-node-0002"
    try:
        eventually(
            lambda: (
                "the runner may change only the labels and annotations under metax-tech.com/driver-upgrade. of a node, not team"
                in refusal(lambda: runner.patch_node(node, {"metadata": {"labels": {"team": "ml"}}}))
            ),
            30,
            "the policy in force",
        )
        runner.patch_node(node, {"spec": {"unschedulable": True}, "metadata": {"labels": {CORDONED_LABEL: "true"}}})
        assert nodes(api)[node].spec.unschedulable is True
        taint = {"spec": {"taints": [{"key": "steer", "value": "x", "effect": "NoSchedule"}]}}
        assert "the runner may change only spec.unschedulable of a node" in refusal(lambda: runner.patch_node(node, taint))
        message = refusal(lambda: runner.patch_node(node, {"metadata": {"annotations": {"metax-tech.com/driver": "x"}}}))
        assert "not metax-tech.com/driver" in message
        runner.patch_node(node, {"spec": {"unschedulable": False}, "metadata": {"labels": {CORDONED_LABEL: None}}})
    finally:
        client.CoreV1Api(api).patch_node(node, {"spec": {"unschedulable": False}, "metadata": {"labels": {CORDONED_LABEL: None}}})
    assert not nodes(api)[node].spec.unschedulable and CORDONED_LABEL not in (nodes(api)[node].metadata.labels or {})
