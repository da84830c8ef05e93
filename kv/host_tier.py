"""The host tier: a second pool of KV blocks in host memory, run by the same ``BlockPool``
machinery as the device pool (free queue, hashes, ref counts), with its own block ids.

It serves two purposes:

* **swap preemption** (:func:`swap_out`, :func:`swap_in`): a preempted request's computed
  blocks are copied into host blocks that it holds while it waits, and copied back into fresh
  device blocks in the same positions (plus the growth its step needs, all or nothing) when it
  resumes. A swapped request is in exactly one place: its device blocks went back to the device
  free queue (hashed ones still hittable there). Its host blocks carry no hash: they are private.
* **an offload cache**: a cached device block that the device pool is about to re-use is
  first written to a host block under the same hash (:meth:`HostTier.offload`, the device
  pool's ``on_evict``), so a later prefix hit copies it back instead of recomputing it. The tier
  is inclusive: a restored block stays cached on the host too, so evicting its device copy
  again costs no copy. Within the host pool a hash is cached at most once.

Copies are block-id pairs collected per step and shipped in the step message
(:meth:`HostTier.take_copies`): the workers run every device->host copy first, then every
host->device copy, then the copy-on-write copies and the forward pass. So a device block freed
(or evicted) and re-used in the same step is read before it is overwritten. Every host block
a pending copy touches holds one extra reference until the copies are taken, so the host pool
cannot hand it out (and overwrite it) again in the same step.

Swap-in of a block that was never swapped out cannot be expressed: host->device pairs come
only from a request's own swap-out record or from host blocks cached by an offload.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedserve.kv.block_pool import BlockPool, KVBlock
from pagedserve.kv.errors import InvalidArgumentError, UnknownRequestError
from pagedserve.kv.group_managers import KVCacheBlocks, SingleTypeManager
from pagedserve.kv.request import KVRequest

__all__ = ["HostTier", "HostTierStats", "swap_in", "swap_in_cost", "swap_out"]


@dataclass(slots=True)
class HostTierStats:
    """Counters of the host tier since construction."""

    swap_outs: int = 0  # requests preempted by swapping
    swap_ins: int = 0  # swapped requests resumed
    blocks_to_host: int = 0  # device -> host block copies (swap-outs and offloads)
    blocks_to_device: int = 0  # host -> device block copies (swap-ins and prefix restores)
    offloaded_blocks: int = 0  # evicted cached device blocks written to the host
    swap_fallbacks: int = 0  # swap preemptions that fell back to recompute (host tier full)


class HostTier:
    """Host block ids, swapped requests and the step's pending tier copies.

    Args:
        num_blocks: host blocks, the host pool's own null block (id 0) included.
        offload: keep evicted cached device blocks in the host pool (the prefix tier).
    """

    def __init__(self, num_blocks: int, offload: bool = True) -> None:
        self.pool = BlockPool(num_blocks, enable_caching=True)
        self.offload_enabled = offload
        self.swapped: dict[str, tuple[list[KVBlock], ...]] = {}
        """Per swapped request, per KV group: its host blocks (host null block where the
        device list held the null block: a released sliding-window position)."""
        self.num_computed: dict[str, int] = {}
        self._to_host: list[tuple[int, int]] = []  # (device src, host dst)
        self._to_device: list[tuple[int, int]] = []  # (host src, device dst)
        self._held: list[KVBlock] = []  # one reference per pending copy's host block
        self.stats = HostTierStats()

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.swapped

    @property
    def held_blocks(self) -> Sequence[KVBlock]:
        """Host blocks referenced by this step's pending copies (for the integrity check)."""
        return self._held

    @property
    def pending(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's pending copies so far: (device -> host, host -> device)."""
        return self._to_host, self._to_device

    def find_hit(self, block_hashes: Sequence[bytes], start: int, stop: int) -> list[KVBlock]:
        """Host blocks that continue a device prefix hit of ``start`` blocks: the cached run
        ``block_hashes[start:stop]`` of group 0 (chaining makes the first miss final)."""
        if not self.offload_enabled:
            return []
        cached = self.pool.cached
        suffix = (0).to_bytes(4, "big")
        out: list[KVBlock] = []
        for i in range(start, stop):
            entry = cached.get(block_hashes[i] + suffix)
            if entry is None:
                break
            assert isinstance(entry, KVBlock), "a hash is cached at most once on the host"
            out.append(entry)
        return out

    # ------------------------------------------------------------------ copies
    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's copies ``(device -> host pairs, host -> device pairs)``; releases the
        references that kept their host blocks from being re-used within the step."""
        out = (self._to_host, self._to_device)
        self._to_host, self._to_device = [], []
        held, self._held = self._held, []
        # Restored hits and swapped-in blocks go back to the host queue; an offloaded block
        # joins it as the most recently used cached block.
        self.pool.free_blocks(held)
        return out

    def offload(self, block: KVBlock, device_cached: dict[bytes, object]) -> None:
        """The device pool's ``on_evict``: keep a copy of ``block`` (still hashed) on the host.

        Skipped when another device block still caches the same hash (duplicates), when the
        host already caches it (it only becomes the most recently used), and when every host
        block is in use: the prefix tier is a cache, never a reason to fail.
        """
        key = block.block_hash
        assert key is not None
        if type(device_cached.get(key)) is dict:
            return
        pool = self.pool
        entry = pool.cached.get(key)
        if entry is not None:
            assert isinstance(entry, KVBlock)
            if entry.ref_cnt == 0:
                pool.free_block_queue.remove(entry)
                pool.free_block_queue.append(entry)
            return
        if pool.num_free_blocks == 0:
            return
        (host,) = pool.get_new_blocks(1)  # drops the LRU host block's hash, if it had one
        pool.register(host, key)
        self._to_host.append((block.block_id, host.block_id))
        self._held.append(host)
        self.stats.offloaded_blocks += 1
        self.stats.blocks_to_host += 1

    def restore(self, host_blocks: Sequence[KVBlock], device_blocks: Sequence[KVBlock]) -> None:
        """Copy prefix-hit host blocks into the request's new device blocks this step."""
        for h, d in zip(host_blocks, device_blocks, strict=True):
            self._to_device.append((h.block_id, d.block_id))
        self.stats.blocks_to_device += len(host_blocks)

    def hold(self, host_blocks: Sequence[KVBlock]) -> None:
        """Reference prefix-hit host blocks before any allocation of this step can evict them
        (an offload may pop host blocks); released by :meth:`take_copies`."""
        self.pool.touch(host_blocks)
        self._held.extend(host_blocks)

    # ------------------------------------------------------------------- swap
    def swap_out(
        self, request_id: str, device_blocks: Sequence[Sequence[KVBlock]], num_computed: int
    ) -> bool:
        """Give the request a host block per non-null device block and queue the copies.

        False, with nothing changed, if the host pool cannot hold them (the caller then
        preempts by recompute). The caller frees the device blocks afterwards.
        """
        if request_id in self.swapped:
            raise InvalidArgumentError(f"request {request_id!r} is already swapped out")
        n = sum(1 for group in device_blocks for b in group if not b.is_null)
        if n > self.pool.num_free_blocks:
            self.stats.swap_fallbacks += 1
            return False
        pool = self.pool
        fresh = iter(pool.get_new_blocks(n))
        per_group: list[list[KVBlock]] = []
        for group in device_blocks:
            host_list: list[KVBlock] = []
            for b in group:
                if b.is_null:
                    host_list.append(pool.null_block)
                    continue
                h = next(fresh)
                h.ref_cnt += 1  # the pending copy's hold, besides the request's own
                self._held.append(h)
                self._to_host.append((b.block_id, h.block_id))
                host_list.append(h)
            per_group.append(host_list)
        self.swapped[request_id] = tuple(per_group)
        self.num_computed[request_id] = num_computed
        self.stats.swap_outs += 1
        self.stats.blocks_to_host += n
        return True

    def take_swapped(self, request_id: str) -> tuple[list[KVBlock], ...]:
        """End the request's swapped state for its swap-in: its host blocks' references move to
        the step's pending copies (released once the copies are taken)."""
        blocks = self.swapped.pop(request_id, None)
        if blocks is None:
            raise UnknownRequestError(f"request {request_id!r} is not swapped out")
        del self.num_computed[request_id]
        for group in blocks:
            self._held.extend(b for b in group if not b.is_null)
        self.stats.swap_ins += 1
        return blocks

    def free(self, request_id: str) -> None:
        """Drop a swapped request (aborted while it waited): its host blocks go back, and
        copies into them that have not been shipped yet are cancelled."""
        blocks = self.swapped.pop(request_id)
        del self.num_computed[request_id]
        mine = [b for group in blocks for b in group if not b.is_null]
        ids = {b.block_id for b in mine}
        if any(dst in ids for _, dst in self._to_host):
            self._to_host = [(s, d) for s, d in self._to_host if d not in ids]
            kept = [b for b in self._held if b.block_id not in ids]
            cancelled = [b for b in self._held if b.block_id in ids]
            self._held = kept
            self.pool.free_blocks(cancelled)
        self.pool.free_blocks(reversed(mine))

    def reset_prefix_cache(self) -> bool:
        """Forget the offloaded hashes; refused while any host block is held."""
        return self.pool.reset_prefix_cache()


# ------------------------------------------------- swap preemption, for KVCacheManager
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
    max_model_len: int,
    reservation_tokens: Callable[[KVRequest], int],
) -> KVCacheBlocks | None:
    """Bring a swapped request back with room for ``num_new_tokens`` more tokens: fresh device
    blocks for its host blocks (copied back before the forward pass) and growth to what the
    step (or the policy's reservation) needs. None, with nothing changed, if they do not fit."""
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
    end = request.num_computed_tokens + num_new_tokens
    if end > max_model_len:
        raise InvalidArgumentError(f"{end} tokens exceed max_model_len={max_model_len}")
    target = -(-max(end, reservation_tokens(request)) // block_size)
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
