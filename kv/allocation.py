"""The general ``allocate_slots`` path: new requests, prefix hits (device and host tier),
several groups, the reserve policy, sliding windows, copy-on-write and lookahead slots. (The
per-step decode fast path is inlined in ``KVCacheManager.allocate_slots``, which falls back
to :meth:`SlotAllocator.allocate` for anything it does not handle.)

Transactional: :meth:`SlotAllocator.plan` only reads, and counts everything the call would
consume; the plan is applied only if it fits. Consumption = new blocks + free cached hit
blocks that touching takes out of the free queue + private copies for shared blocks being
written; released out-of-window blocks are credited.

Lookahead slots (speculative decoding) are blocks for ``num_lookahead_tokens`` positions past
the request's real tokens. They are allocated and made private like written slots, but never
hashed or cached: only full blocks among the first ``min(end, num_tokens)`` tokens are
registered, and a request's block hashes only cover tokens it really has.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedserve.kv.block_pool import BlockPool, KVBlock
from pagedserve.kv.errors import InvalidArgumentError
from pagedserve.kv.group_managers import KVCacheBlocks, SingleTypeManager
from pagedserve.kv.host_tier import HostTier
from pagedserve.kv.request import KVRequest

__all__ = ["AllocationPlan", "SlotAllocator"]


@dataclass(frozen=True, slots=True)
class AllocationPlan:
    """What one ``allocate_slots`` call does, per KV group, once it is known to fit."""

    is_new: bool  # the request holds no blocks yet
    hits: tuple[list[KVBlock], ...]  # validated prefix-hit blocks (empty unless is_new)
    host_hits: list[KVBlock]  # the hit's continuation in the host tier (group 0), copied back
    copies: tuple[list[int], ...]  # indices of shared blocks to copy before writing
    num_blocks: int  # blocks each group holds afterwards (lookahead slots included)
    end: int  # tokens written once the step runs (lookahead slots excluded)


class SlotAllocator:
    """Plans and applies the general path, and owns the copy-on-write edits it makes.

    Args:
        pool: the device pool the groups share.
        managers: the per-group managers, group id = position.
        host: the host tier, or None.
        block_size: the manager's (virtual) block size.
        max_model_len: longest request in tokens.
        enable_caching: register full blocks in the prefix cache.
        reservation_tokens: tokens the policy reserves for a new request (0: none).
    """

    def __init__(
        self,
        pool: BlockPool,
        managers: Sequence[SingleTypeManager],
        host: HostTier | None,
        block_size: int,
        max_model_len: int,
        enable_caching: bool,
        reservation_tokens: Callable[[KVRequest], int],
    ) -> None:
        self.pool = pool
        self.managers = managers
        self.host = host
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.reservation_tokens = reservation_tokens
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block ids
        self.replacements: list[tuple[str, int, int, int]] = []  # (rid, group, index, new id)

    def allocate(
        self,
        request: KVRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_lookahead_tokens: int,
    ) -> KVCacheBlocks | None:
        """``KVCacheManager.allocate_slots`` (same arguments) but for the fill bookkeeping,
        which the manager keeps. None, with nothing changed, if it does not fit."""
        plan = self.plan(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
            num_lookahead_tokens,
        )
        return None if plan is None else self._apply(request, plan)

    # ------------------------------------------------------------------ planning
    def plan(
        self,
        request: KVRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_lookahead_tokens: int,
    ) -> AllocationPlan | None:
        """The plan for these arguments, or None if it does not fit. Raises
        InvalidArgumentError for bad arguments. Changes nothing."""
        if num_new_tokens <= 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise InvalidArgumentError(
                f"need num_new_tokens > 0, num_new_computed_tokens >= 0 and "
                f"num_lookahead_tokens >= 0, got {num_new_tokens}, {num_new_computed_tokens}, "
                f"{num_lookahead_tokens}"
            )
        computed = request.num_computed_tokens + num_new_computed_tokens
        end = computed + num_new_tokens
        if end > self.max_model_len:
            raise InvalidArgumentError(f"{end} tokens exceed max_model_len={self.max_model_len}")
        # Lookahead past max_model_len could never be used: capped rather than refused.
        slots = min(end + num_lookahead_tokens, self.max_model_len)
        rid = request.request_id
        bs = self.block_size
        existing = [m.req_to_blocks.get(rid) for m in self.managers]
        is_new = existing[0] is None
        hits = self._validate_hits(request, is_new, num_new_computed_tokens, new_computed_blocks)
        host_hits = new_computed_blocks.host if new_computed_blocks is not None else []
        need_slot = slots
        if is_new:
            # The whole reservation at admission; afterwards only growth past it allocates.
            need_slot = max(slots, self.reservation_tokens(request))
        target = -(-need_slot // bs)
        needed = 0
        credit = 0
        copies: list[list[int]] = []
        # Blocks restored from the host tier are new device blocks: counted in `target - hit`.
        for m, blocks, hit in zip(self.managers, existing, hits, strict=True):
            have = len(blocks) if blocks is not None else 0
            needed += max(0, target - have - len(hit))
            needed += sum(1 for b in hit if b.ref_cnt == 0 and not b.is_null)
            cow: list[int] = []
            if blocks:
                # Every block this step may write, lookahead slots included, must be private.
                for i in range(computed // bs, min(have, -(-slots // bs))):
                    b = blocks[i]
                    if b.ref_cnt > 1 and not b.is_null:
                        cow.append(i)
                credit += m.num_freeable_skipped_blocks(rid, request.num_computed_tokens)
            needed += len(cow)
            copies.append(cow)
        if needed > self.pool.num_free_blocks + credit:
            return None
        return AllocationPlan(is_new, hits, host_hits, tuple(copies), target, end)

    def _validate_hits(
        self,
        request: KVRequest,
        is_new: bool,
        num_new_computed_tokens: int,
        hit_blocks: KVCacheBlocks | None,
    ) -> tuple[list[KVBlock], ...]:
        if hit_blocks is None or not hit_blocks:
            if num_new_computed_tokens:
                raise InvalidArgumentError("num_new_computed_tokens > 0 without hit blocks")
            return tuple([] for _ in self.managers)
        if not is_new:
            raise InvalidArgumentError("prefix-hit blocks are only accepted for a new request")
        if not self.enable_caching:
            raise InvalidArgumentError("prefix-hit blocks given but prefix caching is disabled")
        if len(hit_blocks.blocks) != len(self.managers):
            raise InvalidArgumentError("hit blocks must have one list per KV group")
        hashes = request.block_hashes
        host = hit_blocks.host
        if host:
            self._validate_host_hits(hashes, len(hit_blocks.blocks[0]), host)
        for gid, hit in enumerate(hit_blocks.blocks):
            if (len(hit) + len(host)) * self.block_size != num_new_computed_tokens:
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

    def _validate_host_hits(self, hashes: list[bytes], start: int, host: list[KVBlock]) -> None:
        """Host-tier hit blocks must still be cached there under the hashes that follow the
        device hit: only blocks the tier holds can be copied back."""
        tier = self.host
        if tier is None or len(self.managers) != 1:
            raise InvalidArgumentError(
                "host-tier hit blocks given but there is no host prefix tier"
            )
        suffix = (0).to_bytes(4, "big")
        for i, b in enumerate(host, start):
            key = b.block_hash
            if (
                key is None
                or i >= len(hashes)
                or key != hashes[i] + suffix
                or tier.pool.cached.get(key) is not b
            ):
                raise InvalidArgumentError(
                    f"stale host-tier hit: host block {b.block_id} re-used"
                )

    # ------------------------------------------------------------------ applying
    def _apply(self, request: KVRequest, plan: AllocationPlan) -> KVCacheBlocks:
        """Carry out a plan that fits. Out-of-window blocks are released and hit blocks
        referenced before any new block is popped, so popping never evicts a block about to
        be re-used."""
        rid = request.request_id
        if plan.is_new:
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
                self.pending_copies.append((src, dst))
                self.replacements.append((rid, m.group_id, i, dst))
            new_per_group.append(m.grow(rid, plan.num_blocks))
            if self.enable_caching:
                m.cache_blocks(rid, request.block_hashes, min(plan.end, request.num_tokens))
        return KVCacheBlocks(tuple(new_per_group))
