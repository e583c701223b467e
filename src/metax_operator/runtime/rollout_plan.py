"""What one rollout decided for a pass (`RolloutPass.decide`): a `Plan` to act on, or, when it
cannot decide, the cordons to give back (`GiveBack`)."""

from __future__ import annotations

from dataclasses import dataclass

from metax_operator.chart.upgrade_policy import Policy
from metax_operator.rollout.decision import Decision
from metax_operator.rollout.observation import Cluster


@dataclass(frozen=True)
class Plan:
    """The rollout's decision for one pass, and what acting on it needs: the CR's
    `spec.driver.upgradePolicy.pause` as the engine saw it, and the status as stored."""

    decision: Decision
    pause_seen: bool
    stored: dict | None  # status.upgradeStatus as read (None: never written)
    now: float  # the time the engine decided at
    # What the engine decided on, with the policy: what the nodes' state labels are worked out
    # from (`node_state.states`). None in a plan made without an observation.
    observed: Cluster | None = None
    policy: Policy | None = None
    read: tuple | None = None  # what the pass read (`RolloutPass._read`), None: not to be reused

    @property
    def upgrade_status(self) -> dict:
        """The `status.upgradeStatus` the pass writes before `act`."""
        return self.decision.status.to_json()


@dataclass(frozen=True)
class GiveBack:
    """A pass the rollout cannot decide gives back the nodes the runner cordoned whose driver is
    back: a frozen rollout holds no capacity it does not need. The status stays as stored."""

    nodes: list[str]
    stored: dict | None

    @property
    def upgrade_status(self) -> dict | None:
        return self.stored
