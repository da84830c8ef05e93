"""Physical blocks, the free-block queue, and the one pool of block ids that every KV group
draws from (the host tier runs a second pool of the same kind).

The queue is an intrusive doubly linked list: the links live on the blocks themselves, so a
prefix-cache hit on a free block can take it out of the middle in O(1) (a deque would be O(n)).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from pagedserve.kv.errors import DoubleFreeError, InvalidArgumentError

__all__ = ["BlockPool", "FreeBlockQueue", "KVBlock", "make_cache_key"]


class KVBlock:
    """Metadata of one physical KV block (the tensors live on the workers).

    ``block_hash`` is the prefix-cache key (hash bytes + group id) and is set once, when the block
    is full and registered; it is cleared only when the block is evicted on re-allocation.
    ``prev``/``next`` are touched only by :class:`FreeBlockQueue`.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; the front is evicted (re-used) first.

    Two sentinel nodes mean every real node always has both neighbours, so no operation branches
    on "am I at an end". ``num_free_blocks`` is kept in sync by every operation.
    """

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        nxt = block.next
        assert nxt is not None
        self._head.next = nxt
        nxt.prev = self._head
        block.prev = block.next = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks or n < 0:
            raise IndexError(f"cannot pop {n} of {self.num_free_blocks} free blocks")
        out: list[KVBlock] = []
        if n == 0:
            return out
        block = self._head.next
        for _ in range(n):
            assert block is not None
            out.append(block)
            nxt = block.next
            block.prev = block.next = None
            block = nxt
        assert block is not None
        self._head.next = block
        block.prev = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVBlock]) -> None:
        """Append in the given order (the first one given is evicted first among them)."""
        last = self._tail.prev
        assert last is not None
        n = 0
        for block in blocks:
            last.next = block
            block.prev = last
            last = block
            n += 1
        last.next = self._tail
        self._tail.prev = last
        self.num_free_blocks += n

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next
        while block is not None and block is not self._tail:
            yield block
            block = block.next

    def get_all_free_blocks(self) -> list[KVBlock]:
        return list(self)

    def check_links(self) -> None:
        """Walk both directions; raise AssertionError on any inconsistency."""
        fwd: list[KVBlock] = []
        node = self._head
        while node.next is not None:
            nxt = node.next
            if nxt.prev is not node:
                raise AssertionError(f"broken back-link at {nxt!r}")
            node = nxt
            if node is self._tail:
                break
            fwd.append(node)
            if len(fwd) > self.num_free_blocks:
                raise AssertionError("free queue longer than its counter (cycle?)")
        if node is not self._tail:
            raise AssertionError("free queue does not reach its tail sentinel")
        if len(fwd) != self.num_free_blocks:
            raise AssertionError(f"free counter {self.num_free_blocks} != {len(fwd)} linked")
        if self._head.prev is not None or self._tail.next is not None:
            raise AssertionError("sentinel outer links must stay None")


def make_cache_key(block_hash: bytes, group_id: int) -> bytes:
    """Prefix-cache key: the chained hash qualified by the KV group (4 big-endian bytes).

    Groups share the pool, so the same token prefix can be cached once per group; the group
    suffix keeps their blocks apart. Raw bytes make a cheaper dict key than a tuple.
    """
    return block_hash + group_id.to_bytes(4, "big")


class BlockPool:
    """Block metadata, the LRU free queue and the prefix-cache map.

    Invariants (checked by :meth:`check_integrity`):

    * block 0 is the null block: a placeholder for skipped positions, never freed, cached,
      counted in usage or linked into the free queue;
    * ``ref_cnt == 0`` <=> the block is in the free queue (null block excepted);
    * a block with a hash is in the map under that key; it may be free (an evictable cached
      block, still hittable) or in use;
    * eviction is lazy: a free cached block loses its hash only when it is re-allocated.

    The map allows several blocks per key. Two requests that compute the same prefix at the same
    time each keep their own block: merging would change a block id after it was sent to the
    workers, and block tables are append-only.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise InvalidArgumentError(f"num_blocks must be >= 2 (null + 1), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # key -> block, or {block_id: block} when duplicates exist (rare, so most entries stay a
        # bare block and we avoid millions of tiny dicts).
        self.cached: dict[bytes, KVBlock | dict[int, KVBlock]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.on_evict: Callable[[KVBlock], None] | None = None
        """Called with a cached block just before re-allocation drops its hash (the host tier
        keeps a copy of it there). The block is already out of the free queue."""

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request may ever hold (everything but the null block)."""
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use; free cached blocks count as free."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: bytes, group_ids: Sequence[int]) -> list[KVBlock] | None:
        """One cached block per group for this hash, or None if any group misses."""
        out: list[KVBlock] = []
        cached = self.cached
        for gid in group_ids:
            entry = cached.get(block_hash + gid.to_bytes(4, "big"))
            if entry is None:
                return None
            out.append(next(iter(entry.values())) if isinstance(entry, dict) else entry)
        return out

    # --------------------------------------------------------------- mutations
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pop ``n`` blocks from the front of the free queue, evicting their cached hashes."""
        if n < 0 or n > self.free_block_queue.num_free_blocks:
            raise InvalidArgumentError(f"cannot get {n} blocks, {self.num_free_blocks} free")
        blocks = self.free_block_queue.popleft_n(n)
        if self.enable_caching:
            on_evict = self.on_evict
            for b in blocks:
                if b.block_hash is not None:
                    if on_evict is not None:
                        on_evict(b)
                    self._evict(b)
                b.ref_cnt = 1
        else:
            for b in blocks:
                b.ref_cnt = 1
        return blocks

    def _evict(self, block: KVBlock) -> None:
        key = block.block_hash
        assert key is not None
        entry = self.cached.get(key)
        if entry is block:
            del self.cached[key]
        elif type(entry) is dict:
            entry.pop(block.block_id, None)
            if len(entry) == 1:
                self.cached[key] = next(iter(entry.values()))
            elif not entry:
                del self.cached[key]
        block.block_hash = None

    def register(self, block: KVBlock, key: bytes) -> None:
        """Cache one block under a full key (hash + group suffix); it must have no hash yet."""
        assert block.block_hash is None and not block.is_null
        block.block_hash = key
        entry = self.cached.get(key)
        if entry is None:
            self.cached[key] = block
        elif isinstance(entry, dict):
            entry[block.block_id] = block
        else:
            self.cached[key] = {entry.block_id: entry, block.block_id: block}

    def uncache(self, block_ids: Iterable[int]) -> None:
        """Take these blocks out of the prefix cache, in use or not: the step that was to
        write their KV did not (see ``controller.rejected``). Unhashed blocks are skipped."""
        for bid in block_ids:
            block = self.blocks[bid]
            if block.block_hash is not None:
                self._evict(block)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks; free ones leave the queue (not evictable now)."""
        queue = self.free_block_queue
        for b in blocks:
            if b.is_null:
                continue
            if b.ref_cnt == 0:
                queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the queue in this order.

        Callers pass a request's blocks tail-first, so the longest (least shareable) prefixes sit
        ahead of their parents and are evicted first. Raises DoubleFreeError, before changing
        anything, if a block has no reference left to drop.
        """
        blocks = [b for b in blocks if not b.is_null]
        for b in blocks:
            if b.ref_cnt <= 0:
                raise DoubleFreeError(f"{b!r} freed with no reference held")
        if len({id(b) for b in blocks}) != len(blocks):
            counts: dict[int, int] = {}
            for b in blocks:
                counts[id(b)] = counts.get(id(b), 0) + 1
                if counts[id(b)] > b.ref_cnt:
                    raise DoubleFreeError(f"{b!r} freed more times than it is referenced")
        freed: list[KVBlock] = []
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                freed.append(b)
        self.free_block_queue.append_n(freed)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVBlock],
        block_hashes: Sequence[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` under their chained hashes.

        A block that already has a hash (a prefix hit re-used as is) keeps it; null blocks are
        skipped.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        suffix = group_id.to_bytes(4, "big")
        cached = self.cached
        for i in range(num_cached_blocks, num_full_blocks):
            b = blocks[i]
            if b.block_hash is not None or b.is_null:
                continue
            key = block_hashes[i] + suffix
            b.block_hash = key
            entry = cached.get(key)
            if entry is None:
                cached[key] = b
            elif isinstance(entry, dict):
                entry[b.block_id] = b
            else:
                cached[key] = {entry.block_id: entry, b.block_id: b}

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (returns False, nothing changed) while any block is
        in use: an in-use block's hash may be referenced by a request's cached-block counter."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self.cached = {}
        for b in self.blocks:
            b.block_hash = None
        return True

    # --------------------------------------------------------------- checking
    def check_integrity(self) -> None:
        """Verify every invariant; raise AssertionError describing the first violation."""
        queue = self.free_block_queue
        queue.check_links()
        in_queue = {id(b) for b in queue}
        null = self.null_block
        if null.block_id != 0 or id(null) in in_queue or null.block_hash is not None:
            raise AssertionError("null block must be id 0, never queued, never hashed")
        used = 0
        for b in self.blocks:
            if b.is_null != (b is null):
                raise AssertionError(f"{b!r} has a wrong is_null flag")
            if b is null:
                continue
            if b.ref_cnt < 0:
                raise AssertionError(f"{b!r} has a negative ref count")
            if (b.ref_cnt == 0) != (id(b) in in_queue):
                raise AssertionError(f"{b!r}: ref_cnt==0 must match free-queue membership")
            used += b.ref_cnt > 0
            if b.block_hash is not None:
                entry = self.cached.get(b.block_hash)
                ok = entry is b or (type(entry) is dict and entry.get(b.block_id) is b)
                if not ok:
                    raise AssertionError(f"{b!r} is hashed but missing from the map")
        if used + queue.num_free_blocks != self.num_blocks - 1:
            raise AssertionError(f"used {used} + free {queue.num_free_blocks} != total")
        for key, entry in self.cached.items():
            if isinstance(entry, dict):
                if len(entry) < 2:
                    raise AssertionError("duplicate-hash dict with < 2 blocks")
                members: list[KVBlock] = list(entry.values())
            else:
                members = [entry]
            for b in members:
                if b.block_hash != key:
                    raise AssertionError(f"map key does not match {b!r}")
                if b.ref_cnt == 0 and id(b) not in in_queue:
                    raise AssertionError(f"cached {b!r} neither in use nor free")
        if not self.enable_caching and self.cached:
            raise AssertionError("caching disabled but the map is not empty")
