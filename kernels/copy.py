"""copy_blocks: copy whole KV blocks src -> dst in every layer (copy-on-write)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from pagedserve.kernels._checks import check_copy_blocks


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,  # [num_blocks, BLOCK_NUMEL], any dtype, contiguous
    pairs_ptr,  # [n, 2], int64 (src, dst)
    BLOCK_NUMEL: tl.constexpr,
    TILE: tl.constexpr,
):
    pair = tl.program_id(0)
    tile = tl.program_id(1)
    src = tl.load(pairs_ptr + 2 * pair)
    dst = tl.load(pairs_ptr + 2 * pair + 1)
    idx = tile * TILE + tl.arange(0, TILE)
    mask = idx < BLOCK_NUMEL
    x = tl.load(cache_ptr + src * BLOCK_NUMEL + idx, mask=mask)
    tl.store(cache_ptr + dst * BLOCK_NUMEL + idx, x, mask=mask)


def copy_blocks(
    kv_caches: Sequence[torch.Tensor],  # per layer [num_blocks, ...], contiguous
    src_to_dst: torch.Tensor | Sequence[Sequence[int]],  # [n, 2] int64 (src, dst) block ids
) -> None:
    """Triton twin of :func:`pagedserve.kernels.reference.copy_blocks_ref`."""
    pairs = check_copy_blocks(kv_caches, src_to_dst)
    if pairs.shape[0] == 0:
        return
    for cache in kv_caches:
        numel = cache[0].numel()
        tile = min(4096, triton.next_power_of_2(numel))
        grid = (pairs.shape[0], triton.cdiv(numel, tile))
        _copy_blocks_kernel[grid](cache, pairs, BLOCK_NUMEL=numel, TILE=tile)
