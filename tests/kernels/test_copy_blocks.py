"""copy_blocks: whole-block copy-on-write copies in every layer."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import (
    KernelArgumentError,
    copy_blocks,
    copy_blocks_ref,
    triton_copy_blocks,
)

IMPLS = {"ref": copy_blocks_ref, "triton": triton_copy_blocks, "dispatch": copy_blocks}


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("dtype,as_list", [(torch.float32, False), (torch.float16, True)])
def test_copy_blocks(impl, dtype, as_list) -> None:
    g = torch.Generator().manual_seed(7)
    caches = [torch.randn(9, 2, 8, 2, 64, generator=g).to(dtype) for _ in range(3)]
    pairs = [[4, 0], [4, 7], [1, 3], [8, 2]]  # one source may feed several destinations
    want = [c.clone() for c in caches]
    for w in want:
        for s, d in pairs:
            w[d] = w[s]
    arg = pairs if as_list else torch.tensor(pairs, dtype=torch.int64)
    IMPLS[impl](caches, arg)
    for got, exp in zip(caches, want, strict=True):
        assert torch.equal(got, exp)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_copy_blocks_empty_and_bad(impl) -> None:
    caches = [torch.randn(4, 2, 8, 1, 16)]
    before = caches[0].clone()
    IMPLS[impl](caches, torch.empty(0, 2, dtype=torch.int64))
    assert torch.equal(caches[0], before)
    with pytest.raises(KernelArgumentError, match="outside"):
        IMPLS[impl](caches, [[0, 4]])
    with pytest.raises(KernelArgumentError, match=r"\[n, 2\]"):
        IMPLS[impl](caches, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(KernelArgumentError, match="non-empty list"):
        IMPLS[impl](caches[0], [[0, 1]])
