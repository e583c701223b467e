"""The runner's hold while Helm is between its pre-upgrade hooks and its apply.

`helm upgrade` runs the bootstrap hook, which writes the values into the CR, and only then
applies the release's objects. A runner acting on that CR write at once (rolling back for
`enableRollout: false`, applying a new version, a changed podTemplateSpec) writes the
DaemonSets' fields before Helm writes the values' copy of them: Helm 4's server-side apply then
fails the upgrade on a field conflict with the runner, and Helm 3's three-way merge writes the
template back (a second template change, a driver revision the CR does not name). So the runner
writes nothing while a DaemonSet carries another release revision than the CR
(`contract.RELEASE_REVISION_ANNOTATION`), from the bootstrap's write until Helm's apply, and at
most `contract.HELM_APPLY_WAIT` seconds after that write: an upgrade that fails after its hooks
never applies, and the runner goes on without it.

`helm rollback` goes the other way: its pre-rollback bootstrap writes the older revision it
restores into the CR, and the DaemonSets carry a newer one until Helm has applied the old
release. Hence "another", not "an older".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from metax_operator.conditions import parse_time
from metax_operator.contract import BOOTSTRAP_FIELD_MANAGER, HELM_APPLY_WAIT, RELEASE_REVISION_ANNOTATION


@dataclass(frozen=True)
class Hold:
    """The runner waits for Helm: the release revision the CR holds is not on every DaemonSet yet."""

    revision: int  # the release revision the CR waits for
    behind: list[str]  # the DaemonSets Helm has not applied it to yet
    until: float  # seconds since the epoch


def _revision(obj: dict) -> int | None:
    text = ((obj.get("metadata") or {}).get("annotations") or {}).get(RELEASE_REVISION_ANNOTATION, "")
    return int(text) if text.isdigit() else None


def _bootstrap_wrote(cr: dict) -> float | None:
    """When the bootstrap hook last changed the CR (its managedFields entry)."""
    times = [
        parse_time(m.get("time"))
        for m in (cr.get("metadata") or {}).get("managedFields") or []
        if m.get("manager") == BOOTSTRAP_FIELD_MANAGER and not m.get("subresource")
    ]
    times = [t for t in times if t is not None]
    return max(times) if times else None


def hold(cr: dict, daemonsets: dict[str, dict], clock: Callable[[], float]) -> Hold | None:
    """The hold in force now, or None (`clock` is read only when a DaemonSet is behind)."""
    wanted, wrote = _revision(cr), _bootstrap_wrote(cr)
    if wanted is None or wrote is None:
        return None
    behind = sorted(ds["metadata"]["name"] for ds in daemonsets.values() if _revision(ds) != wanted)
    if not behind or clock() >= wrote + HELM_APPLY_WAIT:
        return None
    return Hold(wanted, behind, wrote + HELM_APPLY_WAIT)
