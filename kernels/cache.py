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
def _round_float32(y, DROP: tl.constexpr):
    """``y`` (float32) rounded to nearest-even with its low ``DROP`` mantissa bits cleared."""
    bits = y.to(tl.int32, bitcast=True)
    half = (1 << (DROP - 1)) - 1 + ((bits >> DROP) & 1)
    return ((bits + half) & -(1 << DROP)).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_cache(y, FP8: tl.constexpr):
    """``y`` (float32) on the grid of bf16 or e4m3 (|y| <= 448), still float32: the cast that
    follows is exact. Rounding here, not in the cast, matches torch's round-to-nearest-even
    everywhere (the interpreter's bf16 cast truncates and its fp8 cast loses mantissa carries)."""
    if FP8:
        normal = _round_float32(y, 20)  # 3 of float32's 23 mantissa bits kept
        # Below 2^-6 e4m3 is subnormal, steps of 2^-9: adding 1.5 * 2^14 rounds there.
        sub = (y + 24576.0) - 24576.0
        sub = tl.where(sub == 0.0, y * 0.0, sub)  # keep -0.0
        return tl.where(tl.abs(y) < 0.015625, sub, normal)
    return _round_float32(y, 16)


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
    ROUND: tl.constexpr,  # a bf16 or fp8 cache: round in float32 before the cast
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
        if ROUND:
            k = _round_to_cache(k, SATURATE)
            v = _round_to_cache(v, SATURATE)
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
        SATURATE=kv_cache.dtype == FP8_E4M3,
        ROUND=kv_cache.dtype in (torch.bfloat16, FP8_E4M3), FP8_LIMIT=FP8_MAX,
    )
