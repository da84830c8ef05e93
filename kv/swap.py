"""Swap preemption between the device pool and the host tier, for ``KVCacheManager``.

A swapped request is in exactly one place: its device lists are gone (the device blocks went
back to the device free queue, hashed ones still hittable there) and the host tier holds its
blocks. Only blocks holding computed tokens travel; on swap-in the request gets fresh device
blocks in the same positions, plus any growth this step needs, all or nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.kv.base import KVRequest
from pagedserve.kv.block import KVBlock
from pagedserve.kv.block_pool import BlockPool
from pagedserve.kv.errors import InvalidArgumentError, UnknownRequestError
from pagedserve.kv.host_tier import HostTier
from pagedserve.kv.kv_blocks import KVCacheBlocks
from pagedserve.kv.single_type import SingleTypeManager

__all__ = ["swap_in", "swap_in_cost", "swap_out"]


def swap_out(
    managers: Sequence[SingleTypeManager], host: HostTier, request: KVRequest, block_size: int
) -> bool:
    """Move the request's computed blocks to the host tier and free its device blocks.

    False, with nothing changed, when the host tier cannot hold them.
    """
    rid = request.request_id
    if rid not in managers[0].req_to_blocks:
        raise UnknownRequestError(rid)
    computed = request.num_computed_tokens
    keep = -(-computed // block_size)
    # Blocks that slid out of the window need no copy; count without releasing them yet, so
    # that a refusal changes nothing.
    need = sum(
        sum(1 for b in m.req_to_blocks[rid][m.num_skipped(rid, computed) : keep] if not b.is_null)
        for m in managers
    )
    if need > host.num_free_blocks:
        host.stats.swap_fallbacks += 1
        return False
    for m in managers:
        m.remove_skipped_blocks(rid, computed)
    blocks = [m.req_to_blocks[rid][:keep] for m in managers]
    if not host.swap_out(rid, blocks, computed):
        return False
    for m in managers:
        m.free(rid)
    return True


def swap_in_cost(host: HostTier, rid: str, target: int) -> int:
    """Device blocks a swap-in that leaves each group with ``target`` blocks takes."""
    needed = 0
    for group in host.swapped[rid]:
        needed += sum(1 for b in group if not b.is_null) + max(0, target - len(group))
    return needed


def swap_in(
    managers: Sequence[SingleTypeManager],
    pool: BlockPool,
    host: HostTier,
    request: KVRequest,
    num_new_tokens: int,
    block_size: int,
    target: int,
    end: int,
) -> KVCacheBlocks | None:
    """Bring a swapped request back with room for ``num_new_tokens`` more tokens: fresh device
    blocks for its host blocks (copied back before the forward pass) and growth up to
    ``target`` blocks per group. None, with nothing changed, if they do not fit."""
    rid = request.request_id
    if not host.is_swapped(rid):
        raise UnknownRequestError(f"request {rid!r} is not swapped out")
    if num_new_tokens <= 0:
        raise InvalidArgumentError(f"need num_new_tokens > 0, got {num_new_tokens}")
    if request.num_computed_tokens != host.num_computed[rid]:
        raise InvalidArgumentError(
            f"{rid}: {request.num_computed_tokens} computed tokens, "
            f"{host.num_computed[rid]} when swapped out"
        )
    if swap_in_cost(host, rid, target) > pool.num_free_blocks:
        return None
    # The host blocks stay referenced (now by the pending copies) while device blocks are
    # popped below: an offload triggered by those pops cannot take them.
    swapped = host.take_swapped(rid)
    out: list[list[KVBlock]] = []
    for m, group in zip(managers, swapped, strict=True):
        real = [h for h in group if not h.is_null]
        fresh = iter(pool.get_new_blocks(len(real)))
        dev = [pool.null_block if h.is_null else next(fresh) for h in group]
        host.restore(real, [d for d in dev if not d.is_null])
        m.req_to_blocks[rid] = dev
        m.num_cached_blocks[rid] = 0
        m.grow(rid, target)
        # Full blocks are registered again: they were this request's, so their hashes match.
        m.cache_blocks(rid, request.block_hashes, min(end, request.num_tokens))
        out.append(list(dev))
    return KVCacheBlocks(tuple(out))
