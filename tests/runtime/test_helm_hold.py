"""The runner's hold between Helm's pre-upgrade (pre-rollback) hooks and its apply (`runtime.helm_hold`)."""

from __future__ import annotations

from metax_operator.conditions import rfc3339
from metax_operator.contract import BOOTSTRAP_FIELD_MANAGER, HELM_APPLY_WAIT, RELEASE_REVISION_ANNOTATION
from metax_operator.runtime.helm_hold import hold

T0 = 1_800_000_000.0


def cr(revision: str | None, wrote: float | None = T0) -> dict:
    managed = [{"manager": BOOTSTRAP_FIELD_MANAGER, "operation": "Apply", "time": rfc3339(wrote)}] if wrote else []
    managed.append(
        {"manager": "metax-operator-runner", "operation": "Update", "subresource": "status", "time": rfc3339(T0 + 999)}
    )
    annotations = {RELEASE_REVISION_ANNOTATION: revision} if revision is not None else {}
    return {"metadata": {"annotations": annotations, "managedFields": managed}}


def daemonsets(**revisions: str | None) -> dict[str, dict]:
    return {
        name: {"metadata": {"name": f"metax-{name}", "annotations": {RELEASE_REVISION_ANNOTATION: r} if r else {}}}
        for name, r in revisions.items()
    }


def at(now: float):
    return lambda: now


def test_the_runner_holds_while_a_daemonset_is_behind_the_revision_the_bootstrap_ran_for():
    held = hold(cr("4"), daemonsets(driver="3", maca="4"), at(T0 + 5))
    assert held is not None and (held.revision, held.behind, held.until) == (4, ["metax-driver"], T0 + HELM_APPLY_WAIT)


def test_the_runner_holds_while_a_rollback_has_not_applied_the_older_revision():
    # the pre-rollback bootstrap wrote revision 2 into the CR; the DaemonSets still carry 4
    held = hold(cr("2"), daemonsets(driver="4", maca="4"), at(T0 + 5))
    assert held is not None and held.behind == ["metax-driver", "metax-maca"]
    assert hold(cr("2"), daemonsets(driver="2", maca="2"), at(T0 + 5)) is None


def test_no_hold_once_helm_applied_the_release_or_without_a_record():
    assert hold(cr("4"), daemonsets(driver="4", maca="4"), at(T0 + 5)) is None
    assert hold(cr(None), daemonsets(driver="3"), at(T0 + 5)) is None  # Argo CD, or an older chart's bootstrap
    assert hold(cr("4", wrote=None), daemonsets(driver="3"), at(T0 + 5)) is None


def test_a_daemonset_of_an_older_chart_without_the_annotation_is_behind():
    assert hold(cr("2"), daemonsets(driver=None), at(T0 + 5)).behind == ["metax-driver"]


def test_the_hold_ends_after_the_wait_when_helm_never_applies():
    # `helm upgrade` failed after its hooks: the DaemonSets stay at the old revision.
    assert hold(cr("4"), daemonsets(driver="3"), at(T0 + HELM_APPLY_WAIT - 1)) is not None
    assert hold(cr("4"), daemonsets(driver="3"), at(T0 + HELM_APPLY_WAIT)) is None


def test_the_clock_is_read_only_when_a_daemonset_is_behind():
    def clock():
        raise AssertionError("the clock was read")

    assert hold(cr("4"), daemonsets(driver="4"), clock) is None
