"""swap_blocks: whole-block copies between a device pool and a host pool, in every layer."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import KernelArgumentError, swap_blocks


def test_swap_blocks_copies_between_pools_with_their_own_ids() -> None:
    g = torch.Generator().manual_seed(3)
    device = [torch.randn(6, 2, 4, 2, 8, generator=g) for _ in range(3)]  # 6 device blocks
    host = [torch.zeros(10, 2, 4, 2, 8) for _ in range(3)]  # 10 host blocks
    out_pairs = torch.tensor([[5, 9], [1, 2], [3, 1]], dtype=torch.int64)
    swap_blocks(device, host, out_pairs)
    for d, h in zip(device, host, strict=True):
        for s, t in out_pairs.tolist():
            assert torch.equal(h[t], d[s])
        assert not h[0].any() and not h[3].any()  # untouched host blocks stay as they were
    before = [d.clone() for d in device]
    swap_blocks(host, device, torch.tensor([[9, 0], [2, 4]], dtype=torch.int64))
    for d, b in zip(device, before, strict=True):
        assert torch.equal(d[0], b[5]) and torch.equal(d[4], b[1])
        assert torch.equal(d[1:4], b[1:4]) and torch.equal(d[5], b[5])


def test_swap_blocks_rejects_bad_pairs() -> None:
    dev, host = [torch.zeros(4, 2, 2, 1, 4)], [torch.zeros(3, 2, 2, 1, 4)]
    swap_blocks(dev, host, torch.empty(0, 2, dtype=torch.int64))  # nothing to do
    with pytest.raises(KernelArgumentError, match="destination block ids"):
        swap_blocks(dev, host, torch.tensor([[1, 3]]))
    with pytest.raises(KernelArgumentError, match="distinct"):
        swap_blocks(dev, host, torch.tensor([[1, 2], [3, 2]]))
    with pytest.raises(KernelArgumentError, match="differ"):
        swap_blocks(dev, [torch.zeros(3, 2, 4, 1, 4)], torch.tensor([[1, 2]]))
    with pytest.raises(KernelArgumentError, match="one source"):
        swap_blocks(dev, [], torch.tensor([[1, 2]]))
