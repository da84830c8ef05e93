"""Whole-state views of a KVCacheManager for the KV tests: a snapshot to compare before and
after a call that must change nothing, and the check that block hashes only cover real
tokens."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from helpers.kv_requests import SimpleRequest
from pagedserve.kv import KVCacheManager

__all__ = ["check_hashes_cover_real_tokens", "snapshot"]


def host_snapshot(m: KVCacheManager) -> Any:
    h = m.host
    if h is None:
        return None
    return (
        [b.block_id for b in h.pool.free_block_queue],
        [(b.ref_cnt, b.block_hash) for b in h.pool.blocks],
        {k: v.block_id for k, v in h.pool.cached.items()},
        {r: [[b.block_id for b in g] for g in gs] for r, gs in h.swapped.items()},
        (list(h.pending[0]), list(h.pending[1]), [b.block_id for b in h.held_blocks]),
    )


def snapshot(m: KVCacheManager) -> Any:
    return (
        host_snapshot(m),
        [b.block_id for b in m.pool.free_block_queue],
        [(b.ref_cnt, b.block_hash) for b in m.pool.blocks],
        {k: (type(v), getattr(v, "block_id", None) or sorted(v)) for k, v in m.pool.cached.items()},
        [{r: [b.block_id for b in bl] for r, bl in g.req_to_blocks.items()} for g in m.managers],
        [dict(g.num_cached_blocks) for g in m.managers],
        dict(m.num_filled_tokens),
        list(m.allocator.pending_copies),
        list(m.allocator.replacements),
    )


def check_hashes_cover_real_tokens(m: KVCacheManager, requests: Iterable[SimpleRequest]) -> None:
    """Every hashed block a request holds sits at an index ``i`` whose tokens the request has
    and has written (``(i + 1) * B <= min(filled, num_tokens)``), under the request's own hash
    ``i``: lookahead slots, which hold no real token yet, are never covered."""
    bs = m.block_size
    for r in requests:
        rid = r.request_id
        if rid not in m.managers[0].req_to_blocks:
            continue
        real = min(m.num_filled_tokens[rid], r.num_tokens)
        for gid, g in enumerate(m.managers):
            for i, b in enumerate(g.req_to_blocks[rid]):
                if b.is_null or b.block_hash is None:
                    continue
                assert (i + 1) * bs <= real, f"{rid}: block {i} hashed past {real} real tokens"
                assert b.block_hash == r.block_hashes[i] + gid.to_bytes(4, "big")
