"""Paged-attention kernels: Triton on CUDA, compiled C++ or pure torch on CPU.

The un-prefixed names dispatch on the device of their tensors: CUDA tensors go to the Triton
kernels (falling back to the torch reference, which runs on any device, for shapes or dtypes the
kernels do not support, e.g. a head dim that is not a power of two or float64); float32 and
bfloat16 on CPU go to the compiled kernels of ``kernels.cpu`` (without context parallelism, once
built); everything else goes to the torch reference. ``triton_*`` and ``*_ref`` pick an
implementation explicitly (the tests run both on CPU, Triton through ``TRITON_INTERPRET=1``).

A KV cache of its own dtype (``kv_quant``: bfloat16 or scaled fp8 under a float32 model, fp8
under a bf16 one) is quantized on write and widened on read by every implementation: the Triton
kernels, the compiled CPU kernels and the torch reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.kernels._checks import (
    TRITON_FLOAT_DTYPES,
    check_kv_scales,
    check_paged_attention,
    check_reshape_and_cache,
)
from pagedserve.kernels.attention import paged_attention as triton_paged_attention
from pagedserve.kernels.cache import reshape_and_cache as triton_reshape_and_cache
from pagedserve.kernels.copy import copy_blocks as triton_copy_blocks
from pagedserve.kernels.cp_layout import (
    NO_CP,
    CPLayout,
    cp_global_position,
    cp_local_seq_len,
    cp_owner_and_offset,
)
from pagedserve.kernels.cpu import compiled_cache, compiled_for, cpu_ops, cpu_paged_attention
from pagedserve.kernels.errors import KernelArgumentError, KernelDtypeError
from pagedserve.kernels.kv_quant import (
    FP8_E4M3,
    FP8_MAX,
    KV_STORAGE_DTYPES,
    dequantize_kv,
    needs_scale,
    quantize_kv,
    scale_from_amax,
)
from pagedserve.kernels.merge import merge_attn_states as triton_merge_attn_states
from pagedserve.kernels.reference import (
    AttentionPlan,
    compute_dtype,
    copy_blocks_ref,
    merge_attn_states_ref,
    paged_attention_ref,
    plan_paged_attention,
    reshape_and_cache_ref,
)
from pagedserve.kernels.swap import swap_blocks


def _use_triton(x: torch.Tensor, head_dim: int | None = None) -> bool:
    if not x.is_cuda or x.dtype not in TRITON_FLOAT_DTYPES:
        return False
    return head_dim is None or (16 <= head_dim <= 512 and head_dim & (head_dim - 1) == 0)


def _one_dtype(*tensors: torch.Tensor) -> bool:
    return len({t.dtype for t in tensors}) == 1


def _cached_plan(
    plans: dict[tuple, AttentionPlan], q: torch.Tensor, kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
    sliding_window: int | None, cp: CPLayout,
) -> AttentionPlan:
    """The torch path's plan for this step's metadata, built by the first layer that asks."""
    key = (sliding_window, cp, tuple(kv_cache.shape[2:]), q.shape[1], q.dtype)
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = plan_paged_attention(
            cu_seqlens_q, seq_lens, block_table, block_size=kv_cache.shape[2],
            num_kv_heads=kv_cache.shape[3], num_q_heads=q.shape[1], head_dim=q.shape[2],
            sliding_window=sliding_window, cp=cp, dtype=compute_dtype(q.dtype))
    return plan


def reshape_and_cache(
    key: torch.Tensor,  # [T, H_kv, D]
    value: torch.Tensor,  # [T, H_kv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, B, H_kv, D], contiguous
    slot_mapping: torch.Tensor,  # [T], int32/int64; -1 = skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Writes keys and values into their slots, quantized to a narrower cache dtype with the
    scales; see ``reshape_and_cache_ref``."""
    if _use_triton(key):
        triton_reshape_and_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    elif (_one_dtype(key, value) and compiled_for(key, value)
          and compiled_cache(key.dtype, kv_cache)):
        check_kv_scales(k_scale, v_scale)  # the kernel takes floats: a bool would pass as 1.0
        try:  # checked by the kernel; the typed error as above
            cpu_ops().reshape_and_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)
        except RuntimeError:
            check_reshape_and_cache(key, value, kv_cache, slot_mapping)
            raise
    else:
        reshape_and_cache_ref(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    q: torch.Tensor,  # [T_q, H_q, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, B, H_kv, D], contiguous
    out: torch.Tensor,  # [T_q, H_q, D], written
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1], int32
    seq_lens: torch.Tensor,  # [num_seqs], int32
    block_table: torch.Tensor,  # [num_seqs, max_blocks], int32
    softmax_scale: float,
    *,
    sliding_window: int | None = None,
    cp: CPLayout = NO_CP,
    return_lse: bool = False,
    num_kv_splits: int | None = None,
    plans: dict[tuple, AttentionPlan] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor | None:
    """Varlen causal paged attention; see ``paged_attention_ref``. ``plans`` caches the torch
    path's :class:`AttentionPlan` for this metadata (keyed by window and layout), so that every
    layer of a step after the first reuses it; the Triton path needs none. A cache of another
    dtype than ``q``'s reads as ``stored * k_scale`` (``v_scale``)."""
    if _use_triton(q, q.shape[-1]):
        return triton_paged_attention(q, kv_cache, out, cu_seqlens_q, seq_lens, block_table,
                                      softmax_scale, sliding_window=sliding_window, cp=cp,
                                      return_lse=return_lse, num_kv_splits=num_kv_splits,
                                      k_scale=k_scale, v_scale=v_scale)
    if (cp.size == 1 and _one_dtype(q, out) and compiled_for(q, out)
            and compiled_cache(q.dtype, kv_cache)):
        # Prefill chunks too: the kernel's vectorised path is 1.3-2.5x the torch path's
        # batched GEMMs on a 128-512-token prefill (SmolLM2 and llama-22m shapes, float32 and
        # bf16). The kernel checks its arguments itself (a Python check per layer costs more
        # than a decode step's attention on a small model); the typed error comes from the same
        # check the other paths run, once something is wrong.
        check_kv_scales(k_scale, v_scale)  # as the cache write
        try:
            return cpu_paged_attention(q, kv_cache, out, cu_seqlens_q, seq_lens, block_table,
                                       softmax_scale, sliding_window, return_lse, k_scale,
                                       v_scale)
        except RuntimeError:
            check_paged_attention(q, kv_cache, out, cu_seqlens_q, seq_lens, block_table,
                                  softmax_scale, sliding_window, cp)
            raise
    plan = None
    if plans is not None:
        plan = _cached_plan(plans, q, kv_cache, cu_seqlens_q, seq_lens, block_table,
                            sliding_window, cp)
    return paged_attention_ref(q, kv_cache, out, cu_seqlens_q, seq_lens, block_table,
                               softmax_scale, sliding_window=sliding_window, cp=cp,
                               return_lse=return_lse, plan=plan, k_scale=k_scale,
                               v_scale=v_scale)


def merge_attn_states(
    outputs: torch.Tensor,  # [N, T, H, D]
    lses: torch.Tensor,  # [N, T, H], float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """LSE merge of partial attention results; see ``merge_attn_states_ref``."""
    impl = triton_merge_attn_states if _use_triton(outputs) else merge_attn_states_ref
    return impl(outputs, lses)


def copy_blocks(
    kv_caches: Sequence[torch.Tensor],  # per layer [num_blocks, ...], contiguous
    src_to_dst: torch.Tensor | Sequence[Sequence[int]],  # [n, 2] (src, dst)
) -> None:
    """Copy-on-write block copies in every layer; see ``copy_blocks_ref``."""
    on_cuda = len(kv_caches) > 0 and kv_caches[0].is_cuda
    (triton_copy_blocks if on_cuda else copy_blocks_ref)(kv_caches, src_to_dst)


__all__ = [
    "AttentionPlan",
    "CPLayout",
    "FP8_E4M3",
    "FP8_MAX",
    "KV_STORAGE_DTYPES",
    "KernelArgumentError",
    "KernelDtypeError",
    "NO_CP",
    "copy_blocks",
    "copy_blocks_ref",
    "cp_global_position",
    "cp_local_seq_len",
    "cp_owner_and_offset",
    "cpu_paged_attention",
    "dequantize_kv",
    "merge_attn_states",
    "merge_attn_states_ref",
    "needs_scale",
    "paged_attention",
    "paged_attention_ref",
    "plan_paged_attention",
    "quantize_kv",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "scale_from_amax",
    "swap_blocks",
    "triton_copy_blocks",
    "triton_merge_attn_states",
    "triton_paged_attention",
    "triton_reshape_and_cache",
]
