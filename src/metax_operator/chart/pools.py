"""Driver pools (`driver.pools`): GPU nodes that run a driver version of their own.

Each pool has its DaemonSet, `metax-driver-pool-NAME` (contract.POOL_DAEMONSET_PREFIX), rendered
from the driver's values with the pool's own over them (`pool_driver`): `payload.version` and
`payload.digest` (empty: the driver's), `fwUpgradePolicy`, `fwEnableVirt`, and `upgradePolicy`,
whose keys go over the driver's one by one (a mapping such as `drain` key by key; a list such as
`upgradeSteps` whole). Everything else (the image, the log settings, the podTemplateSpec, the
config) is the driver's. Nodes no pool selects run the driver DaemonSet itself.

Which pool a node is in is the runner's to say (`rollout.pools`): it labels the node
(contract.POOL_LABEL), and each pool's DaemonSet selects its label while the driver's own selects
the nodes without one. Pure: the chart's validation, the runner's reconcile and its rollout read
the same rules from here.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from metax_operator.chart import upgrade_policy
from metax_operator.contract import POOL_DAEMONSET_PREFIX
from metax_operator.errors import UserError

#: What a pool sets over the driver's values.
POOL_KEYS = ("payload", "fwUpgradePolicy", "fwEnableVirt", "upgradePolicy")


def pools_of(driver: Any) -> list[dict]:
    """The pools of a driver's values (or of the CR's spec.driver), in their order."""
    pools = driver.get("pools") if isinstance(driver, Mapping) else None
    return [p for p in pools if isinstance(p, Mapping)] if isinstance(pools, list) else []


def daemonset_name(pool: str) -> str:
    return f"{POOL_DAEMONSET_PREFIX}{pool}"


def pool_driver(driver: Mapping, pool: Mapping) -> dict:
    """The driver's values as the pool's DaemonSet renders them: the driver's, without the pools,
    with the pool's own (`POOL_KEYS`) over them."""
    merged = {key: copy.deepcopy(value) for key, value in driver.items() if key != "pools"}
    payload = {key: value for key, value in (pool.get("payload") or {}).items() if value not in ("", None)}
    if payload:
        merged["payload"] = {**(merged.get("payload") or {}), **payload}
    for key in ("fwUpgradePolicy", "fwEnableVirt"):
        if pool.get(key) is not None:
            merged[key] = pool[key]
    if pool.get("upgradePolicy"):
        merged["upgradePolicy"] = _over(merged.get("upgradePolicy") or {}, pool["upgradePolicy"])
    return merged


def _over(base: Any, own: Any) -> Any:
    """`own` over `base`: mappings key by key, anything else replaced."""
    if isinstance(base, Mapping) and isinstance(own, Mapping):
        return {**base, **{key: _over(base.get(key), value) for key, value in own.items()}}
    return copy.deepcopy(own)


def problems(driver: Mapping, prefix: str = "driver") -> list[UserError]:
    """The pools' rules the schema cannot say: names and node selectors each once, and each
    pool's upgrade policy (the driver's with the pool's over it) valid."""
    errors: list[UserError] = []
    driver_policy_valid = not upgrade_policy.problems(driver.get("upgradePolicy"))
    seen_names: dict[str, int] = {}
    seen_selectors: dict[str, int] = {}
    for i, pool in enumerate(pools_of(driver)):
        where = f"{prefix}.pools[{i}]"
        name = pool.get("name")
        if name in seen_names:
            errors.append(
                UserError(
                    f"{where}.name", f"{name} is also driver.pools[{seen_names[name]}]'s", "give each pool a name of its own"
                )
            )
        seen_names.setdefault(name, i)
        selector = repr(sorted((pool.get("nodeSelector") or {}).items()))
        if selector in seen_selectors:
            errors.append(
                UserError(
                    f"{where}.nodeSelector",
                    f"is driver.pools[{seen_selectors[selector]}]'s: both pools would select the same nodes",
                    "give each pool node labels that tell its nodes apart",
                )
            )
        seen_selectors.setdefault(selector, i)
        if pool.get("upgradePolicy") and driver_policy_valid:  # else the driver's problems say it
            policy = pool_driver(driver, pool).get("upgradePolicy")
            errors += upgrade_policy.problems(policy, f"{where}.upgradePolicy")
    return errors


def pool_spec(spec: Mapping, name: str) -> dict | None:
    """The ClusterOperator spec as pool `name`'s DaemonSet and rollout act on it: spec.driver is
    the pool's (`pool_driver`); None when the spec has no such pool."""
    driver = spec.get("driver") or {}
    pool = next((p for p in pools_of(driver) if p.get("name") == name), None)
    return None if pool is None else {**spec, "driver": pool_driver(driver, pool)}
