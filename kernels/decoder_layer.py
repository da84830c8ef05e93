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
from pagedserve.kernels.linear import is_tiled
from pagedserve.kernels.quant_linear import (
    GROUP_SIZE,
    INT_MM_MIN_K,
    WEIGHT_ONLY_ROWS,
    Int4Weight,
    Int8Weight,
)
from pagedserve.kernels.reference import paged_attention_ref, reshape_and_cache_ref

__all__ = ["LayerWeights", "decoder_layer", "decoder_layer_ref", "projection"]

# How a projection's weight is held, as csrc/decoder_layer_cpu.cpp's Kind numbers them.
(LINEAR_PLAIN, LINEAR_PACKED, LINEAR_INT8, LINEAR_INT8_DYNAMIC, LINEAR_INT4, LINEAR_TILED,
 LINEAR_INT8_TILED) = range(7)


def projection(
    weight: torch.Tensor | None, packed: torch.Tensor | None, quant: Int8Weight | Int4Weight | None
) -> tuple[int, tuple[torch.Tensor, ...]]:
    """(kind, tensors) of one projection, held as ``parallel.linear`` holds it: its plain
    weight, packed copy (tiled or oneDNN's) or quantized weight; the kernel chosen per call is
    the one ``kernels.linear.linear`` or ``kernels.quant_linear.quantized_linear`` would
    choose."""
    if isinstance(quant, Int8Weight) and quant.tiled is not None:
        return LINEAR_INT8_TILED, (quant.tiled, quant.offset, quant.col_scale)
    if isinstance(quant, Int8Weight):
        dynamic = quant.dynamic and quant.qweight.shape[1] >= INT_MM_MIN_K
        return (LINEAR_INT8_DYNAMIC if dynamic else LINEAR_INT8,
                (quant.qweight, quant.scale, quant.col_scale))
    if isinstance(quant, Int4Weight):
        return LINEAR_INT4, (quant.packed, quant.scale_zeros)
    if packed is not None:
        return LINEAR_TILED if is_tiled(packed) else LINEAR_PACKED, (packed,)
    assert weight is not None
    return LINEAR_PLAIN, (weight,)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """What a layer reads that does not change between steps."""

    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    eps: float
    linears: tuple[torch.Tensor, ...]
    """The tensors of qkv [Q + 2K, H], o [H, Q], gate_up [2I, H], down [H, I] in turn, each
    as ``projection`` gives them."""
    kinds: tuple[int, int, int, int]
    qkv_bias: torch.Tensor | None  # [Q + 2K]
    num_heads: int
    num_kv_heads: int
    cos: torch.Tensor  # [P, D/2] float32
    sin: torch.Tensor  # [P, D/2] float32
    scale: float
    sliding_window: int | None
    hadamard: tuple[int, int, int, int] = (0, 0, 0, 0)
    """Per projection, the block of the Hadamard rotation its input takes first (0: none;
    ``Int8Weight.hadamard``)."""


def decoder_layer(
    w: LayerWeights,
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,  # [T, H]; None: x starts the residual stream
    positions: torch.Tensor,  # [T] int64
    kv_cache: torch.Tensor,  # [NB, 2, B, Hkv, D], the model's dtype or a KV storage dtype
    slot_mapping: torch.Tensor,  # [T]
    cu_seqlens_q: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32
    block_table: torch.Tensor,  # [S, max_blocks] int32
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(MLP output, residual stream) [T, H] each, as ``LlamaDecoderLayer.forward`` returns them.
    The caller has checked that the compiled library serves this layer (CPU, float32 or bf16
    throughout, a KV cache of that dtype or of ``kv_quant.KV_STORAGE_DTYPES`` with its
    scales)."""
    try:
        return cpu_ops().decoder_layer(
            x, residual, positions, w.cos, w.sin, w.input_norm, w.post_norm, w.eps,
            list(w.linears), list(w.kinds), list(w.hadamard), WEIGHT_ONLY_ROWS, GROUP_SIZE,
            w.qkv_bias, w.num_heads, w.num_kv_heads, kv_cache,
            slot_mapping, cu_seqlens_q, seq_lens, block_table, w.scale,
            -1 if w.sliding_window is None else w.sliding_window, k_scale, v_scale)
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
