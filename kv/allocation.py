"""The general ``allocate_slots`` path: new requests, prefix hits, several groups, the
reserve policy, sliding windows and copy-on-write. (The per-step decode fast path stays in
``manager.py``.) A friend module of :class:`KVCacheManager`: it reads and writes its state.

Transactional: everything this call would consume is counted first, read-only; only if it fits
is anything changed. Consumption = new blocks + free cached hit blocks that touching takes out
of the free queue + private copies for shared blocks being written; released out-of-window
blocks are credited.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.kv.base import KVRequest
from pagedserve.kv.block import KVBlock
from pagedserve.kv.errors import InvalidArgumentError
from pagedserve.kv.kv_blocks import KVCacheBlocks

if TYPE_CHECKING:
    from pagedserve.kv.manager import KVCacheManager

__all__ = ["allocate_general"]


def allocate_general(
    mgr: KVCacheManager,
    request: KVRequest,
    computed: int,
    end: int,
    num_new_computed_tokens: int,
    new_computed_blocks: KVCacheBlocks | None,
    lookahead: int,
) -> KVCacheBlocks | None:
    rid = request.request_id
    bs = mgr.block_size
    managers = mgr.managers
    existing = [m.req_to_blocks.get(rid) for m in managers]
    is_new = existing[0] is None
    hits = _validate_hits(mgr, request, is_new, num_new_computed_tokens, new_computed_blocks)
    need_slot = min(end + lookahead, mgr.max_model_len)
    if mgr.policy == "reserve" and is_new:
        # The whole reservation at admission; afterwards only growth past it allocates.
        need_slot = max(need_slot, mgr.reservation_tokens(request))
    target = -(-need_slot // bs)
    prev_computed = request.num_computed_tokens

    # Plan (read-only): count what this call would consume and release.
    needed = 0
    credit = 0
    cow_plan: list[list[int]] = []
    for m, blocks, hit in zip(managers, existing, hits, strict=True):
        have = len(blocks) if blocks is not None else 0
        needed += max(0, target - have - len(hit))
        needed += sum(1 for b in hit if b.ref_cnt == 0 and not b.is_null)
        cow: list[int] = []
        if blocks:
            for i in range(computed // bs, min(have, -(-end // bs))):
                b = blocks[i]
                if b.ref_cnt > 1 and not b.is_null:
                    cow.append(i)
            credit += m.num_freeable_skipped_blocks(rid, prev_computed)
        needed += len(cow)
        cow_plan.append(cow)
    pool = mgr.pool
    if needed > pool.num_free_blocks + credit:
        return None

    # Commit. Release out-of-window blocks, then take references on hits before any new
    # block is popped, so get_new_blocks can never evict a block we are about to re-use.
    if not is_new:
        for m in managers:
            m.remove_skipped_blocks(rid, prev_computed)
    if mgr.enable_caching:
        for hit in hits:
            pool.touch(hit)
    if is_new:
        mgr._freed_ids.pop(rid, None)
        for m, hit in zip(managers, hits, strict=True):
            m.req_to_blocks[rid] = list(hit)
            m.num_cached_blocks[rid] = len(hit)
    new_per_group: list[list[KVBlock]] = []
    for gid, (m, cow) in enumerate(zip(managers, cow_plan, strict=True)):
        blocks = m.req_to_blocks[rid]
        for i in cow:
            src = blocks[i]
            dst = pool.get_new_blocks(1)[0]
            src.ref_cnt -= 1  # still >= 1: the other sharers keep it
            blocks[i] = dst
            mgr._pending_copies.append((src.block_id, dst.block_id))
            mgr._replacements.append((rid, gid, i, dst.block_id))
        n = target - len(blocks)
        new = pool.get_new_blocks(n) if n > 0 else []
        blocks.extend(new)
        new_per_group.append(new)
        if mgr.enable_caching:
            m.cache_blocks(rid, request.block_hashes, min(end, request.num_tokens))
    mgr._num_filled[rid] = end
    return KVCacheBlocks(tuple(new_per_group))


def _validate_hits(
    mgr: KVCacheManager,
    request: KVRequest,
    is_new: bool,
    num_new_computed_tokens: int,
    hit_blocks: KVCacheBlocks | None,
) -> tuple[list[KVBlock], ...]:
    if hit_blocks is None or not hit_blocks:
        if num_new_computed_tokens:
            raise InvalidArgumentError("num_new_computed_tokens > 0 without hit blocks")
        return mgr._empty.blocks
    if not is_new:
        raise InvalidArgumentError("prefix-hit blocks are only accepted for a new request")
    if not mgr.enable_caching:
        raise InvalidArgumentError("prefix-hit blocks given but prefix caching is disabled")
    if len(hit_blocks.blocks) != len(mgr.managers):
        raise InvalidArgumentError("hit blocks must have one list per KV group")
    hashes = request.block_hashes
    for gid, hit in enumerate(hit_blocks.blocks):
        if len(hit) * mgr.block_size != num_new_computed_tokens:
            raise InvalidArgumentError("hit blocks do not match num_new_computed_tokens")
        # A hit found earlier may have been evicted and re-used since: refuse to share a
        # block whose contents are no longer this prefix.
        for i, b in enumerate(hit):
            key = b.block_hash
            if not b.is_null and (
                key is None
                or i >= len(hashes)
                or key[:-4] != hashes[i]
                or int.from_bytes(key[-4:], "big") != gid
            ):
                raise InvalidArgumentError(f"stale prefix hit: block {b.block_id} re-used")
    return hit_blocks.blocks
