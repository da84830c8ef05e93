"""Bad inputs raise typed errors and leave the manager exactly as it was."""

from __future__ import annotations

import pytest
from helpers.kv_requests import SimpleRequest

from pagedserve.kv import (
    BlockHasher,
    DoubleFreeError,
    InvalidArgumentError,
    KVCacheError,
    KVCacheManager,
    RequestTooLargeError,
    SlidingWindowSpec,
    UnknownRequestError,
)

B = 16
HASHER = BlockHasher(B)


def fresh() -> tuple[KVCacheManager, SimpleRequest]:
    m = KVCacheManager(None, 11, B, max_model_len=256)
    a = SimpleRequest("a", list(range(40)), HASHER)
    assert m.allocate_slots(a, 40) is not None
    a.num_computed_tokens = 40
    return m, a


def state(m: KVCacheManager):  # type: ignore[no-untyped-def]
    return (
        [b.block_id for b in m.pool.free_block_queue],
        [(b.ref_cnt, b.block_hash) for b in m.pool.blocks],
        {k: [b.block_id for b in v] for k, v in m.managers[0].req_to_blocks.items()},
    )


def assert_unchanged(m: KVCacheManager, before) -> None:  # type: ignore[no-untyped-def]
    m.check_integrity()
    assert state(m) == before and m.num_free_blocks == 7


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_new_tokens": 0},
        {"num_new_tokens": -1},
        {"num_new_tokens": 1, "num_new_computed_tokens": -16},
        {"num_new_tokens": 1, "num_new_computed_tokens": 16},  # hit tokens without blocks
        {"num_new_tokens": 300},  # beyond max_model_len
    ],
)
def test_invalid_allocate_arguments(kwargs) -> None:  # type: ignore[no-untyped-def]
    m, a = fresh()
    before = state(m)
    with pytest.raises(InvalidArgumentError) as exc:
        m.allocate_slots(a, **kwargs)
    assert isinstance(exc.value, KVCacheError) and isinstance(exc.value, ValueError)
    assert_unchanged(m, before)


def test_hit_blocks_for_a_running_request_are_rejected() -> None:
    m, a = fresh()
    b = SimpleRequest("b", list(range(40)), HASHER)
    hit_blocks, hit = m.get_computed_blocks(b)
    assert hit == 32
    before = state(m)
    with pytest.raises(InvalidArgumentError):
        m.allocate_slots(a, 1, hit, hit_blocks)
    with pytest.raises(InvalidArgumentError):
        m.allocate_slots(b, 8, 16, hit_blocks)  # count does not match the blocks
    assert_unchanged(m, before)


def test_stale_prefix_hit_is_rejected() -> None:
    m, a = fresh()
    m.free(a)  # blocks 3, 2, 1 free but cached, at the back of the queue
    b = SimpleRequest("b", list(range(40)), HASHER)
    hit_blocks, hit = m.get_computed_blocks(b)
    assert hit == 32
    # Another request re-uses (and so evicts) every free block before b allocates.
    other = SimpleRequest("o", list(range(500, 660)), HASHER)
    assert m.allocate_slots(other, 160) is not None
    m.free(other)
    before = state(m)
    with pytest.raises(InvalidArgumentError):
        m.allocate_slots(b, 8, hit, hit_blocks)
    assert state(m) == before
    m.check_integrity()


def test_double_free_and_unknown_request() -> None:
    m, a = fresh()
    m.free(a)
    free_after = m.num_free_blocks
    with pytest.raises(DoubleFreeError):
        m.free(a)
    with pytest.raises(UnknownRequestError):
        m.free("never-seen")
    with pytest.raises(UnknownRequestError):
        m.get_block_ids("never-seen")
    with pytest.raises(UnknownRequestError):
        m.fork("never-seen", "x")
    m.check_integrity()
    assert m.num_free_blocks == free_after == 10
    # A preempted (freed) request can be admitted again under the same id.
    a.num_computed_tokens = 0
    assert m.allocate_slots(a, 40) is not None
    m.free(a)
    with pytest.raises(DoubleFreeError):
        m.free("a")


def test_fork_into_existing_request_rejected() -> None:
    m, a = fresh()
    b = SimpleRequest("b", [1, 2, 3], HASHER)
    m.allocate_slots(b, 3)
    before = [blk.ref_cnt for blk in m.pool.blocks]
    with pytest.raises(InvalidArgumentError):
        m.fork(a, b)
    assert [blk.ref_cnt for blk in m.pool.blocks] == before
    m.check_integrity()


def test_request_too_large_for_the_cache() -> None:
    m = KVCacheManager(None, 11, B, max_model_len=1000)
    m.check_admissible(160)  # exactly 10 blocks: fits an empty cache
    with pytest.raises(RequestTooLargeError):
        m.check_admissible(161)
    with pytest.raises(RequestTooLargeError):
        m.check_admissible(1001)  # beyond max_model_len
    with pytest.raises(InvalidArgumentError):
        m.check_admissible(-1)
    # A sliding-window model's footprint is the window, not the length.
    sw = KVCacheManager([SlidingWindowSpec(B, 1, 1, 1, sliding_window=32)], 11, B, 4096)
    sw.check_admissible(4096)
    reserve = KVCacheManager(None, 11, B, max_model_len=1000, policy="reserve")
    with pytest.raises(RequestTooLargeError):
        reserve.check_admissible(10)
    m.check_integrity()
    assert m.num_free_blocks == 10


def test_bad_construction() -> None:
    with pytest.raises(InvalidArgumentError):
        KVCacheManager(None, 1, B, 100)
    with pytest.raises(InvalidArgumentError):
        KVCacheManager(None, 11, B, 100, policy="contiguous")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        KVCacheManager([SlidingWindowSpec(8, 1, 1, 1, 32)], 11, B, 100)
    with pytest.raises(InvalidArgumentError):
        KVCacheManager([SlidingWindowSpec(B, 1, 1, 1, 32)], 11, B, 100, virtual_block_factor=2)
    with pytest.raises(InvalidArgumentError):
        KVCacheManager([], 11, B, 100)
