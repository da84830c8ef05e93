"""The scheduler-facing KV cache manager. Call order, per request: ``check_admissible`` once,
``get_computed_blocks`` (the prefix hit) and ``allocate_slots(req, n, hit, hit_blocks)`` at
admission, ``allocate_slots(req, n)`` each later step (``None``: does not fit, nothing changed;
preempt or stop admitting), ``take_pending_copies()`` / ``take_block_replacements()`` /
``take_tier_copies()`` to ship after each step, and ``free(req)`` at the end or on preemption
(or ``swap_out(req)`` then ``swap_in(req, n)`` with a host tier)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Literal

import numpy as np

from pagedserve.kv.allocate import AllocationMixin
from pagedserve.kv.base import KVRequest
from pagedserve.kv.block import KVBlock
from pagedserve.kv.block_pool import BlockPool
from pagedserve.kv.capacity import CapacityMixin
from pagedserve.kv.coordinator import find_common_hit
from pagedserve.kv.errors import DoubleFreeError, InvalidArgumentError, UnknownRequestError
from pagedserve.kv.host_tier import HostTier
from pagedserve.kv.introspection import block_fill_snapshot, check_manager_integrity
from pagedserve.kv.kv_blocks import KVCacheBlocks, PrefixCacheStats
from pagedserve.kv.single_type import FullAttentionManager, SingleTypeManager, make_manager
from pagedserve.kv.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from pagedserve.kv.swap import swap_in, swap_out

__all__ = ["AllocationPolicy", "KVCacheManager"]

AllocationPolicy = Literal["paged", "reserve"]

# Ids of recently freed requests, so a second free is reported as a double free rather than an
# unknown id. Bounded: a long-running server must not grow this forever.
_FREED_MEMORY = 4096


class KVCacheManager(AllocationMixin, CapacityMixin):
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
        if policy not in ("paged", "reserve"):
            raise InvalidArgumentError(f"unknown allocation policy {policy!r}")
        if reserve_tokens is not None and policy != "reserve":
            raise InvalidArgumentError("reserve_tokens needs policy='reserve'")
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
        self.policy: AllocationPolicy = policy
        self.group_specs = tuple(group_specs)
        self.pool = BlockPool(num_blocks, enable_caching)
        self.managers: list[SingleTypeManager] = [
            make_manager(spec, self.block_size, gid, self.pool)
            for gid, spec in enumerate(self.group_specs)
        ]
        # Groups with equal specs are looked up together (a hit must exist in all of them);
        # full attention first, since its hit is downward closed and needs one lookup only.
        kinds: dict[KVCacheSpec, list[int]] = {}
        for gid, spec in enumerate(self.group_specs):
            kinds.setdefault(spec, []).append(gid)
        self._kinds = sorted(kinds.items(), key=lambda kv: not isinstance(kv[0], FullAttentionSpec))
        self._single_full = len(self.managers) == 1 and isinstance(
            self.managers[0], FullAttentionManager
        )
        self._fast_path = self._single_full and policy == "paged"
        self._group0_blocks = self.managers[0].req_to_blocks
        self._group0_cached = self.managers[0].num_cached_blocks
        self._reserve_blocks = -(-max_model_len // self.block_size)
        self._reserve_tokens = reserve_tokens
        self.prefix_cache_stats = PrefixCacheStats()
        # Tokens each request will have written once the current step runs (for fill snapshots).
        self._num_filled: dict[str, int] = {}
        self._freed_ids: dict[str, None] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self._replacements: list[tuple[str, int, int, int]] = []
        self._empty = KVCacheBlocks(tuple([] for _ in self.managers))
        self.host: HostTier | None = None
        if num_host_blocks:
            # Host prefix hits continue a full-attention chain only (a sliding-window hit is
            # not downward closed), so other layouts use the tier for swapping alone.
            self.host = host = HostTier(num_host_blocks, offload and self._single_full)
            if host.offload_enabled and enable_caching:
                device_cached = self.pool.cached
                self.pool.on_evict = lambda b: host.offload(b, device_cached)

    # ------------------------------------------------------------------ queries
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

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        if request_id not in self.managers[0].req_to_blocks:
            raise UnknownRequestError(request_id)
        return KVCacheBlocks(tuple(list(m.req_to_blocks[request_id]) for m in self.managers))

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write block copies ``(src_block_id, dst_block_id)`` since the last call.

        Workers copy block src to dst in every layer's KV tensor before this step's forward
        pass (another sharer may write into src in the same step).
        """
        out, self._pending_copies = self._pending_copies, []
        return out

    def take_block_replacements(self) -> list[tuple[str, int, int, int]]:
        """Copy-on-write table edits ``(request_id, group_id, block_index, new_block_id)``.

        The one exception to append-only block tables: the writer of a shared block gets a
        private copy at the same index. Taken together with :meth:`take_pending_copies`.
        """
        out, self._replacements = self._replacements, []
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
        (see :func:`pagedserve.kv.coordinator.find_common_hit`). Nothing is referenced here;
        ``allocate_slots`` takes the references, so call it right after, before any other
        allocation can evict the hit blocks.
        """
        if not self.enable_caching:
            return self._empty, 0
        num_tokens = request.num_tokens
        hashes = request.block_hashes
        max_blocks = min(len(hashes), (num_tokens - 1) // self.block_size) if num_tokens else 0
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += num_tokens
        if max_blocks <= 0:
            return self._empty, 0
        host: list[KVBlock] = []
        if self._single_full:
            blocks = self.managers[0].find_longest_cache_hit(hashes, max_blocks, (0,))[0]
            per_group, hit = [blocks], len(blocks)
            if self.host is not None and hit < max_blocks:
                # The chain may go on in the host tier, among evicted blocks kept there.
                host = self.host.find_hit(hashes, hit, max_blocks)
                hit += len(host)
        else:
            per_group, hit = find_common_hit(self.managers, self._kinds, hashes, max_blocks)
        stats.hits += hit * self.block_size
        stats.host_hits += len(host) * self.block_size
        return KVCacheBlocks(tuple(per_group), host), hit * self.block_size

    # ------------------------------------------------------------ release etc.
    def free(self, request: KVRequest | str) -> None:
        """Release every block of the request, tail-first (longest prefix evicted first).

        Used on finish, abort and preemption. Raises DoubleFreeError for a request freed
        moments ago, UnknownRequestError for an id that holds no blocks.
        """
        rid = request if isinstance(request, str) else request.request_id
        if self.host is not None and rid in self.host.swapped:
            self.host.free(rid)
            self._forget(rid)
            return
        if rid not in self.managers[0].req_to_blocks:
            if rid in self._freed_ids:
                raise DoubleFreeError(f"request {rid!r} was already freed")
            raise UnknownRequestError(rid)
        for m in self.managers:
            m.free(rid)
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        self._num_filled.pop(rid, None)
        self._freed_ids[rid] = None
        if len(self._freed_ids) > _FREED_MEMORY:
            del self._freed_ids[next(iter(self._freed_ids))]

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
        end = request.num_computed_tokens + num_new_tokens
        if end > self.max_model_len:
            raise InvalidArgumentError(f"{end} tokens exceed max_model_len={self.max_model_len}")
        slots = max(end, self.reservation_tokens(request))
        target = -(-slots // self.block_size)
        out = swap_in(self.managers, self.pool, self.host, request, num_new_tokens,
                      self.block_size, target, end)
        if out is not None:
            self._num_filled[request.request_id] = end
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
        self.prefix_cache_stats = PrefixCacheStats()
        return True

    # -------------------------------------------------------------- inspection
    def block_fill_snapshot(self) -> np.ndarray:
        """Tokens each block holds for running requests (int32, length num_blocks).

        A block shared by several requests counts once. Free (even cached) blocks and the null
        block read 0. O(blocks held) with one numpy scatter: cheap enough for every step.
        """
        return block_fill_snapshot(self)

    def check_integrity(self) -> None:
        """Verify pool invariants plus: every block's ref count equals the number of request
        lists that hold it, and per-request bookkeeping is consistent."""
        check_manager_integrity(self)
