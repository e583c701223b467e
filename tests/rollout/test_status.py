"""`status.upgradeStatus` as the engine writes it: a golden trace of a rollout that touches most of
the bookkeeping (retry, timed and manual pauses, a drain that times out, skipped and reboot-needing
nodes, a rollback), compared key for key and in key order with the JSON the engine wrote when it
was captured (tests/rollout/data/upgrade_status_trace.json)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from metax_operator.rollout import engine as R
from metax_operator.rollout.policy import validate

T0 = 1_800_000_000.0
GOLDEN = Path(__file__).parent / "data" / "upgrade_status_trace.json"


def scenario() -> list[dict]:
    """Six nodes (n5 skipped, n4 needing a reboot, n3 running GPU work that a drain cannot end), the
    status after each pass."""
    nodes = {f"n{i}" for i in range(6)}
    pods = {n: R.Pod(f"p-{n}-0", f"u-{n}-0", n, "old", True, "Running", 0, T0 - 1000) for n in nodes}
    revision, cordoned, serial = "new", set(), 0
    busy, skipped, reboot = {"n3"}, {"n5"}, frozenset({"n4"})
    base = {"enableRollout": True, "maxParallel": 2, "maxFailureThreshold": 1, "readinessTimeout": "1m",
            "drain": {"enable": True, "timeout": "30s"},
            "upgradeSteps": [{"replicas": 2, "pauseDuration": "10s"}, {"replicas": 4, "pause": {}},
                             {"replicas": "100%", "pauseDuration": 0}]}
    status, out, pause = None, [], False
    # (seconds after T0, the admin's policy edits, what happens to the pods before the pass)
    script = [(-5, {}, ("revision", "old")), (0, {}, ("revision", "new")), (5, {}, ("fail", "n0")), (10, {}, None),
              (15, {}, ("ready",)), (20, {}, None), (31, {}, None), (36, {}, ("ready",)), (40, {}, None),
              (45, {"pause": True}, None), (50, {"pause": False}, None), (55, {}, None), (60, {}, ("ready",)),
              (65, {}, None), (70, {"pause": False}, None), (75, {}, ("ready",)), (80, {}, None), (85, {}, None),
              (116, {}, None), (121, {}, None),
              (125, {"enableRollout": False}, None), (130, {"enableRollout": False}, None),
              (135, {"enableRollout": False}, ("ready",)), (140, {"enableRollout": False}, None)]
    for dt, overrides, change in script:
        if change and change[0] == "revision":
            revision = change[1]
        elif change and change[0] == "fail":
            pods[change[1]] = dataclasses.replace(pods[change[1]], phase="Failed")
        elif change:
            for n, p in pods.items():
                if p.phase != "Failed":
                    pods[n] = dataclasses.replace(p, ready=True)
        observed = R.Observed(revision, True, frozenset(nodes - skipped), tuple(pods.values()), frozenset(busy),
                              skipped=frozenset(skipped), cordoned=frozenset(cordoned), need_reboot=reboot,
                              template=f"template-{revision}", driver_spec=f"spec-{revision}")
        overrides = dict(overrides)
        pause = overrides.pop("pause", pause)
        decision = R.decide(observed, validate({**base, **overrides, "pause": pause}), status, T0 + dt)
        if decision.set_pause is not None:
            pause = decision.set_pause
        status = decision.status
        out.append(json.loads(json.dumps(status)))
        cordoned = (cordoned - set(decision.uncordon)) | set(decision.cordon)
        for ref in decision.delete:
            serial += 1
            cordoned.add(ref.node)
            pods[ref.node] = R.Pod(f"p-{ref.node}-{serial}", f"u-{ref.node}-{serial}", ref.node, revision,
                                   False, "Running", 0, T0 + dt)
        if decision.restore_revision:
            revision = decision.restore_revision
    return out


def test_the_engine_writes_the_golden_status_trace_key_for_key_and_in_order():
    golden = json.loads(GOLDEN.read_text())
    got = scenario()
    assert len(got) == len(golden)
    for i, (status, expected) in enumerate(zip(got, golden, strict=True)):
        assert json.dumps(status) == json.dumps(expected), f"pass {i}"
