"""Which decoder layers run as one compiled call (``kernels.decoder_layer``), and the loop over
the layers that takes that call where it serves and the modules everywhere else.

A layer qualifies once, after loading (``fuse_layers``): on the CPU with the compiled library,
float32 or bfloat16, one rank (no tensor or context parallelism), plain, packed or quantized
(int8, GGUF int4) projections alike, and none of the variants the call does not carry
(per-head q/k norms, biases on the output or MLP projections). A step then takes the call per
layer when that layer's KV cache is of the model's dtype or a narrower storage dtype
(``kernels.kv_quant``) whose scales are set, not being calibrated by this step. Either way the
layer computes the same thing, so the two may alternate freely.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pagedserve.kernels.cpu import COMPILED_DTYPES, compiled_cache, cpu_ops
from pagedserve.kernels.decoder_layer import LayerWeights, decoder_layer, projection
from pagedserve.kernels.quant_linear import Int8Weight
from pagedserve.workers.context import get_forward_context

# A ``LlamaDecoderLayer`` (typed loosely: that module imports this one).
DecoderLayer = Any


def layer_weights(layer: DecoderLayer) -> LayerWeights | None:
    """The layer's step-invariant arguments of the compiled call, or None where it does not
    serve this layer."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    norm = layer.input_layernorm.weight
    if (norm.device.type != "cpu" or norm.dtype not in COMPILED_DTYPES or cpu_ops() is None
            or attn.qkv_proj.state.size != 1 or attn.attn.dcp.size != 1
            or attn.q_norm is not None or any(lin.bias is not None for lin in linears[1:])):
        return None
    held = [projection(lin.weight, lin.packed, lin.quant) for lin in linears]
    return LayerWeights(
        input_norm=norm,
        post_norm=layer.post_attention_layernorm.weight,
        eps=layer.input_layernorm.eps,
        linears=tuple(t for _kind, tensors in held for t in tensors),
        kinds=tuple(kind for kind, _tensors in held),  # type: ignore[arg-type]
        hadamard=tuple(  # type: ignore[arg-type]
            lin.quant.hadamard if isinstance(lin.quant, Int8Weight) else 0 for lin in linears),
        qkv_bias=attn.qkv_proj.bias,
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        cos=attn.rotary.cos,
        sin=attn.rotary.sin,
        scale=attn.attn.scale,
        sliding_window=attn.attn.sliding_window,
    )


def run_layers(
    layers: Sequence[DecoderLayer],
    fused: Sequence[LayerWeights | None],
    positions: torch.Tensor,  # [T] int64
    x: torch.Tensor,  # [T, hidden], the embedding
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer in order: (last MLP output, residual stream), the last add left to the
    final norm."""
    ctx = get_forward_context()
    step_ok = any(w is not None for w in fused) and ctx.cp.size == 1
    residual: torch.Tensor | None = None
    for layer, w in zip(layers, fused, strict=True):
        pa = layer.self_attn.attn
        cache = pa.kv_cache
        if (step_ok and w is not None and cache is not None and compiled_cache(x.dtype, cache)
                and not pa.calibrate_kv_scales):
            md = ctx.groups[pa.kv_group]
            x, residual = decoder_layer(w, x, residual, positions, cache, md.slot_mapping,
                                        md.cu_seqlens_q, md.seq_lens, md.block_table,
                                        pa.k_scale, pa.v_scale)
        else:
            x, residual = layer(positions, x, residual)
    assert residual is not None
    return x, residual
