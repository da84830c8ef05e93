"""The DCP slot-owner formula: owner/offset, its inverse, and per-rank lengths."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cp_global_position, cp_local_seq_len, cp_owner_and_offset


@pytest.mark.parametrize("block_size,cp_size,interleave", [
    (8, 1, 1), (8, 2, 1), (8, 3, 8), (16, 4, 4), (16, 3, 1), (32, 4, 32),
])
def test_layout_round_trip(block_size: int, cp_size: int, interleave: int) -> None:
    pos = torch.arange(5 * block_size * cp_size + 3)
    owner, local = cp_owner_and_offset(pos, block_size, cp_size, interleave)
    assert ((0 <= owner) & (owner < cp_size)).all()
    assert ((0 <= local) & (local < block_size)).all()
    for rank in range(cp_size):
        mine = pos[owner == rank]
        # Local index = virtual block * B + offset; it must enumerate 0, 1, 2, ... in order.
        j = (mine // (block_size * cp_size)) * block_size + local[owner == rank]
        assert torch.equal(j, torch.arange(mine.numel()))
        assert torch.equal(cp_global_position(j, rank, block_size, cp_size, interleave), mine)
        for n in range(pos.numel() + 1):
            want = int((mine < n).sum())
            assert cp_local_seq_len(n, rank, cp_size, interleave) == want
        lens = cp_local_seq_len(torch.arange(pos.numel() + 1), rank, cp_size, interleave)
        assert torch.equal(lens, (mine.unsqueeze(0) < torch.arange(pos.numel() + 1)[:, None])
                           .sum(1))


def test_interleave_one_is_round_robin_and_block_fills_rank_by_rank() -> None:
    owner, _ = cp_owner_and_offset(torch.arange(12), 4, 3, 1)
    assert owner.tolist() == [0, 1, 2] * 4
    owner, local = cp_owner_and_offset(torch.arange(12), 4, 3, 4)
    assert owner.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert local.tolist() == [0, 1, 2, 3] * 3
    assert cp_owner_and_offset(13, 4, 3, 1) == (1, 0)


def test_interleave_must_divide_block_size() -> None:
    with pytest.raises(ValueError, match="multiple of cp_interleave"):
        cp_owner_and_offset(3, 8, 2, 3)
