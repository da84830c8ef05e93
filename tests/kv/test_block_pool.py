from __future__ import annotations

import pytest

from pagedserve.kv.block_pool import BlockPool, make_cache_key
from pagedserve.kv.errors import DoubleFreeError
from pagedserve.kv.hashing import hash_block_tokens


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue]


def test_null_block_is_reserved_and_not_counted() -> None:
    pool = BlockPool(11)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.num_free_blocks == 10 and queue_ids(pool) == list(range(1, 11))
    assert pool.usage == 0.0
    blocks = pool.get_new_blocks(10)
    assert [b.block_id for b in blocks] == list(range(1, 11))
    assert pool.usage == 1.0
    pool.free_blocks([pool.null_block])  # ignored: never freed
    pool.check_integrity()
    pool.free_blocks(reversed(blocks))
    assert queue_ids(pool) == list(range(10, 0, -1))
    pool.check_integrity()


def test_lazy_eviction_and_touch_of_free_cached_block() -> None:
    pool = BlockPool(11)
    hashes = hash_block_tokens(list(range(48)), 16)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, hashes, 0, 3, group_id=0)
    pool.free_blocks(reversed(blocks))
    # Free but still cached (hittable): hashes kept until re-allocation.
    assert queue_ids(pool) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    assert pool.get_cached_block(hashes[1], [0]) == [blocks[1]]
    # A prefix hit on a free cached block pulls it out of the middle of the queue.
    pool.touch([blocks[1]])
    assert blocks[1].ref_cnt == 1 and queue_ids(pool) == [4, 5, 6, 7, 8, 9, 10, 3, 1]
    pool.check_integrity()
    # Re-allocating a cached block evicts its hash (lazily, only now).
    got = pool.get_new_blocks(8)
    assert [b.block_id for b in got][-1] == 3 and blocks[2].block_hash is None
    assert pool.get_cached_block(hashes[2], [0]) is None
    assert pool.get_cached_block(hashes[0], [0]) == [blocks[0]]
    pool.check_integrity()


def test_duplicate_hashes_coexist() -> None:
    pool = BlockPool(11)
    hashes = hash_block_tokens(list(range(32)), 16)
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, hashes, 0, 2, 0)
    pool.cache_full_blocks(b, hashes, 0, 2, 0)
    key = make_cache_key(hashes[0], 0)
    assert isinstance(pool.cached[key], dict) and len(pool.cached[key]) == 2
    pool.check_integrity()
    pool.free_blocks(reversed(a))
    pool.get_new_blocks(8)  # re-uses a's blocks last -> evicts them
    assert pool.cached[key] is b[0]  # the survivor is stored bare again
    assert pool.get_cached_block(hashes[1], [0]) == [b[1]]
    pool.check_integrity()


def test_group_id_separates_keys() -> None:
    pool = BlockPool(11)
    hashes = hash_block_tokens(list(range(16)), 16)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([blk], hashes, 0, 1, group_id=1)
    assert pool.get_cached_block(hashes[0], [0]) is None
    assert pool.get_cached_block(hashes[0], [1]) == [blk]
    assert pool.get_cached_block(hashes[0], [0, 1]) is None


def test_reset_refused_while_in_use() -> None:
    pool = BlockPool(11)
    hashes = hash_block_tokens(list(range(32)), 16)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, hashes, 0, 2, 0)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(hashes[0], [0]) == [blocks[0]]
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {} and all(b.block_hash is None for b in pool.blocks)
    pool.check_integrity()


def test_double_free_is_typed_and_harmless() -> None:
    pool = BlockPool(11)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks)
    with pytest.raises(DoubleFreeError):
        pool.free_blocks(blocks)
    (c,) = pool.get_new_blocks(1)
    with pytest.raises(DoubleFreeError):
        pool.free_blocks([c, c])
    assert c.ref_cnt == 1
    pool.check_integrity()


def test_caching_disabled_never_hashes() -> None:
    pool = BlockPool(5, enable_caching=False)
    hashes = hash_block_tokens(list(range(32)), 16)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, hashes, 0, 2, 0)
    assert pool.cached == {} and blocks[0].block_hash is None
    pool.check_integrity()
