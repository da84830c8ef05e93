"""Lookahead slots (``allocate_slots(..., num_lookahead_tokens=k)``, for speculative decoding):
blocks for k positions past the step's tokens, allocated all or nothing, re-used by later
steps, never hashed, made private before a write like written slots, released by ``free``.
The per-step fast path and the general path are compared on the same random steps."""

from __future__ import annotations

import pytest
from helpers.kv_requests import SimpleRequest
from helpers.kv_state import check_hashes_cover_real_tokens, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.kv import (
    BlockHasher,
    FullAttentionSpec,
    InvalidArgumentError,
    KVCacheManager,
    SlidingWindowSpec,
)

B = 4
HASHER = BlockHasher(B)
FULL = FullAttentionSpec(B, 1, 1, 1)
SW8 = SlidingWindowSpec(B, 1, 1, 1, sliding_window=8)


def make(specs=None, num_blocks: int = 20, **kw) -> KVCacheManager:  # type: ignore[no-untyped-def]
    kw.setdefault("max_model_len", 64)
    return KVCacheManager(specs, num_blocks, B, **kw)


def req(rid: str, tokens: list[int]) -> SimpleRequest:
    return SimpleRequest(rid, tokens, HASHER)


def ids(m: KVCacheManager, rid: str, group: int = 0) -> list[int]:
    return m.get_block_ids(rid)[group]


def step(m: KVCacheManager, r: SimpleRequest, n: int, lookahead: int) -> bool:
    """One scheduled step of ``n`` tokens with ``lookahead`` draft slots; checks invariants."""
    out = m.allocate_slots(r, n, num_lookahead_tokens=lookahead)
    m.check_integrity()
    check_hashes_cover_real_tokens(m, [r])
    if out is None:
        return False
    r.num_computed_tokens += n
    return True


def _no_general_path(*args: object) -> None:
    raise AssertionError("a decode step left the fast path")


def test_lookahead_blocks_are_allocated_then_reused_and_never_hashed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m = make()
    r = req("a", list(range(8)))  # two full blocks
    # Prefill (general path: a new request) with 5 draft slots: 13 slots -> 4 blocks.
    new = m.allocate_slots(r, 8, num_lookahead_tokens=5)
    assert new is not None and new.get_block_ids() == ([1, 2, 3, 4],)
    r.num_computed_tokens = 8
    m.check_integrity()
    blocks = m.managers[0].req_to_blocks["a"]
    assert [b.block_hash is not None for b in blocks] == [True, True, False, False]
    assert len(m.pool.cached) == 2 and m.num_filled_tokens["a"] == 8
    assert list(m.block_fill_snapshot()[1:5]) == [4, 4, 0, 0]
    # Decode steps (the fast path) that stay within the lookahead take no block.
    monkeypatch.setattr(m.allocator, "allocate", _no_general_path)
    for lookahead in (4, 2, 0):
        r.append_token_id(7)
        assert m.allocate_slots(r, 1, num_lookahead_tokens=lookahead).get_block_ids() == ([],)
        r.num_computed_tokens += 1
        assert ids(m, "a") == [1, 2, 3, 4]
        m.check_integrity()
        check_hashes_cover_real_tokens(m, [r])
    # Token 11 completes block 3: hashed now that it holds real tokens; block 4 still not.
    r.append_token_id(7)
    assert step(m, r, 1, 0)
    assert [b.block_hash is not None for b in blocks] == [True, True, True, False]
    # Lookahead past what the request holds grows it on the fast path.
    r.append_token_id(7)
    assert m.allocate_slots(r, 1, num_lookahead_tokens=8).get_block_ids() == ([5, 6],)
    assert ids(m, "a") == [1, 2, 3, 4, 5, 6]
    m.free(r)
    m.check_integrity()
    assert m.num_free_blocks == m.pool.num_usable_blocks and m.usage == 0.0


@pytest.mark.parametrize("new_request", [True, False])
def test_lookahead_that_does_not_fit_returns_none_and_changes_nothing(new_request: bool) -> None:
    m = make(num_blocks=6)  # 5 usable
    a = req("a", list(range(6)))
    assert step(m, a, 6, 0)  # 2 blocks
    r = req("b", list(range(5))) if new_request else a
    if not new_request:
        r.append_token_id(7)
    n = 5 if new_request else 1
    before = snapshot(m)
    # 3 blocks free. b (the general path): 5 tokens + 8 slots = 4 blocks; 4 slots fit.
    # a (the fast path): 7 tokens + 14 slots = 6 blocks, 4 more; 10 slots fit.
    too_many = 8 if new_request else 14
    assert m.allocate_slots(r, n, num_lookahead_tokens=too_many) is None
    assert snapshot(m) == before
    m.check_integrity()
    assert m.allocate_slots(r, n, num_lookahead_tokens=too_many - 4) is not None
    m.check_integrity()


@pytest.mark.parametrize("new_request", [True, False])
def test_negative_lookahead_is_refused_before_any_change(new_request: bool) -> None:
    m = make()
    a = req("a", list(range(6)))
    assert step(m, a, 6, 0)
    r = req("b", list(range(5))) if new_request else a
    if not new_request:
        r.append_token_id(7)
    before = snapshot(m)
    with pytest.raises(InvalidArgumentError):
        m.allocate_slots(r, 5 if new_request else 1, num_lookahead_tokens=-1)
    assert snapshot(m) == before


def test_lookahead_is_capped_at_max_model_len() -> None:
    m = make(max_model_len=20)
    r = req("a", list(range(10)))
    assert step(m, r, 10, 100)
    assert len(ids(m, "a")) == 5  # ceil(20 / 4), not ceil(110 / 4)
    r.append_token_id(7)
    assert step(m, r, 1, 100)  # fast path position, capped by the general path
    assert len(ids(m, "a")) == 5


def test_lookahead_blocks_shared_by_a_fork_are_copied_before_the_child_writes() -> None:
    m = make()
    a = req("a", list(range(6)))
    assert step(m, a, 6, 5)  # 11 slots -> blocks [1, 2, 3], block 2 half written
    a.append_token_id(7)
    c = a.fork("c")
    m.fork(a, c)
    # The child writes token 6 and has drafts up to slot 10: blocks 2 and 3 are shared.
    assert step(m, c, 1, 4)
    assert ids(m, "c") == [1, 4, 5] and m.take_pending_copies() == [(2, 4), (3, 5)]
    assert m.take_block_replacements() == [("c", 0, 1, 4), ("c", 0, 2, 5)]
    # The parent owns 2 and 3 alone now: no copy, and the fast path takes it.
    assert step(m, a, 1, 4)
    assert ids(m, "a") == [1, 2, 3] and m.take_pending_copies() == []
    m.free(a)
    m.free(c)
    assert m.num_free_blocks == m.pool.num_usable_blocks


def test_a_shared_block_only_in_the_lookahead_range_is_copied_too() -> None:
    m = make()
    a = req("a", list(range(6)))
    assert step(m, a, 6, 8)  # 14 slots -> [1, 2, 3, 4]
    a.append_token_id(7)
    c = a.fork("c")
    m.fork(a, c)
    assert step(m, c, 1, 0)  # writes into shared block 2 only
    assert ids(m, "c") == [1, 5, 3, 4] and m.take_pending_copies() == [(2, 5)]
    c.append_token_id(7)
    # Token 7 goes into the now private block 5; drafts up to slot 11 reach shared block 3.
    assert step(m, c, 1, 4)
    assert ids(m, "c") == [1, 5, 6, 4] and m.take_pending_copies() == [(3, 6)]


@pytest.mark.parametrize(
    "specs,policy", [([FULL, SW8], "paged"), ([SW8], "paged"), ([FULL], "reserve")]
)
def test_general_path_layouts_allocate_lookahead(specs: list, policy: str) -> None:
    m = make(specs, num_blocks=60, policy=policy)
    r = req("a", list(range(9)))
    assert step(m, r, 9, 6)  # 15 slots -> 4 blocks per group (16 under reserve)
    want = 16 if policy == "reserve" else 4
    assert [len(b) for b in m.get_block_ids("a")] == [want] * len(specs)
    for _ in range(5):  # up to 14 tokens + 2 slots: within the 4 blocks
        r.append_token_id(1)
        assert step(m, r, 1, 2)
    assert [len(b) for b in m.get_block_ids("a")] == [want] * len(specs)
    r.append_token_id(1)
    assert step(m, r, 1, 6)  # 15 tokens + 6 slots -> 6 blocks
    assert [len(b) for b in m.get_block_ids("a")] == [max(want, 6)] * len(specs)
    m.free(r)
    m.check_integrity()
    assert m.num_free_blocks == m.pool.num_usable_blocks


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.integers(1, 6), st.integers(0, 9), st.booleans()), min_size=1, max_size=30
    ),
    num_blocks=st.integers(4, 24),
    prompt_len=st.integers(1, 20),
)
def test_fast_path_matches_the_general_path(
    steps: list[tuple[int, int, bool]], num_blocks: int, prompt_len: int
) -> None:
    """The same decode / chunked-prefill steps with lookahead on two managers, one forced onto
    the general path: identical results, blocks, hashes, fills and free queues throughout."""
    fast, slow = make(num_blocks=num_blocks), make(num_blocks=num_blocks)
    slow._fast_path = False
    rs = [req("a", list(range(prompt_len))), req("a", list(range(prompt_len)))]
    for m, r in zip((fast, slow), rs, strict=True):
        m.allocate_slots(r, 1)
        r.num_computed_tokens = 1
    r0 = rs[0]
    for n, lookahead, sample in steps:
        if sample and r0.num_computed_tokens == r0.num_tokens:
            if r0.num_tokens >= 60:
                break
            for r in rs:
                r.append_token_id(n)
        k = min(n, r0.num_tokens - r0.num_computed_tokens)
        if k == 0:
            continue
        outs = []
        for m, r in zip((fast, slow), rs, strict=True):
            out = m.allocate_slots(r, k, num_lookahead_tokens=lookahead)
            outs.append(None if out is None else out.get_block_ids())
            if out is not None:
                r.num_computed_tokens += k
            m.check_integrity()
            check_hashes_cover_real_tokens(m, [r])
        assert outs[0] == outs[1]
        assert snapshot(fast) == snapshot(slow)
    for m in (fast, slow):
        m.free("a")
        assert m.num_free_blocks == m.pool.num_usable_blocks
