"""Read-only views of a KVCacheManager, through its public accessors: integrity checking and
block-fill snapshots."""

from __future__ import annotations

import numpy as np

from pagedserve.kv.base import ManagerView
from pagedserve.kv.specs import FullAttentionSpec

__all__ = ["block_fill_snapshot", "check_manager_integrity"]


def block_fill_snapshot(mgr: ManagerView) -> np.ndarray:
    """Tokens held per block id by running requests; see ``KVCacheManager.block_fill_snapshot``.

    Counts are in manager (virtual) block tokens, i.e. up to ``mgr.block_size``.
    """
    out = np.zeros(mgr.pool.num_blocks, dtype=np.int32)
    bs = mgr.block_size
    ids: list[int] = []
    last_ids: list[int] = []
    last_fill: list[int] = []
    filled = mgr.num_filled_tokens
    for m in mgr.managers:
        for rid, blocks in m.req_to_blocks.items():
            if not blocks:
                continue
            n = filled.get(rid, 0)
            n_full = min(n // bs, len(blocks))
            ids.extend([b.block_id for b in blocks[:n_full]])
            if n_full < len(blocks):
                last_ids.append(blocks[n_full].block_id)
                last_fill.append(n - n_full * bs)
    if ids:
        out[np.asarray(ids, dtype=np.int64)] = bs
    if last_ids:
        # A shared partial block may be seen by several requests: keep the largest count.
        np.maximum.at(out, np.asarray(last_ids, dtype=np.int64), np.asarray(last_fill, np.int32))
    out[0] = 0  # null block entries (released sliding-window positions) hold nothing
    return out


def check_manager_integrity(mgr: ManagerView) -> None:
    """Raise AssertionError on the first broken invariant."""
    pool = mgr.pool
    pool.check_integrity()
    refs = [0] * pool.num_blocks
    rids = set(mgr.managers[0].req_to_blocks)
    bs = mgr.block_size
    filled_tokens = mgr.num_filled_tokens
    for gid, m in enumerate(mgr.managers):
        if set(m.req_to_blocks) != rids or set(m.num_cached_blocks) != rids:
            raise AssertionError(f"group {gid}: request ids differ between groups")
        for rid, blocks in m.req_to_blocks.items():
            num_cached = m.num_cached_blocks[rid]
            if num_cached > len(blocks):
                raise AssertionError(f"{rid}: {num_cached} cached > {len(blocks)} blocks")
            for i, b in enumerate(blocks):
                if b is not pool.blocks[b.block_id]:
                    raise AssertionError(f"{rid}: foreign block object {b!r}")
                if b.is_null:
                    if isinstance(m.spec, FullAttentionSpec):
                        raise AssertionError(f"{rid}: null block in a full-attention table")
                    continue
                refs[b.block_id] += 1
                if b.ref_cnt == 0:
                    raise AssertionError(f"{rid}: holds free block {b!r}")
                if mgr.enable_caching and i < num_cached and b.block_hash is None:
                    raise AssertionError(f"{rid}: block {i} counted cached but has no hash")
            filled = filled_tokens.get(rid)
            if filled is None or filled > len(blocks) * bs:
                raise AssertionError(f"{rid}: fill {filled} exceeds {len(blocks)} blocks")
    for b in pool.blocks[1:]:
        if b.ref_cnt != refs[b.block_id]:
            raise AssertionError(f"{b!r}: ref_cnt != {refs[b.block_id]} holders")
    if set(filled_tokens) != rids:
        raise AssertionError("fill bookkeeping out of sync with held requests")
