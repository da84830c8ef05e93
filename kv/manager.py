"""The scheduler-facing KV cache manager. Call order, per request: ``check_admissible`` once,
``get_computed_blocks`` (the prefix hit) and ``allocate_slots(req, n, hit, hit_blocks)`` at
admission, ``allocate_slots(req, n)`` each later step (``None``: does not fit, nothing changed;
preempt or stop admitting), ``take_pending_copies()`` / ``take_block_replacements()`` /
``take_tier_copies()`` to ship after each step, and ``free(req)`` at the end or on preemption
(or ``swap_out(req)`` then ``swap_in(req, n)`` with a host tier)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import numpy as np

from pagedserve.kv.allocation import SlotAllocator
from pagedserve.kv.block_pool import BlockPool
from pagedserve.kv.capacity import AllocationPolicy, Capacity
from pagedserve.kv.errors import DoubleFreeError, InvalidArgumentError, UnknownRequestError
from pagedserve.kv.group_managers import (
    FullAttentionManager,
    KVCacheBlocks,
    SingleTypeManager,
    make_manager,
)
from pagedserve.kv.host_tier import HostTier, swap_in, swap_out
from pagedserve.kv.introspection import block_fill_snapshot, check_manager_integrity
from pagedserve.kv.prefix_hits import PrefixCacheStats, PrefixLookup
from pagedserve.kv.request import KVRequest
from pagedserve.kv.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

__all__ = ["AllocationPolicy", "KVCacheManager"]

# Ids of recently freed requests, so a second free is reported as a double free rather than an
# unknown id. Bounded: a long-running server must not grow this forever.
_FREED_MEMORY = 4096


class KVCacheManager:
    """Allocates KV blocks for requests across one or more KV groups sharing one pool.

    Args:
        group_specs: one spec per KV group (group id = position). None: one full-attention group.
        num_blocks: physical blocks in the pool, the null block (id 0) included.
        block_size: tokens per physical block.
        max_model_len: longest request (prompt + output) in tokens.
        enable_caching: automatic prefix caching on/off.
        policy: ``"paged"`` allocates blocks on demand; ``"reserve"`` holds
            ``ceil(max_model_len / B)`` blocks per group from admission: the contiguous
            pre-allocation baseline that the memory experiments compare against.
        reserve_tokens: with ``policy="reserve"``, the tokens to reserve for a request at its
            admission (capped at ``max_model_len``; None: ``max_model_len``); growth past it is
            on demand. ``check_admissible`` assumes the ``max_model_len`` reservation.
        virtual_block_factor: decode-context-parallel size. Each rank stores ``block_size``
            tokens of a block whose tokens are interleaved over the ranks, so the manager sees
            blocks of ``block_size * virtual_block_factor`` tokens (``self.block_size``). Block
            ids are the same on every rank. Only a multiplier here; the workers do the rest.
        num_host_blocks: blocks of the host tier (its null block included); 0: no tier.
        offload: with a host tier and one full-attention group, keep evicted cached device
            blocks in the host tier, where prefix lookups continue.
    """

    def __init__(
        self,
        group_specs: Sequence[KVCacheSpec] | None,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        policy: AllocationPolicy = "paged",
        virtual_block_factor: int = 1,
        reserve_tokens: Callable[[KVRequest], int] | None = None,
        num_host_blocks: int = 0,
        offload: bool = True,
    ) -> None:
        if block_size <= 0 or max_model_len <= 0 or virtual_block_factor <= 0:
            raise InvalidArgumentError("block_size, max_model_len, virtual_block_factor must be >0")
        if group_specs is None:
            group_specs = [FullAttentionSpec(block_size, 1, 1, 1)]
        if not group_specs:
            raise InvalidArgumentError("at least one KV group is required")
        for spec in group_specs:
            if spec.block_size != block_size:
                raise InvalidArgumentError(
                    f"spec block_size {spec.block_size} != manager block_size {block_size}"
                )
            if isinstance(spec, SlidingWindowSpec) and virtual_block_factor != 1:
                raise InvalidArgumentError("sliding-window groups do not support DCP")
        self.block_size = block_size * virtual_block_factor
        self.physical_block_size = block_size
        self.virtual_block_factor = virtual_block_factor
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.group_specs = tuple(group_specs)
        self.pool = BlockPool(num_blocks, enable_caching)
        self.capacity = Capacity(
            policy, self.group_specs, self.block_size, max_model_len,
            self.pool.num_usable_blocks, reserve_tokens,
        )
        self.managers: list[SingleTypeManager] = [
            make_manager(spec, self.block_size, gid, self.pool)
            for gid, spec in enumerate(self.group_specs)
        ]
        single_full = len(self.managers) == 1 and isinstance(
            self.managers[0], FullAttentionManager
        )
        self._fast_path = single_full and policy == "paged"
        self._group0_blocks = self.managers[0].req_to_blocks
        self._group0_cached = self.managers[0].num_cached_blocks
        # Tokens each request will have written once the current step runs (for fill snapshots).
        self._num_filled: dict[str, int] = {}
        self._freed_ids: dict[str, None] = {}
        self._empty = KVCacheBlocks(tuple([] for _ in self.managers))
        self.host: HostTier | None = None
        if num_host_blocks:
            # Host prefix hits continue a full-attention chain only (a sliding-window hit is
            # not downward closed), so other layouts use the tier for swapping alone.
            self.host = host = HostTier(num_host_blocks, offload and single_full)
            if host.offload_enabled and enable_caching:
                device_cached = self.pool.cached
                self.pool.on_evict = lambda b: host.offload(b, device_cached)
        self.prefix = PrefixLookup(
            self.managers, self.host, self.block_size, enable_caching, single_full
        )
        self.allocator = SlotAllocator(
            self.pool, self.managers, self.host, self.block_size, max_model_len,
            enable_caching, self.capacity.reservation_tokens,
        )

    # ------------------------------------------------------------------ queries
    @property
    def policy(self) -> AllocationPolicy:
        return self.capacity.policy

    def reservation_tokens(self, request: KVRequest) -> int:
        """See :meth:`Capacity.reservation_tokens`."""
        return self.capacity.reservation_tokens(request)

    def check_admissible(self, num_tokens_total: int) -> None:
        """See :meth:`Capacity.check_admissible`: the scheduler calls it at admission rather
        than letting a request that can never fit wait forever."""
        self.capacity.check_admissible(num_tokens_total)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.prefix.stats

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (null block excluded; free cached blocks are free)."""
        return self.pool.usage

    @property
    def num_filled_tokens(self) -> Mapping[str, int]:
        """Read-only: tokens each held request will have written once the current step runs."""
        return MappingProxyType(self._num_filled)

    def has_request(self, request_id: str) -> bool:
        """The request holds blocks, on the device or swapped out to the host tier."""
        return request_id in self.managers[0].req_to_blocks or self.is_swapped(request_id)

    def is_swapped(self, request_id: str) -> bool:
        return self.host is not None and request_id in self.host.swapped

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group (0 marks a released sliding-window position)."""
        if request_id not in self.managers[0].req_to_blocks:
            raise UnknownRequestError(request_id)
        return tuple([b.block_id for b in m.req_to_blocks[request_id]] for m in self.managers)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write block copies ``(src_block_id, dst_block_id)`` since the last call,
        which workers run before the step's forward pass (another sharer may write src)."""
        alloc = self.allocator
        out, alloc.pending_copies = alloc.pending_copies, []
        return out

    def take_block_replacements(self) -> list[tuple[str, int, int, int]]:
        """Copy-on-write table edits ``(request_id, group_id, block_index, new_block_id)``:
        the writer of a shared block gets a private copy at the same index (the one exception
        to append-only tables besides :meth:`trim`). Taken with :meth:`take_pending_copies`."""
        alloc = self.allocator
        out, alloc.replacements = alloc.replacements, []
        return out

    def take_tier_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Host-tier copies since the last call: ``(device -> host, host -> device)`` block-id
        pairs. Workers run the first list, then the second, before this step's copy-on-write
        copies and forward pass. Ship them with a step that runs: until taken, their host
        blocks stay referenced."""
        if self.host is None:
            return [], []
        return self.host.take_copies()

    # ------------------------------------------------------------ prefix hits
    def get_computed_blocks(self, request: KVRequest) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of a new request: (blocks per group, hit tokens).

        The hit is block aligned and at most ``num_tokens - 1`` (one token must be computed to
        produce logits). With several group kinds it is the longest length every kind accepts
        (see :func:`pagedserve.kv.prefix_hits.find_common_hit`). Nothing is referenced here;
        ``allocate_slots`` takes the references, so call it right after, before any other
        allocation can evict the hit blocks.
        """
        return self.prefix.find(request)

    # --------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens and ``num_lookahead_tokens`` slots.

        ``num_new_computed_tokens``/``new_computed_blocks`` are the prefix hit of a new request
        from :meth:`get_computed_blocks`. Lookahead slots (speculative decoding's drafts, capped
        at ``max_model_len``) get blocks that are never hashed and hold nothing yet; a later
        step re-uses them. Returns the newly allocated blocks per group, or ``None`` with **no
        state changed** if they do not fit. Touching a free cached hit block takes it out of
        the free queue, so it counts against the free blocks like a new one. Full blocks among
        the first ``min(computed + new, num_tokens)`` tokens are registered in the prefix
        cache. A write into a block shared by :meth:`fork` (lookahead slots included) first
        gives the writer a private copy (see :meth:`take_pending_copies`).

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
            # Hot path (every running request, every step), inlined here because it runs ~256
            # times per step: one full-attention group, paged policy, a request already holding
            # blocks. Anything unusual (new request, copy-on-write, too long, a negative or
            # capped lookahead) falls through to the allocator.
            rid = request.request_id
            blocks = self._group0_blocks.get(rid)
            if blocks is not None:
                bs = self.block_size
                computed = request.num_computed_tokens
                end = computed + num_new_tokens
                slots = end + num_lookahead_tokens
                n_have = len(blocks)
                need = -(-slots // bs)
                # Written blocks are [computed // bs, need), usually just one; a shared
                # (forked) one needs copy-on-write, which the general path does.
                i = computed // bs
                stop = need if need < n_have else n_have
                while i < stop and blocks[i].ref_cnt == 1:
                    i += 1
                if i >= stop and slots <= self.max_model_len and num_lookahead_tokens >= 0:
                    n_new = need - n_have
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
        out = self.allocator.allocate(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
            num_lookahead_tokens,
        )
        if out is not None:
            end = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
            self._num_filled[request.request_id] = end
            self._freed_ids.pop(request.request_id, None)
        return out

    # ------------------------------------------------------------ release etc.
    def free(self, request: KVRequest | str) -> None:
        """Release every block of the request, tail-first (longest prefix evicted first).

        Used on finish, abort and preemption. Raises DoubleFreeError for a request freed
        moments ago, UnknownRequestError for an id that holds no blocks.
        """
        rid = request if isinstance(request, str) else request.request_id
        if self.host is not None and rid in self.host.swapped:
            self.host.free(rid)
        elif rid in self.managers[0].req_to_blocks:
            for m in self.managers:
                m.free(rid)
        elif rid in self._freed_ids:
            raise DoubleFreeError(f"request {rid!r} was already freed")
        else:
            raise UnknownRequestError(rid)
        self._num_filled.pop(rid, None)
        self._freed_ids[rid] = None
        if len(self._freed_ids) > _FREED_MEMORY:
            del self._freed_ids[next(iter(self._freed_ids))]

    def trim(self, request: KVRequest) -> int | None:
        """Give back the blocks past the request's tokens (slots only rejected drafts filled).
        Returns the blocks per group it keeps, or None when none went back. ``reserve`` holds
        max_model_len's blocks from admission by design, so it never trims."""
        rid = request.request_id
        keep = -(-request.num_tokens // self.block_size)
        held = self.managers[0].req_to_blocks.get(rid)
        if self.policy == "reserve" or held is None or len(held) <= keep:
            return None
        for m in self.managers:
            m.trim(rid, keep)
        self._num_filled[rid] = min(self._num_filled.get(rid, 0), request.num_computed_tokens)
        return keep

    def swap_out(self, request: KVRequest) -> bool:
        """Preempt by swapping: the request's computed blocks are copied to the host tier (see
        :meth:`take_tier_copies`) and its device blocks freed. False, with nothing changed,
        without a host tier or when it is too full: preempt by recompute (:meth:`free`)."""
        if self.host is None:
            return False
        if not swap_out(self.managers, self.host, request, self.block_size):
            return False
        self._num_filled.pop(request.request_id, None)
        return True

    def swap_in(self, request: KVRequest, num_new_tokens: int) -> KVCacheBlocks | None:
        """Resume a swapped request with room for ``num_new_tokens`` more tokens: every block
        of the request (its computed blocks come back from the host tier). None, with nothing
        changed, if it does not fit. UnknownRequestError if it is not swapped out."""
        if self.host is None:
            raise UnknownRequestError(f"request {request.request_id!r} is not swapped out")
        out = swap_in(self.managers, self.pool, self.host, request, num_new_tokens,
                      self.block_size, self.max_model_len, self.capacity.reservation_tokens)
        if out is not None:
            self._num_filled[request.request_id] = request.num_computed_tokens + num_new_tokens
            self._freed_ids.pop(request.request_id, None)
        return out

    def fork(self, parent: KVRequest | str, child: KVRequest | str) -> None:
        """Let ``child`` share every block of ``parent`` (parallel sampling / beam search).

        Ref counts go up; nothing is copied now. The first write into a block that is still
        shared (normally the partial last block) copies it for the writer (copy-on-write).
        The caller gives the child the same token ids and block hashes as the parent.
        """
        pid = parent if isinstance(parent, str) else parent.request_id
        cid = child if isinstance(child, str) else child.request_id
        if pid not in self.managers[0].req_to_blocks:
            raise UnknownRequestError(pid)
        if cid in self.managers[0].req_to_blocks:
            raise InvalidArgumentError(f"fork target {cid!r} already holds blocks")
        for m in self.managers:
            m.fork(pid, cid)
        self._num_filled[cid] = self._num_filled[pid]
        self._freed_ids.pop(cid, None)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash (e.g. after a weight update). Returns False and changes
        nothing while any request holds blocks: free or preempt them first."""
        if self.host is not None and self.host.pool.num_free_blocks != self.host.num_usable_blocks:
            return False
        if not self.pool.reset_prefix_cache():
            return False
        if self.host is not None:
            self.host.reset_prefix_cache()
        self.prefix.stats = PrefixCacheStats()
        return True

    # -------------------------------------------------------------- inspection
    def block_fill_snapshot(self) -> np.ndarray:
        """Tokens each block holds for running requests (int32, length num_blocks; a shared
        block counts once; free blocks, lookahead slots and the null block read 0). O(blocks
        held) with one numpy scatter: cheap enough for every step."""
        return block_fill_snapshot(self)

    def check_integrity(self) -> None:
        """Verify pool invariants plus: every block's ref count equals the number of request
        lists that hold it, and per-request bookkeeping is consistent."""
        check_manager_integrity(self)
