"""Prefix-hit reconciliation across KV groups of different kinds."""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.kv.block import KVBlock
from pagedserve.kv.single_type import SingleTypeManager
from pagedserve.kv.specs import FullAttentionSpec, KVCacheSpec

__all__ = ["find_common_hit"]


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
