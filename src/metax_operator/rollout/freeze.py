"""The spec a driver rollout acts on: only `pause` and `enableRollout` change it mid-rollout.

While a rollout is in progress an admin may change only `driver.upgradePolicy.pause` and
`enableRollout` (seed §3.2.8). From Kubernetes 1.30 the chart's ValidatingAdmissionPolicy refuses
any other edit; an older API server stores it. The runner then holds it, on every version alike:
the engine records the spec the rollout acts on (`resume.spec`, `record`), and while the rollout
is in progress each pass acts on that record with the CR's current controls (`in_force`). A held
edit is reported (the CR's condition SpecHeld, with the policy's line, and its Event), takes
effect in the first pass after the rollout ends, and is dropped when the admin reverts it. The
runner's own rollback writes `spec.driver` back, and records what it writes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from metax_operator.chart.admission import POLICY, ROLLOUT_CONTROLS, frozen_changes, frozen_during_rollout
from metax_operator.conditions import FALSE, TRUE, Condition, CrCondition, CrReason
from metax_operator.lookup import lookup
from metax_operator.rollout.restore import Restore
from metax_operator.rollout.status import UpgradeStatus
from metax_operator.rollout.target import DRIVER, Target, targets


@dataclass(frozen=True)
class SpecInForce:
    """What one pass acts on: `spec`, and the CR's fields it holds back (none: the CR's own spec)."""

    spec: dict
    held: tuple[str, ...] = ()
    phase: str = ""

    def condition(self) -> Condition:
        if not self.held:
            return Condition(CrCondition.SPEC_HELD, FALSE, CrReason.NOTHING_HELD, "the runner acts on the CR's spec")
        problem = frozen_during_rollout(", ".join(self.held), self.phase)
        return Condition(
            CrCondition.SPEC_HELD,
            TRUE,
            CrReason.EDIT_DURING_ROLLOUT,
            f"{problem.field}: {problem.problem}: the edit is held, and the rollout goes on with the spec it "
            "started with; it takes effect when the rollout ends: revert the edit to drop it, or set "
            "enableRollout: false to roll the rollout back first",
        )


def record(spec: dict, restore: Restore | None = None) -> str:
    """`spec` less the rollout's controls, as `resume.spec` holds it (a rollback's `restore`
    writes its spec.driver over the CR's: the record holds that one)."""
    frozen = json.loads(json.dumps(spec))
    if restore is not None and restore.driver_spec is not None:
        frozen["driver"] = json.loads(json.dumps(restore.driver_spec))
    policy = lookup(frozen, "driver", "upgradePolicy")
    if isinstance(policy, dict):
        for key in ROLLOUT_CONTROLS:
            policy.pop(key, None)
    return json.dumps(frozen, sort_keys=True, separators=(",", ":"))


def in_force(cr: dict, target: Target = DRIVER) -> SpecInForce:
    """The spec a pass acts on for `cr` and the rollout `target` (a pool's: `Target.spec`): its
    own, unless the target's rollout is in progress (as its stored status says) and its record
    differs from it in a field other than the controls; then the record with the CR's controls.
    A status without a record (written by an older runner) holds nothing: the rollout adopts the
    spec. The pools are each their own rollout's to hold: the driver's keeps the CR's."""
    spec = target.spec(cr.get("spec") or {}) or {}
    status = UpgradeStatus.from_json(target.stored(cr.get("status")))
    try:
        recorded = json.loads(status.resume.spec) if status.upgrading and status.resume.spec else None
    except ValueError:  # not JSON: an edited status
        recorded = None
    if not isinstance(recorded, dict):
        return SpecInForce(spec)
    changed = frozen_changes(recorded, spec)
    if not changed:
        return SpecInForce(spec)
    # While a rollback restores spec.driver, the CR's own fields of it differ from the record until
    # that write lands: the runner's pending write, re-planned every pass, not an admin's edit.
    restoring = status.resume.restoring is not None
    held = [f for f in changed if not (restoring and f.startswith("driver.") and not f.startswith(f"{POLICY}."))]
    controls = lookup(spec, "driver", "upgradePolicy") or {}
    driver = recorded.get("driver") if isinstance(recorded.get("driver"), dict) else {}
    policy = driver.get("upgradePolicy") if isinstance(driver.get("upgradePolicy"), dict) else {}
    policy = {**policy, **{key: controls[key] for key in ROLLOUT_CONTROLS if key in controls}}
    if policy:
        driver = {**driver, "upgradePolicy": policy}
    driver = {key: value for key, value in driver.items() if key != "pools"}
    if "pools" in (spec.get("driver") or {}):
        driver["pools"] = spec["driver"]["pools"]
    if target.pool is not None:
        held = [f"{field} (pool {target.pool})" for field in held]
    return SpecInForce({**recorded, "driver": driver} if driver else recorded, tuple(held), status.phase)


def each_in_force(cr: dict, pools: Iterable[str]) -> dict[Target, SpecInForce]:
    """The spec in force of each rollout (`in_force`): the driver's own, and each pool of the CR
    whose DaemonSet exists (`pools` names those)."""
    present = set(pools)
    return {t: in_force(cr, t) for t in targets(cr.get("spec") or {}) if t == DRIVER or t.pool in present}


def every_held(forces: dict[Target, SpecInForce]) -> SpecInForce:
    """The driver's spec in force with the fields every rollout holds: what SpecHeld reports."""
    held = tuple(field for force in forces.values() for field in force.held)
    phase = next((force.phase for force in forces.values() if force.held), "")
    return SpecInForce(forces[DRIVER].spec, held, phase)
