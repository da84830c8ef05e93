"""The engine core's stats snapshot: one flat dict for ``/metrics``, ``llm.stats()`` and the
benchmarks."""

from __future__ import annotations

import dataclasses

from pagedserve.controller.scheduler import SchedulerStats
from pagedserve.kv import KVCacheManager
from pagedserve.kv.host_tier import HostTierStats

__all__ = ["engine_stats"]


def engine_stats(
    sched: SchedulerStats, kv: KVCacheManager, num_blocks: int, core: dict[str, int | float]
) -> dict[str, int | float]:
    """Scheduler counters, KV usage of both tiers, prefix-cache hits per tier (tokens), and
    the core's own numbers (``core``: timings, integrity checks) last."""
    stats: dict[str, int | float] = dataclasses.asdict(sched)
    stats["kv_blocks_total"] = num_blocks - 1  # without the null block
    stats["kv_blocks_used"] = stats["kv_blocks_total"] - kv.num_free_blocks
    # Token capacity grows with decode context parallelism: a block spans B x dcp tokens.
    stats["kv_capacity_tokens"] = stats["kv_blocks_total"] * kv.block_size
    pc = kv.prefix_cache_stats
    stats["prefix_cache_device_hits"] = pc.device_hits
    stats["prefix_cache_host_hits"] = pc.host_hits
    host = kv.host
    # Present without a tier too (zeros), so dashboards and alerts need no special case.
    total = host.num_usable_blocks if host is not None else 0
    stats["kv_host_blocks_total"] = total
    stats["kv_host_blocks_used"] = total - host.num_free_blocks if host is not None else 0
    tier_stats = host.stats if host is not None else HostTierStats()
    for name, value in dataclasses.asdict(tier_stats).items():
        stats[f"kv_host_{name}"] = value
    stats.update(core)
    return stats
