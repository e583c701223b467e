"""Which driver DaemonSet a rollout is of: the driver's own, or a driver pool's (`chart/pools.py`).

Each has its staged rollout, decided by the same engine: `Target` says where its DaemonSet, its
status, its spec and its nodes are.

- The driver's own: DaemonSet `metax-driver`, status `status.upgradeStatus`, spec `spec.driver`,
  the GPU nodes without the runner's pool label.
- Pool NAME: DaemonSet `metax-driver-pool-NAME`, status `status.pools[]` (the item named NAME)
  `.upgradeStatus`, spec `spec.driver` with `spec.driver.pools[]` NAME's over it
  (`pools.pool_spec`), the GPU nodes labelled `metax-tech.com/driver-upgrade.pool=NAME`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from metax_operator.chart import pools
from metax_operator.contract import DRIVER_DAEMONSET, POOL_LABEL


@dataclass(frozen=True)
class Target:
    """One driver DaemonSet's rollout: its pool's name, None for the driver's own."""

    pool: str | None = None

    @property
    def daemonset(self) -> str:
        return DRIVER_DAEMONSET if self.pool is None else pools.daemonset_name(self.pool)

    def __str__(self) -> str:
        return "driver" if self.pool is None else f"pool {self.pool}"

    def owns(self, labels: Mapping[str, str]) -> bool:
        """Whether a node with `labels` is this rollout's (the runner's pool label says)."""
        return labels.get(POOL_LABEL) == self.pool

    def stored(self, status: Mapping | None) -> dict | None:
        """Its rollout status in the CR's `status` (None: never written)."""
        status = status or {}
        if self.pool is None:
            return status.get("upgradeStatus") or None
        entry = next((p for p in _entries(status) if p.get("name") == self.pool), None)
        return (entry or {}).get("upgradeStatus") or None

    def status_fields(self, status: Mapping | None, upgrade_status: dict) -> dict:
        """The CR status fields that hold `upgrade_status` as its rollout status, the rest of
        `status` as it is."""
        if self.pool is None:
            return {"upgradeStatus": upgrade_status}
        entries = [p for p in _entries(status or {}) if p.get("name") != self.pool]
        entries.append({"name": self.pool, "upgradeStatus": upgrade_status})
        return {"pools": sorted(entries, key=lambda p: str(p.get("name")))}

    def spec(self, spec: Mapping) -> dict | None:
        """The ClusterOperator spec as its DaemonSet and rollout act on it (None: no such pool)."""
        return dict(spec) if self.pool is None else pools.pool_spec(spec, self.pool)

    def policy_pointer(self, spec: Mapping) -> str | None:
        """The JSON pointer of its upgradePolicy in the CR (None: the pool is gone)."""
        if self.pool is None:
            return "/spec/driver/upgradePolicy"
        index = self.index(spec)
        return None if index is None else f"/spec/driver/pools/{index}/upgradePolicy"

    def policy_field(self, spec: Mapping) -> str:
        """Where its upgradePolicy is in the CR, as messages name a field."""
        return "spec.driver.upgradePolicy" if self.pool is None else f"spec.driver.pools[{self.index(spec)}].upgradePolicy"

    def index(self, spec: Mapping) -> int | None:
        """Its position in spec.driver.pools (None: the driver's own, or a pool that is gone)."""
        entries = pools.pools_of(spec.get("driver") or {})
        return next((i for i, p in enumerate(entries) if p.get("name") == self.pool), None) if self.pool else None


#: The driver DaemonSet's own rollout.
DRIVER = Target()


def _entries(status: Mapping) -> list[dict]:
    entries = status.get("pools")
    return [p for p in entries if isinstance(p, dict)] if isinstance(entries, list) else []


def targets(spec: Mapping) -> list[Target]:
    """The driver's own rollout and one per pool of `spec`, in the spec's order."""
    return [Target(), *(Target(p["name"]) for p in pools.pools_of(spec.get("driver") or {}) if p.get("name"))]
