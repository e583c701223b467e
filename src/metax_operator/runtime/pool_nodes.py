"""The nodes each driver pool's node selector selects (`driver.pools[].nodeSelector`).

One metadata-only watch of the nodes per selector, the API server filtering by label selector: the
runner learns what every pool selects without keeping every node's labels (its node cache keeps
only the product's own, `metax-tech.com/...`, while a pool may select on any label). A watch
starts when a selector appears in the spec and stops when it leaves.
"""

from __future__ import annotations

from collections.abc import Callable

from metax_operator.runtime.informer import Informer
from metax_operator.runtime.kube import Client


def label_selector(node_selector: dict[str, str]) -> str:
    """A nodeSelector as a label selector (`key=value,...`)."""
    return ",".join(f"{key}={value}" for key, value in sorted(node_selector.items()))


class PoolNodes:
    """`selected(pools)`: the node names each pool's selector selects, from a watch per selector."""

    def __init__(self, api: Client, resync: float, on_change: Callable[[], None] | None = None):
        self.api, self.resync, self.on_change = api, resync, on_change
        self.informers: dict[str, Informer] = {}  # label selector -> its watch

    def selected(self, pools: list[dict]) -> dict[str, frozenset[str]] | None:
        """Pool name -> the nodes its selector selects; None while a watch has not listed yet or
        fails (no node is moved on a partial view)."""
        wanted = {pool["name"]: label_selector(pool.get("nodeSelector") or {}) for pool in pools}
        for selector in set(self.informers) - set(wanted.values()):
            self.informers.pop(selector).stop()
        for selector in set(wanted.values()) - set(self.informers):
            informer = Informer(
                self.api,
                self.api.resource("v1", "Node").path(),
                label_selector=selector,
                project=lambda obj: obj["metadata"]["name"],
                metadata_only=True,
                resync=self.resync,
                name=f"pool-nodes {selector}",
            )
            informer.on_change = self.on_change
            self.informers[selector] = informer.start()
        if any(not i.synced or i.state == "failing" for i in self.informers.values()):
            return None
        return {name: frozenset(self.informers[selector].snapshot().values()) for name, selector in wanted.items()}

    def stop(self) -> None:
        for informer in self.informers.values():
            informer.stop()
        self.informers = {}
