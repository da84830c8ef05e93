"""Planning for the general ``allocate_slots`` path: new requests, prefix hits, several groups,
the reserve policy, sliding windows and copy-on-write. (The per-step decode fast path is in
``allocate.py``.)

Transactional: :func:`plan_allocation` only reads the manager, through its public accessors,
and counts everything the call would consume; the manager applies the plan only if it fits.
Consumption = new blocks + free cached hit blocks that touching takes out of the free queue +
private copies for shared blocks being written; released out-of-window blocks are credited.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.kv.base import KVRequest, ManagerView
from pagedserve.kv.block import KVBlock
from pagedserve.kv.errors import InvalidArgumentError
from pagedserve.kv.kv_blocks import KVCacheBlocks

__all__ = ["AllocationPlan", "plan_allocation"]


@dataclass(frozen=True, slots=True)
class AllocationPlan:
    """What one ``allocate_slots`` call does, per KV group, once it is known to fit."""

    is_new: bool  # the request holds no blocks yet
    hits: tuple[list[KVBlock], ...]  # validated prefix-hit blocks (empty unless is_new)
    host_hits: list[KVBlock]  # the hit's continuation in the host tier (group 0), copied back
    copies: tuple[list[int], ...]  # indices of shared blocks to copy before writing
    num_blocks: int  # blocks each group holds afterwards
    end: int  # tokens written once the step runs


def plan_allocation(
    mgr: ManagerView,
    request: KVRequest,
    num_new_tokens: int,
    num_new_computed_tokens: int,
    new_computed_blocks: KVCacheBlocks | None,
) -> AllocationPlan | None:
    """The plan for ``KVCacheManager.allocate_slots`` (same arguments), or None if it does not
    fit. Raises InvalidArgumentError for bad arguments. Changes nothing."""
    if num_new_tokens <= 0 or num_new_computed_tokens < 0:
        raise InvalidArgumentError(
            f"need num_new_tokens > 0 and num_new_computed_tokens >= 0, got "
            f"{num_new_tokens}, {num_new_computed_tokens}"
        )
    computed = request.num_computed_tokens + num_new_computed_tokens
    end = computed + num_new_tokens
    if end > mgr.max_model_len:
        raise InvalidArgumentError(f"{end} tokens exceed max_model_len={mgr.max_model_len}")
    rid = request.request_id
    bs = mgr.block_size
    existing = [m.req_to_blocks.get(rid) for m in mgr.managers]
    is_new = existing[0] is None
    hits = _validate_hits(mgr, request, is_new, num_new_computed_tokens, new_computed_blocks)
    host_hits = new_computed_blocks.host if new_computed_blocks is not None else []
    need_slot = end
    if mgr.policy == "reserve" and is_new:
        # The whole reservation at admission; afterwards only growth past it allocates.
        need_slot = max(end, mgr.reservation_tokens(request))
    target = -(-need_slot // bs)
    needed = 0
    credit = 0
    copies: list[list[int]] = []
    # Blocks restored from the host tier are new device blocks: counted in `target - hit`.
    for m, blocks, hit in zip(mgr.managers, existing, hits, strict=True):
        have = len(blocks) if blocks is not None else 0
        needed += max(0, target - have - len(hit))
        needed += sum(1 for b in hit if b.ref_cnt == 0 and not b.is_null)
        cow: list[int] = []
        if blocks:
            for i in range(computed // bs, min(have, -(-end // bs))):
                b = blocks[i]
                if b.ref_cnt > 1 and not b.is_null:
                    cow.append(i)
            credit += m.num_freeable_skipped_blocks(rid, request.num_computed_tokens)
        needed += len(cow)
        copies.append(cow)
    if needed > mgr.num_free_blocks + credit:
        return None
    return AllocationPlan(is_new, hits, host_hits, tuple(copies), target, end)


def _validate_hits(
    mgr: ManagerView,
    request: KVRequest,
    is_new: bool,
    num_new_computed_tokens: int,
    hit_blocks: KVCacheBlocks | None,
) -> tuple[list[KVBlock], ...]:
    if hit_blocks is None or not hit_blocks:
        if num_new_computed_tokens:
            raise InvalidArgumentError("num_new_computed_tokens > 0 without hit blocks")
        return tuple([] for _ in mgr.managers)
    if not is_new:
        raise InvalidArgumentError("prefix-hit blocks are only accepted for a new request")
    if not mgr.enable_caching:
        raise InvalidArgumentError("prefix-hit blocks given but prefix caching is disabled")
    if len(hit_blocks.blocks) != mgr.num_groups:
        raise InvalidArgumentError("hit blocks must have one list per KV group")
    hashes = request.block_hashes
    host = hit_blocks.host
    if host:
        _validate_host_hits(mgr, hashes, len(hit_blocks.blocks[0]), host)
    for gid, hit in enumerate(hit_blocks.blocks):
        if (len(hit) + len(host)) * mgr.block_size != num_new_computed_tokens:
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


def _validate_host_hits(
    mgr: ManagerView, hashes: list[bytes], start: int, host: list[KVBlock]
) -> None:
    """Host-tier hit blocks must still be cached there under the hashes that follow the
    device hit: only blocks the tier holds can be copied back."""
    tier = mgr.host
    if tier is None or mgr.num_groups != 1:
        raise InvalidArgumentError("host-tier hit blocks given but there is no host prefix tier")
    suffix = (0).to_bytes(4, "big")
    for i, b in enumerate(host, start):
        key = b.block_hash
        if (
            key is None
            or i >= len(hashes)
            or key != hashes[i] + suffix
            or tier.pool.cached.get(key) is not b
        ):
            raise InvalidArgumentError(f"stale host-tier hit: host block {b.block_id} re-used")
