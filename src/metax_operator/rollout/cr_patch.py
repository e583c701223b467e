"""The rollout's writes to the ClusterOperator's spec, as JSON patches: the runner's pause of a
rollout and a rollback's restore of the spec that gives the old template, for the driver's own
rollout (spec.driver) or a driver pool's (its item of spec.driver.pools, found by name). Pure:
`runtime.rollout_pass` sends them."""

from __future__ import annotations

from metax_operator.chart import pools
from metax_operator.rollout.restore import without_policy
from metax_operator.rollout.target import Target


def pause_patch(spec: dict, target: Target, pointer: str, seen: bool, value: bool) -> list[dict]:
    """The JSON patch that sets the target's `pause` (at `pointer`/pause) to `value` if the CR
    still holds `seen` there. A pool's is the pool's own: its position is checked first (the
    pools' list may have changed), and where the pool sets no pause of its own (it followed the
    driver's) or no upgradePolicy at all, it gets one."""
    path = f"{pointer}/pause"
    if target.pool is None:
        return [{"op": "test", "path": path, "value": seen}, {"op": "replace", "path": path, "value": value}]
    index = target.index(spec)
    ops = [{"op": "test", "path": f"/spec/driver/pools/{index}/name", "value": target.pool}]
    own = spec["driver"]["pools"][index].get("upgradePolicy")
    if not isinstance(own, dict):
        return [*ops, {"op": "add", "path": pointer, "value": {"pause": value}}]
    if "pause" in own:
        ops.append({"op": "test", "path": path, "value": seen})
    return [*ops, {"op": "add", "path": path, "value": value}]


def restore_patch(spec: dict, target: Target, wanted: dict) -> list[dict] | None:
    """The JSON patch that makes the target's spec.driver (less its upgradePolicy) `wanted`: the
    CR's spec.driver itself, or for a pool the pool's own fields (`pools.POOL_KEYS`); None when
    the pool's fields cannot give it (the restored template differs in a field the driver's
    values hold for every pool)."""
    driver = spec.get("driver") or {}
    if target.pool is None:
        live = without_policy(driver)
        ops = [{"op": "add", "path": f"/spec/driver/{key}", "value": value} for key, value in sorted(wanted.items())]
        return ops + [{"op": "remove", "path": f"/spec/driver/{key}"} for key in sorted(live.keys() - wanted.keys())]
    index = target.index(spec)
    if index is None:
        return None
    payload = wanted.get("payload") or {}
    own = {"payload": {"version": payload.get("version", ""), "digest": payload.get("digest", "")}}
    # A firmware option the driver's values give already is left to them (the pool follows).
    own.update(
        {key: wanted[key] for key in ("fwUpgradePolicy", "fwEnableVirt") if key in wanted and wanted[key] != driver.get(key)}
    )
    entry = driver["pools"][index]
    drop = sorted(key for key in ("fwUpgradePolicy", "fwEnableVirt") if key in entry and key not in own)
    pool = {**{k: v for k, v in entry.items() if k not in drop}, **own}
    if without_policy(pools.pool_driver(driver, pool)) != wanted:
        return None
    at = f"/spec/driver/pools/{index}"
    ops = [{"op": "test", "path": f"{at}/name", "value": target.pool}]
    ops += [{"op": "add", "path": f"{at}/{key}", "value": value} for key, value in sorted(own.items())]
    return ops + [{"op": "remove", "path": f"{at}/{key}"} for key in drop]
