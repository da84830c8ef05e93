"""Read-only views of a KVCacheManager, through its public accessors: the integrity checks
(every invariant of both tiers, which the tests assert after each operation) and block-fill
snapshots."""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedserve.kv.specs import FullAttentionSpec

# A KVCacheManager, by duck typing: the manager imports this module, so it is not imported here.
KVCacheManager = Any

__all__ = ["block_fill_snapshot", "check_manager_integrity"]


def block_fill_snapshot(mgr: KVCacheManager) -> np.ndarray:
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


def check_manager_integrity(mgr: KVCacheManager) -> None:
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
    if mgr.host is not None:
        check_host_integrity(mgr, rids)


def check_host_integrity(mgr: KVCacheManager, device_rids: set[str]) -> None:
    """Host-tier invariants: every host block is free, held by one swapped request's list, or
    held by this step's pending copies, and its ref count says exactly how many of those; a
    request is on the device or swapped, never both; a hash is cached once on the host and
    only by offloaded blocks; every pending copy's host block is held."""
    tier = mgr.host
    hp = tier.pool
    hp.check_integrity()
    swapped = set(tier.swapped)
    if swapped & device_rids:
        raise AssertionError(f"requests both on the device and swapped: {swapped & device_rids}")
    if set(tier.num_computed) != swapped:
        raise AssertionError("swapped requests' computed counts out of sync")
    refs = [0] * hp.num_blocks
    for rid, groups in tier.swapped.items():
        if len(groups) != mgr.num_groups:
            raise AssertionError(f"{rid}: swapped with {len(groups)} groups")
        for group in groups:
            for b in group:
                if b is not hp.blocks[b.block_id]:
                    raise AssertionError(f"{rid}: foreign host block {b!r}")
                if b.is_null:
                    continue
                refs[b.block_id] += 1
                if b.block_hash is not None:
                    raise AssertionError(f"{rid}: swapped host block {b!r} carries a hash")
    held = set()
    for b in tier.held_blocks:
        refs[b.block_id] += 1
        held.add(b.block_id)
    for b in hp.blocks[1:]:
        if b.ref_cnt != refs[b.block_id]:
            raise AssertionError(f"host {b!r}: ref_cnt != {refs[b.block_id]} holders")
    for key, entry in hp.cached.items():
        if not isinstance(entry, type(hp.null_block)):
            raise AssertionError(f"host caches hash {key.hex()[:8]} more than once")
    to_host, to_device = tier.pending
    dsts = [d for _, d in to_host]
    if len(set(dsts)) != len(dsts):
        raise AssertionError("two pending copies write the same host block")
    if not set(dsts) <= held or not {s for s, _ in to_device} <= held:
        raise AssertionError("a pending copy's host block is not held")
    dev_dsts = [d for _, d in to_device]
    if len(set(dev_dsts)) != len(dev_dsts) or 0 in dev_dsts:
        raise AssertionError("pending host -> device copies write a block twice or the null")
    if any(mgr.pool.blocks[d].ref_cnt == 0 for d in dev_dsts):
        # A block is never freed in the step that allocated it (before that step ran).
        raise AssertionError("a pending host -> device copy writes a free device block")
    if mgr.pool.on_evict is not None and not tier.offload_enabled:
        raise AssertionError("device evictions offload while the host prefix tier is off")
