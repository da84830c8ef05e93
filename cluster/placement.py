"""Placement of one worker group: a Ray placement group with one bundle per rank, and the
rank order derived from where the bundles landed.

Everything is keyed by Ray node id, never by IP: fake multi-node clusters (and some real ones)
give every node the same address. The pure helpers (``rank_order``, ``missing_resources``) take
plain data so they can be tested without Ray.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from pagedserve.controller.executor import ExecutorError

__all__ = [
    "PlacementError",
    "PlacementTimeoutError",
    "RankSlot",
    "create_placement_group",
    "default_bundle",
    "missing_resources",
    "rank_order",
    "rank_slots",
    "remove_quietly",
    "warn_if_split",
]

logger = logging.getLogger(__name__)


class PlacementError(ExecutorError):
    """The worker group could not be placed on the cluster."""


class PlacementTimeoutError(PlacementError, TimeoutError):
    """The placement group was not ready in time; names what the cluster lacks."""

    def __init__(
        self,
        bundles: list[dict[str, float]],
        strategy: str,
        timeout_s: float,
        missing: dict[str, str],
    ) -> None:
        what = "; ".join(f"{k}: {v}" for k, v in missing.items()) or (
            "the cluster has the resources in total, but not free or not in the shape the "
            "strategy needs (other placement groups or actors hold them?)"
        )
        super().__init__(
            f"placement group of {len(bundles)} bundles {bundles[0] if bundles else {}} "
            f"({strategy}) was not ready within {timeout_s:.1f} s; missing {what}. "
            "Check `ray status`, add nodes, or lower tensor_parallel_size."
        )
        self.bundles = bundles
        self.strategy = strategy
        self.timeout_s = timeout_s
        self.missing = missing

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.bundles, self.strategy, self.timeout_s, self.missing))


@dataclass(frozen=True, slots=True)
class RankSlot:
    """Where one rank lives: its placement-group bundle and that bundle's node."""

    rank: int
    bundle_index: int
    node_id: str


def default_bundle(cluster_resources: Mapping[str, float]) -> dict[str, float]:
    """One device per rank: ``{"GPU": 1}`` where the cluster has GPUs, ``{"CPU": 1}`` otherwise."""
    return {"GPU": 1.0} if cluster_resources.get("GPU", 0) > 0 else {"CPU": 1.0}


def rank_order(bundle_nodes: Mapping[int, str], controller_node: str) -> list[RankSlot]:
    """Ranks for the bundles: the controller's node first, then the other nodes (in order of
    their lowest bundle index), bundles of one node consecutive and by index. Ranks of one node
    are thus contiguous (a TP group stays node-local where it can) and rank 0, the output rank,
    sits next to the controller when any bundle does."""
    first_index: dict[str, int] = {}
    for index in sorted(bundle_nodes):
        first_index.setdefault(bundle_nodes[index], index)

    def key(index: int) -> tuple[int, int, int]:
        node = bundle_nodes[index]
        return (0 if node == controller_node else 1, first_index[node], index)

    ordered = sorted(bundle_nodes, key=key)
    return [RankSlot(rank, index, bundle_nodes[index]) for rank, index in enumerate(ordered)]


def missing_resources(
    bundles: Sequence[Mapping[str, float]],
    strategy: str,
    node_resources: Sequence[Mapping[str, float]],
) -> dict[str, str]:
    """What the live nodes cannot provide for ``bundles`` even when idle, per resource key.

    Checks the cluster total, the largest node for STRICT_PACK (every bundle on one node) and
    the largest single bundle against every node. Empty when the cluster could hold the group
    (it may still be busy)."""
    missing: dict[str, str] = {}
    keys = sorted({k for b in bundles for k in b})
    for key in keys:
        need = sum(b.get(key, 0.0) for b in bundles)
        per_node = [n.get(key, 0.0) for n in node_resources]
        total = sum(per_node)
        largest = max(per_node, default=0.0)
        biggest_bundle = max((b.get(key, 0.0) for b in bundles), default=0.0)
        if total < need:
            missing[key] = f"need {need:g} in total, the cluster has {total:g}"
        elif strategy == "STRICT_PACK" and largest < need:
            missing[key] = f"STRICT_PACK needs {need:g} on one node, the largest has {largest:g}"
        elif largest < biggest_bundle:
            missing[key] = f"a bundle needs {biggest_bundle:g}, no node has more than {largest:g}"
    return missing


def _alive_node_resources() -> list[dict[str, float]]:
    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]


def create_placement_group(
    world_size: int,
    strategy: str,
    bundle: Mapping[str, float],
    timeout_s: float,
    name: str = "",
) -> PlacementGroup:
    """Create the group's placement group and wait (bounded) until it is placed.

    On timeout the pending group is removed and ``PlacementTimeoutError`` names the missing
    resources; a pending placement group otherwise stays PENDING forever without an error."""
    bundles = [dict(bundle) for _ in range(world_size)]
    logger.info("placement group: %d x %s, strategy %s", world_size, dict(bundle), strategy)
    pg = placement_group(bundles, strategy=strategy, name=name)
    start = time.monotonic()
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_quietly(pg)
        missing = missing_resources(bundles, strategy, _alive_node_resources())
        raise PlacementTimeoutError(bundles, strategy, time.monotonic() - start, missing)
    ray.get(ready[0])
    return pg


def wait_placed(pg: PlacementGroup, timeout_s: float) -> None:
    """Wait (bounded) until ``pg`` is placed, e.g. again after a node's death."""
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        raise PlacementError(f"the worker placement group was not placed within {timeout_s} s")
    ray.get(ready[0])


def reserve_worker_group(
    world_size: int, strategy: str, timeout_s: float, bundle: Mapping[str, float] | None = None
) -> PlacementGroup:
    """The placement group of one worker group: ``world_size`` bundles of ``bundle`` (by default
    one GPU each on GPU clusters, one CPU otherwise). Its creator owns it and removes it."""
    chosen = bundle if bundle is not None else default_bundle(ray.cluster_resources())
    return create_placement_group(world_size, strategy, chosen, timeout_s)


def rank_slots(pg: PlacementGroup, controller_node: str) -> list[RankSlot]:
    """The rank table of a ready placement group (see ``rank_order``)."""
    table = placement_group_table(pg)
    bundle_nodes = {int(i): str(n) for i, n in table["bundles_to_node_id"].items()}
    if len(bundle_nodes) != pg.bundle_count:
        raise PlacementError(f"placement group table lists {len(bundle_nodes)} placed bundles")
    return rank_order(bundle_nodes, controller_node)


def remove_quietly(pg: PlacementGroup | None) -> None:
    """Remove a placement group; a group already gone (or Ray already down) is fine."""
    if pg is None or not ray.is_initialized():
        return
    try:
        remove_placement_group(pg)
    except Exception:  # already removed, or the cluster is going away
        logger.debug("removing placement group %s failed", pg.id, exc_info=True)


def warn_if_split(ranks: Sequence[Mapping[str, Any]], strategy: str) -> int:
    """Log where a worker group's ranks landed (``rank``, ``node_id``, ``node_ip`` each) and,
    when one tensor-parallel group spans several nodes, that every layer's all-reduce now
    crosses the network. Returns the number of nodes.

    PACK (the default) keeps the group on one node whenever one node has room for it, and
    spills over only when none has; SPREAD asks for the split on purpose."""
    nodes = {r["node_id"] for r in ranks}
    where = ", ".join(f"{r['rank']}->{r['node_ip']} ({str(r['node_id'])[:8]})" for r in ranks)
    logger.info("worker group on %d node(s): %s", len(nodes), where)
    if len(nodes) > 1:
        why = "as SPREAD asks" if strategy == "SPREAD" else f"no single node had room ({strategy})"
        logger.warning(
            "the tensor-parallel group spans %d nodes, %s: every layer's all-reduce crosses the "
            "network, which is much slower than within a node. STRICT_PACK keeps a group on "
            "one node (it waits for a node with room instead of splitting).",
            len(nodes), why,
        )
    return len(nodes)
