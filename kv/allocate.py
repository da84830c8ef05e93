"""``KVCacheManager.allocate_slots``: the per-step decode fast path, inlined, and the general
path (plan with :mod:`pagedserve.kv.allocation`, then apply). A mixin of the manager, which owns
the state it reads and writes."""

from __future__ import annotations

from pagedserve.kv.allocation import AllocationPlan, plan_allocation
from pagedserve.kv.base import KVRequest
from pagedserve.kv.block import KVBlock
from pagedserve.kv.block_pool import BlockPool
from pagedserve.kv.host_tier import HostTier
from pagedserve.kv.kv_blocks import KVCacheBlocks
from pagedserve.kv.single_type import SingleTypeManager

__all__ = ["AllocationMixin"]


class AllocationMixin:
    block_size: int
    max_model_len: int
    enable_caching: bool
    pool: BlockPool
    managers: list[SingleTypeManager]
    host: HostTier | None
    _fast_path: bool
    _group0_blocks: dict[str, list[KVBlock]]
    _group0_cached: dict[str, int]
    _num_filled: dict[str, int]
    _freed_ids: dict[str, None]
    _pending_copies: list[tuple[int, int]]
    _replacements: list[tuple[str, int, int, int]]
    _empty: KVCacheBlocks

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens.

        ``num_new_computed_tokens``/``new_computed_blocks`` are the prefix hit of a new request
        from :meth:`get_computed_blocks`. Returns the newly allocated blocks per group, or
        ``None`` with **no state changed** if they do not fit. Touching a free cached hit block
        takes it out of the free queue, so it counts against the free blocks like a new one.
        Full blocks among the first ``min(computed + new, num_tokens)`` tokens are registered
        in the prefix cache. A write into a block shared by :meth:`fork` first gives the
        writer a private copy (see :meth:`take_pending_copies`).

        Raises:
            InvalidArgumentError: ``num_new_tokens <= 0``, a negative count, tokens beyond
                ``max_model_len``, or hit blocks that are stale, mismatched or given for a
                request that already holds blocks. Raised before any change.
        """
        if (
            self._fast_path
            and new_computed_blocks is None
            and num_new_computed_tokens == 0
            and num_new_tokens > 0
        ):
            # Hot path (every running request, every step), inlined because it runs ~256 times
            # per step: one full-attention group, paged policy, a request already holding
            # blocks. Anything unusual (new request, copy-on-write, too long) falls through.
            rid = request.request_id
            blocks = self._group0_blocks.get(rid)
            if blocks is not None:
                bs = self.block_size
                computed = request.num_computed_tokens
                end = computed + num_new_tokens
                n_have = len(blocks)
                # Written blocks are [computed // bs, ceil(end / bs)), usually just one; a
                # shared (forked) one needs copy-on-write, which the general path does.
                i = computed // bs
                stop = -(-end // bs)
                if stop > n_have:
                    stop = n_have
                while i < stop and blocks[i].ref_cnt == 1:
                    i += 1
                if i >= stop and end <= self.max_model_len:
                    n_new = -(-end // bs) - n_have
                    result = self._empty
                    if n_new > 0:
                        pool = self.pool
                        if n_new > pool.free_block_queue.num_free_blocks:
                            return None
                        new = pool.get_new_blocks(n_new)
                        blocks.extend(new)
                        result = KVCacheBlocks((new,))
                    if self.enable_caching:
                        # Register blocks that became full; compared with `end` first so the
                        # common "no block completed" case costs one dict lookup.
                        num_cached = self._group0_cached[rid]
                        if end // bs > num_cached:
                            num_tokens = request.num_tokens
                            num_full = (end if end < num_tokens else num_tokens) // bs
                            if num_full > num_cached:
                                self.managers[0].cache_blocks(
                                    rid, request.block_hashes, num_full * bs
                                )
                    self._num_filled[rid] = end
                    return result
        plan = plan_allocation(
            self, request, num_new_tokens, num_new_computed_tokens, new_computed_blocks
        )
        return None if plan is None else self._apply(request, plan)

    def _apply(self, request: KVRequest, plan: AllocationPlan) -> KVCacheBlocks:
        """Carry out a plan that fits. Out-of-window blocks are released and hit blocks
        referenced before any new block is popped, so popping never evicts a block about to
        be re-used."""
        rid = request.request_id
        if plan.is_new:
            self._freed_ids.pop(rid, None)
            for m, hit in zip(self.managers, plan.hits, strict=True):
                self.pool.touch(hit)
                m.add_request(rid, hit)
            if plan.host_hits:
                # Referenced before any device block is popped: an offload triggered by the
                # pops below takes host blocks, and must not take these.
                assert self.host is not None
                self.host.hold(plan.host_hits)
                m0 = self.managers[0]
                restored = m0.grow(rid, len(plan.hits[0]) + len(plan.host_hits))
                self.host.restore(plan.host_hits, restored)
        else:
            for m in self.managers:
                m.remove_skipped_blocks(rid, request.num_computed_tokens)
        new_per_group: list[list[KVBlock]] = []
        for m, copies in zip(self.managers, plan.copies, strict=True):
            for i, src, dst in m.copy_shared_blocks(rid, copies):
                self._pending_copies.append((src, dst))
                self._replacements.append((rid, m.group_id, i, dst))
            new_per_group.append(m.grow(rid, plan.num_blocks))
            if self.enable_caching:
                m.cache_blocks(rid, request.block_hashes, min(plan.end, request.num_tokens))
        self._num_filled[rid] = plan.end
        return KVCacheBlocks(tuple(new_per_group))

