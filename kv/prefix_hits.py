"""Prefix hits: the longest cached prefix of a new request that every KV group accepts, found
in the device pool and continued in the host tier, and the counters of those lookups."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.kv.block_pool import KVBlock
from pagedserve.kv.group_managers import KVCacheBlocks, SingleTypeManager
from pagedserve.kv.host_tier import HostTier
from pagedserve.kv.request import KVRequest
from pagedserve.kv.specs import FullAttentionSpec, KVCacheSpec

__all__ = ["PrefixCacheStats", "PrefixLookup", "find_common_hit"]


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


class PrefixLookup:
    """Finds prefix hits for ``KVCacheManager.get_computed_blocks`` and counts them.

    Args:
        managers: the per-group managers, group id = position.
        host: the host tier, or None; hits continue there with one full-attention group.
        block_size: the manager's (virtual) block size.
        enable_caching: prefix caching on; off, every lookup misses and nothing is counted.
        single_full: one full-attention group, whose lookup needs no reconciliation.
    """

    def __init__(
        self,
        managers: Sequence[SingleTypeManager],
        host: HostTier | None,
        block_size: int,
        enable_caching: bool,
        single_full: bool,
    ) -> None:
        self.managers = managers
        self.host = host
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.single_full = single_full
        # Groups with equal specs are looked up together (a hit must exist in all of them);
        # full attention first, since its hit is downward closed and needs one lookup only.
        kinds: dict[KVCacheSpec, list[int]] = {}
        for gid, m in enumerate(managers):
            kinds.setdefault(m.spec, []).append(gid)
        self.kinds = sorted(kinds.items(), key=lambda kv: not isinstance(kv[0], FullAttentionSpec))
        self.stats = PrefixCacheStats()
        self._empty = KVCacheBlocks(tuple([] for _ in managers))

    def find(self, request: KVRequest) -> tuple[KVCacheBlocks, int]:
        """(hit blocks per group, hit tokens); see ``KVCacheManager.get_computed_blocks``."""
        if not self.enable_caching:
            return self._empty, 0
        num_tokens = request.num_tokens
        hashes = request.block_hashes
        max_blocks = min(len(hashes), (num_tokens - 1) // self.block_size) if num_tokens else 0
        stats = self.stats
        stats.requests += 1
        stats.queries += num_tokens
        if max_blocks <= 0:
            return self._empty, 0
        host: list[KVBlock] = []
        if self.single_full:
            blocks = self.managers[0].find_longest_cache_hit(hashes, max_blocks, (0,))[0]
            per_group, hit = [blocks], len(blocks)
            if self.host is not None and hit < max_blocks:
                # The chain may go on in the host tier, among evicted blocks kept there.
                host = self.host.find_hit(hashes, hit, max_blocks)
                hit += len(host)
        else:
            per_group, hit = find_common_hit(self.managers, self.kinds, hashes, max_blocks)
        stats.hits += hit * self.block_size
        stats.host_hits += len(host) * self.block_size
        return KVCacheBlocks(tuple(per_group), host), hit * self.block_size


def find_common_hit(
    managers: Sequence[SingleTypeManager],
    kinds: Sequence[tuple[KVCacheSpec, list[int]]],
    block_hashes: Sequence[bytes],
    max_blocks: int,
) -> tuple[list[list[KVBlock]], int]:
    """Longest hit (in blocks) that every group accepts, and the hit blocks per group.

    ``kinds`` lists (spec, group ids) with equal-spec groups together, full attention first.
    Fixed point: start at ``max_blocks``; each kind keeps or lowers the length; repeat until a
    whole pass changes nothing. Full attention is downward closed (any prefix of a hit is a hit),
    so it is looked up once and afterwards only trimmed. A sliding-window hit is not (a shorter
    length needs the window before *it*), so that kind is looked up again at each new length.
    """
    per_group: list[list[KVBlock]] = [[] for _ in managers]
    hit = max_blocks
    full_done: set[int] = set()
    changed = True
    while changed:
        changed = False
        for spec, gids in kinds:
            is_full = isinstance(spec, FullAttentionSpec)
            if is_full and gids[0] in full_done:
                for g in gids:
                    del per_group[g][hit:]
                continue
            found = managers[gids[0]].find_longest_cache_hit(block_hashes, hit, gids)
            if is_full:
                full_done.add(gids[0])
            for g, blocks in zip(gids, found, strict=True):
                per_group[g] = blocks
            n = len(found[0])
            if n < hit:
                hit = n
                changed = True
    for blocks in per_group:
        del blocks[hit:]
    return per_group, hit
