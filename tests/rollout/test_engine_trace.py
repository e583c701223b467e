"""A golden trace of the engine's whole decisions (`engine.decide`): for each pass of the rollout
scenario of tests/rollout/test_status.py, every field of the `Decision` (status, pause, restore,
cordons, evictions, deletions, uncordons, events with their reasons and messages, wake-up time),
compared with the trace captured before the engine was restructured
(tests/rollout/data/engine_decision_trace.json). The decision later gained `idle_first` (the
executor's last look for GPU pods after a cordon): true in every pass of the trace, and added to
it so; and `resume.spec` (the spec the rollout acts on, `rollout.freeze`): in every pass with a
rollout in progress, added so; and `resume.restoring` (a rollback's restore not seen landed yet),
in the one pass that plans the restore. When the engine was split by topic, the decision's
`idle_first` became `work_check` (what the executor looks for on a node right before a deletion:
GPU pods, and pods matching `waitForCompletion.podSelector`; here `{gpu: true}` in every pass),
the status gained `resume.deletedAt` (each node's late deletion: empty here) and the restore
`revision_missing` (true in that pass: the scenario keeps no ControllerRevision). With the
validation of swapped nodes the decision gained `validate` and `verdicts`: empty in every pass
(the scenario's policy validates nothing); with the health gate, `observe_health` (false) and
`health_compared` (empty) in every pass (no gate). Every other field is as captured."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from metax_operator.rollout.status import UpgradeStatus
from tests.rollout.test_status import scenario

GOLDEN = Path(__file__).parent / "data" / "engine_decision_trace.json"


def plain(value):
    """A decision as JSON: statuses as the CR stores them, other dataclasses field by field."""
    if isinstance(value, UpgradeStatus):
        return value.to_json()
    if dataclasses.is_dataclass(value):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return {key: plain(item) for key, item in value._asdict().items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted(plain(item) for item in value)
    return value


def test_the_engine_decides_the_golden_trace_pass_for_pass():
    decisions: list = []
    scenario(decisions)
    golden = json.loads(GOLDEN.read_text())
    assert len(decisions) == len(golden)
    for i, (decision, expected) in enumerate(zip(decisions, golden, strict=True)):
        assert json.loads(json.dumps(plain(decision))) == expected, f"pass {i}"
