"""Small value types returned to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.kv.block import KVBlock

__all__ = ["KVCacheBlocks", "PrefixCacheStats"]


class KVCacheBlocks:
    """Blocks per KV group, ``blocks[group][i]``. Read-only for callers: the scheduler only
    reads ids (:meth:`get_block_ids`) and passes prefix hits back into ``allocate_slots``."""

    __slots__ = ("blocks", "host")

    def __init__(
        self, blocks: tuple[list[KVBlock], ...], host: list[KVBlock] | None = None
    ) -> None:
        self.blocks = blocks
        # A prefix hit's continuation in the host tier (group 0 only): host blocks whose
        # contents are copied into new device blocks when the hit is allocated.
        self.host: list[KVBlock] = host if host is not None else []

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    def num_blocks(self) -> int:
        """Blocks in the first group (all groups have equally long lists)."""
        return len(self.blocks[0]) if self.blocks else 0

    def __bool__(self) -> bool:
        return any(self.blocks) or bool(self.host)

    def __repr__(self) -> str:
        host = f", host={[b.block_id for b in self.host]}" if self.host else ""
        return f"KVCacheBlocks({self.get_block_ids()}{host})"


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache counters in tokens since construction or the last reset."""

    requests: int = 0
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which served from the cache (either tier)
    host_hits: int = 0  # of those, served from the host tier (copied back, not recomputed)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def device_hits(self) -> int:
        return self.hits - self.host_hits
