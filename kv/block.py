"""Physical block metadata and the free-block queue.

The queue is an intrusive doubly linked list: the links live on the blocks themselves, so a
prefix-cache hit on a free block can take it out of the middle in O(1) (a deque would be O(n)).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

__all__ = ["FreeBlockQueue", "KVBlock"]


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
