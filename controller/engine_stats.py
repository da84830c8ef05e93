"""The scheduler's counters and the engine core's stats snapshot: one flat dict for
``/metrics``, ``llm.stats()`` and the benchmarks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedserve.kv import KVCacheManager
from pagedserve.kv.host_tier import HostTierStats

__all__ = ["BATCHED_TOKENS_BUCKETS", "SchedulerStats", "engine_stats"]

BATCHED_TOKENS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384,
                          512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 16384)
"""Upper bounds (inclusive) of the tokens-per-step histogram; one more bucket holds the rest."""


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    num_swapped: int = 0
    """Preempted requests waiting with their blocks in the host tier."""
    batched_tokens_counts: tuple[int, ...] = ()
    """Steps that scheduled tokens, per ``BATCHED_TOKENS_BUCKETS`` bucket (+ the overflow)."""
    batched_tokens_sum: int = 0
    num_multi_pass_steps: int = 0
    """Steps that asked the workers for several decode passes (``decode_steps``)."""


def _shallow(obj: SchedulerStats | HostTierStats) -> dict[str, int | float]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def engine_stats(
    sched: SchedulerStats, kv: KVCacheManager, num_blocks: int, core: dict[str, int | float]
) -> dict[str, int | float]:
    """Scheduler counters, KV usage of both tiers, prefix-cache hits per tier (tokens), and
    the core's own numbers (``core``: timings, integrity checks) last."""
    # Field by field: ``dataclasses.asdict`` deep-copies, and this runs once a step.
    stats: dict[str, int | float] = _shallow(sched)
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
    for name, value in _shallow(tier_stats).items():
        stats[f"kv_host_{name}"] = value
    stats.update(core)
    return stats
