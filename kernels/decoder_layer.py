"""A whole Llama-family decoder layer in one compiled call (``csrc/decoder_layer_cpu.cpp``).

At decode batch sizes a layer's arithmetic is a few small matmuls and pointwise passes, and the
Python that strings fifteen operators together (module calls, wrapper checks, views) costs as
much again. ``decoder_layer`` runs the same operators in the same order from C++: the result is
the modules' own, bit for bit. ``decoder_layer_ref`` is the same layer as torch expressions
(the references of each operator), for any dtype and device: the semantics, and the float64
reference of the parity tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu import cpu_ops
from pagedserve.kernels.errors import KernelArgumentError
from pagedserve.kernels.layer_ops import (
    add_rms_norm_ref,
    rms_norm_ref,
    rotary_ref,
    silu_and_mul_ref,
)
from pagedserve.kernels.reference import paged_attention_ref, reshape_and_cache_ref

__all__ = ["LayerWeights", "decoder_layer", "decoder_layer_ref"]


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """What a layer reads that does not change between steps."""

    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    eps: float
    linears: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    """qkv [Q + 2K, H], o [H, Q], gate_up [2I, H], down [H, I]: plain, or oneDNN-packed."""
    packed: int  # bit i: linears[i] is a packed copy (``kernels.linear.pack_weight``)
    qkv_bias: torch.Tensor | None  # [Q + 2K]
    num_heads: int
    num_kv_heads: int
    cos: torch.Tensor  # [P, D/2] float32
    sin: torch.Tensor  # [P, D/2] float32
    scale: float
    sliding_window: int | None


def decoder_layer(
    w: LayerWeights,
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,  # [T, H]; None: x starts the residual stream
    positions: torch.Tensor,  # [T] int64
    kv_cache: torch.Tensor,  # [NB, 2, B, Hkv, D], the model's dtype
    slot_mapping: torch.Tensor,  # [T]
    cu_seqlens_q: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32
    block_table: torch.Tensor,  # [S, max_blocks] int32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(MLP output, residual stream) [T, H] each, as ``LlamaDecoderLayer.forward`` returns them.
    The caller has checked that the compiled library serves this layer (CPU, float32 or bf16
    throughout, a KV cache of the model's dtype, no long float32 prefill rows)."""
    try:
        return cpu_ops().decoder_layer(
            x, residual, positions, w.cos, w.sin, w.input_norm, w.post_norm, w.eps,
            list(w.linears), w.packed, w.qkv_bias, w.num_heads, w.num_kv_heads, kv_cache,
            slot_mapping, cu_seqlens_q, seq_lens, block_table, w.scale,
            -1 if w.sliding_window is None else w.sliding_window)
    except RuntimeError as exc:  # the kernels' own checks; typed as the modules' errors are
        raise KernelArgumentError(str(exc).splitlines()[0]) from exc


def decoder_layer_ref(
    input_norm: torch.Tensor,
    post_norm: torch.Tensor,
    eps: float,
    linears: Sequence[torch.Tensor],  # plain weights: qkv, o, gate_up, down
    qkv_bias: torch.Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``decoder_layer`` as torch expressions (the operators' references), in x's dtype."""
    t, d = x.shape[0], kv_cache.shape[-1]
    if residual is None:
        residual, h = x, rms_norm_ref(x, input_norm, eps)
    else:
        h = add_rms_norm_ref(residual, x, input_norm, eps)
    q, k, v = F.linear(h, linears[0], qkv_bias).split(
        [num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q, k = rotary_ref(q.view(t, num_heads, d), k.view(t, num_kv_heads, d), positions, cos, sin)
    reshape_and_cache_ref(k, v.reshape(t, num_kv_heads, d), kv_cache, slot_mapping)
    out = torch.empty_like(q)
    paged_attention_ref(q, kv_cache, out, cu_seqlens_q, seq_lens, block_table, scale,
                        sliding_window=sliding_window)
    h = add_rms_norm_ref(residual, F.linear(out.view(t, num_heads * d), linears[1]), post_norm,
                         eps)
    return F.linear(silu_and_mul_ref(F.linear(h, linears[2])), linears[3]), residual
