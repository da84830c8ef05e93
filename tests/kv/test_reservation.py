"""The ``reserve`` policy with a per-request reservation (``reserve_tokens``), B=16."""

from __future__ import annotations

import pytest
from helpers.kv_requests import SimpleRequest

from pagedserve.kv import BlockHasher, InvalidArgumentError, KVCacheManager

B = 16
HASHER = BlockHasher(B)


def make(num_blocks: int = 11, **kw) -> KVCacheManager:  # type: ignore[no-untyped-def]
    kw.setdefault("max_model_len", 2048)
    kw.setdefault("policy", "reserve")
    return KVCacheManager(None, num_blocks, B, enable_caching=False, **kw)


def req(rid: str, n: int) -> SimpleRequest:
    return SimpleRequest(rid, list(range(1, n + 1)), HASHER)


def admit(m: KVCacheManager, r: SimpleRequest) -> bool:
    new = m.allocate_slots(r, r.num_tokens)
    m.check_integrity()
    if new is None:
        return False
    r.num_computed_tokens = r.num_tokens
    return True


def decode(m: KVCacheManager, r: SimpleRequest) -> list[int] | None:
    r.append_token_id(7)
    new = m.allocate_slots(r, 1)
    m.check_integrity()
    if new is None:
        return None
    r.num_computed_tokens += 1
    return new.get_block_ids()[0]


def test_reservation_is_held_from_admission_then_grows_on_demand() -> None:
    m = make(reserve_tokens=lambda r: 40)
    r = req("a", 20)
    assert admit(m, r)
    assert len(m.get_block_ids("a")[0]) == 3  # ceil(40 / 16)
    assert m.num_free_blocks == 10 - 3
    while r.num_tokens < 48:  # inside the reservation: nothing new
        assert decode(m, r) == []
    assert len(decode(m, r) or []) == 1  # token 49 outgrows it: one block on demand
    assert len(m.get_block_ids("a")[0]) == 4
    fill = m.block_fill_snapshot()
    assert int(fill.sum()) == r.num_computed_tokens == 49


def test_reservation_is_per_request_and_capped_at_max_model_len() -> None:
    sizes = {"a": 16, "b": 100, "c": 10_000}
    m = make(num_blocks=40, max_model_len=256, reserve_tokens=lambda r: sizes[r.request_id])
    for rid in sizes:
        assert admit(m, req(rid, 5))
    held = {rid: len(m.get_block_ids(rid)[0]) for rid in sizes}
    assert held == {"a": 1, "b": 7, "c": 16}  # c capped at ceil(256 / 16)
    assert m.reservation_tokens(req("c", 1)) == 256


def test_a_reservation_that_does_not_fit_changes_nothing() -> None:
    m = make(reserve_tokens=lambda r: 16 * 6)
    assert admit(m, req("a", 3))
    free = m.num_free_blocks
    assert not admit(m, req("b", 3))  # 6 more blocks, 4 free
    assert m.num_free_blocks == free and not m.has_request("b")
    m.free("a")
    assert admit(m, req("b", 3))


def test_preempted_request_reserves_again_on_readmission() -> None:
    m = make(reserve_tokens=lambda r: 64)
    r = req("a", 30)
    assert admit(m, r)
    m.free(r)
    r.num_computed_tokens = 0
    assert admit(m, r)
    assert len(m.get_block_ids("a")[0]) == 4


def test_default_reserve_is_max_model_len_and_paged_refuses_the_hook() -> None:
    m = make(num_blocks=20, max_model_len=100)
    assert admit(m, req("a", 3))
    assert len(m.get_block_ids("a")[0]) == 7  # ceil(100 / 16)
    assert m.reservation_tokens(req("x", 1)) == 100
    with pytest.raises(InvalidArgumentError):
        make(policy="paged", reserve_tokens=lambda r: 10)
    assert make(policy="paged").reservation_tokens(req("x", 1)) == 0


def test_bad_reservation_raises_before_any_change() -> None:
    m = make(reserve_tokens=lambda r: -1)
    with pytest.raises(InvalidArgumentError):
        m.allocate_slots(req("a", 3), 3)
    assert m.num_free_blocks == 10 and not m.has_request("a")
    m.check_integrity()
