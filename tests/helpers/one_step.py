"""One forward pass of a loaded model, with and without the compiled whole-layer call, from the
same KV cache: a batch of short prefills (more than the weight-only rows of the int8 kernel)
after cached context, then a two-row decode step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedserve.workers.context import AttentionMetadata, ForwardContext, forward_context

BLOCK = 4


def _step(lens: list[int], new: list[int], vocab: int) -> tuple[torch.Tensor, ...]:
    per = -(-max(lens) // BLOCK)
    table = torch.arange(len(lens) * per, dtype=torch.int32).view(len(lens), per) + 1
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(lens, new, strict=True)])
    seq_of = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(new))
    slots = table[seq_of, positions // BLOCK].long() * BLOCK + positions % BLOCK
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(new), 0)
    ids = torch.randint(3, vocab, (int(cu[-1]),), generator=torch.Generator().manual_seed(1))
    return ids, positions, slots, table, torch.tensor(lens, dtype=torch.int32), cu


def forward_both(model: Any, vocab: int, cache_of: Callable[[torch.Tensor], torch.Tensor]
                 | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, (hidden states through the modules, through the compiled layers);
    ``cache_of`` turns each layer's random cache [NB, 2, B, Hkv, D] into the one this model
    would have written."""
    layers, fused = model.model, list(model.model.fused)
    g = torch.Generator().manual_seed(0)
    dtype = layers.norm.weight.dtype
    caches = []
    for layer in layers.layers:
        attn = layer.self_attn.attn
        cache = torch.randn(32, 2, BLOCK, attn.num_kv_heads, attn.head_dim, generator=g)
        caches.append((cache_of(cache) if cache_of else cache).to(dtype))
    results = []
    for lens, new in (([9, 5, 12], [5, 5, 3]), ([10, 13], [1, 1])):
        ids, pos, slots, table, seq_lens, cu = _step(lens, new, vocab)
        pair = []
        for on in (False, True):
            layers.fused = fused if on else [None] * len(fused)
            for layer, cache in zip(layers.layers, caches, strict=True):
                layer.self_attn.attn.kv_cache = cache.clone()
            ctx = ForwardContext([AttentionMetadata(slots, table, seq_lens, cu)])
            with torch.inference_mode(), forward_context(ctx):
                pair.append(model(ids, pos))
        results.append((pair[0], pair[1]))
    layers.fused = fused
    return results
