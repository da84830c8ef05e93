from __future__ import annotations

import random

import pytest

from pagedserve.kv.block_pool import FreeBlockQueue, KVBlock


def ids(q: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in q]


def test_initial_order_and_popleft() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert ids(q) == [0, 1, 2, 3, 4] and len(q) == 5
    assert q.popleft() is blocks[0]
    assert [b.block_id for b in q.popleft_n(2)] == [1, 2]
    assert ids(q) == [3, 4]
    q.check_links()
    assert blocks[1].prev is None and blocks[1].next is None


def test_remove_middle_append_n() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4]
    q.append(blocks[2])
    assert ids(q) == [0, 1, 3, 4, 2]
    q.popleft_n(5)
    assert len(q) == 0 and ids(q) == []
    with pytest.raises(IndexError):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft_n(1)
    q.append_n([blocks[4], blocks[0]])
    assert ids(q) == [4, 0]
    with pytest.raises(ValueError):
        q.remove(blocks[1])  # not linked
    q.check_links()


def test_random_ops_match_reference_list() -> None:
    rng = random.Random(0)
    blocks = [KVBlock(i) for i in range(40)]
    q = FreeBlockQueue(blocks)
    ref = list(range(40))
    for _ in range(3000):
        op = rng.randrange(5)
        if op == 0 and ref:
            assert q.popleft().block_id == ref.pop(0)
        elif op == 1 and ref:
            n = rng.randint(0, len(ref))
            got = [b.block_id for b in q.popleft_n(n)]
            assert got == ref[:n]
            del ref[:n]
        elif op == 2 and ref:
            victim = rng.choice(ref)
            q.remove(blocks[victim])
            ref.remove(victim)
        else:
            outside = [i for i in range(40) if i not in ref]
            rng.shuffle(outside)
            chosen = outside[: rng.randint(0, min(3, len(outside)))]
            if len(chosen) == 1:
                q.append(blocks[chosen[0]])
            else:
                q.append_n(blocks[i] for i in chosen)
            ref.extend(chosen)
        assert ids(q) == ref
        assert q.num_free_blocks == len(ref)
        q.check_links()
