"""reshape_and_cache: scatter new tokens' keys and values into their paged-cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels._checks import TRITON_FLOAT_DTYPES, check_reshape_and_cache


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, H_kv, D], float
    value_ptr,  # [T, H_kv, D], float
    cache_ptr,  # [num_blocks, 2, B, H_kv, D], float, contiguous
    slot_ptr,  # [T], int32/int64; -1 = skip
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    TOKEN_NUMEL: tl.constexpr,  # H_kv * D
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
):
    tok = tl.program_id(0)
    tile = tl.program_id(1)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    idx = tile * TILE + tl.arange(0, TILE)  # [TILE] flat (head, dim) index
    mask = (idx < TOKEN_NUMEL) & ((idx * 0 + slot) >= 0)  # broadcast the skip to the tile
    head = idx // HEAD_DIM
    dim = idx % HEAD_DIM
    k = tl.load(key_ptr + tok.to(tl.int64) * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(value_ptr + tok.to(tl.int64) * stride_vt + head * stride_vh + dim, mask=mask)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    k_dst = cache_ptr + blk * (2 * BLOCK_SIZE * TOKEN_NUMEL) + off * TOKEN_NUMEL + idx
    tl.store(k_dst, k, mask=mask)
    tl.store(k_dst + BLOCK_SIZE * TOKEN_NUMEL, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [T, H_kv, D]
    value: torch.Tensor,  # [T, H_kv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, B, H_kv, D], contiguous
    slot_mapping: torch.Tensor,  # [T], int32/int64; slot = block_id * B + offset; -1 = skip
) -> None:
    """Triton twin of :func:`pagedserve.kernels.reference.reshape_and_cache_ref`."""
    check_reshape_and_cache(key, value, kv_cache, slot_mapping, TRITON_FLOAT_DTYPES)
    num_tokens, h_kv, d = key.shape
    if num_tokens == 0:
        return
    numel = h_kv * d
    tile = min(1024, triton.next_power_of_2(numel))
    grid = (num_tokens, triton.cdiv(numel, tile))
    _reshape_and_cache_kernel[grid](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        HEAD_DIM=d, TOKEN_NUMEL=numel, BLOCK_SIZE=kv_cache.shape[2], TILE=tile,
    )
