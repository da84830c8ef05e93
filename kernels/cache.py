"""reshape_and_cache: scatter new tokens' keys and values into their paged-cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels._checks import (
    TRITON_KV_CACHE_DTYPES,
    check_kv_scales,
    check_reshape_and_cache,
)
from pagedserve.kernels.kv_quant import FP8_E4M3, FP8_MAX


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, H_kv, D], float
    value_ptr,  # [T, H_kv, D], float
    cache_ptr,  # [num_blocks, 2, B, H_kv, D], float or fp8, contiguous
    slot_ptr,  # [T], int32/int64; -1 = skip
    k_scale,  # float: the cache stores key / k_scale
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    TOKEN_NUMEL: tl.constexpr,  # H_kv * D
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    QUANTIZE: tl.constexpr,  # the cache dtype or a scale differs: go through float32
    SATURATE: tl.constexpr,  # fp8: clamp to +-FP8_MAX instead of overflowing to NaN
    FP8_LIMIT: tl.constexpr,
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
    if QUANTIZE:  # as kv_quant.quantize_kv: float32 divide, saturate, round to the cache dtype
        k = k.to(tl.float32) / k_scale
        v = v.to(tl.float32) / v_scale
        if SATURATE:
            k = tl.minimum(tl.maximum(k, -FP8_LIMIT), FP8_LIMIT)
            v = tl.minimum(tl.maximum(v, -FP8_LIMIT), FP8_LIMIT)
        k = k.to(cache_ptr.dtype.element_ty)
        v = v.to(cache_ptr.dtype.element_ty)
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Triton twin of :func:`pagedserve.kernels.reference.reshape_and_cache_ref`."""
    check_reshape_and_cache(key, value, kv_cache, slot_mapping, TRITON_KV_CACHE_DTYPES)
    check_kv_scales(k_scale, v_scale)
    num_tokens, h_kv, d = key.shape
    if num_tokens == 0:
        return
    numel = h_kv * d
    tile = min(1024, triton.next_power_of_2(numel))
    grid = (num_tokens, triton.cdiv(numel, tile))
    _reshape_and_cache_kernel[grid](
        key, value, kv_cache, slot_mapping, float(k_scale), float(v_scale),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        HEAD_DIM=d, TOKEN_NUMEL=numel, BLOCK_SIZE=kv_cache.shape[2], TILE=tile,
        QUANTIZE=kv_cache.dtype != key.dtype or (k_scale, v_scale) != (1.0, 1.0),
        SATURATE=kv_cache.dtype == FP8_E4M3, FP8_LIMIT=FP8_MAX,
    )
