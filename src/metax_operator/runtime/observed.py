"""What the runtime reconcile of one pass reads and wants (`reconcile`): the cluster as observed
(`Observed`), its spec validated once (`check_spec`, `SpecCheck`), and what a reconciler wants
done (`Outcome`: partial objects to apply, conditions, events)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

from metax_operator.chart import upgrade_policy, validation
from metax_operator.chart.admission import POLICY
from metax_operator.chart.daemonset import scheduling_inputs
from metax_operator.chart.merge import merge_scheduling
from metax_operator.conditions import Condition, Event
from metax_operator.contract import DAEMONSETS
from metax_operator.errors import UserError, UserErrors
from metax_operator.lookup import lookup


@dataclass(frozen=True)
class SpecCheck:
    """The spec's validation, done once per pass (and once per spec: `check_spec` keeps the last
    few): its problems, and the upgrade policy parsed (None when it is invalid)."""

    errors: tuple[UserError, ...]
    policy: upgrade_policy.Policy | None


@dataclass
class Observed:
    """What one pass reads: the CR, the component DaemonSets (by values key), the ConfigMaps."""

    namespace: str
    cr: dict | None
    daemonsets: dict[str, dict] = field(default_factory=dict)
    configmaps: dict[str, dict | None] = field(default_factory=dict)
    service: dict | None = None  # the exporter's Service
    pools: dict[str, dict] = field(default_factory=dict)  # the driver pools' DaemonSets, by pool name
    # The spec each pool's DaemonSet is applied from (`freeze.in_force` of its rollout), by pool
    # name; a pool not here: the CR's (`pools.pool_spec`).
    pool_specs: dict[str, dict] = field(default_factory=dict)

    @property
    def spec(self) -> dict:
        return (self.cr or {}).get("spec") or {}

    @functools.cached_property
    def check(self) -> SpecCheck:
        """The spec's validation (`check_spec`), once for this pass."""
        return check_spec(self.spec)


@dataclass(frozen=True)
class Apply:
    """A partial object to server-side apply, and the fields it changes (for the log and event)."""

    body: dict
    fields: tuple[str, ...]


@dataclass
class Outcome:
    """What a reconciler wants: partial objects to apply, conditions to set, events to emit."""

    applies: list[Apply] = field(default_factory=list)
    conditions: list[Condition] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    def extend(self, other: Outcome) -> None:
        self.applies += other.applies
        self.conditions += other.conditions
        self.events += other.events


def check_spec(spec: dict) -> SpecCheck:
    """The CR spec's validation: the shared validation rules, then the podTemplateSpec inputs (the
    global podTemplateSpec is checked once per component: each problem is kept once); and the
    upgrade policy parsed when none of the problems is its own. A spec seen again is not checked
    again (the runner passes every few seconds over the same spec)."""
    return _check(json.dumps(spec, sort_keys=True))


@functools.lru_cache(maxsize=4)
def _check(text: str) -> SpecCheck:
    spec = json.loads(text)
    errors: list[UserError] = []
    checks = [lambda: validation.validate_cr_spec(spec)]
    checks += [lambda key=key: merge_scheduling(scheduling_inputs(spec, key), prefix="spec.") for key in DAEMONSETS]
    for check in checks:
        try:
            check()
        except UserErrors as err:
            errors += err.errors
        except UserError as err:
            errors.append(err)
    unique = tuple({str(e): e for e in errors}.values())
    policy_invalid = any(e.field.startswith(f"spec.{POLICY}") for e in unique)
    raw = lookup(spec, "driver", "upgradePolicy") or {}
    return SpecCheck(unique, None if policy_invalid else upgrade_policy.build(raw))
