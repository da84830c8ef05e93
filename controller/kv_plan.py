"""From the workers' report to the KV pool: the context limit, the layer groups, the pool size."""

from __future__ import annotations

import logging

from pagedserve.config import ConfigError, EngineConfig
from pagedserve.kv import (
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheManager,
    KVCacheSpec,
    SlidingWindowSpec,
    group_layer_specs,
    num_blocks_from_bytes,
)
from pagedserve.messages import KVCacheLayout, WorkerReport

__all__ = [
    "KVPlan",
    "draft_groups_from_report",
    "kv_groups_from_report",
    "plan_kv_cache",
    "resolve_max_model_len",
]

logger = logging.getLogger(__name__)


def resolve_max_model_len(config: EngineConfig, report: WorkerReport) -> int:
    """The configured limit, else the checkpoint's; never more than the checkpoint supports.
    Without chunked prefill a (resumed) request must fit one step's budget whole."""
    configured = config.model.max_model_len
    limit = report.max_model_len
    if configured is not None and configured > limit:
        logger.warning("max_model_len=%d exceeds the model's %d; using %d",
                       configured, limit, limit)
    elif configured is not None:
        limit = configured
    sched = config.scheduler
    if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < limit:
        logger.warning(
            "chunked prefill is off: max_model_len lowered to max_num_batched_tokens=%d",
            sched.max_num_batched_tokens,
        )
        limit = sched.max_num_batched_tokens
    return limit


def kv_groups_from_report(report: WorkerReport, block_size: int) -> list[KVCacheGroup]:
    """Per-layer KV specs (layer index as name, in model order) grouped by kv's rules."""
    specs: dict[str, KVCacheSpec] = {}
    for i, ls in enumerate(report.layer_specs):
        if ls.sliding_window is not None:
            specs[str(i)] = SlidingWindowSpec(
                block_size, ls.num_kv_heads, ls.head_size, ls.dtype_bytes, ls.sliding_window
            )
        else:
            specs[str(i)] = FullAttentionSpec(
                block_size, ls.num_kv_heads, ls.head_size, ls.dtype_bytes
            )
    return group_layer_specs(specs)


def draft_groups_from_report(report: WorkerReport, groups: list[KVCacheGroup]) -> list[int]:
    """Per draft-model layer, the target group whose block table it shares: one that keeps
    every token the layer attends to, a full-attention group first, else the narrowest
    sliding-window group at least as wide as the layer's own window."""
    windows = [g.spec.sliding_window if isinstance(g.spec, SlidingWindowSpec) else None
               for g in groups]
    out = []
    for i, ls in enumerate(report.draft_layer_specs):
        need = ls.sliding_window  # None: every token
        fits = [(w is not None, w or 0, g) for g, w in enumerate(windows)
                if w is None or (need is not None and w >= need)]
        if not fits:
            raise ConfigError(
                "speculative_config.model",
                f"draft layer {i} attends over {need or 'all its'} tokens, but every layer "
                "of the target keeps a shorter sliding window: no block table holds what it "
                "reads",
            )
        out.append(min(fits)[2])
    return out


def _draft_block_bytes(report: WorkerReport, block_size: int) -> int:
    """Bytes of one block over every draft-model layer (K and V)."""
    return sum(
        2 * block_size * ls.num_kv_heads * ls.head_size * ls.dtype_bytes
        for ls in report.draft_layer_specs
    )


def _num_blocks(kv_bytes: int, groups: list[KVCacheGroup], draft_block_bytes: int) -> int:
    """Blocks in ``kv_bytes`` when each also costs ``draft_block_bytes`` of draft KV."""
    if not draft_block_bytes or not groups:
        return num_blocks_from_bytes(kv_bytes, groups)
    layers_per_group = max(len(g.layer_names) for g in groups)
    return kv_bytes // (groups[0].spec.page_size_bytes * layers_per_group + draft_block_bytes)


class KVPlan:
    """The pool the controller decided on, and how to make a fresh manager for it."""

    def __init__(self, config: EngineConfig, layout: KVCacheLayout,
                 specs: list[KVCacheSpec], max_model_len: int,
                 draft_block_bytes: int = 0) -> None:
        self.config = config
        self.layout = layout
        self.specs = specs
        self.max_model_len = max_model_len
        self.draft_block_bytes = draft_block_bytes
        """Bytes a block costs in the draft model's layers (0 without one), per rank."""

    def pool_bytes(self) -> dict[str, int]:
        """One rank's KV pool size (the draft model's layers included) and element width:
        they follow ``kv_cache_dtype``."""
        if not self.specs:
            return {}
        page = self.specs[0].page_size_bytes  # equal across groups, per layer
        block = page * len(self.layout.groups[0]) + self.draft_block_bytes
        return {"kv_cache_bytes": self.layout.num_blocks * block,
                "kv_cache_element_bytes": self.specs[0].dtype_bytes}

    def new_manager(self) -> KVCacheManager:
        cache = self.config.cache
        return KVCacheManager(
            self.specs or None,
            self.layout.num_blocks,
            self.layout.block_size,
            self.max_model_len,
            enable_caching=cache.enable_prefix_caching,
            policy=cache.allocation_policy,  # type: ignore[arg-type]
            virtual_block_factor=self.config.parallel.decode_context_parallel_size,
            num_host_blocks=self.layout.num_host_blocks,
            offload=cache.kv_offload,
        )


def plan_kv_cache(config: EngineConfig, report: WorkerReport, max_model_len: int) -> KVPlan:
    """Group the reported layer specs and size the pool."""
    cache = config.cache
    # Per-rank page geometry: under decode context parallelism each rank holds B tokens of
    # every virtual block of B x dcp tokens, so bytes -> blocks is the same as without it.
    groups = kv_groups_from_report(report, cache.block_size)
    # A draft model's layers index their own tensors with the target's block ids: every block
    # costs their bytes as well, in both tiers.
    draft_bytes = _draft_block_bytes(report, cache.block_size)
    if cache.num_gpu_blocks is not None:
        num_blocks = cache.num_gpu_blocks
    else:
        num_blocks = _num_blocks(report.available_kv_bytes, groups, draft_bytes)
    if num_blocks < 2:
        raise RuntimeError(
            f"no room for the KV cache: {report.available_kv_bytes} bytes give {num_blocks} "
            "blocks; raise kv_cache_memory_bytes / gpu_memory_utilization or num_gpu_blocks"
        )
    num_host = 0
    if cache.num_host_blocks is not None:
        num_host = cache.num_host_blocks
    elif cache.host_kv_cache_bytes:
        num_host = _num_blocks(cache.host_kv_cache_bytes, groups, draft_bytes)
        if num_host < 2:
            raise ConfigError(
                "host_kv_cache_bytes",
                f"{cache.host_kv_cache_bytes} bytes hold {num_host} KV blocks; the host tier "
                "needs at least 2 (raise --swap-space)",
            )
    layout = KVCacheLayout(
        num_blocks=num_blocks,
        block_size=cache.block_size,
        groups=[[int(name) for name in g.layer_names] for g in groups],
        num_host_blocks=num_host,
        draft_groups=draft_groups_from_report(report, groups),
    )
    return KVPlan(config, layout, [g.spec for g in groups], max_model_len, draft_bytes)
