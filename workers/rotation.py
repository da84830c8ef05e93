"""A rotated residual stream: the same model, with its activations spread evenly over channels.

A decoder's residual stream carries a few channels far larger than the rest (and the RMSNorm
weights scale some channels up further), so an int8 activation row quantized with one scale
loses most of its other elements to rounding. For an orthogonal ``Q [hidden, hidden]`` the
model computes exactly the same function on the stream ``h Q`` (the idea of QuaRot, Ashkboos
et al. 2024), and a random ``Q`` spreads every outlier over all channels:

- RMSNorm commutes with ``Q`` once its weight ``g`` moves into the layers that read the norm's
  output: ``rms(h Q) = rms(h)``, so ``norm(h Q) = (h / rms(h)) Q`` and a reader's
  ``W diag(g)`` becomes ``W diag(g) Q`` with the norm's weight ones (the QKV and gate/up
  projections, whose inputs are then rotated);
- the layers that write the stream (attention output, MLP down) produce ``y Q``:
  ``W`` becomes ``Q^T W`` and a bias ``b`` becomes ``b Q``;
- the ends fold too, so that no rotation runs at a step: the embedding's rows become ``E Q``
  (its output enters the stream rotated), and the final norm is a reader like the others, its
  weight folded into the LM head, ``W diag(g) Q``. A head tied to the embedding is untied for
  that (the two now differ by the norm's weight); quantizing replaces it with its own int8
  copy anyway, and the embedding keeps its one table. (Rotating the embedding's output and
  turning the stream back before the final norm at every step, as this module did before,
  took two ``[T, hidden] x [hidden, hidden]`` float32 products over every token of a step, a
  prefill's included.)

The attention output has large channels of its own, per head. A value head rotated by an
orthonormal Hadamard matrix ``H [D, D]`` (``v -> v H``: its rows of the QKV weight times
``H^T``) gives every query head reading it an output ``o H``, which the output projection's
columns of that head, times ``H``, take back. The KV cache then holds the rotated values, which
only this model reads.

In exact arithmetic nothing changes; in floating point the folded weights are rounded once to
the model dtype. ``workers/quantize.py`` rotates before quantizing to int8, so that every
projection can take int8 activations per row; ``docs/results/quantization.md`` has the
perplexity with and without.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.quant_linear import hadamard_block, hadamard_rows_ref

__all__ = ["random_orthogonal", "rotate_residual_stream"]


def random_orthogonal(n: int, seed: int = 0) -> torch.Tensor:
    """A seeded random orthogonal matrix [n, n] in float64 (Haar: QR of a Gaussian matrix with
    the signs of R's diagonal moved into Q, so every seed gives a different rotation)."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None, :]


def _times_q(w: torch.Tensor, q: torch.Tensor, g: torch.Tensor | None = None) -> None:
    """``W [rows, hidden]`` -> ``W diag(g) Q`` in place (``W Q`` without g), in float64 a few
    thousand rows at a time: a vocabulary's table at once would take eight times its bytes."""
    for rows in w.split(8192):
        x = rows.double() if g is None else rows.double() * g[None, :]
        rows.copy_(x @ q)


def _fold_norm_into(norm: nn.Module, readers: list[torch.Tensor], q: torch.Tensor) -> None:
    """``W [out, hidden]`` -> ``W diag(g) Q`` for each reader of the norm; g -> ones."""
    g = norm.weight.data.double()
    for w in readers:
        _times_q(w, q, g)
    norm.weight.data.fill_(1.0)


def _rotate_output(layer: nn.Module, q: torch.Tensor) -> None:
    """A writer of the stream, ``y = x W^T + b``: ``W [hidden, in]`` -> ``Q^T W``, ``b`` ->
    ``b Q``."""
    w = layer.weight.data
    w.copy_(q.t() @ w.double())
    if layer.bias is not None:
        layer.bias.data.copy_(layer.bias.data.double() @ q)


def _rotate_values(attn: nn.Module, h: torch.Tensor) -> None:
    """Each value head ``v -> v H`` (its rows of the QKV weight, and bias, times ``H^T``), and
    each query head's columns of the attention output's weight ``W_o -> W_o H``: the attention
    output of every head arrives rotated and leaves as before."""
    qkv, d = attn.qkv_proj, attn.head_dim
    v_start = qkv.q_size + qkv.kv_size
    for g in range(attn.num_kv_heads):
        rows = slice(v_start + g * d, v_start + (g + 1) * d)
        qkv.weight.data[rows] = h.t() @ qkv.weight.data[rows].double()
        if qkv.bias is not None:
            qkv.bias.data[rows] = qkv.bias.data[rows].double() @ h
    w = attn.o_proj.weight.data
    for i in range(attn.num_heads):
        cols = slice(i * d, (i + 1) * d)
        w[:, cols] = w[:, cols].double() @ h


@torch.no_grad()
def rotate_residual_stream(model: nn.Module, seed: int = 0) -> None:
    """Fold a random rotation into a loaded Llama-family model (float weights, before
    quantizing or packing), the embedding and the LM head included: its hidden states then run
    rotated to the end, its logits unchanged. The value heads take a Hadamard rotation of their
    own (``_rotate_values``), which spreads the attention output's large channels before the
    output projection, as the stream's rotation does before QKV and gate/up."""
    inner = model.model
    q = random_orthogonal(inner.norm.weight.shape[0], seed)
    d = inner.layers[0].self_attn.head_dim
    h = hadamard_rows_ref(torch.eye(d, dtype=torch.float64), hadamard_block(d, cap=d))
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _rotate_values(attn, h)
        _fold_norm_into(layer.input_layernorm, [attn.qkv_proj.weight.data], q)
        _fold_norm_into(layer.post_attention_layernorm, [mlp.gate_up_proj.weight.data], q)
        _rotate_output(attn.o_proj, q)
        _rotate_output(mlp.down_proj, q)
    head, emb = model.lm_head, inner.embed_tokens.weight.data
    if head.tied:
        head.untie(head.weight.data.clone())
    _fold_norm_into(inner.norm, [head.weight.data], q)
    _times_q(emb, q)
