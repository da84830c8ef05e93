"""Per-group managers: one per KV group, all sharing the manager's single BlockPool, and
``KVCacheBlocks``, the blocks per group that the manager hands out.

Each owns its group's per-request block lists. Lists are append-only from the workers' point of
view; the only in-place edits are (a) sliding-window heads replaced by the null block (the
workers are never told: kernels never read out-of-window positions) and (b) copy-on-write
replacements, which the manager reports explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.kv.block_pool import BlockPool, KVBlock
from pagedserve.kv.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

__all__ = [
    "FullAttentionManager",
    "KVCacheBlocks",
    "SingleTypeManager",
    "SlidingWindowManager",
    "make_manager",
]


class KVCacheBlocks:
    """Blocks per KV group, ``blocks[group][i]``. Read-only for callers: the scheduler only
    reads ids (:meth:`get_block_ids`) and passes prefix hits back into ``allocate_slots``."""

    __slots__ = ("blocks", "host")

    def __init__(
        self, blocks: tuple[list[KVBlock], ...], host: list[KVBlock] | None = None
    ) -> None:
        self.blocks = blocks
        # A prefix hit's continuation in the host tier (group 0 only): host blocks whose
        # contents are copied into new device blocks when the hit is allocated.
        self.host: list[KVBlock] = host if host is not None else []

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    def num_blocks(self) -> int:
        """Blocks in the first group (all groups have equally long lists)."""
        return len(self.blocks[0]) if self.blocks else 0

    def __bool__(self) -> bool:
        return any(self.blocks) or bool(self.host)

    def __repr__(self) -> str:
        host = f", host={[b.block_id for b in self.host]}" if self.host else ""
        return f"KVCacheBlocks({self.get_block_ids()}{host})"


class SingleTypeManager:
    """State and type-independent operations of one KV group."""

    def __init__(self, spec: KVCacheSpec, block_size: int, group_id: int, pool: BlockPool) -> None:
        self.spec = spec
        self.block_size = block_size  # the manager's (virtual) block size, not spec.block_size
        self.group_id = group_id
        self.pool = pool
        self.null_block = pool.null_block
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # Leading blocks of each request already registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}

    # ---- lookup
    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_num_blocks: int, group_ids: Sequence[int]
    ) -> list[list[KVBlock]]:
        """Longest hit of at most ``max_num_blocks`` blocks common to all ``group_ids``
        (groups of this same spec); one block list per group id."""
        raise NotImplementedError

    # ---- window handling (no-ops for full attention)
    def num_freeable_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        """Blocks :meth:`remove_skipped_blocks` would return to the free queue."""
        return 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        return None

    def num_skipped(self, request_id: str, num_computed_tokens: int) -> int:
        """Leading positions that are (or :meth:`remove_skipped_blocks` would make) null."""
        return 0

    # ---- bookkeeping
    def add_request(self, request_id: str, hit: Sequence[KVBlock]) -> None:
        """Start the request's list with its prefix-hit blocks (already referenced)."""
        self.req_to_blocks[request_id] = list(hit)
        self.num_cached_blocks[request_id] = len(hit)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Let the child share every block of the parent (one more reference each)."""
        blocks = list(self.req_to_blocks[parent_id])
        for b in blocks:
            if not b.is_null:
                b.ref_cnt += 1
        self.req_to_blocks[child_id] = blocks
        self.num_cached_blocks[child_id] = self.num_cached_blocks[parent_id]

    def copy_shared_blocks(
        self, request_id: str, indices: Sequence[int]
    ) -> list[tuple[int, int, int]]:
        """Give the request a private new block at each index of a shared one (copy-on-write).

        Returns ``(index, src_block_id, dst_block_id)`` per copy; the caller has counted them.
        """
        blocks = self.req_to_blocks[request_id]
        out = []
        for i in indices:
            src = blocks[i]
            dst = self.pool.get_new_blocks(1)[0]
            src.ref_cnt -= 1  # still >= 1: the other sharers keep it
            blocks[i] = dst
            out.append((i, src.block_id, dst.block_id))
        return out

    def grow(self, request_id: str, num_blocks: int) -> list[KVBlock]:
        """Append new blocks until the request holds ``num_blocks``; returns the new ones."""
        blocks = self.req_to_blocks[request_id]
        n = num_blocks - len(blocks)
        new = self.pool.get_new_blocks(n) if n > 0 else []
        blocks.extend(new)
        return new

    def cache_blocks(self, request_id: str, block_hashes: Sequence[bytes], num_tokens: int) -> None:
        """Register the request's blocks that are full within its first ``num_tokens`` tokens."""
        num_full = min(num_tokens // self.block_size, len(block_hashes))
        num_cached = self.num_cached_blocks[request_id]
        if num_full > num_cached:
            self.pool.cache_full_blocks(
                self.req_to_blocks[request_id], block_hashes, num_cached, num_full, self.group_id
            )
            self.num_cached_blocks[request_id] = num_full

    def trim(self, request_id: str, num_blocks: int) -> None:
        """Release the request's blocks past its first ``num_blocks``, tail-first. They hold
        no accepted token (slots of rejected drafts), so none is in the prefix cache."""
        blocks = self.req_to_blocks[request_id]
        tail = blocks[num_blocks:]
        del blocks[num_blocks:]
        tail.reverse()
        self.pool.free_blocks(tail)

    def free(self, request_id: str) -> None:
        """Release the request's blocks tail-first: its longest prefix is evicted first."""
        blocks = self.req_to_blocks.pop(request_id)
        self.num_cached_blocks.pop(request_id, None)
        blocks.reverse()
        self.pool.free_blocks(blocks)


class FullAttentionManager(SingleTypeManager):
    """Full attention: a hit is the longest run of cached blocks from the start."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_num_blocks: int, group_ids: Sequence[int]
    ) -> list[list[KVBlock]]:
        out: list[list[KVBlock]] = [[] for _ in group_ids]
        n = min(max_num_blocks, len(block_hashes))
        if len(group_ids) == 1:
            # Hot path: one group, so probe the map directly. Chaining makes the first miss
            # final: no later block can hit without its parent.
            cached = self.pool.cached
            suffix = group_ids[0].to_bytes(4, "big")
            hit = out[0]
            for i in range(n):
                entry = cached.get(block_hashes[i] + suffix)
                if entry is None:
                    break
                hit.append(next(iter(entry.values())) if isinstance(entry, dict) else entry)
            return out
        for i in range(n):
            blocks = self.pool.get_cached_block(block_hashes[i], group_ids)
            if blocks is None:
                break
            for lst, b in zip(out, blocks, strict=True):
                lst.append(b)
        return out


class SlidingWindowManager(SingleTypeManager):
    """Sliding window W: only the last W tokens matter.

    A hit at length L needs only the last ``ceil((W-1)/B)`` blocks before L to be cached (the
    current token is recomputed anyway); earlier positions are the null block.
    """

    spec: SlidingWindowSpec

    def __init__(self, spec: KVCacheSpec, block_size: int, group_id: int, pool: BlockPool) -> None:
        assert isinstance(spec, SlidingWindowSpec)
        super().__init__(spec, block_size, group_id, pool)
        self.window = spec.sliding_window
        self.blocks_needed_for_hit = -(-(self.window - 1) // block_size)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_num_blocks: int, group_ids: Sequence[int]
    ) -> list[list[KVBlock]]:
        n = min(max_num_blocks, len(block_hashes))
        null = self.null_block
        out = [[null] * n for _ in group_ids]
        need = self.blocks_needed_for_hit
        if need == 0:
            return out
        # Scan right to left; the first run of `need` consecutive cached blocks ends the search.
        run = 0
        for i in range(n - 1, -1, -1):
            blocks = self.pool.get_cached_block(block_hashes[i], group_ids)
            if blocks is None:
                run = 0
                continue
            for lst, b in zip(out, blocks, strict=True):
                lst[i] = b
            run += 1
            if run >= need:
                for lst in out:
                    del lst[i + run :]
                return out
        # No full window anywhere: the only valid hit is the run that starts at block 0 (the
        # loop ended at i == 0, so `run` is exactly its length; nothing before it is needed).
        for lst in out:
            del lst[run:]
        return out

    def _skipped_range(self, request_id: str, num_computed_tokens: int) -> int:
        skipped_tokens = num_computed_tokens - self.window + 1
        return skipped_tokens // self.block_size if skipped_tokens > 0 else 0

    def num_skipped(self, request_id: str, num_computed_tokens: int) -> int:
        blocks = self.req_to_blocks.get(request_id) or []
        return min(self._skipped_range(request_id, num_computed_tokens), len(blocks))

    def num_freeable_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return 0
        n = 0
        for i in range(
            min(self._skipped_range(request_id, num_computed_tokens), len(blocks)) - 1, -1, -1
        ):
            b = blocks[i]
            if b.is_null:
                break
            n += b.ref_cnt == 1
        return n

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        k = min(self._skipped_range(request_id, num_computed_tokens), len(blocks))
        removed: list[KVBlock] = []
        null = self.null_block
        # Walk back from the newest skipped block; everything before the first null was
        # already released by an earlier call, which makes this idempotent and O(new).
        for i in range(k - 1, -1, -1):
            b = blocks[i]
            if b.is_null:
                break
            removed.append(b)
            blocks[i] = null
        if removed:
            # Released blocks keep their hashes: they stay hittable until re-allocated.
            self.pool.free_blocks(removed)


def make_manager(
    spec: KVCacheSpec, block_size: int, group_id: int, pool: BlockPool
) -> SingleTypeManager:
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager(spec, block_size, group_id, pool)
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, block_size, group_id, pool)
    raise TypeError(f"no manager for {type(spec).__name__}")
