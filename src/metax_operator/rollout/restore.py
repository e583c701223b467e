"""What a rollback writes back: the driver DaemonSet's template of an older ControllerRevision, and
first the CR's `spec.driver` that gives that template, so that the runner's reconcile does not
re-apply the abandoned version. Pure: the engine calls it with what the pass observed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from metax_operator.chart.daemonset import restored_driver_spec


@dataclass(frozen=True)
class Restore:
    """Roll the driver back to `revision`: write `driver_spec` to the CR's spec.driver (None: no
    spec.driver reproduces the revision's template; the admin must set it), then patch the
    DaemonSet with `template_patch`, the ControllerRevision's data, as `kubectl rollout undo`
    (None: the ControllerRevision is gone and the template cannot be restored)."""

    revision: str
    driver_spec: dict | None
    template_patch: dict | None


def revision_template(data: dict) -> dict:
    """The pod template a DaemonSet ControllerRevision's `data` records (a strategic merge patch
    `{"spec": {"template": {..., "$patch": "replace"}}}`)."""
    template = dict(((data.get("spec") or {}).get("template")) or {})
    template.pop("$patch", None)
    return template


def plan(revision: str, data: dict | None, daemonset: dict, cr_spec: dict, recorded: str) -> Restore:
    """The restore of `revision` (ControllerRevision `data`, None when gone).

    spec.driver: `recorded` (`lastCoDriverSpec`) when it reproduces the template, else the spec
    read back from the template (`daemonset.restored_driver_spec`); without the ControllerRevision,
    the recorded spec still brings the version back. Either keeps the CR's current upgradePolicy.
    """
    if data is not None:
        return Restore(revision, restored_driver_spec(daemonset, revision_template(data), cr_spec, recorded), data)
    try:
        driver = json.loads(recorded)
    except ValueError:  # none recorded (or not JSON: an edited status)
        driver = None
    if not isinstance(driver, dict):
        return Restore(revision, None, None)
    return Restore(revision, {**driver, "upgradePolicy": (cr_spec.get("driver") or {}).get("upgradePolicy", {})}, None)
