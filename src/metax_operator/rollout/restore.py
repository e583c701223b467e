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
    (None: the template is at `revision` already, or, with `revision_missing`, the
    ControllerRevision is gone and the template cannot be restored)."""

    revision: str
    driver_spec: dict | None
    template_patch: dict | None
    revision_missing: bool = False

    def landed(self, stored_driver: dict) -> bool:
        """Whether the CR's spec.driver as stored (`stored_driver`) is the one this restore writes
        (or none is known: there is nothing to write)."""
        return self.driver_spec is None or without_policy(self.driver_spec) == without_policy(stored_driver)


def without_policy(driver: dict) -> dict:
    """spec.driver but its upgradePolicy: what a restore writes (the rollout's controls and policy
    stay as the admin has them)."""
    return {key: value for key, value in driver.items() if key != "upgradePolicy"}


def revision_template(data: dict) -> dict:
    """The pod template a DaemonSet ControllerRevision's `data` records (a strategic merge patch
    `{"spec": {"template": {..., "$patch": "replace"}}}`)."""
    template = dict(((data.get("spec") or {}).get("template")) or {})
    template.pop("$patch", None)
    return template


#: The pod template's fields that say only where its pods may run.
SCHEDULING = ("nodeSelector", "affinity", "tolerations")


def same_driver(revisions: dict[str, dict], current: str | None) -> frozenset[str]:
    """The revisions (hash -> ControllerRevision data) whose pod template is `current`'s but for
    where pods may run (`SCHEDULING`), `current` included. A pod at one of them runs the same
    driver as a new pod would: a change of the driver's tolerations, affinity or nodeSelector
    alone replaces no driver pod. (The DaemonSet controller itself deletes a pod from a node its
    template no longer selects.)"""
    if current is None:
        return frozenset()
    driver = without_scheduling(revision_template(revisions[current]))
    return frozenset(h for h, data in revisions.items() if without_scheduling(revision_template(data)) == driver)


def without_scheduling(template: dict) -> dict:
    spec = {k: v for k, v in (template.get("spec") or {}).items() if k not in SCHEDULING}
    return {**template, "spec": spec}


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
        return Restore(revision, None, None, revision_missing=True)
    policy = (cr_spec.get("driver") or {}).get("upgradePolicy", {})
    return Restore(revision, {**driver, "upgradePolicy": policy}, None, revision_missing=True)
