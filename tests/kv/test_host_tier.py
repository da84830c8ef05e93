"""Host-tier scenarios with exact block ids: swap out and in, offload on eviction, host prefix
hits, stale hits, aborts of swapped requests, and what cannot be expressed."""

from __future__ import annotations

import pytest
from helpers.kv_requests import SimpleRequest

from pagedserve.kv import BlockHasher, InvalidArgumentError, KVCacheManager, UnknownRequestError

B = 4
H = BlockHasher(B)


def req(rid: str, tokens: list[int]) -> SimpleRequest:
    return SimpleRequest(rid, tokens, H)


def run(m: KVCacheManager, r: SimpleRequest, n: int | None = None) -> None:
    """Admit ``r`` with its prefix hit and compute its whole prompt."""
    hit_blocks, hit = m.get_computed_blocks(r)
    n = r.num_tokens - hit if n is None else n
    assert m.allocate_slots(r, n, hit, hit_blocks if hit else None) is not None
    r.num_computed_tokens = hit + n


def test_swap_out_and_in_round_trip_copies_each_block_once() -> None:
    m = KVCacheManager(None, 8, B, 64, num_host_blocks=8)
    r = req("a", list(range(1, 11)))  # 10 tokens: 3 blocks, the last one partial
    run(m, r)
    dev = m.get_block_ids("a")[0]
    m.take_tier_copies()
    assert m.swap_out(r)
    assert m.is_swapped("a") and m.has_request("a") and m.num_free_blocks == 7
    to_host, to_device = m.take_tier_copies()
    assert [s for s, _ in to_host] == dev and not to_device
    host_ids = [d for _, d in to_host]
    m.check_integrity()
    r.append_token_id(7)
    assert m.swap_in(r, 1) is not None  # the 11th token still fits the third block
    to_host, to_device = m.take_tier_copies()
    assert not to_host and [s for s, _ in to_device] == host_ids
    assert [d for _, d in to_device] == m.get_block_ids("a")[0]
    m.check_integrity()
    m.free(r)
    assert m.num_free_blocks == 7 and m.host.num_free_blocks == 7


def test_swap_in_of_a_request_that_was_never_swapped_out_is_refused() -> None:
    m = KVCacheManager(None, 8, B, 64, num_host_blocks=8)
    r = req("a", [1, 2, 3])
    with pytest.raises(UnknownRequestError, match="not swapped out"):
        m.swap_in(r, 1)
    run(m, r)
    with pytest.raises(UnknownRequestError):
        m.swap_in(r, 1)  # running on the device, not swapped
    assert not KVCacheManager(None, 8, B, 64).swap_out(r)  # no host tier: recompute
    m.check_integrity()


def test_swap_out_refused_without_room_changes_nothing() -> None:
    m = KVCacheManager(None, 8, B, 64, num_host_blocks=3)  # two usable host blocks
    r = req("a", list(range(1, 13)))
    run(m, r)
    assert not m.swap_out(r)
    assert m.get_block_ids("a")[0] and m.host.stats.swap_fallbacks == 1
    m.check_integrity()


def test_evicted_prefix_blocks_go_to_the_host_and_come_back_on_a_hit() -> None:
    m = KVCacheManager(None, 5, B, 64, num_host_blocks=8)  # four usable device blocks
    a = req("a", list(range(1, 10)))  # two full blocks + 1 token
    run(m, a)
    m.free(a)
    a_blocks = sorted(b.block_id for b in m.pool.blocks if b.block_hash is not None)
    b = req("b", list(range(50, 66)))  # four blocks: evicts both of a's cached blocks
    run(m, b)
    to_host, _ = m.take_tier_copies()
    assert sorted(s for s, _ in to_host) == a_blocks
    m.free(b)
    c = req("c", list(range(1, 9)) + [99, 98])  # a's two full blocks, then its own
    hit_blocks, hit = m.get_computed_blocks(c)
    assert hit == 8 and len(hit_blocks.host) == 2 and not hit_blocks.blocks[0]
    assert m.allocate_slots(c, 2, hit, hit_blocks) is not None
    _, to_device = m.take_tier_copies()
    assert sorted(s for s, _ in to_device) == sorted(h for _, h in to_host)
    assert [d for _, d in to_device] == m.get_block_ids("c")[0][:2]
    assert m.prefix_cache_stats.host_hits == 8
    m.check_integrity()


def test_a_stale_host_hit_is_refused() -> None:
    m = KVCacheManager(None, 5, B, 64, num_host_blocks=3)  # two usable host blocks
    a = req("a", list(range(1, 10)))
    run(m, a)
    m.free(a)
    run(m, x := req("x", list(range(50, 66))))  # a's blocks move to the host
    m.take_tier_copies()
    m.free(x)
    c = req("c", list(range(1, 10)))
    hit_blocks, hit = m.get_computed_blocks(c)
    assert len(hit_blocks.host) == 2
    # Two other blocks evicted from the device take the host's two blocks in the meantime.
    run(m, y := req("y", list(range(200, 216))))
    m.take_tier_copies()
    with pytest.raises(InvalidArgumentError, match="stale host-tier hit"):
        m.allocate_slots(c, 1, hit, hit_blocks)
    m.free(y)
    m.check_integrity()


def test_aborting_a_swapped_request_cancels_its_unshipped_copies() -> None:
    m = KVCacheManager(None, 8, B, 64, num_host_blocks=8)
    r = req("a", list(range(1, 11)))
    run(m, r)
    m.take_tier_copies()
    assert m.swap_out(r)
    m.free(r)  # aborted before any step shipped the swap-out
    assert m.take_tier_copies() == ([], [])
    assert m.host.num_free_blocks == 7 and not m.has_request("a")
    m.check_integrity()
