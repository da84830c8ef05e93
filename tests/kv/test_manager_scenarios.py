"""Scripted scenarios with exact block ids and free-queue order (B=16, 11 blocks incl. null)."""

from __future__ import annotations

import math

import numpy as np
from helpers.kv_requests import SimpleRequest

from pagedserve.kv import (
    BlockHasher,
    BlockPool,
    FullAttentionSpec,
    KVCacheManager,
    SlidingWindowSpec,
)

B = 16
HASHER = BlockHasher(B)
FULL = FullAttentionSpec(B, 2, 8, 2)
SW32 = SlidingWindowSpec(B, 2, 8, 2, sliding_window=32)


def make(specs=None, num_blocks: int = 11, **kw) -> KVCacheManager:  # type: ignore[no-untyped-def]
    kw.setdefault("max_model_len", 2048)
    return KVCacheManager(specs, num_blocks, B, **kw)


def req(rid: str, tokens: list[int], salt: str | None = None) -> SimpleRequest:
    return SimpleRequest(rid, tokens, HASHER, salt)


def admit(m: KVCacheManager, r: SimpleRequest) -> tuple[list[list[int]], int] | None:
    """Scheduler admission: prefix lookup, allocate the rest of the prompt, mark it computed."""
    hit_blocks, hit = m.get_computed_blocks(r)
    new = m.allocate_slots(r, r.num_tokens - hit, hit, hit_blocks)
    m.check_integrity()
    if new is None:
        return None
    r.num_computed_tokens = r.num_tokens
    return list(map(list, new.get_block_ids())), hit


def decode(m: KVCacheManager, r: SimpleRequest, token: int = 7) -> list[int] | None:
    """Sample a token, then schedule it (one decode step)."""
    r.append_token_id(token)
    new = m.allocate_slots(r, 1)
    m.check_integrity()
    if new is None:
        return None
    r.num_computed_tokens += 1
    return new.get_block_ids()[0]


def queue(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.pool.free_block_queue]


def ids(m: KVCacheManager, rid: str, group: int = 0) -> list[int]:
    return m.get_block_ids(rid)[group]


def test_prefix_hit_and_eviction_order_after_frees() -> None:
    m = make()
    prefix = list(range(1000, 1048))
    a = req("a", prefix + [1, 2])
    assert admit(m, a) == ([[1, 2, 3, 4]], 0)
    b = req("b", prefix + [5, 6, 7, 8, 9])
    assert admit(m, b) == ([[5]], 48)
    assert ids(m, "b") == [1, 2, 3, 5]
    assert [m.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [2, 2, 2, 1, 1]
    m.free(a)  # tail first: only block 4 reaches ref 0
    assert queue(m) == [6, 7, 8, 9, 10, 4]
    m.free(b)
    assert queue(m) == [6, 7, 8, 9, 10, 4, 5, 3, 2, 1]
    assert m.usage == 0.0
    # Unrelated requests take blocks from the front: the prefix's tail (3) goes before 2 and 1.
    assert admit(m, req("c", list(range(60)))) == ([[6, 7, 8, 9]], 0)
    assert admit(m, req("d", list(range(500, 548)))) == ([[10, 4, 5]], 0)
    assert admit(m, req("e", list(range(900, 910)))) == ([[3]], 0)
    assert queue(m) == [2, 1]
    # Block 3's hash was evicted on re-use, so the prefix now hits only 2 blocks.
    f = req("f", prefix + [42])
    hit_blocks, hit = m.get_computed_blocks(f)
    assert hit == 32 and hit_blocks.get_block_ids() == ([1, 2],)
    stats = m.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (6, 50 + 53 + 60 + 48 + 10 + 49, 80)


def test_hit_on_free_cached_blocks_counts_as_consumption() -> None:
    m = make()
    prefix = list(range(1000, 1048))
    a = req("a", prefix + [1])
    admit(m, a)
    m.free(a)
    assert queue(m) == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]
    admit(m, req("x", list(range(100))))  # 7 blocks: 5..10, 4
    assert queue(m) == [3, 2, 1]
    # 49 tokens: 3 hit blocks (all free, so touching consumes 3) + 1 new = 4 > 3 free.
    before = (queue(m), [b.ref_cnt for b in m.pool.blocks], dict(m.pool.cached))
    b = req("b", prefix + [2])
    assert admit(m, b) is None
    assert (queue(m), [b.ref_cnt for b in m.pool.blocks], dict(m.pool.cached)) == before
    assert not m.has_request("b")
    # 48 tokens: the hit is capped at 47 -> 2 blocks (touch 2, 1) + 1 new (pops 3, evicting it).
    c = req("c", prefix)
    assert admit(m, c) == ([[3]], 32)
    assert ids(m, "c") == [1, 2, 3] and queue(m) == []
    assert m.pool.blocks[3].block_hash is not None  # re-registered by c with the same hash


def test_duplicate_blocks_for_concurrent_identical_prompts() -> None:
    m = make()
    a, b = req("a", list(range(40))), req("b", list(range(40)))
    # Both looked up in the same step, before either allocated: neither hits.
    ha, hb = m.get_computed_blocks(a), m.get_computed_blocks(b)
    assert ha[1] == hb[1] == 0
    assert m.allocate_slots(a, 40).get_block_ids() == ([1, 2, 3],)  # type: ignore[union-attr]
    assert m.allocate_slots(b, 40).get_block_ids() == ([4, 5, 6],)  # type: ignore[union-attr]
    m.check_integrity()  # two blocks per hash for blocks 0 and 1
    m.free(a)
    c = req("c", list(range(40)))
    _, hit = m.get_computed_blocks(c)
    assert hit == 32
    m.check_integrity()


def test_reset_prefix_cache_refused_while_in_use() -> None:
    m = make()
    a = req("a", list(range(40)))
    admit(m, a)
    assert m.reset_prefix_cache() is False
    assert m.get_computed_blocks(req("z", list(range(40))))[1] == 32
    m.free(a)
    assert m.reset_prefix_cache() is True
    assert m.prefix_cache_stats.queries == 0
    assert m.get_computed_blocks(req("y", list(range(40))))[1] == 0
    m.check_integrity()


def test_decode_allocates_on_block_boundaries_and_caches_generated_tokens() -> None:
    m = make()
    a = req("a", list(range(31)))
    admit(m, a)
    assert ids(m, "a") == [1, 2]
    assert decode(m, a) == []  # token 32 fits block 2
    assert decode(m, a) == [3]  # token 33 needs block 3
    assert len(a.block_hashes) == 2
    assert m.pool.blocks[2].block_hash is not None  # full block (incl. a generated token) cached
    fill = m.block_fill_snapshot()
    assert fill.tolist() == [0, 16, 16, 1, 0, 0, 0, 0, 0, 0, 0]


def test_reserve_policy_holds_max_len_from_admission() -> None:
    per_req = math.ceil(200 / B)
    m = make(num_blocks=1 + 2 * per_req + 3, max_model_len=200, policy="reserve")
    a = req("a", list(range(10)))
    new, _ = admit(m, a)  # type: ignore[misc]
    assert len(new[0]) == per_req == len(ids(m, "a"))
    for _ in range(40):
        assert decode(m, a) == []
    b = req("b", list(range(500, 520)))
    admit(m, b)
    assert m.num_free_blocks == 3
    assert admit(m, req("c", [1, 2, 3])) is None
    m.free(a)
    m.free(b)
    assert m.num_free_blocks == m.pool.num_usable_blocks


def test_fork_shares_blocks_and_copies_on_first_write() -> None:
    m = make()
    a = req("a", list(range(40)))
    admit(m, a)
    a.append_token_id(99)  # first sampled token
    c = a.fork("c")
    m.fork(a, c)
    assert ids(m, "c") == [1, 2, 3] and [m.pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2] * 3
    m.check_integrity()
    # The child writes token 40 into shared partial block 3 -> private copy 4.
    assert m.allocate_slots(c, 1).get_block_ids() == ([],)  # type: ignore[union-attr]
    assert ids(m, "c") == [1, 2, 4] and m.take_pending_copies() == [(3, 4)]
    assert m.take_block_replacements() == [("c", 0, 2, 4)]
    assert m.take_pending_copies() == []
    # The parent is now the sole owner of block 3: no copy.
    m.allocate_slots(a, 1)
    assert ids(m, "a") == [1, 2, 3] and m.take_pending_copies() == []
    m.check_integrity()
    m.free(a)
    m.free(c)
    assert m.num_free_blocks == 10
    m.check_integrity()


def test_fork_copy_needs_a_free_block() -> None:
    m = make(num_blocks=4)
    a = req("a", list(range(40)))
    admit(m, a)
    c = a.fork("c")
    m.fork(a, c)
    before = [b.ref_cnt for b in m.pool.blocks]
    assert m.allocate_slots(c, 1) is None
    assert [b.ref_cnt for b in m.pool.blocks] == before and m.take_pending_copies() == []
    m.free(a)
    assert m.allocate_slots(c, 1) is not None and m.take_pending_copies() == []


def test_virtual_block_factor_scales_block_size() -> None:
    m = KVCacheManager(None, 11, B, max_model_len=2048, virtual_block_factor=4)
    assert m.block_size == 64
    r = SimpleRequest("a", list(range(100)), BlockHasher(m.block_size))
    assert m.allocate_slots(r, 100).get_block_ids() == ([1, 2],)  # type: ignore[union-attr]
    m.check_integrity()


# ----------------------------------------------------------------- sliding window
def cached_pool(cached_idx: set[int], n: int = 4):  # type: ignore[no-untyped-def]
    """A pool whose blocks 1..n hold request blocks 0..n-1; only `cached_idx` stay cached."""
    from pagedserve.kv.group_managers import SlidingWindowManager

    pool = BlockPool(11)
    hashes = HASHER_HASHES[:n]
    blocks = pool.get_new_blocks(n)
    for i in cached_idx:
        pool.cache_full_blocks(blocks, hashes, i, i + 1, 0)
    pool.free_blocks(reversed(blocks))
    return pool, hashes, SlidingWindowManager


HASHER_HASHES: list[bytes] = []
HASHER.extend(HASHER_HASHES, list(range(64)))


def sw_hit(cached: set[int], window: int, max_blocks: int = 4) -> list[int]:
    pool, hashes, cls = cached_pool(cached)
    spec = SlidingWindowSpec(B, 2, 8, 2, sliding_window=window)
    mgr = cls(spec, B, 0, pool)
    return [b.block_id for b in mgr.find_longest_cache_hit(hashes, max_blocks, [0])[0]]


def test_sliding_window_hit_examples() -> None:
    # W=32, B=16: a hit needs the last ceil(31/16) = 2 blocks.
    assert sw_hit({2, 3}, 32) == [0, 0, 3, 4]  # evicted head
    assert sw_hit({0, 1, 2, 3}, 32) == [0, 0, 3, 4]  # only the window is needed
    assert sw_hit({0, 1, 3}, 32) == [1, 2]  # evicted middle: fall back to the run at 1..2
    assert sw_hit({0, 1, 2, 3}, 32, max_blocks=3) == [0, 2, 3]
    assert sw_hit({3}, 32) == []
    # W=64: needs 4 blocks; no full window cached -> the run from block 0.
    assert sw_hit({0, 1}, 64) == [1, 2]
    assert sw_hit({1, 2, 3}, 64) == []


def test_sliding_window_frees_blocks_leaving_the_window() -> None:
    m = make([SW32])
    a = req("a", list(range(40)))
    admit(m, a)
    assert ids(m, "a") == [1, 2, 3]
    for _ in range(7):  # allocations at computed 40..46: fewer than 16 tokens skipped
        decode(m, a)
    assert ids(m, "a") == [1, 2, 3]
    decode(m, a)  # at computed 47 the window is 16..47: tokens 0..15 (block 0) are out
    assert ids(m, "a") == [0, 2, 3]
    decode(m, a)  # token 48 needs a fourth block
    assert ids(m, "a") == [0, 2, 3, 4]
    assert queue(m)[-1] == 1 and m.pool.blocks[1].block_hash is not None  # still hittable
    for _ in range(16):
        decode(m, a)
    assert ids(m, "a") == [0, 0, 3, 4, 5]
    m.free(a)
    assert m.num_free_blocks == 10
    m.check_integrity()


def test_hybrid_full_and_sliding_reconciliation() -> None:
    m = make([FULL, SW32])
    prompt = list(range(80))
    a = req("a", prompt)
    assert admit(m, a) == ([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], 0)
    m.free(a)
    assert queue(m) == [5, 4, 3, 2, 1, 10, 9, 8, 7, 6]
    # Both kinds agree on 80 tokens: full needs all 5 blocks, sliding only its last 2.
    hit_blocks, hit = m.get_computed_blocks(req("b", prompt + [1]))
    assert hit == 80 and hit_blocks.get_block_ids() == ([1, 2, 3, 4, 5], [0, 0, 0, 9, 10])
    # Evict the sliding group's last block: sliding lowers the length to 64, full is trimmed.
    evict(m.pool, m.pool.blocks[10])
    hit_blocks, hit = m.get_computed_blocks(req("c", prompt + [1]))
    assert hit == 64 and hit_blocks.get_block_ids() == ([1, 2, 3, 4], [0, 0, 8, 9])
    # Evict full block index 2: full lowers to 32; sliding must re-check its window there.
    evict(m.pool, m.pool.blocks[3])
    hit_blocks, hit = m.get_computed_blocks(req("d", prompt + [1]))
    assert hit == 32 and hit_blocks.get_block_ids() == ([1, 2], [6, 7])
    # Evict sliding block index 0: the window at 32 needs blocks 0 and 1 -> then 16 -> 0.
    evict(m.pool, m.pool.blocks[6])
    e = req("e", prompt + [1])
    hit_blocks, hit = m.get_computed_blocks(e)
    assert hit == 0 and hit_blocks.get_block_ids() == ([], [])
    m.check_integrity()


def test_hybrid_admission_with_hit_references_both_groups() -> None:
    m = make([FULL, SW32])
    prompt = list(range(80))
    a = req("a", prompt)
    admit(m, a)
    m.free(a)
    # Queue [5, 4, 3, 2, 1, 10, 9, 8, 7, 6]. 65 tokens: hit 64 = full [1..4] + sliding
    # [null, null, 8, 9]; touching takes 1-4 and 8-9 out of the queue, then each group needs
    # one new block: 5 (evicting full block 4's old hash) and 10.
    f = req("f", prompt[:64] + [1])
    assert admit(m, f) == ([[5], [10]], 64)
    assert m.get_block_ids("f") == ([1, 2, 3, 4, 5], [0, 0, 8, 9, 10])
    assert queue(m) == [7, 6]
    m.free(f)
    assert queue(m) == [7, 6, 5, 4, 3, 2, 1, 10, 9, 8]
    m.check_integrity()


def evict(pool: BlockPool, target) -> None:  # type: ignore[no-untyped-def]
    """Force the lazy eviction of one free cached block (test helper)."""
    others = [b for b in pool.free_block_queue if b is not target]
    pool.touch(others)
    (got,) = pool.get_new_blocks(1)
    assert got is target and got.block_hash is None
    pool.free_blocks([got, *others])


def test_block_fill_snapshot_counts_shared_blocks_once() -> None:
    m = make()
    a = req("a", list(range(40)))
    admit(m, a)
    c = a.fork("c")
    m.fork(a, c)
    snap = m.block_fill_snapshot()
    assert snap.dtype == np.int32 and snap.shape == (11,)
    assert snap.tolist() == [0, 16, 16, 8, 0, 0, 0, 0, 0, 0, 0]


def test_prefix_stats_and_usage() -> None:
    m = make()
    a = req("a", list(range(64)))
    admit(m, a)
    assert m.usage == 0.4
    b = req("b", list(range(64)))
    admit(m, b)
    s = m.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (2, 128, 48) and s.hit_rate == 48 / 128
    assert m.usage == 0.5  # b shares 3 blocks and adds 1


def test_sliding_window_fork_shares_nulls_and_frees_cleanly() -> None:
    m = make([SW32])
    a = req("a", list(range(60)))
    admit(m, a)
    for _ in range(5):
        decode(m, a)
    c = a.fork("c")
    m.fork(a, c)
    assert ids(m, "c") == ids(m, "a") and ids(m, "a")[0] == 0
    for _ in range(20):
        decode(m, a)
        decode(m, c)
    assert len(m.take_pending_copies()) == 1
    m.free(a)
    m.free(c)
    assert m.num_free_blocks == 10
    m.check_integrity()
