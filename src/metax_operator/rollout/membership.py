"""Which driver DaemonSet runs each GPU node's driver, and moving a node from one to another.

With driver pools (`chart/pools.py`) the runner labels each GPU node with the pool whose node
selector selects it (contract.POOL_LABEL; no label: the driver DaemonSet's own; what each selector
selects comes from a watch per selector: `runtime.pool_nodes`). Each pool's
DaemonSet selects its label and the driver's own selects the nodes without one, so writing the
label is the node's driver swap: the DaemonSet controller deletes the old pod and the other
DaemonSet creates one. The label is therefore written like a wave's deletion, inside the budget:

- a node with no serving driver (no Ready driver pod: a new node, a node being set up) moves at
  once, nothing serving is lost;
- a serving node moves only while its new rollout (the pool it goes to) is neither paused nor
  without room: with `enableRollout` its `maxParallel` nodes at once, and, with the GPU nodes out
  of service anywhere (`out_of_service`: being swapped or moved, not Ready, cordoned), no more
  than its `maxParallel` plus `maxUnavailable`; without it every node at once (as a new
  revision's pods); never a node running GPU work unless the policy allows it, nor a node an
  admin marked to skip, nor one a wave is swapping. It is cordoned first if the policy says so,
  and uncordoned by its new rollout once its driver is Ready there;
- a node two pools select moves nowhere, and is reported with both pools.

Pure: `decide` takes the node cache's snapshot and what the rollouts observed, and returns what
to write (`Moves`); `runtime.rollouts` writes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from metax_operator.chart.upgrade_policy import Policy
from metax_operator.conditions import FALSE, TRUE, Condition, CrCondition, CrReason
from metax_operator.contract import GPU_NODE_LABEL, POOL_LABEL, SKIP_LABEL
from metax_operator.rollout.budget import Budget
from metax_operator.rollout.status import LISTED_NODES
from metax_operator.rollout.target import Target


@dataclass
class Moves:
    """What one pass writes: each node's pool label (None: remove it), the nodes to cordon first,
    the nodes two or more pools select (node -> pools), and why nodes wait (reason -> nodes)."""

    label: dict[str, str | None] = field(default_factory=dict)
    cordon: list[str] = field(default_factory=list)
    overlaps: dict[str, list[str]] = field(default_factory=dict)
    waiting: dict[str, list[str]] = field(default_factory=dict)


def decide(
    nodes: Mapping[str, frozenset[tuple[str, str]]],
    selected: Mapping[str, frozenset[str]],
    serving: frozenset[str],
    busy: frozenset[str],
    in_waves: frozenset[str],
    out_of_service: frozenset[str],
    policy_of: Callable[[Target], Policy | None],
) -> Moves:
    """The moves of one pass. `nodes`: every node's product labels (the node cache); `selected`:
    the nodes each pool's node selector selects, by pool in the spec's order; `serving`:
    the nodes with a Ready driver pod of any driver DaemonSet and not cordoned; `busy`: the nodes
    running GPU work; `in_waves`: the nodes a rollout's wave holds; `out_of_service`: the GPU
    nodes not serving anywhere; `policy_of`: each rollout's policy (None: invalid, or its
    DaemonSet is missing: nothing moves to it)."""
    moves = Moves()
    wanted, owners = _wanted(nodes, selected, serving, in_waves, moves)
    for destination, candidates in sorted(wanted.items()):
        policy = policy_of(Target(destination or None))
        taken = _taken(policy, candidates, owners[destination], busy, out_of_service, moves.waiting)
        for name in taken:
            moves.label[name] = destination or None
            if policy is not None and policy.cordon:
                moves.cordon.append(name)
        out_of_service |= frozenset(taken)  # one budget: the next destination counts these
    return moves


def _wanted(
    nodes: Mapping[str, frozenset[tuple[str, str]]],
    selected: Mapping[str, frozenset[str]],
    serving: frozenset[str],
    in_waves: frozenset[str],
    moves: Moves,
) -> tuple[dict[str, list[str]], dict[str, int]]:
    """The serving GPU nodes to move, by destination (pool name, "" for the driver's own), and how
    many GPU nodes each destination has or gets; the nodes that move at once, those two pools
    select and those that wait for a swap or a skip label go into `moves`."""
    wanted: dict[str, list[str]] = {}
    owners: dict[str, int] = {}
    for name, labels in sorted(nodes.items()):
        label = dict(labels)
        if label.get(GPU_NODE_LABEL) != "true":
            continue
        pool, overlap = wanted_pool(name, selected)
        current = label.get(POOL_LABEL)
        owners[(current if overlap else pool) or ""] = owners.get((current if overlap else pool) or "", 0) + 1
        if overlap:
            moves.overlaps[name] = overlap
        elif pool == current:
            continue
        elif name in in_waves or label.get(SKIP_LABEL) == "true":
            moves.waiting.setdefault("swapping or skipped", []).append(name)
        elif name not in serving:
            moves.label[name] = pool  # nothing serving to lose
        else:
            wanted.setdefault(pool or "", []).append(name)
    return wanted, owners


def _taken(
    policy: Policy | None,
    candidates: list[str],
    total: int,
    busy: frozenset[str],
    out_of_service: frozenset[str],
    waiting: dict[str, list[str]],
) -> list[str]:
    """The serving `candidates` that move into a rollout of `policy` (its `total` nodes) now; why
    the others wait goes into `waiting`."""
    if policy is None or policy.pause:
        waiting.setdefault("paused" if policy else "no valid policy or DaemonSet", []).extend(candidates)
        return []
    idle = [n for n in candidates if policy.allow_gpu_workloads or n not in busy]
    if len(idle) < len(candidates):
        waiting.setdefault("running GPU work", []).extend(n for n in candidates if n not in idle)
    if not policy.enable_rollout:
        return idle
    # The budget's last step: the one rule of how many at once (`budget`).
    taken, left = Budget.for_step(policy, total, len(policy.steps), frozenset(), out_of_service).take(idle, node=str)
    if left:
        waiting.setdefault("no room in the budget", []).extend(left)
    return taken


def wanted_pool(node: str, selected: Mapping[str, frozenset[str]]) -> tuple[str | None, list[str]]:
    """The pool whose node selector selects `node` (None: the driver's own), and every pool that
    does when more than one does (then the node is none's to move)."""
    matching = [pool for pool, nodes in selected.items() if node in nodes]
    return (matching[0] if len(matching) == 1 else None), (matching if len(matching) > 1 else [])


def serving(
    nodes: Mapping[str, frozenset[tuple[str, str]]],
    pods: Iterable[tuple[str, bool]],
    unschedulable: frozenset[str],
    swapping: frozenset[str],
) -> tuple[frozenset[str], frozenset[str]]:
    """The GPU nodes serving (a live Ready driver pod of any driver DaemonSet, the node
    schedulable) and those out of service, of `nodes` (the node cache: each node's product
    labels). `pods` gives each driver pod's node and whether it serves (live and Ready). Out of
    service are the GPU nodes that have a driver pod or that the runner cordoned (`swapping`: a
    node whose pod is between two DaemonSets) and do not serve: a GPU node no driver DaemonSet
    runs on (its taints, an admin's nodeSelector) is no node of any rollout, as for one DaemonSet."""
    gpu = frozenset(name for name, labels in nodes.items() if (GPU_NODE_LABEL, "true") in labels)
    with_driver, up = set(swapping), set()
    for node, ready in pods:
        with_driver.add(node)
        if ready:
            up.add(node)
    up_now = (gpu & up) - unschedulable
    return frozenset(up_now), frozenset((gpu & with_driver) - up_now)


def condition(moves: Moves) -> Condition:
    """DriverPoolsDisjoint: whether each GPU node is in one pool at most; else the nodes two pools
    select, with the pools (they keep the driver they have: no pod is touched there)."""
    if not moves.overlaps:
        return Condition(CrCondition.POOLS_DISJOINT, TRUE, CrReason.DISJOINT, "each GPU node is in one driver pool at most")
    shown = sorted(moves.overlaps)[:LISTED_NODES]
    said = "; ".join(f"{node} by {', '.join(moves.overlaps[node])}" for node in shown)
    more = f" and {len(moves.overlaps) - len(shown)} more" if len(moves.overlaps) > len(shown) else ""
    return Condition(
        CrCondition.POOLS_DISJOINT,
        FALSE,
        CrReason.POOLS_OVERLAP,
        f"GPU nodes selected by more than one driver pool keep the driver they have: {said}{more}; "
        "change the pools' nodeSelectors (driver.pools[].nodeSelector) or the nodes' labels so that one pool selects each",
    )
