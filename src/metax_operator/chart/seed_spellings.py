"""The product manual's spellings of two options, read as the chart's own.

Seed 000 names the vfio-manager options `vfio-manager` (table 3.1) where its own examples and this
chart write `vfioManager` (§3.2.6.1), and the staged rollout's switch `driver.enableRollout` (§3.1)
where table 3.11 puts it under `driver.upgradePolicy`. Both spellings are accepted
(`contract.SEED_SPELLINGS`), each with a notice naming the chart's key:

- in values, every leaf of the seed's spelling (a scalar or a list; mappings are walked) is written
  to the same leaf of the chart's key. Helm has merged values.yaml into the values already, so a
  leaf of the chart's key that holds its chart default counts as not given; one that holds
  anything else and differs from the seed spelling's is a conflict, refused naming both. Without
  the defaults (`defaults=None`) every leaf the chart's key holds counts as given.
- in the ClusterOperator, the API server fills in every default, so the chart's key always holds a
  value: `spec.driver.enableRollout` is admitted when it agrees with
  `spec.driver.upgradePolicy.enableRollout`, refused naming both when it does not, and
  `spec.vfio-manager` (a whole component, which `spec.vfioManager` holds already) is refused
  naming `spec.vfioManager`. The CRD's rules (admission.py) say the same words.

The chart's render-time copy is templates/_seed_spellings.tpl; tests/data/bad_values.yaml runs
the cases through both.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from metax_operator.contract import SEED_SPELLINGS
from metax_operator.errors import UserError
from metax_operator.lookup import lookup

_MISSING = object()


def dotted(path: tuple[str, ...]) -> str:
    return ".".join(path)


def notice(seed: tuple[str, ...], key: tuple[str, ...]) -> UserError:
    """The deprecation notice of the seed's spelling `seed` of the chart's `key`."""
    return UserError(dotted(seed), f"is the product manual's spelling of {dotted(key)} and is read as it", f"write {dotted(key)}")


def conflict(seed_leaf: str, seed_value: str, key_leaf: str, key_value: str, seed: str, key: str) -> UserError:
    """Both spellings of one option given with different values (each as `show` writes it)."""
    return UserError(
        seed_leaf,
        f"is {seed_value} but {key_leaf} is {key_value}",
        f"they are one option ({seed} is the product manual's spelling of {key}): set only {key_leaf}",
    )


def whole_component_in_cr(seed: str, key: str) -> UserError:
    """The seed's spelling of a whole component in the ClusterOperator's spec."""
    return UserError(
        seed,
        f"is the product manual's spelling of {key}, which this spec holds already",
        f"write its fields under {key} (kubectl edit clusteroperators cluster-operator)",
    )


def show(value: Any) -> str:
    """A value as the chart's template prints it (Helm's toJson: compact, keys sorted)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


@dataclass
class Spelled:
    """Values with the seed's spellings read as the chart's keys."""

    values: dict
    notices: list[UserError] = field(default_factory=list)
    errors: list[UserError] = field(default_factory=list)


def normalise(values: Mapping, defaults: Mapping | None = None) -> Spelled:
    """`values` with each seed spelling's leaves written to the chart's key and the seed's keys
    removed; `defaults` (the chart's values.yaml) tells a leaf Helm merged in from one a user gave."""
    out = Spelled(copy.deepcopy(dict(values)))
    for seed, key in SEED_SPELLINGS.items():
        given = lookup(out.values, *seed)
        if given is None:
            continue
        out.notices.append(notice(seed, key))
        for path, value in _leaves(given):
            have = _get(out.values, key + path)
            default = _get(defaults, key + path) if defaults is not None else _MISSING
            if have is not _MISSING and have != value and (defaults is None or have != default):
                out.errors.append(
                    conflict(dotted(seed + path), show(value), dotted(key + path), show(have), dotted(seed), dotted(key))
                )
            else:
                _set(out.values, key + path, value)
        del _parent(out.values, seed)[seed[-1]]
    if out.errors:
        out.values = copy.deepcopy(dict(values))
    return out


def cr_problems(spec: Mapping) -> list[UserError]:
    """The seed's spellings in a ClusterOperator `spec` (field paths below `spec`)."""
    errors = []
    for seed, key in SEED_SPELLINGS.items():
        given = lookup(spec, *seed)
        if given is None:
            continue
        if isinstance(given, Mapping):
            errors.append(whole_component_in_cr(dotted(seed), dotted(key)))
        elif given != lookup(spec, *key):
            errors.append(conflict(dotted(seed), show(given), dotted(key), show(lookup(spec, *key)), dotted(seed), dotted(key)))
    return errors


def cr_notice(seed: tuple[str, ...], key: tuple[str, ...]) -> UserError:
    """The notice of the seed's spelling `seed` in the ClusterOperator, where it must agree with
    the chart's `key` (the API server's warn policy says it: admission.warning_validations)."""
    return UserError(dotted(seed), f"is the product manual's spelling of {dotted(key)}, which decides", f"write {dotted(key)}")


def _leaves(value: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    if isinstance(value, Mapping) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(v, path + (k,))]
    return [(path, value)]


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(tree, Mapping) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


def _parent(tree: dict, path: tuple[str, ...]) -> dict:
    for part in path[:-1]:
        tree = tree[part]
    return tree


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        if not isinstance(tree.get(part), dict):
            tree[part] = {}
        tree = tree[part]
    tree[path[-1]] = copy.deepcopy(value)
