"""Block tables: row operations, slot mapping and the DCP -1 mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.kernels import CPLayout
from pagedserve.workers.block_table import BlockTable, MultiGroupBlockTable

CPU = torch.device("cpu")


def table(**kw) -> BlockTable:
    args = {"max_num_reqs": 4, "max_num_blocks_per_req": 8, "block_size": 4, "device": CPU}
    return BlockTable(**{**args, **kw})


def test_row_operations():
    t = table()
    t.add_row([7, 3], 0)
    t.append_row([9], 0)
    t.add_row([5], 1)
    assert t.np[0, :3].tolist() == [7, 3, 9] and t.num_blocks[0] == 3
    t.move_row(0, 2)
    assert t.np[2, :3].tolist() == [7, 3, 9] and t.num_blocks[2] == 3
    t.move_row(1, 2)  # a shorter row over a longer one leaves no stale ids
    assert t.np[2].tolist() == [5] + [0] * 7 and t.num_blocks[2] == 1
    t.clear_row(2)
    assert t.num_blocks[2] == 0 and not t.np[2].any()
    t.add_row([1, 2], 3)
    assert t.commit(4)[3, :2].tolist() == [1, 2]
    with pytest.raises(ValueError):
        t.append_row(list(range(10)), 0)
    # Blocks the controller gave back (rejected drafts' slots): cut, then appended after.
    t.truncate_row(0, 1)
    t.append_row([4], 0)
    assert t.np[0].tolist() == [7, 4] + [0] * 6 and t.num_blocks[0] == 2
    t.truncate_row(0, 5)  # never grows a row
    assert t.num_blocks[0] == 2


def test_slot_mapping_without_cp():
    t = table()
    t.add_row([7, 3, 9], 0)
    t.add_row([2], 1)
    rows = np.array([0] * 10 + [1, 1])
    pos = np.array(list(range(10)) + [0, 3])
    expected = [7 * 4 + p for p in range(4)] + [3 * 4 + p for p in range(4)] + [36, 37]
    assert t.slot_mapping(rows, pos).tolist() == expected + [8, 11]


def _reference_slots(ids, positions, b, w, inter, rank):
    """The DCP slot rule written out directly for one request: virtual block V = B * W,
    owner (off // I) % W, local offset (off // (W * I)) * I + off % I, else -1."""
    out = []
    v = b * w
    for p in positions:
        off = p % v
        owner = (off // inter) % w
        local = (off // (w * inter)) * inter + off % inter
        out.append(ids[p // v] * b + local if owner == rank else -1)
    return out


@pytest.mark.parametrize("w", [2, 3])
@pytest.mark.parametrize("interleave", [1, 4])  # I = 1 and I = B
def test_slot_mapping_with_dcp(w, interleave):
    b = 4
    ids = [5, 2, 8]
    positions = list(range(b * w * len(ids)))
    owners = []
    seen_slots = set()
    for rank in range(w):
        t = table(cp=CPLayout(rank, w, interleave))
        t.add_row(ids, 1)
        got = t.slot_mapping(np.ones(len(positions), dtype=np.int64), np.array(positions))
        assert got.tolist() == _reference_slots(ids, positions, b, w, interleave, rank)
        mine = got[got >= 0]
        # A rank stores exactly 1/W of the tokens, densely packed into its copies of the blocks.
        assert sorted(mine.tolist()) == sorted(i * b + o for i in ids for o in range(b))
        seen_slots.update((rank, s) for s in mine.tolist())
        owners.append(got >= 0)
    # Every token has exactly one owner.
    assert (np.sum(owners, axis=0) == 1).all()
    if interleave == 1:
        assert owners[0][:w].tolist() == [True] + [False] * (w - 1)  # round robin
    else:
        assert owners[0][:b].all() and not owners[0][b : 2 * b].any()  # rank 0's block first


def test_slot_mapping_matches_kernel_cp_layout():
    from pagedserve.kernels import cp_owner_and_offset

    b, w, inter = 8, 3, 2
    t = table(block_size=b, cp=CPLayout(1, w, inter))
    t.add_row([4, 6], 0)
    pos = np.arange(2 * b * w)
    owner, local = cp_owner_and_offset(pos, b, w, inter)
    expected = np.where(owner == 1, np.array([4, 6])[pos // (b * w)] * b + local, -1)
    assert t.slot_mapping(np.zeros_like(pos), pos).tolist() == expected.tolist()


def test_multi_group_fans_out():
    tables = MultiGroupBlockTable([table(), table()])
    tables.add_row([[1, 2], [3]], 0)
    tables.append_row([[4], []], 0)
    assert tables[0].np[0, :3].tolist() == [1, 2, 4] and tables[1].np[0, :1].tolist() == [3]
    tables.move_row(0, 2)
    tables.clear_row(0)
    assert tables[0].num_blocks.tolist() == [0, 0, 3, 0] and tables[1].num_blocks[2] == 1
